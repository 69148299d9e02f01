"""Errors unwind: an exception in the prepare, start or wait of one bucket's gather, with several
buckets of a group in flight, leaves every gather of the binding idle and the binding usable (a
checkpoint's pending-error check, further steps bit-exact with ``all_gather_into_tensor``,
uninstall). Real CieraAllGather on two gloo ranks, through megatron-core's bucket group."""

import pytest
import torch
import torch.distributed as dist

import ciera.gather as gather_mod
from ciera import CieraAllGather, CieraConfig
from ciera.codecs import as_bits
from ciera.gather import Phase
from ciera.testing.trajectory import AdamTrajectory
from megatron.ciera.binding import bucket_group as binding
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup
from test_mc_bucket_group import _bucket, fake_ddp

pytestmark = pytest.mark.distributed

N_BUCKETS, SHARD = 3, 4096
CONFIG = CieraConfig(codec="exponent_reuse", selection="always", warmup_gathers=1, per_rank_sizes=False)


class Injected(RuntimeError):
    """The failure a test injects."""


def _group(world):
    cfg = DistributedDataParallelConfig(use_distributed_optimizer=True)
    n = SHARD * world
    buckets = [_bucket(params=[], param_data=torch.zeros(n, dtype=torch.bfloat16), grad_data=torch.zeros(n),
                       offset=n * i, numel_unpadded=n, gradient_scaling_factor=1.0, bucket_id=i)
               for i in range(N_BUCKETS)]
    return _ParamAndGradBucketGroup(buckets, cfg, dist.group.WORLD, world)


def _inject(phase, rank, gathers, once):
    """Make the second bucket's ``phase`` raise once (``wait``: its decode on rank 0 only, a local
    failure; the others on every rank, as a failing collective would)."""
    if phase == "prepare":  # the agreement's collective
        once(gather_mod, "exchange")
    elif phase == "apply":  # the second bucket's plan
        once(CieraAllGather, "apply", nth=2)
    elif phase == "start":  # the second bucket's collective launch
        once(gather_mod, "all_gather_into", nth=2)
    elif phase == "wait" and rank == 0:  # the second bucket's decode, inside its wait()
        once(gathers[1].codec, "decode_many")


def _errors_worker(rank, world, phase):
    group = _group(world)
    ddp = fake_ddp(group)
    assert binding.install([ddp], CONFIG) == 1
    gathers = binding._installed([ddp])[0].gathers
    trajectories = [AdamTrajectory(numel=SHARD, dtype=torch.bfloat16, lr=1e-3, seed=10 * rank + i)
                    for i in range(N_BUCKETS)]
    restore = []

    def once(owner, attr, nth=1):
        original, calls = getattr(owner, attr), [0]

        def failing(*a, **k):
            calls[0] += 1
            if calls[0] == nth:
                raise Injected(f"{phase} failed on rank {rank}")
            return original(*a, **k)

        restore.append((owner, attr, original))
        setattr(owner, attr, failing)

    raised = []
    for step in range(8):
        for b, t in zip(group.buckets, trajectories):
            b.param_data.view(world, -1)[rank].copy_(t.step())
        if step == 4:
            _inject(phase, rank, gathers, once)
        failed = torch.zeros((), dtype=torch.int64)
        try:
            group.start_param_sync()
        except Injected as e:
            raised.append((step, str(e)))
            failed.fill_(1)
        for owner, attr, original in restore:
            setattr(owner, attr, original)
        restore.clear()
        assert [g.phase for g in gathers] == [Phase.IDLE] * N_BUCKETS, "a gather was left prepared or in flight"
        dist.all_reduce(failed)  # a rank whose decode failed raised alone: every rank gathers again
        if failed.item():
            assert binding.finish_param_gathers([ddp]) == 0
            binding.raise_pending_errors([ddp])  # what a checkpoint save does first
            group.start_param_sync()  # the same step again: raw for the buckets that failed
        for b in group.buckets:
            ref = torch.empty_like(b.param_data)
            dist.all_gather_into_tensor(ref, b.param_data.view(world, -1)[rank].clone())
            assert torch.equal(as_bits(b.param_data), as_bits(ref)), f"step {step}: bucket differs"
        assert [g.phase for g in gathers] == [Phase.IDLE] * N_BUCKETS
    binding.uninstall([ddp])
    return raised, [g.stats.compressed_gathers for g in gathers]


PHASES = ("prepare", "apply", "start", "wait")


def _bytes_worker(rank, world, steps=10):
    """CIERA's device bytes per rank after each step of a clean run, and the start-up line."""
    group, lines = _group(world), []
    ddp = fake_ddp(group)
    binding.install([ddp], CONFIG, log=lines.append)
    trajectories = [AdamTrajectory(numel=SHARD, dtype=torch.bfloat16, lr=1e-4, seed=10 * rank + i)
                    for i in range(N_BUCKETS)]
    per_step = []
    for _ in range(steps):
        for b, t in zip(group.buckets, trajectories):
            b.param_data.view(world, -1)[rank].copy_(t.step())
        group.start_param_sync()
        per_step.append(binding.device_bytes([ddp]))
    binding.uninstall([ddp])
    return lines, per_step


def _phases_worker(rank, world):
    out = {phase: _errors_worker(rank, world, phase) for phase in PHASES}  # one spawn for all
    out["bytes"] = _bytes_worker(rank, world)
    out["rollback"] = _prepare_rollback_worker(rank, world)
    return out


@pytest.fixture(scope="module")
def two_ranks():
    from ciera.testing import run_on_ranks

    return run_on_ranks(_phases_worker, world=2, timeout_s=60)


def test_cieras_device_bytes_are_printed_at_install_and_do_not_grow_after_the_first_step(two_ranks):
    for lines, per_step in (r["bytes"] for r in two_ranks):
        assert any(line.startswith("CIERA device memory per rank: ") and "MiB of parameter buffers" in line
                   for line in lines), lines
        assert per_step[0]["receive"] == 0  # the warmup gather is raw: nothing received compressed
        first = per_step[1]  # after the first compressed gather
        assert first["model"] == N_BUCKETS * SHARD * 2 * 2  # bf16, two ranks' shards per bucket
        assert first["send"] > 0 and first["receive"] > 0 and first["state"] > 0
        assert all(b == first for b in per_step[2:]), [b["total"] for b in per_step]


def test_a_failure_in_any_phase_leaves_every_gather_idle_and_the_binding_usable(two_ranks):
    results = two_ranks
    for phase in PHASES:
        failing_ranks = [0] if phase == "wait" else [0, 1]
        for rank, by_phase in enumerate(results):
            raised, compressed = by_phase[phase]
            assert [s for s, _ in raised] == ([4] if rank in failing_ranks else []), (phase, raised)
            assert all(c >= 4 for c in compressed), (phase, compressed)  # compressed again after the failure


def test_start_failure_waits_the_started_buckets_and_drops_the_rest():
    """Without processes: the second of three starts raises; the first is waited, the others
    invalidated, and the group's next request gathers again."""
    log = []

    class Handle:
        def __init__(self, name):
            self.name = name

        def wait(self):
            log.append(("wait", self.name))

    class G:
        def __init__(self, name, fails=False):
            self.name, self.fails = name, fails

        def start(self):
            if self.fails:
                raise Injected(self.name)
            log.append(("start", self.name))
            return Handle(self.name)

        def invalidate(self):
            log.append(("invalidate", self.name))

    with pytest.raises(Injected):
        binding._start_all([G("b0"), G("b1", fails=True), G("b2")])
    assert log == [("start", "b0"), ("invalidate", "b1"), ("invalidate", "b2"), ("wait", "b0")]


def test_group_handle_waits_every_bucket_when_one_wait_raises():
    log = []

    class Handle:
        def __init__(self, name, fails=False):
            self.name, self.fails = name, fails

        def wait(self):
            log.append(self.name)
            if self.fails:
                raise Injected(self.name)

    handle = binding._GroupHandle([Handle("b0"), Handle("b1", fails=True), Handle("b2", fails=True)])
    with pytest.raises(Injected, match="b1"):  # the first error
        handle.wait()
    assert log == ["b0", "b1", "b2"]
    handle.wait()  # idempotent: nothing left
    assert log == ["b0", "b1", "b2"]


def _prepare_rollback_worker(rank, world):
    bufs = [torch.zeros(SHARD * world, dtype=torch.bfloat16) for _ in range(N_BUCKETS)]
    gathers = [CieraAllGather(b, config=CONFIG, name=f"b{i}") for i, b in enumerate(bufs)]
    for g in gathers:  # past the warmup
        g.start().wait()
    original = gather_mod.exchange

    def failing(*a, **k):
        raise Injected("exchange")

    gather_mod.exchange = failing
    try:
        CieraAllGather.prepare_many(gathers, group=None)
    except Injected:
        pass
    finally:
        gather_mod.exchange = original
    return [g.phase.value for g in gathers]


def test_prepare_many_rolls_back_when_the_agreement_raises(two_ranks):
    for r in two_ranks:
        assert r["rollback"] == ["idle"] * N_BUCKETS
