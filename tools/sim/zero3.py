"""The simulator's ZeRO-3 timeline: every unit gathered in the forward and again in the backward.

Under ZeRO-3 (FSDP2, Megatron-FSDP's ``optim_grads_params``) each unit (a trace bucket) is gathered
before its forward and again before its backward, for every micro-batch; the next unit's gather is
prefetched while the current one computes. :mod:`ciera.zero3` encodes a unit's shard once per
optimizer step: the first gather of a step is *fresh* (encode, compressed collective, decode), the
others *replay*: with the exponent cache they send the payloads again and decode them, with the
values cache they send nothing (one agreement). Each gather of the exponent cache also seeds the
fresh buffer from the cache and refreshes it (two passes over the gathered values, costed like a
decode). Per-gather costs come from :mod:`ciera.cost_model`; ``auto`` decides per unit with the
step's :class:`ciera.cost_model.StepShape`.

Streams, as in :mod:`tools.sim.timeline`: a compute stream (forward units in order, then backward
units in reverse order, per micro-batch) and a comm stream running gathers one at a time in
dispatch order; gather ``k+1`` (forward) or ``k-1`` (backward) is dispatched before gather ``k`` is
waited on. Encodes run on the compute stream when dispatched (or on their own stream from the start
of the step with ``overlap_encode``). Gradient reduce-scatters are left out (the same bytes with and
without CIERA); the optimizer step is outside the timeline.
"""

from __future__ import annotations

from dataclasses import dataclass

from ciera.cost_model import RAW, Link, StepShape, agreement_time, decide, predict_compressed, predict_raw

from .timeline import AUTO, estimates, shard_numel
from .trace import Trace

CACHES = ("exponents", "values")


@dataclass(frozen=True)
class GatherCost:
    """One gather's pieces (seconds)."""

    encode_s: float
    comm_s: float
    decode_s: float


@dataclass(frozen=True)
class UnitPlan:
    """What a unit's gathers cost in one step: the fresh one and each replay."""

    choice: str
    fresh: GatherCost
    replay: GatherCost
    wire_bytes_per_rank: float


@dataclass(frozen=True)
class Zero3Result:
    """One simulated ZeRO-3 step."""

    trace: str
    world: int
    mode: str
    cache: str
    micro_batches: int
    iteration_s: float
    compute_s: float
    comm_s: float
    """Sum of all gathers' durations on the comm stream (hidden or not)."""
    choices: tuple[str, ...]
    """Per unit: ``raw`` or the codec used."""


def plan_unit(*, bucket, world: int, link: Link, mode: str, cache: str, micro_batches: int,
              overlap_encode: bool) -> UnitPlan:
    """The fresh gather and the replays of one unit under ``mode`` (``raw``, a codec, ``auto``)."""
    if cache not in CACHES:
        raise ValueError(f"cache={cache!r}; expected one of {CACHES}")
    raw_bytes = shard_numel(numel=bucket.numel, world=world) * bucket.torch_dtype.itemsize
    shape = StepShape(gathers=2 * micro_batches, replays_send=cache == "exponents",
                      cache_passes=2 if cache == "exponents" else 0)
    agree_s = agreement_time(link=link, world=world)
    cands = [c for c in estimates(bucket=bucket, world=world) if cache == "values" or c.name == "exponent_reuse"]
    if mode == AUTO:
        d = decide(raw_bytes_per_rank=raw_bytes, world=world, link=link, candidates=cands,
                   overlapped_encode=overlap_encode, agreement_s=agree_s, shape=shape)
        mode = d.choice
    if mode == RAW:
        p = predict_raw(raw_bytes_per_rank=raw_bytes, world=world, link=link)
        g = GatherCost(0.0, p.comm_s, 0.0)  # a replay of the values cache holds the step's values already
        return UnitPlan(RAW, g, g if shape.replays_send else GatherCost(0.0, 0.0, 0.0), p.wire_bytes_per_rank)
    est = next((c for c in cands if c.name == mode), None)
    if est is None:
        raise ValueError(f"unit {bucket.name}: codec {mode!r} is not usable with cache={cache!r} "
                         f"(have {[c.name for c in cands]})")
    p = predict_compressed(raw_bytes_per_rank=raw_bytes, world=world, link=link, estimate=est,
                           agreement_s=agree_s)
    passes = shape.cache_passes * world * raw_bytes / est.speed.decode_bytes_per_s
    fresh = GatherCost(p.encode_s, p.comm_s, p.decode_s + passes)
    # a replay reuses the step's plan: no agreement; it resends (exponent cache) or sends nothing (values)
    replay = GatherCost(0.0, p.comm_s - agree_s, p.decode_s + passes) if shape.replays_send else GatherCost(0.0, 0.0, 0.0)
    return UnitPlan(mode, fresh, replay, p.wire_bytes_per_rank)


def simulate_zero3_step(*, trace: Trace, world: int, link: Link, mode: str = RAW, cache: str = "exponents",
                        micro_batches: int = 1, overlap_encode: bool = False, overlap_comm: bool = True) -> Zero3Result:
    """Place every gather of one ZeRO-3 step on the timeline described in the module doc.
    ``overlap_comm=False``: one serial stream (each gather's encode, collective and decode, then the
    unit's compute), the right model for FSDP2 on a CPU with gloo, whose unshards are synchronous."""
    units = list(trace.buckets)
    plans = [plan_unit(bucket=b, world=world, link=link, mode=mode, cache=cache, micro_batches=micro_batches,
                       overlap_encode=overlap_encode) for b in units]
    fwd = [b.compute_s for b in units]
    total_fwd = sum(fwd)
    bwd_total = trace.iteration_compute_s - total_fwd
    bwd = [bwd_total * f / total_fwd for f in fwd] if total_fwd > 0 else [bwd_total / max(len(units), 1)] * len(units)
    order = []  # (unit, compute seconds) in execution order, per micro-batch: forward then backward
    for _ in range(micro_batches):
        order += [(k, fwd[k]) for k in range(len(units))]
        order += [(k, bwd[k]) for k in reversed(range(len(units)))]
    seen: set[int] = set()
    costs = []
    for k, _ in order:
        costs.append(plans[k].replay if k in seen else plans[k].fresh)
        seen.add(k)
    c = m = e = 0.0
    done = [0.0] * len(order)

    def dispatch(i: int) -> None:
        nonlocal c, m, e
        g = costs[i]
        if overlap_encode:
            e += g.encode_s
            ready = max(c, e)
        else:
            c += g.encode_s
            ready = c
        m = done[i] = max(m, ready) + g.comm_s

    if not overlap_comm:
        c = sum(g.encode_s + g.comm_s + g.decode_s for g in costs) + sum(compute for _, compute in order)
    elif order:
        dispatch(0)
    for i, (k, compute) in enumerate(order if overlap_comm else ()):
        if i + 1 < len(order):
            dispatch(i + 1)
        c = max(c, done[i]) + costs[i].decode_s + compute
    return Zero3Result(trace=trace.name, world=world, mode=mode, cache=cache, micro_batches=micro_batches,
                       iteration_s=c, compute_s=micro_batches * trace.iteration_compute_s,
                       comm_s=sum(g.comm_s for g in costs), choices=tuple(p.choice for p in plans))
