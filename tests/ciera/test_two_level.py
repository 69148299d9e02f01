"""The two-level ZeRO-3 gather (ciera.two_level, ``cache='two_level'``) on four gloo ranks laid out as
two nodes of two: bit for bit against the plain all-gather, one agreement per step across nodes, a
cache of half the values, unequal node layouts refused."""

import pytest
import torch
import torch.distributed as dist

from ciera import CieraConfig
from ciera.codecs import as_bits
from ciera.testing import run_on_ranks
from ciera.testing.trajectory import AdamTrajectory, adversarial_step
from ciera.two_level import NodeLayout, layout_of
from ciera.zero3 import Zero3Gather, Zero3Units, cache_bytes_per_rank, plan_caches

pytestmark = pytest.mark.distributed

N = 1201  # odd: byte offsets of shards not multiples of 8


def _worker(rank, world, cache, codec, steps, per_step, budget):
    """Two units gathered ``per_step`` times per step into fresh buffers, prepared after each step
    from their sources (one agreement per step for both units); adversarial steps mixed in."""
    from ciera.memory import Budget

    shards = [AdamTrajectory(numel=N + 16 * u, seed=11 * u + rank) for u in range(2)]
    current = [t.step() for t in shards]
    gen = torch.Generator().manual_seed(rank)
    units = Zero3Units(budget=None if budget is None else Budget(bytes=budget, free=0, spec=str(budget)))
    config = CieraConfig(codec=codec, selection="always", cache=cache, node_size=2, verify_interval=5)
    gathers = [Zero3Gather(config=config, name=f"unit{u}", units=units,
                           source=lambda out, u=u: out.copy_(current[u])) for u in range(2)]
    for step in range(steps):
        if step:
            for u, t in enumerate(shards):
                x = t.step()
                if step % 4 == 2:
                    kinds = ["all_exponents", "nan_inf", "sign_flip", "zeros", "replace", "same"]
                    x = adversarial_step(x, kind=kinds[(step + rank + u) % len(kinds)], gen=gen, fraction=0.3)
                current[u] = x
            units.step()
        if step == steps // 2:  # a checkpoint load: the next gather is raw everywhere, then compressed again
            for g in gathers:
                g.invalidate()
        for k in range(per_step):
            for u, g in enumerate(gathers):
                n = current[u].numel()
                out = g.allocate(numel=world * n, dtype=torch.bfloat16, device=torch.device("cpu"))
                g.gather(output=out, input=current[u].clone())
                ref = torch.empty(world * n, dtype=torch.bfloat16)
                dist.all_gather_into_tensor(ref, current[u])
                if not torch.equal(as_bits(out), as_bits(ref)):
                    bad = (as_bits(out) != as_bits(ref)).nonzero().view(-1)
                    raise AssertionError(f"rank {rank} step {step} gather {k} unit {u}: {bad.numel()} differ, "
                                         f"first {bad[:5].tolist()}")
                out.fill_(float("nan"))  # the engine frees it
    return ([g.cache for g in gathers], [g.stats for g in gathers], [g.cache_bytes for g in gathers],
            units.agreements, [g.fresh_gathers for g in gathers])


@pytest.mark.parametrize("codec", ["delta", "exponent_reuse"])
def test_two_level_bit_exact_with_one_agreement_per_step_across_nodes(codec):
    steps, per_step = 16, 3
    results = run_on_ranks(_worker, world=4, args=("two_level", codec, steps, per_step, None), timeout_s=120)
    for caches, stats, cache_bytes, agreements, fresh in results:
        assert caches == ["two_level"] * 2
        assert agreements == steps - 1, "one agreement per step (the first step's gathers prepare themselves)"
        assert fresh == [steps, steps]
        assert all(s.raw_gathers >= 2 for s in stats), "the first gather and the one after invalidate() are raw"
        for u, s in enumerate(stats):
            assert s.gathers == steps * per_step and s.failures == 0
            assert s.replays == steps * (per_step - 1)
            assert s.compressed_gathers >= steps // 3  # warmup and raw adversarial steps aside
            numel = 4 * (N + 16 * u)
            assert cache_bytes[u] == cache_bytes_per_rank(numel=numel, world=4, dtype=torch.bfloat16,
                                                          cache="two_level", nodes=2)
            assert cache_bytes[u] <= cache_bytes_per_rank(numel=numel, world=4, dtype=torch.bfloat16,
                                                          cache="values") * 0.6
    # the two ranks of one local index share the inter group: their counters agree
    assert results[0][1][0].wire_bytes == results[2][1][0].wire_bytes


def test_auto_takes_two_level_when_values_do_not_fit():
    values = cache_bytes_per_rank(numel=4 * N, world=4, dtype=torch.bfloat16, cache="values")
    two = cache_bytes_per_rank(numel=4 * N, world=4, dtype=torch.bfloat16, cache="two_level", nodes=2)
    results = run_on_ranks(_worker, world=4, args=("auto", "exponent_reuse", 3, 2, values - 1), timeout_s=120)
    for caches, _, cache_bytes, _, _ in results:  # the second unit's two levels no longer fit
        assert caches == ["two_level", "exponents"], caches
        assert cache_bytes[0] == two
    from ciera.memory import Budget

    units = [(4 * N, 4, torch.bfloat16, 2)] * 2
    assert plan_caches(units, cache="auto", budget=Budget(bytes=values - 1, free=0, spec="x")) == ["two_level", "exponents"]
    assert plan_caches(units, cache="auto", budget=Budget(bytes=values + two, free=0, spec="x")) == ["values", "two_level"]
    assert plan_caches(units, cache="auto", budget=Budget(bytes=two - 1, free=0, spec="x")) == ["exponents"] * 2
    assert plan_caches([u[:3] for u in units], cache="auto", budget=Budget(bytes=values - 1, free=0, spec="x")) \
        == ["exponents"] * 2, "one node: no two-level"


def test_layouts():
    assert layout_of(ranks=[0, 1, 2, 3], ranks_per_node=2) == NodeLayout(nodes=2, local=2)
    assert layout_of(ranks=[0, 2, 4, 6], ranks_per_node=4) == NodeLayout(nodes=2, local=2)  # TP=2 inside a node
    assert layout_of(ranks=[0, 1, 2], ranks_per_node=2) is None  # 2 + 1: unequal nodes
    assert layout_of(ranks=[0, 2, 1, 3], ranks_per_node=2) is None  # not numbered node by node
    assert layout_of(ranks=[0, 1, 2, 3], ranks_per_node=0) is None  # unknown
    assert not layout_of(ranks=[0, 1], ranks_per_node=2).useful  # one node
    assert not layout_of(ranks=[0, 1], ranks_per_node=1).useful  # one rank per node


def _refused_worker(rank, world):
    g = Zero3Gather(config=CieraConfig(codec="delta", selection="always", cache="two_level", node_size=world))
    out = torch.empty(world * 8, dtype=torch.bfloat16)
    try:
        g.gather(output=out, input=torch.ones(8, dtype=torch.bfloat16))
    except ValueError as exc:
        return str(exc)
    return None


def test_two_level_on_one_node_is_refused_by_name():
    for msg in run_on_ranks(_refused_worker, world=2, timeout_s=60):
        assert msg is not None and "two_level" in msg and "several nodes" in msg, msg


def _sneak_worker(rank, world):
    """Rank 1 changes its shard within a step without ``step()``: at the next step its node group
    (ranks 1 and 3) raises StaleReplayError, and the other node group stops too, right there."""
    from ciera import CieraVerifyError, StaleReplayError

    n = 500
    traj = AdamTrajectory(numel=n, seed=rank)
    shard = traj.step()
    units = Zero3Units()
    g = Zero3Gather(config=CieraConfig(codec="delta", selection="always", cache="two_level", node_size=2),
                    name="unit-sneak", units=units, source=lambda out: out.copy_(shard))
    for step in range(5):
        if step:
            shard = traj.step()
            try:
                units.step()
            except CieraVerifyError as exc:
                return step, type(exc).__name__, str(exc)
        for k in range(2):
            if step == 2 and k == 1 and rank == 1:
                shard = shard.clone()
                shard[7] += 1  # a write outside the optimizer step
            g.gather(output=torch.empty(world * n, dtype=torch.bfloat16), input=shard.clone())
    return None


def test_two_level_stale_shard_stops_every_rank_at_the_next_step():
    results = run_on_ranks(_sneak_worker, world=4, timeout_s=60)
    assert all(r is not None and r[0] == 3 for r in results), results
    assert [r[1] for r in results] == ["CieraVerifyError", "StaleReplayError", "CieraVerifyError", "StaleReplayError"]
    assert "another node group" in results[0][2] and "rank(s) [1]" in results[1][2]
