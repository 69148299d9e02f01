"""selection='auto': the cost model's decisions inside a real gather, identical on every rank,
bit-exact through every switch."""

import math

import pytest
import torch
import torch.distributed as dist

from ciera import CieraAllGather, CieraConfig
from ciera.codecs import as_bits
from ciera.cost_model import LinkModel
from ciera.selection import Measurements
from ciera.testing import run_on_ranks
from ciera.testing.trajectory import AdamTrajectory, adversarial_step

pytestmark = pytest.mark.distributed


def _free_decisions():
    """Decisions cost nothing to the budget (``DECISION_BUDGET``): the intervals are the back-off's
    alone. This process only (a spawned rank)."""
    import ciera.selection

    ciera.selection.DECISION_BUDGET = float("inf")


def _worker(rank, world, bandwidth, codec, steps, selection="auto", free=True):
    if free:
        _free_decisions()
    n = 4096 * world
    buf = torch.zeros(n, dtype=torch.bfloat16)
    ref = torch.zeros_like(buf)
    traj = AdamTrajectory(numel=n // world, seed=rank)
    gen = torch.Generator().manual_seed(rank)
    link = LinkModel(bandwidth_bytes_per_s=bandwidth, latency_s=1e-5)
    gather = CieraAllGather(buf, measurements=Measurements(link=link), name="b0",
                            config=CieraConfig(codec=codec, selection=selection, reevaluate_interval=7))
    modes, decided = [], []  # decided: the gathers at which a decision was taken
    for step in range(steps):
        x = traj.step()
        if step == 20:
            x = adversarial_step(x, kind="replace", gen=gen)  # a burst the selector must survive
        buf.view(world, -1)[rank].copy_(x)
        gather.start().wait()
        dist.all_gather_into_tensor(ref, x)
        assert torch.equal(as_bits(buf), as_bits(ref)), step
        modes.append(gather._codec_name)
        if gather.selector.decisions > len(decided):
            decided.append(step)
    sel = gather.selector
    schedule = dict(decide_at=sel.decide_at, cost_s=sel.cost_s, mode=sel.mode, decided=decided,
                    predicted=sel.decision.times)
    return modes, gather.stats, sel.decisions, sel.backoff, schedule


@pytest.mark.parametrize("world", [2, 4])
def test_slow_link_compresses_fast_link_does_not(world):
    slow = run_on_ranks(_worker, world=world, args=(1e6, "auto", 30))
    fast = run_on_ranks(_worker, world=world, args=(1e13, "auto", 30))
    for runs in (slow, fast):
        assert all(r[0] == runs[0][0] for r in runs), "ranks took different decisions"
        assert all(r[4] == runs[0][4] for r in runs), "ranks hold different schedules"
    # Slow: re-decided every 7 gathers. Fast: raw wins outright, so the interval doubles (1, 15, 43).
    assert slow[0][2] >= 3 and slow[0][3] == 1
    assert fast[0][2] == 2 and fast[0][3] == 4
    assert slow[0][0][-1] in ("exponent_reuse", "delta", "delta_ans") and slow[0][1].ratio > 1.5
    assert fast[0][0][-1] is None and fast[0][1].ratio == 1.0


def test_single_codec_auto_can_still_choose_raw():
    runs = run_on_ranks(_worker, world=2, args=(1e13, "exponent_reuse", 16))
    assert runs[0][0][-1] is None


def test_auto_codec_under_always_never_sends_raw():
    """codec='auto' with selection='always': the cost model picks the codec, raw is not an option."""
    runs = run_on_ranks(_worker, world=2, args=(1e13, "auto", 16, "always"))
    assert all(r[0] == runs[0][0] for r in runs)
    assert all(m in ("exponent_reuse", "delta", "delta_ans") for m in runs[0][0]) and runs[0][1].ratio > 1.2


def test_decisions_stay_within_their_budget():
    """With the real ``DECISION_BUDGET``: on a link so fast that a decision's probes outweigh many
    raw gathers, the next decision is pushed out to the cap (``MAX_BACKOFF`` intervals); on a slow
    link, where they are a sliver of one gather, the interval stays the configured one. The cost is
    the slowest rank's, so the schedule is the same everywhere."""
    from ciera.selection import DECISION_BUDGET, MAX_BACKOFF

    fast = run_on_ranks(_worker, world=2, args=(1e13, "auto", 30, "auto", False))
    slow = run_on_ranks(_worker, world=2, args=(1e5, "auto", 40, "auto", False))
    for runs in (fast, slow):
        assert runs[0][4] == runs[1][4] and runs[0][4]["cost_s"] > 0, "ranks hold different schedules"
    f = fast[0][4]
    assert f["decided"] == [1] and f["mode"] == "raw" and f["decide_at"] == 1 + MAX_BACKOFF * 7  # the cap
    s = slow[0][4]
    assert len(s["decided"]) >= 3 and s["mode"] in ("exponent_reuse", "delta", "delta_ans")
    least = math.ceil(s["cost_s"] / (DECISION_BUDGET * s["predicted"][s["mode"]]))
    assert s["decide_at"] - s["decided"][-1] == max(7, min(least, MAX_BACKOFF * 7)), s


def _one_rank_invalidates(rank, world, bandwidth, at):
    """Rank 1 alone calls invalidate() before the gathers in ``at`` (a local write, as after a
    failure): the selector's schedule must stay rank-identical, or a decision's collectives would
    meet different collectives on the other rank (a hang)."""
    _free_decisions()  # decisions at the configured intervals, among the invalidations
    n = 4096 * world
    buf = torch.zeros(n, dtype=torch.bfloat16)
    ref = torch.zeros_like(buf)
    traj = AdamTrajectory(numel=n // world, seed=rank)
    link = LinkModel(bandwidth_bytes_per_s=bandwidth, latency_s=1e-5)
    gather = CieraAllGather(buf, measurements=Measurements(link=link), name="b0",
                            config=CieraConfig(codec="auto", selection="auto", reevaluate_interval=7))
    schedule = []
    for step in range(40):
        x = traj.step()
        buf.view(world, -1)[rank].copy_(x)
        if rank == 1 and step in at:
            gather.invalidate()
        gather.start().wait()
        schedule.append((gather.selector.decide_at, gather._codec_name))
        dist.all_gather_into_tensor(ref, x)
        assert torch.equal(as_bits(buf), as_bits(ref)), step
    return schedule, gather.selector.decisions, gather.stats.raw_gathers


@pytest.mark.parametrize("bandwidth", [1e6, 1e13])
def test_one_rank_invalidating_keeps_the_schedule_rank_identical(bandwidth):
    # 1: the first decision's gather; 5, 8, 12, 19: at, before and after the re-decisions (every 7)
    at = [1, 5, 8, 12, 19]
    runs = run_on_ranks(_one_rank_invalidates, world=2, args=(bandwidth, at), timeout_s=60)
    assert runs[0][0] == runs[1][0], "ranks followed different selection schedules"
    assert runs[0][1] >= 2, runs[0][1]  # decisions still happened, postponed past the raw gathers
    if bandwidth < 1e9:  # compressing: each invalidation made one more gather raw on every rank
        assert runs[0][0][-1][1] in ("exponent_reuse", "delta", "delta_ans")
        assert runs[0][2] == runs[1][2] >= 1 + len(at), runs[0][2]


def _count_agreements(rank, world, steps):
    """Fast link: selection chooses raw; count the size-agreement collectives per gather, and
    keep the selection's log lines."""
    import logging

    import ciera.agreement as agreement

    calls, records = [], []
    real = agreement.all_gather_into
    agreement.all_gather_into = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    handler = logging.Handler(level=logging.INFO)
    handler.emit = lambda r: records.append(r.getMessage())
    lg = logging.getLogger("ciera.selection")
    old, lg.level = lg.level, logging.INFO
    lg.addHandler(handler)
    try:
        modes, stats, decisions, *_ = _worker(rank, world, 1e13, "auto", steps)
    finally:
        agreement.all_gather_into = real
        lg.removeHandler(handler)
        lg.setLevel(old)
    return modes, len(calls), decisions, records


def test_auto_that_chose_raw_skips_the_size_agreement():
    """Once selection has chosen raw, a gather is a plain all-gather: no size table until the next
    re-decision (the bits still match plain all_gather every step, checked in the worker)."""
    steps = 30
    runs = run_on_ranks(_count_agreements, world=2, args=(steps,))
    modes, agreements, decisions, records = runs[0]
    assert all(r[:2] == runs[0][:2] for r in runs), "ranks took different paths"
    raw_from = modes.index(None)  # first gather after selection chose raw
    assert all(m is None for m in modes[raw_from:]) and decisions >= 2  # 1 and 15: raw wins outright, backing off
    assert agreements <= raw_from + 1, (agreements, raw_from)  # only the gathers before raw was chosen
    # the log says it picked raw, once, naming the bucket and what each codec would have cost
    assert len(records) == 1, records
    msg = records[0]
    assert msg.startswith("b0: selection -> raw (raw ") and "compressing is not faster: exponent_reuse" in msg, msg
    assert "delta" in msg and "world 2" in msg, msg



def _refine(rank, world):
    m = Measurements()
    first = m.link_for(group=None, device="cpu", shard_bytes=1 << 16)
    before = list(m.link_times)
    refined = m.refine_link(group=None, device="cpu")
    again = m.refine_link(group=None, device="cpu")  # once only: no further collective
    return before, list(m.link_times), m.link_measurements, first, refined, again is refined


def test_refined_link_is_measured_once_more_and_agreed():
    """On a real group the second link measurement is collective and rank-identical: every rank
    holds the same per-size times, each the faster of its two measurements."""
    runs = run_on_ranks(_refine, world=2)
    before, after, count, first, refined, once = runs[0]
    assert all(r[1:5] == runs[0][1:5] for r in runs), "ranks hold different links"
    assert count == 2 and once and len(after) == 3
    assert all(a <= b for a, b in zip(after, before))
