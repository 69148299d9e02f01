"""megatron.ciera.binding.bucket_group without processes: the dispatch on Megatron-Core's real bucket group
class (as installed: 0.16.x or 0.19.x), a 0.19.x-shaped variant, fallbacks, invalidation and uninstall."""

import inspect
import typing
from types import SimpleNamespace

import pytest
import torch

from megatron.ciera.binding import bucket_group as binding
from megatron.ciera.binding import upstream_patch as upstream
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucket, _ParamAndGradBucketGroup


def _bucket(**given):
    """A real ``_ParamAndGradBucket`` from the fields every version takes; any further required
    constructor argument of the installed megatron-core (0.19.x adds ``param_index_map`` and
    ``params_with_extra_main_grads``) gets an empty value of its annotated container type, read
    from the constructor's own signature."""
    for name, p in inspect.signature(_ParamAndGradBucket.__init__).parameters.items():
        if name == "self" or name in given or p.default is not inspect.Parameter.empty:
            continue
        origin = typing.get_origin(p.annotation) or p.annotation
        assert origin in (dict, list), f"_ParamAndGradBucket takes {name}: {p.annotation}; teach _bucket it"
        given[name] = origin()
    return _ParamAndGradBucket(**given)


class FakeGroup:
    def __init__(self, rank=0, size=2):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


class FakeGather:
    """Records calls; wait() 'completes' by marking the buffer's non-local shard."""

    log = []

    def __init__(self, buffer, *, group, config, name, measurements=None):
        self.buffer, self.group, self.config, self.name = buffer, group, config, name
        self.measurements = measurements
        self.invalidations = 0
        FakeGather.log.append(("init", name))

    def start(self):
        FakeGather.log.append(("start", self.name))
        gather = self

        class Handle:
            def wait(self_inner):
                FakeGather.log.append(("wait", gather.name))
                gather.buffer[gather.buffer.numel() // 2:] = 7

        return Handle()

    def invalidate(self):
        self.invalidations += 1

    @staticmethod
    def prepare_many(gathers, *, group):
        FakeGather.log.append(("agree", tuple(g.name for g in gathers)))

    @property
    def stats(self):
        return SimpleNamespace(raw_bytes=4, wire_bytes=2, gathers=1, raw_gathers=0, overflows=0, codec="fake")


def make_group(overlap=False, n_buckets=2, dtype=torch.bfloat16, cls=_ParamAndGradBucketGroup, **ddp_kw):
    cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=overlap,
                                        overlap_param_gather=overlap, **ddp_kw)
    buckets = [_bucket(params=[], param_data=torch.zeros(8, dtype=dtype), grad_data=torch.zeros(8),
                                   offset=8 * i, numel_unpadded=8, gradient_scaling_factor=1.0, bucket_id=i)
               for i in range(n_buckets)]
    return cls(buckets, cfg, FakeGroup(), 2)


class Group019(_ParamAndGradBucketGroup):
    """0.19.x adds _post_param_sync, run by start_param_sync at the end of a forced sync."""

    def _post_param_sync(self):
        self.post_syncs = getattr(self, "post_syncs", 0) + 1


def fake_ddp(*groups, expert=()):
    return SimpleNamespace(bucket_groups=list(groups), expert_parallel_bucket_groups=list(expert))


@pytest.fixture(autouse=True)
def clear_log():
    FakeGather.log = []


#: Whether the installed megatron-core's bucket group has 0.19.x's ``_post_param_sync``.
INSTALLED_HAS_POST_SYNC = hasattr(_ParamAndGradBucketGroup, "_post_param_sync")


def test_upstream_post_sync_isolates_the_version_difference():
    real = upstream.upstream_post_sync(make_group())
    assert (real is not None) == INSTALLED_HAS_POST_SYNC  # None on 0.16.x, the method on 0.19.x
    group = make_group(cls=Group019)
    upstream.upstream_post_sync(group)()
    assert group.post_syncs == 1


def test_synchronous_gather_starts_and_waits_every_bucket():
    group = make_group()
    ddp = fake_ddp(group)
    assert binding.install([ddp], config="cfg", make_gather=FakeGather) == 1
    # Gathers are built at install (link and codec speeds are measured there).
    assert FakeGather.log == [("init", "dense0.bucket0"), ("init", "dense0.bucket1")]
    group.start_param_sync()
    assert FakeGather.log[2:] == [("agree", ("dense0.bucket0", "dense0.bucket1")),
                                  ("start", "dense0.bucket0"), ("start", "dense0.bucket1"),
                                  ("wait", "dense0.bucket0"), ("wait", "dense0.bucket1")]
    assert group.param_gather_handle is None and group.param_gather_dispatched
    assert all(torch.equal(b.param_data[4:], torch.full((4,), 7, dtype=torch.bfloat16)) for b in group.buckets)
    group.start_param_sync()  # without optimizer tracking every request gathers, with the same gathers
    assert [e[0] for e in FakeGather.log].count("start") == 4
    assert [e for e in FakeGather.log if e[0] == "init"] == [("init", "dense0.bucket0"), ("init", "dense0.bucket1")]


@pytest.mark.parametrize("cls", [_ParamAndGradBucketGroup, Group019], ids=["installed", "0.19-shaped"])
def test_overlapped_gather_is_waited_by_upstream_finish_param_sync(cls):
    first, second = make_group(overlap=True, n_buckets=1, cls=cls), make_group(overlap=True, n_buckets=1, cls=cls)
    first.next_param_gather_bucket_group = second
    binding.install([fake_ddp(first, expert=[second])], config="cfg", make_gather=FakeGather)
    first.finish_param_sync()  # forward pre-hook: dispatch, wait, prefetch the next group
    assert FakeGather.log[2:5] == [("agree", ("dense0.bucket0",)), ("start", "dense0.bucket0"),
                                   ("wait", "dense0.bucket0")]
    assert FakeGather.log[-1] == ("start", "expert0.bucket0")
    assert second.param_gather_handle is not None
    second.start_param_sync(force_sync=True)  # e.g. disable_forward_pre_hook: finish the one in flight
    assert FakeGather.log[-1] == ("wait", "expert0.bucket0") and second.param_gather_handle is None
    assert getattr(second, "post_syncs", 0) == (1 if cls is Group019 else 0)


def test_forced_sync_without_gather_in_flight_gathers_synchronously():
    group = make_group(overlap=True, n_buckets=1, cls=Group019)
    binding.install([fake_ddp(group)], config="cfg", make_gather=FakeGather)
    group.start_param_sync(force_sync=True)
    assert [e[0] for e in FakeGather.log] == ["init", "agree", "start", "wait"]
    assert group.param_gather_handle is None and group.param_gather_dispatched and group.post_syncs == 1


def test_second_gather_while_one_is_in_flight_is_refused():
    group = make_group(overlap=True)
    binding.install([fake_ddp(group)], config="cfg", make_gather=FakeGather)
    group.start_param_sync()
    with pytest.raises(AssertionError):
        group.start_param_sync()


def test_invalidate_stats_and_uninstall():
    group = make_group()
    ddp = fake_ddp(group)
    binding.install([ddp], config="cfg", make_gather=FakeGather)
    binding.invalidate_param_caches([ddp])
    group.start_param_sync()
    binding.invalidate_param_caches([ddp])
    assert [g.invalidations for g in upstream.state_of(group).gathers] == [2, 2]
    assert [name for name, _ in binding.bucket_stats([ddp])] == ["dense0.bucket0", "dense0.bucket1"]
    binding.uninstall([ddp])
    assert "start_param_sync" not in vars(group) and not upstream.is_attached(group)
    assert binding.bucket_stats([ddp]) == []
    with pytest.raises(RuntimeError):
        binding.install([ddp], config="cfg", make_gather=FakeGather) and binding.install([ddp], config="cfg", make_gather=FakeGather)


@pytest.mark.parametrize("make, reason", [
    (lambda: make_group(fp8_param_gather=True), "ddp_config.fp8_param_gather"),
    (lambda: make_group(dtype=torch.uint8), "dtype torch.uint8"),
    (lambda: _shared_buffers(make_group()), "shared with the gradient buffer"),
    (lambda: _single_rank(make_group()), "single-rank gather group"),
    (lambda: _no_distopt(make_group()), "layer-wise"),
])
def test_unsupported_modes_keep_upstream_gather_with_one_log_line(make, reason):
    group, lines = make(), []
    ok = make_group()
    assert binding.install([fake_ddp(ok, group)], config="cfg", make_gather=FakeGather, log=lines.append) == 1
    assert len(lines) == 1 and reason in lines[0] and "dense1" in lines[0]
    assert "start_param_sync" not in vars(group)


def test_precision_aware_optimizer_falls_back():
    group, lines = make_group(), []
    opt = SimpleNamespace(use_precision_aware_optimizer=True)
    assert binding.install([fake_ddp(group)], config="cfg", optimizer_config=opt, make_gather=FakeGather, log=lines.append) == 0
    assert "use_precision_aware_optimizer" in lines[0]


def test_fields_missing_in_older_versions_read_as_off():
    group = SimpleNamespace(ddp_config=SimpleNamespace(use_distributed_optimizer=True),
                            intra_distributed_optimizer_instance_size=2,
                            buckets=[SimpleNamespace(param_data=torch.zeros(4, dtype=torch.float16))])
    assert upstream.fallback_reason(group) is None


def _shared_buffers(group):
    for b in group.buckets:
        b.grad_data = b.param_data
    return group


def _single_rank(group):
    group.intra_distributed_optimizer_instance_size = 1
    return group


def _no_distopt(group):
    group.ddp_config.use_distributed_optimizer = False
    return group


def test_bucket_groups_of_one_process_group_share_measurements():
    a, b, other = make_group(n_buckets=2), make_group(n_buckets=1), make_group(n_buckets=1)
    b.intra_distributed_optimizer_instance_group = a.intra_distributed_optimizer_instance_group
    binding.install([fake_ddp(a, b, expert=[other])], config="cfg", make_gather=FakeGather)
    for bg in (a, b, other):
        bg.start_param_sync()
    shared = {id(g.measurements) for bg in (a, b) for g in upstream.state_of(bg).gathers}
    assert len(shared) == 1 and id(upstream.state_of(other).gathers[0].measurements) not in shared


class FakeDistOpt:
    """The two things the binding reads of a megatron-core DistributedOptimizer: its parameter
    buffers and ``step_with_ready_grads``, which (synchronous mode) asks every model chunk's DDP to
    gather every bucket group, as upstream does."""

    def __init__(self, param_buffers, ddps, overlap):
        self.buffers = [SimpleNamespace(param_data=b) for b in param_buffers]
        self.ddps, self.overlap, self.steps = ddps, overlap, 0

    def step_with_ready_grads(self):
        self.steps += 1
        if not self.overlap:
            for ddp in self.ddps:
                for bg in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
                    bg.start_param_sync()
        return True


def _grouped_buckets(overlap, storage):
    """A bucket group whose two buckets are views of one parameter buffer ``storage``."""
    cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=overlap,
                                        overlap_param_gather=overlap)
    buckets = [_bucket(params=[], param_data=storage[8 * i: 8 * (i + 1)], grad_data=torch.zeros(8),
                                   offset=8 * i, numel_unpadded=8, gradient_scaling_factor=1.0, bucket_id=i)
               for i in range(2)]
    return _ParamAndGradBucketGroup(buckets, cfg, FakeGroup(), 2)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_chained_optimizers_gather_each_bucket_once_per_step(overlap):
    """EP > 1: a dense and an expert distributed optimizer, chained. Upstream asks for every group
    from both optimizers' steps (sync); each bucket must still be gathered once per step, after
    the optimizer that owns it has written it, with one size agreement per process group."""
    dense_buf, expert_buf = torch.zeros(16, dtype=torch.bfloat16), torch.zeros(16, dtype=torch.bfloat16)
    dense, expert = _grouped_buckets(overlap, dense_buf), _grouped_buckets(overlap, expert_buf)
    expert.intra_distributed_optimizer_instance_group = FakeGroup()  # the expert data-parallel group
    dense.next_param_gather_bucket_group = expert
    ddp = fake_ddp(dense, expert=[expert])
    chained = SimpleNamespace(chained_optimizers=[])
    chained.chained_optimizers = [FakeDistOpt([dense_buf], [ddp], overlap), FakeDistOpt([expert_buf], [ddp], overlap)]
    binding.install([ddp], config="cfg", make_gather=FakeGather, optimizer=chained)
    steps = 3

    def forward_backward():
        if overlap:
            dense.finish_param_sync()  # first forward pre-hook (prefetches the expert group)
            expert.finish_param_sync()
        for bg in (dense, expert):
            bg.param_gather_dispatched = False  # finish_grad_sync, in the backward

    for _ in range(steps):
        forward_backward()
        for opt in chained.chained_optimizers:  # ChainedOptimizer.step_with_ready_grads
            opt.step_with_ready_grads()
        if overlap:
            assert binding.prepare_param_gathers([ddp]) == 4
    forward_backward()  # the next iteration's forward gathers the last step's parameters
    starts = [name for kind, name in FakeGather.log if kind == "start"]
    agrees = [names for kind, names in FakeGather.log if kind == "agree"]
    names = ["dense0.bucket0", "dense0.bucket1", "expert0.bucket0", "expert0.bucket1"]
    for name in names:
        assert starts.count(name) == steps, (name, starts)
    # One agreement per process group and step, covering all its written buckets.
    assert agrees.count(("dense0.bucket0", "dense0.bucket1")) == steps
    assert agrees.count(("expert0.bucket0", "expert0.bucket1")) == steps
    assert len(agrees) == 2 * steps
    if not overlap:  # sync: a group is gathered right after its own optimizer's step, not before
        order = [e for e in FakeGather.log if e[0] in ("start", "agree")][:6]
        assert order[0] == ("agree", ("dense0.bucket0", "dense0.bucket1"))
        assert order[3] == ("agree", ("expert0.bucket0", "expert0.bucket1"))


def test_synchronous_request_starts_every_prepared_group_ahead():
    """Sync mode, three bucket groups on one process group: the first request agrees every written
    bucket once and starts all three groups' gathers (so each decode overlaps the next transfers),
    waiting only its own; the later requests wait theirs without starting anything again."""
    bufs = [torch.zeros(16, dtype=torch.bfloat16) for _ in range(3)]
    groups = [_grouped_buckets(False, b) for b in bufs]
    shared = FakeGroup()
    for g in groups:
        g.intra_distributed_optimizer_instance_group = shared
    ddp = fake_ddp(*groups)
    opt = FakeDistOpt(bufs, [ddp], overlap=False)
    binding.install([ddp], config="cfg", make_gather=FakeGather, optimizer=opt)
    opt.step_with_ready_grads()
    names = [f"dense{i}.bucket{j}" for i in range(3) for j in range(2)]
    assert FakeGather.log[6:] == [("agree", tuple(names)), *(("start", n) for n in names), *(("wait", n) for n in names)]
    assert all(torch.equal(b.param_data[4:], torch.full((4,), 7, dtype=torch.bfloat16)) for g in groups for b in g.buckets)
    assert binding.finish_param_gathers([ddp]) == 0  # every group's own request came
    assert all(upstream.state_of(g).launched is None and g.param_gather_dispatched for g in groups)


def test_groups_started_ahead_are_finished_after_the_step_if_their_request_never_comes():
    """An optimizer that asks for one group only: the others' gathers, started ahead, are waited
    by after_optimizer_step, so no parameter is left ungathered into the next forward."""
    bufs = [torch.zeros(16, dtype=torch.bfloat16) for _ in range(2)]
    groups = [_grouped_buckets(False, b) for b in bufs]
    groups[1].intra_distributed_optimizer_instance_group = groups[0].intra_distributed_optimizer_instance_group
    ddp = fake_ddp(*groups)
    binding.install([ddp], config="cfg", make_gather=FakeGather)
    groups[0].start_param_sync()
    assert upstream.state_of(groups[1]).launched is not None and ("wait", "dense1.bucket0") not in FakeGather.log
    binding.after_optimizer_step([ddp], overlap_param_gather=False)
    assert upstream.state_of(groups[1]).launched is None and ("wait", "dense1.bucket1") in FakeGather.log
    groups[1].start_param_sync()  # its request now gathers afresh (no tracking: every request gathers)
    assert [n for k, n in FakeGather.log if k == "start"].count("dense1.bucket0") == 2


def test_uninstall_restores_the_optimizer_step():
    """After uninstall the optimizer's step is its class's again (the marking wrapper is gone)."""
    buf = torch.zeros(16, dtype=torch.bfloat16)
    group = _grouped_buckets(False, buf)
    ddp = fake_ddp(group)
    opt = FakeDistOpt([buf], [ddp], overlap=False)
    binding.install([ddp], config="cfg", make_gather=FakeGather, optimizer=opt)
    assert "step_with_ready_grads" in vars(opt)
    opt.step_with_ready_grads()
    assert [k for k, _ in FakeGather.log].count("start") == 2
    binding.uninstall([ddp])
    assert "step_with_ready_grads" not in vars(opt) and not upstream.is_attached(group)
