"""CieraAllGather on real gloo process groups, compared bit for bit with all_gather_into_tensor
after every gather."""

import pytest
import torch
import torch.distributed as dist

from ciera import CieraAllGather, CieraConfig, CieraVerifyError
from ciera.codecs import as_bits, available_codecs
from ciera.testing import run_on_ranks
from ciera.testing.trajectory import AdamTrajectory, adversarial_step

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
            # Ranks stress their shards differently: one rank's payload may be far larger than the others'.
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
    assert len({(s.wire_bytes, s.payload_bytes, s.raw_gathers) for s in stats}) == 1, "ranks diverged"
    for s in stats:
        assert s.overflows == 0 and s.failures == 0
        assert s.payload_bytes <= s.wire_bytes - s.raw_gathers * s.raw_bytes // s.gathers
    if not adversarial:
        assert stats[0].wire_bytes < stats[0].raw_bytes


def _many_trajectories_worker(rank, world, cases, steps, shard):
    """Several trajectories in one process group (spawning is the expensive part of these tests)."""
    return [_trajectory_worker(rank, world, codec, torch.bfloat16, steps, shard, adv, 1e-4) for codec, adv in cases]


@pytest.mark.parametrize("world, steps", [(2, 300), (4, 120)])  # 4 ranks share 2 cores: fewer steps
def test_trajectory_small(world, steps):
    cases = [(codec, adv) for codec in CODECS for adv in (False, True)]
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
    n = 1024  # large enough that the payloads are smaller than the shard (else the gather is raw)
    buf = torch.zeros(n * world, dtype=torch.bfloat16)
    traj = AdamTrajectory(numel=n, seed=rank)
    gather = CieraAllGather(buf, config=CieraConfig(codec="exponent_reuse", selection="always", verify_interval=1))
    for _ in range(3):
        buf.view(world, -1)[rank].copy_(traj.step())
        gather.start().wait()
    # A write outside the gather: every rank overwrites the whole buffer (as a checkpoint load
    # would), but rank 1 loads different values for shard 0 than rank 0 holds.
    loaded = torch.randn(buf.numel(), generator=torch.Generator().manual_seed(9)).to(buf.dtype)
    if rank == 1:
        loaded[:n] += 1
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
    """Wire bytes equal the sizes of the collectives actually issued: exact payloads at the agreed
    (largest) size, and that size is the largest payload any rank needed, 16-aligned."""
    buf = torch.zeros(4096 * world, dtype=torch.bfloat16)
    traj = AdamTrajectory(numel=4096, seed=rank)
    gather = CieraAllGather(buf, config=CieraConfig(codec="exponent_reuse", selection="always"))
    expected = 0
    for _ in range(12):
        buf.view(world, -1)[rank].copy_(traj.step())
        gather.prepare()
        plan = gather.plan
        needed = torch.tensor([int(gather._needed)])
        everyone = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(everyone, needed)
        if not plan.raw:
            assert plan.size == -(-max(int(t) for t in everyone) // 16) * 16
            assert plan.payload_bytes == sum(int(t) for t in everyone)
        gather.start().wait()
        expected += buf.numel() * 2 if plan.raw else (sum(plan.sizes) if plan.sizes else world * plan.size)
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


def _old_linear_checksum(bits):
    v = bits.to(torch.int64)
    return int(v.sum()), int((v * torch.arange(1, v.numel() + 1)).sum())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_verify_hash_catches_plus1_minus2_plus1(dtype):
    """The pattern a linear position-weighted checksum misses: +1, -2, +1 ulps on neighbours."""
    from ciera.replicas import shard_hashes

    buf = AdamTrajectory(numel=2 * 4096, dtype=dtype, seed=3).current().clone()
    before = shard_hashes(buf, 2, salt=7)
    for at in (0, 17, 4093, 5000):
        bad = buf.clone()
        bits = as_bits(bad)
        bits[at : at + 3] += torch.tensor([1, -2, 1], dtype=bits.dtype)
        assert _old_linear_checksum(as_bits(buf)) == _old_linear_checksum(bits)  # the old check's blind spot
        after = shard_hashes(bad, 2, salt=7)
        shard = at // 4096
        assert after[shard] != before[shard] and after[1 - shard] == before[1 - shard]
    assert torch.equal(shard_hashes(buf, 2, salt=7), before)  # deterministic
    assert not torch.equal(shard_hashes(buf, 2, salt=8), before)  # salted per check


def _stale_pattern_worker(rank, world):
    n = 2048
    buf = torch.zeros(n * world, dtype=torch.bfloat16)
    traj = AdamTrajectory(numel=n, seed=rank)
    gather = CieraAllGather(buf, config=CieraConfig(codec="delta", selection="always", verify_interval=1))
    for _ in range(3):
        buf.view(world, -1)[rank].copy_(traj.step())
        gather.start().wait()
    if rank == 1:  # rank 1's cache of shard 0 goes stale by +1, -2, +1 units
        as_bits(buf)[100:103] += torch.tensor([1, -2, 1], dtype=torch.int16)
    errors = []
    for _ in range(3):
        buf.view(world, -1)[rank].copy_(traj.step())
        try:
            gather.start().wait()
        except CieraVerifyError as e:
            errors.append(str(e))
    return errors


def test_verify_catches_a_stale_receiver_with_the_linear_blind_spot():
    # Caught at the first verified gather on every rank; the failure makes the next gather raw
    # everywhere, which resyncs the cache, so the later checks pass.
    for errors in run_on_ranks(_stale_pattern_worker, world=2):
        assert len(errors) == 1 and "shard 0" in errors[0] and "[1]" in errors[0], errors


def _failure_worker(rank, world):
    """Rank 1's encode fails once; later rank 0's decode fails once. Every rank must stay on the
    same path (one agreed raw gather each time) and bit-exact."""
    n = 2048
    buf = torch.zeros(n * world, dtype=torch.bfloat16)
    ref = torch.zeros_like(buf)
    traj = AdamTrajectory(numel=n, seed=rank)
    gather = CieraAllGather(buf, config=CieraConfig(codec="delta", selection="always"))
    codec = gather.codec
    raised = []

    def failing(method, exc):
        original = getattr(codec, method)

        def once(**kw):
            setattr(codec, method, original)
            raise exc
        setattr(codec, method, once)

    plans = []
    for step in range(12):
        x = traj.step()
        buf.view(world, -1)[rank].copy_(x)
        if step == 4 and rank == 1:
            failing("encode", RuntimeError("injected encode failure"))
        if step == 8 and rank == 0:
            failing("decode_many", RuntimeError("injected decode failure"))
        dist.all_gather_into_tensor(ref, x)  # every rank, also where the gather below raises
        gather.prepare()
        plans.append(gather.plan.raw)
        try:
            gather.start().wait()
        except RuntimeError as e:
            raised.append((step, str(e)))
            continue
        assert torch.equal(as_bits(buf), as_bits(ref)), step
    return plans, raised, gather.stats


def test_local_failures_are_agreed_not_divergent():
    results = run_on_ranks(_failure_worker, world=2)
    (plans0, raised0, s0), (plans1, raised1, s1) = results
    assert plans0 == plans1, "ranks took different paths"
    assert plans0[4] and plans0[9] and not plans0[3] and not plans0[8]  # agreed raw after each failure
    assert raised0 == [(8, "injected decode failure")] and raised1 == []
    assert s0.failures == s1.failures == 2 and s0.raw_gathers == s1.raw_gathers


def _late_corruption_worker(rank, world, ask_at_once=False):
    """Rank 1's decode at step 5 returns a failing verdict unread, as the Triton decoder does on
    CUDA. The next agreement must stop every rank with the same error, rank 1's naming the check;
    ``ask_at_once``: rank 1 asks for the verdicts right after that gather (as before a checkpoint)."""
    from ciera.codecs.deferred import DeviceError

    n = 2048
    buf = torch.zeros(n * world, dtype=torch.bfloat16)
    traj = AdamTrajectory(numel=n, seed=rank)
    gather = CieraAllGather(buf, config=CieraConfig(codec="delta", selection="always"))
    codec = gather.codec
    real = codec._decode_many_impl
    step_now = [0]

    def deferred(t):
        impl = real(t)

        def decode_many(**kw):
            impl(**kw)
            code = 2 if (rank == 1 and step_now[0] == 5) else 9
            return DeviceError(word=torch.tensor([code], dtype=torch.int32), clean=9,
                               describe=lambda c: f"injected check {c} failed")
        return decode_many

    codec._decode_many_impl = deferred
    for step in range(8):
        step_now[0] = step
        buf.view(world, -1)[rank].copy_(traj.step())
        try:
            gather.prepare()
        except CieraVerifyError as e:
            return step, str(e)
        assert not gather.plan.raw or step == 0, step
        gather.start().wait()
        if ask_at_once and step == 5:
            if rank == 0:
                gather.raise_pending_errors()  # nothing pending here
                return None
            with pytest.raises(ValueError, match="injected check 2 failed"):
                gather.raise_pending_errors()
            return "raised"
    return None


def test_a_corrupt_payload_found_late_stops_every_rank_at_the_next_agreement():
    (step0, msg0), (step1, msg1) = run_on_ranks(_late_corruption_worker, world=2)
    assert step0 == step1 == 6
    assert "rank(s) [1] decoded a corrupt payload" in msg0 and "here:" not in msg0
    assert "rank(s) [1] decoded a corrupt payload" in msg1 and "here: injected check 2 failed" in msg1
    assert "resume from the last checkpoint" in msg1


def test_a_corrupt_payload_found_late_raises_when_asked_for():
    assert run_on_ranks(_late_corruption_worker, world=2, args=(True,)) == [None, "raised"]
