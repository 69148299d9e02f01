"""ZeRO-3 gathers (ciera.zero3, ciera.fsdp2) on real gloo ranks, bit for bit against the plain
all-gather: fresh buffers every gather, one encode per step, replays for the step's later gathers."""


import pytest
import torch
import torch.distributed as dist

from ciera import CieraConfig
from ciera.codecs import as_bits
from ciera.cost_model import LinkModel
from ciera.testing import run_on_ranks
from ciera.testing.lm_steps import full_params_sha256, train_steps
from ciera.testing.trajectory import AdamTrajectory, adversarial_step
from ciera.zero3 import Zero3Gather, cache_bytes_per_rank

pytestmark = pytest.mark.distributed


def _zero3_worker(rank, world, cache, codec, steps, gathers_per_step, adversarial):
    """Each step: the shard changes, then ``gathers_per_step`` gathers into new buffers (the forward
    and backward of each micro-batch), every one bit-exact."""
    n = 3000
    traj = AdamTrajectory(numel=n, seed=7 + rank)
    gen = torch.Generator().manual_seed(rank)
    g = Zero3Gather(config=CieraConfig(codec=codec, selection="always", cache=cache, verify_interval=7),
                    name=f"unit-{cache}-{codec}")
    ref = torch.empty(world * n, dtype=torch.bfloat16)
    for step in range(steps):
        x = traj.step()
        if adversarial and step % 5 == 3:
            kinds = ["all_exponents", "nan_inf", "sign_flip", "zeros", "replace", "same"]
            x = adversarial_step(x, kind=kinds[(step + rank) % len(kinds)], gen=gen, fraction=0.3)
        if step:
            g.step()
        for k in range(gathers_per_step):
            out = g.allocate(numel=world * n, dtype=torch.bfloat16, device=torch.device("cpu"))
            out.view(world, n)[rank].copy_(x)
            g.gather(output=out, input=out.view(world, n)[rank])
            dist.all_gather_into_tensor(ref, x)
            if not torch.equal(as_bits(out), as_bits(ref)):
                bad = (as_bits(out) != as_bits(ref)).nonzero().view(-1)
                raise AssertionError(f"rank {rank} step {step} gather {k}: {bad.numel()} values differ, first {bad[:5].tolist()}")
            if cache == "exponents":
                out.fill_(float("nan"))  # the engine frees it: nothing may be read from it later
    return g.stats, g.fresh_gathers, g.cache_bytes


@pytest.mark.parametrize("cache,codec", [("exponents", "exponent_reuse"), ("values", "delta"),
                                         ("values", "exponent_reuse"), ("exponents", "auto")])
def test_zero3_bit_exact_one_encode_per_step(cache, codec):
    steps, per_step = 24, 4
    results = run_on_ranks(_zero3_worker, world=2, args=(cache, codec, steps, per_step, True))
    for stats, fresh, cache_bytes in results:
        assert fresh == steps, "one encode per step"
        assert stats.gathers == steps * per_step
        assert stats.replays == steps * (per_step - 1), stats
        assert stats.failures == 0
        assert stats.compressed_gathers >= steps // 2  # warmup and raw adversarial steps aside
        assert cache_bytes == cache_bytes_per_rank(numel=2 * 3000, world=2, dtype=torch.bfloat16, cache=cache)
        if cache == "values":  # replays send nothing
            assert stats.wire_bytes < stats.raw_bytes / per_step + stats.raw_bytes * 0.1
        else:  # replays send the step's payloads again
            assert stats.wire_bytes < stats.raw_bytes * 0.8
    assert len({(s.wire_bytes, s.replays, s.raw_gathers) for s, _, _ in results}) == 1, "ranks diverged"


def _sneak_worker(rank, world, cache, prepared_ahead):
    """Rank 1 changes its shard between two gathers of one step without ``step()`` (a write outside
    the optimizer step without ``invalidate()``): the replay sends no agreement, so the change is
    caught at the next step's agreement, where EVERY rank raises StaleReplayError naming rank 1."""
    from ciera import StaleReplayError
    from ciera.zero3 import Zero3Units

    n = 1000
    traj = AdamTrajectory(numel=n, seed=rank)
    shard = torch.empty(n, dtype=torch.bfloat16)
    units = Zero3Units()
    g = Zero3Gather(config=CieraConfig(codec="exponent_reuse", selection="always", cache=cache), name="unit-sneak",
                    source=(lambda out: out.copy_(shard)) if prepared_ahead else None, units=units)
    for step in range(4):
        shard.copy_(traj.step())
        try:
            if step:
                units.step()
            for k in range(3):
                if step == 2 and k == 1 and rank == 1:
                    shard[17] = -shard[17] if shard[17] != 0 else 1.0
                out = g.allocate(numel=world * n, dtype=torch.bfloat16, device=torch.device("cpu"))
                g.gather(output=out, input=shard)
        except StaleReplayError as e:
            return step, str(e)
    return None


@pytest.mark.parametrize("cache,prepared_ahead", [("values", True), ("exponents", False)])
def test_zero3_shard_changed_within_a_step_stops_every_rank_at_the_next_step(cache, prepared_ahead):
    for result in run_on_ranks(_sneak_worker, world=2, args=(cache, prepared_ahead)):
        assert result is not None, "the changed shard went unnoticed"
        step, msg = result
        assert step == 3 and "unit-sneak: rank(s) [1]" in msg, result


def _auto_worker(rank, world, n):
    """selection='auto' on loopback (raw wins: the exponent cache is not kept while raw is certain),
    shards whose byte offsets are not multiples of 8 (n odd), then a forced switch to compression."""
    traj = AdamTrajectory(numel=n, seed=rank)
    g = Zero3Gather(config=CieraConfig(codec="exponent_reuse", selection="auto", cache="exponents",
                                       reevaluate_interval=3))
    ref = torch.empty(world * n, dtype=torch.bfloat16)
    for step in range(10):
        x = traj.step()
        if step:
            g.step()
        if step == 6:  # the cost model's next decision sees a 100 kB/s link: it compresses
            sel = g._inner.selector
            sel.link = LinkModel(bandwidth_bytes_per_s=1e5, latency_s=1e-6)
            sel.measurements = None
            sel.decide_at = g._inner._started + 1  # snapshot at this step's fresh gather, decide at the next
        for _ in range(3):
            out = torch.empty(world * n, dtype=torch.bfloat16)
            out.view(world, n)[rank].copy_(x)
            g.gather(output=out, input=out.view(world, n)[rank])
            dist.all_gather_into_tensor(ref, x)
            assert torch.equal(as_bits(out), as_bits(ref)), (rank, step)
    return g.stats


def test_zero3_auto_selection_stays_exact_through_raw_and_a_switch():
    for s in run_on_ranks(_auto_worker, world=2, args=(1001,)):
        assert s.gathers == 30 and s.failures == 0
        assert s.raw_gathers >= 1 and s.compressed_gathers >= 1, s


def test_zero3_rejects_delta_with_the_exponent_cache():
    with pytest.raises(ValueError, match="needs cache='values'"):
        Zero3Gather(config=CieraConfig(codec="delta", cache="exponents"))


def _unstepped_worker(rank, world):
    """Without step() every gather encodes (still exact)."""
    n = 1000
    traj = AdamTrajectory(numel=n, seed=rank)
    g = Zero3Gather(config=CieraConfig(codec="exponent_reuse", selection="always"), stepped=False)
    ref = torch.empty(world * n, dtype=torch.bfloat16)
    for _ in range(5):
        x = traj.step()
        for _ in range(2):
            out = torch.empty(world * n, dtype=torch.bfloat16)
            g.gather(output=out, input=x)  # a separate input tensor: copied into its slot
            dist.all_gather_into_tensor(ref, x)
            assert torch.equal(as_bits(out), as_bits(ref))
    return g.fresh_gathers, g.stats.replays


def test_zero3_without_step_calls_encodes_every_gather():
    for fresh, replays in run_on_ranks(_unstepped_worker, world=2):
        assert (fresh, replays) == (10, 0)


# -- FSDP2 end to end ------------------------------------------------------------------------------
class _Block(torch.nn.Module):
    """Norm, router and experts: an FSDP unit whose shards hold parameters of different kinds."""

    def __init__(self, dim, experts):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.router = torch.nn.Linear(dim, experts, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(experts))

    def forward(self, h):
        x = self.norm(h)
        w = torch.softmax(self.router(x).float(), dim=-1).to(x.dtype)
        return h + sum(w[..., i : i + 1] * e(x) for i, e in enumerate(self.experts))


class _TinyMoE(torch.nn.Module):
    def __init__(self, dim=32, experts=4, blocks=2, vocab=64):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(_Block(dim, experts) for _ in range(blocks))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens):
        h = self.embed(tokens)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _fsdp2_worker(rank, world, use_ciera, cache, micro_batches, steps):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import ciera.fsdp2

    torch.manual_seed(0)
    model = _TinyMoE()
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for b in model.blocks:
        fully_shard(b, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gathers = None
    if use_ciera:
        gathers = ciera.fsdp2.enable(model, optimizer=opt,
                                     config=CieraConfig(codec="exponent_reuse" if cache == "exponents" else "auto",
                                                        selection="always", cache=cache, node_size=2))
    losses = train_steps(model, opt, steps=steps, micro_batches=micro_batches, vocab=64, batch=4, seq=15,
                         generator=torch.Generator().manual_seed(100 + rank))
    digest = full_params_sha256(model)
    info = None
    if gathers is not None:
        units = {n: (g.fresh_gathers, g.stats.gathers) for n, g in gathers.gathers.items()}
        info = (gathers.stats(), units, gathers.cache_bytes)
    return losses, digest, info


@pytest.mark.parametrize("cache", ["exponents", "values"])
def test_fsdp2_training_is_bit_identical_with_ciera(cache):
    steps, micro = 6, 2
    plain = run_on_ranks(_fsdp2_worker, world=2, args=(False, cache, micro, steps))
    ciera_runs = run_on_ranks(_fsdp2_worker, world=2, args=(True, cache, micro, steps))
    for (l0, h0, _), (l1, h1, info) in zip(plain, ciera_runs):
        assert l0 == l1, "per-micro-batch losses differ"
        assert h0 == h1, "final params differ"
        stats, units, cache_bytes = info
        assert stats.compressed_gathers > 0 and stats.wire_bytes < stats.raw_bytes
        assert cache_bytes > 0
        for name, (fresh, gathers) in units.items():
            assert fresh == steps, f"{name}: one encode per step"
            if name:  # resharded after forward: gathered in forward and backward of each micro-batch
                assert gathers == steps * 2 * micro, (name, gathers)


def _load_worker(rank, world):
    """Four steps of gathers, then every rank's shard overwritten outside a step (what a checkpoint
    load does) and ``invalidate()``: the next gather is raw, every one exact, and two steps later
    the gathers are compressed again. Returns the raw gathers since the load after each gather."""
    n = 2000
    traj = AdamTrajectory(numel=n, seed=3 + rank)
    g = Zero3Gather(config=CieraConfig(codec="exponent_reuse", selection="always", cache="exponents"),
                    name="unit-load")
    ref = torch.empty(world * n, dtype=torch.bfloat16)

    def gather(x):
        out = g.allocate(numel=world * n, dtype=torch.bfloat16, device=torch.device("cpu"))
        out.view(world, n)[rank].copy_(x)
        g.gather(output=out, input=out.view(world, n)[rank])
        dist.all_gather_into_tensor(ref, x)
        assert torch.equal(as_bits(out), as_bits(ref)), f"rank {rank}: the gather differs from the plain one"

    for step in range(4):
        x = traj.step()
        if step:
            g.step()
        gather(x)
        gather(x)
    before = g.stats.raw_gathers
    loaded = AdamTrajectory(numel=n, seed=99 + rank).step()  # the checkpoint's values
    g.invalidate()
    raws = []
    for step in range(3):
        x = loaded if step == 0 else traj.step()
        if step:
            g.step()
        for _ in range(2):
            gather(x)
            raws.append(g.stats.raw_gathers - before)
    return raws


def test_zero3_first_gather_after_invalidate_is_raw_and_exact():
    for raws in run_on_ranks(_load_worker, world=2, args=()):
        assert raws[0] == 1, raws  # the first gather after the load
        assert raws[-1] == raws[-3], raws  # the last step's gathers compressed again


# -- one agreement per step, no host read in a step's gathers, FSDP2's order untouched -----------------
class _Recorder:
    """Counts the agreements (``ciera.gather.exchange``) and host reads (``.item()``/``int()``, and
    ``.cpu()``/``.tolist()``/``.numpy()``) made while a gather's ``start()`` or ``wait()`` runs."""

    def __init__(self):
        self.agreements = 0
        self.host_reads = []
        self.watching = 0


def _watch_ciera(rec: _Recorder):
    """Patch the gathers' entry points to count what they do (the caller undoes nothing: the worker
    process ends)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import ciera.gather
    import ciera.zero3

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                rec.host_reads.append(str(func))
            return func(*args, **(kwargs or {}))

    exchange = ciera.gather.exchange

    def counting_exchange(*a, **k):
        rec.agreements += 1
        return exchange(*a, **k)

    ciera.gather.exchange = counting_exchange
    for name in ("cpu", "tolist", "numpy"):
        original = getattr(torch.Tensor, name)

        def method(self, *a, _o=original, _n=name, **k):
            if rec.watching:
                import traceback
                where = [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno}" for f in traceback.extract_stack()[-6:-1]]
                rec.host_reads.append(f"Tensor.{_n} at {where}")  # (where: to find it)
            return _o(self, *a, **k)
        setattr(torch.Tensor, name, method)

    def watched(fn):
        def call(*a, **k):
            rec.watching += 1
            try:
                with Mode():
                    return fn(*a, **k)
            finally:
                rec.watching -= 1
        return call

    ciera.zero3.Zero3Gather.start = watched(ciera.zero3.Zero3Gather.start)
    ciera.zero3.Zero3Handle.wait = watched(ciera.zero3.Zero3Handle.wait)
    # The codec implementations behind decode_many's dispatch are outside the watch, as in
    # test_host_reads.py (the CPU codecs read host memory by design; the Triton ones have their own test).
    from ciera.codecs import Codec

    impl = Codec._decode_many_impl

    def boundary(self, t):
        fn = impl(self, t)

        def call(**kw):
            saved, rec.watching = rec.watching, 0
            try:
                with torch.utils._python_dispatch._disable_current_modes():
                    return fn(**kw)
            finally:
                rec.watching = saved
        return call

    Codec._decode_many_impl = boundary


def _recording(comm, name, events):
    """FSDP2's custom all-gather ``comm`` (``None``: the plain gather), recording FSDP2's calls."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

    class Recording(AllGather):
        def allocate(self, size, *, dtype, device):
            if comm is not None:
                return comm.allocate(size, dtype=dtype, device=device)
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            events.append(("start", name))
            if comm is not None:
                work = comm(output_tensor, input_tensor, group, async_op=async_op)
            else:
                work = dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
            if work is None:
                return None

            class Work(dist.Work):
                def wait(self, timeout=None):
                    events.append(("wait", name))
                    return work.wait()

                def is_completed(self):
                    return work.is_completed()

            return Work()

    return Recording()


def _steps_worker(rank, world, use_ciera, cache, micro_batches, steps):
    """FSDP2 with CIERA: per optimizer step, the agreements made and the host reads inside the
    gathers; and the order in which FSDP2 starts and waits its units' gathers."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import ciera.fsdp2

    torch.manual_seed(0)
    model = _TinyMoE(blocks=3)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for b in model.blocks:
        fully_shard(b, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    events, rec = [], _Recorder()
    units = {n: m for n, m in model.named_modules() if hasattr(m, "set_custom_all_gather")}
    if use_ciera:
        _watch_ciera(rec)
        ciera.fsdp2.enable(model, optimizer=opt, config=CieraConfig(codec="exponent_reuse", selection="always",
                                                                   cache=cache))
    for name, m in units.items():  # record FSDP2's calls around the comm (CIERA's, or the plain gather)
        comm = m._get_fsdp_state()._fsdp_param_groups[0]._all_gather_comm if use_ciera else None
        m.set_custom_all_gather(_recording(comm, name or "root", events))
    gen = torch.Generator().manual_seed(100 + rank)
    per_step, reads, orders = [], [], []
    for _ in range(steps):
        a0, r0, e0 = rec.agreements, len(rec.host_reads), len(events)
        for _ in range(micro_batches):
            tokens = torch.randint(0, 64, (4, 16), generator=gen)
            logits = model(tokens[:, :-1])
            torch.nn.functional.cross_entropy(logits.float().reshape(-1, 64), tokens[:, 1:].reshape(-1)).backward()
        reads.append(rec.host_reads[r0:])
        opt.step()  # CIERA: the units are encoded here, one agreement for all of them
        opt.zero_grad()
        per_step.append(rec.agreements - a0)
        orders.append(events[e0:])
    return per_step, reads, orders


@pytest.mark.parametrize("micro_batches", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_fsdp2_one_agreement_per_step_and_no_host_read_in_its_gathers(micro_batches):
    """Whatever the number of units (4 here) and micro-batches: after the first step, ONE agreement
    per step (at the optimizer step) and no host read in any gather; FSDP2 starts and waits its
    gathers in the same order as with a plain comm (its prefetch is untouched)."""
    steps = 4
    plain = run_on_ranks(_steps_worker, world=2, args=(False, "values", micro_batches, steps))
    for cache in ("values", "exponents") if micro_batches == 2 else ("values",):
        for (per_step, reads, orders), (_, _, plain_orders) in zip(
                run_on_ranks(_steps_worker, world=2, args=(True, cache, micro_batches, steps)), plain):
            assert per_step[1:] == [1] * (steps - 1), (cache, per_step)
            assert per_step[0] == 4 + 1, per_step  # the first forward: each unit's own, then the step's
            assert all(not r for r in reads[1:]), (cache, reads)
            assert orders == plain_orders, cache
            assert orders[-1].count(("start", "blocks.0")) == 2 * micro_batches  # forward and backward


@pytest.mark.slow  # (the default run has the unit test in test_two_level and Megatron-FSDP's through pretrain_gpt.py)
def test_fsdp2_training_is_bit_identical_with_the_two_level_cache():
    """Four ranks as two nodes of two: FSDP2's units gather across nodes from a cache of half the
    values, within the node raw; the losses and final parameters are the plain run's."""
    steps, micro = 4, 2
    plain = run_on_ranks(_fsdp2_worker, world=4, args=(False, "two_level", micro, steps))
    ciera_runs = run_on_ranks(_fsdp2_worker, world=4, args=(True, "two_level", micro, steps))
    for (l0, h0, _), (l1, h1, info) in zip(plain, ciera_runs):
        assert (l0, h0) == (l1, h1), "losses or final params differ"
        stats, units, cache_bytes = info
        assert stats.compressed_gathers > 0 and stats.wire_bytes < stats.raw_bytes
        assert all(fresh == steps for fresh, _ in units.values()), units
