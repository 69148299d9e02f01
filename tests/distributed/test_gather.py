"""CieraAllGather on real gloo process groups, compared bit for bit with all_gather_into_tensor
after every gather."""

import pytest
import torch
import torch.distributed as dist

from ciera import CieraAllGather, CieraConfig, CieraVerifyError
from ciera.codecs import as_bits, available_codecs
from ciera.testing import run_on_ranks
from ciera.trajectory import AdamTrajectory, adversarial_step

pytestmark = pytest.mark.distributed

CODECS = [c for c in available_codecs() if c != "raw"]


def _trajectory_worker(rank, world, codec, dtype, steps, shard, adversarial, lr):
    """Drive one gather through a trajectory; return the stats and the number of exact matches."""
    buf = torch.zeros(shard * world, dtype=dtype)
    ref = torch.zeros_like(buf)
    traj = AdamTrajectory(numel=shard, dtype=dtype, lr=lr, seed=100 + rank)
    gen = torch.Generator().manual_seed(rank)
    gather = CieraAllGather(buf, config=CieraConfig(codec=codec, selection="always", verify_interval=25), name=f"{codec}-b0")
    x = traj.current()
    for step in range(steps):
        x = traj.step()
        if adversarial and step % 10 == 5:
            kinds = ["all_exponents", "nan_inf", "sign_flip", "zeros", "replace", "same"]
            # Ranks stress their shards differently: one rank may overflow while the others do not.
            x = adversarial_step(x, kind=kinds[(step // 10 + rank) % len(kinds)], gen=gen, fraction=0.2)
        buf.view(world, -1)[rank].copy_(x)
        if step % 3 == 1:
            gather.prepare()  # encode ahead, as the binding does right after the optimizer step
        gather.start().wait()
        dist.all_gather_into_tensor(ref, x)
        if not torch.equal(as_bits(buf), as_bits(ref)):
            diff = (as_bits(buf) != as_bits(ref)).nonzero()
            raise AssertionError(f"rank {rank} step {step}: {diff.numel()} values differ, first {diff[:5].tolist()}")
    return gather.stats


def _check(stats, steps, adversarial):
    for s in stats:
        assert s.gathers == steps
        assert s.raw_gathers >= 1
    assert len({(s.wire_bytes, s.overflows, s.raw_gathers) for s in stats}) == 1, "ranks diverged"
    if not adversarial:
        assert stats[0].wire_bytes < stats[0].raw_bytes
    else:
        assert stats[0].overflows >= 1, "adversarial run never exercised the overflow fallback"


def _many_trajectories_worker(rank, world, cases, steps, shard):
    """Several trajectories in one process group (spawning is the expensive part of these tests)."""
    return [_trajectory_worker(rank, world, codec, torch.bfloat16, steps, shard, adv, 1e-4) for codec, adv in cases]


@pytest.mark.parametrize("world", [2, 4])
def test_trajectory_small(world):
    cases = [(codec, adv) for codec in CODECS for adv in (False, True)]
    steps = 300
    results = run_on_ranks(_many_trajectories_worker, world=world, args=(cases, steps, 1031))
    for i, (_, adv) in enumerate(cases):
        _check([r[i] for r in results], steps, adv)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_trajectory_other_dtypes(dtype):
    stats = run_on_ranks(_trajectory_worker, world=2, args=(CODECS[0], dtype, 30, 517, True, 3e-4))
    _check(stats, 30, True)


@pytest.mark.slow
@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("adversarial", [False, True])
def test_trajectory_300_gathers(codec, world, adversarial):
    steps = 300
    stats = run_on_ranks(_trajectory_worker, world=world,
                         args=(codec, torch.bfloat16, steps, 1 << 14, adversarial, 1e-4))
    _check(stats, steps, adversarial)


def _bad_input_worker(rank, world, cases):
    return [_one_bad_input(rank, case) for case in cases]


def _one_bad_input(rank, case):
    try:
        if case == "dtype":
            CieraAllGather(torch.zeros(8, dtype=torch.float64))
        elif case == "divisible":
            CieraAllGather(torch.zeros(7, dtype=torch.bfloat16))
        elif case == "config":
            CieraAllGather(torch.zeros(8, dtype=torch.bfloat16), config=CieraConfig(block_size=8 << rank))
        elif case == "size":
            CieraAllGather(torch.zeros(8 * (rank + 1), dtype=torch.bfloat16))
        elif case == "dtype_mismatch":
            CieraAllGather(torch.zeros(8, dtype=torch.bfloat16 if rank else torch.float16))
    except (TypeError, ValueError) as e:
        return str(e)
    return None


BAD_INPUTS = {
    "dtype": "CIERA gathers",
    "divisible": "not divisible by the group size 2",
    "config": "ranks disagree on config.block_size: rank",
    "size": "ranks disagree on numel",
    "dtype_mismatch": "ranks disagree on dtype",
}


def test_bad_input_is_a_clear_error():
    results = run_on_ranks(_bad_input_worker, world=2, args=(list(BAD_INPUTS),))
    for rank_errors in results:
        for (case, match), err in zip(BAD_INPUTS.items(), rank_errors):
            assert err is not None and match in err, (case, err)


def _stale_cache_worker(rank, world, invalidate):
    buf = torch.zeros(64 * world, dtype=torch.bfloat16)
    traj = AdamTrajectory(numel=64, seed=rank)
    gather = CieraAllGather(buf, config=CieraConfig(codec="exponent_reuse", selection="always", verify_interval=1))
    for _ in range(3):
        buf.view(world, -1)[rank].copy_(traj.step())
        gather.start().wait()
    # A write outside the gather: every rank overwrites the whole buffer (as a checkpoint load
    # would), but rank 1 loads different values for shard 0 than rank 0 holds.
    loaded = torch.randn(buf.numel(), generator=torch.Generator().manual_seed(9)).to(buf.dtype)
    if rank == 1:
        loaded[:64] += 1
    buf.copy_(loaded)
    buf.view(world, -1)[rank].copy_(traj.step())
    gather.prepare()  # a payload prepared before the invalidation must not be sent
    if invalidate:
        gather.invalidate()
    try:
        gather.start().wait()
    except CieraVerifyError as e:
        return str(e)
    return None


def test_stale_cache_is_detected_by_verify():
    errors = run_on_ranks(_stale_cache_worker, world=2, args=(False,))
    assert all(e is not None and "shard 0" in e and "[1]" in e for e in errors), errors


def test_invalidate_resyncs():
    assert run_on_ranks(_stale_cache_worker, world=2, args=(True,)) == [None, None]


def _double_start_worker(rank, world):
    g = CieraAllGather(torch.zeros(16 * world, dtype=torch.bfloat16))
    h = g.start()
    try:
        g.start()
    except RuntimeError as e:
        h.wait()
        return str(e)
    return None


def test_start_twice_without_wait_fails():
    assert all("not waited on" in e for e in run_on_ranks(_double_start_worker, world=2))


def _stats_worker(rank, world):
    """Wire bytes equal the sizes of the collectives actually issued."""
    buf = torch.zeros(4096 * world, dtype=torch.bfloat16)
    traj = AdamTrajectory(numel=4096, seed=rank)
    gather = CieraAllGather(buf, config=CieraConfig(codec="exponent_reuse", selection="always"))
    expected = 0
    for _ in range(12):
        buf.view(world, -1)[rank].copy_(traj.step())
        cap = gather.stats.capacity_bytes
        raw = gather._raw_left > 0
        gather.start().wait()
        expected += buf.numel() * 2 if raw else world * cap
    s = gather.stats
    return s, expected


def test_stats_add_up():
    for s, expected in run_on_ranks(_stats_worker, world=2):
        assert s.overflows == 0
        assert s.wire_bytes == expected
        assert s.raw_bytes == 12 * 4096 * 2 * 2
        assert s.payload_bytes <= s.wire_bytes
        assert 0.0 < s.change_rate < 0.5
        assert s.ratio > 1.2
