"""The simulator's iteration timeline: three streams, one forward pass of prefetched gathers.

Costs of one bucket's gather come from :mod:`ciera.cost_model` (``predict_raw`` /
``predict_compressed`` / ``decide``) and payload sizes from the codecs' own size accounting
(``make_codec(...).clamp_capacity``: never below the codec's fixed part, never above its worst
case). This module only places those costs on a timeline:

* **compute stream** (clock ``c``): per bucket ``k`` in forward order: dispatch the gather of
  ``k+1`` (Megatron's ``overlap_param_gather`` prefetch: the next bucket's gather is started
  before waiting on this one), wait for gather ``k``, decode it (critical path), run its forward
  compute. Without ``overlap_encode`` the encode of a bucket runs here, when its gather is
  dispatched.
* **comm stream** (clock ``m``): gathers run one at a time in dispatch order; gather ``k`` starts at
  ``max(m, dispatch time, encode done)``.
* **encode stream** (with ``overlap_encode``): encodes run back to back from the start of the
  iteration, off the compute stream (the paper's pipelining; the optimizer step has produced the new
  shards before forward starts).

The iteration is ``forward end + (iteration_compute_s - sum of bucket forward compute)``: backward
and the optimizer step follow the forward pass and are not delayed by parameter gathers (one gather
per bucket per iteration, as Megatron's distributed optimizer does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from ciera.codecs import make_codec
from ciera.cost_model import (
    RAW, CodecEstimate, Link, Prediction, decide, predict_compressed, predict_raw,
)

from .trace import BucketTrace, Trace

AUTO = "auto"


@lru_cache(maxsize=4096)
def _codec(name: str, dtype, numel: int):
    return make_codec(name, dtype=dtype, numel=numel, backend="torch")


def shard_numel(*, numel: int, world: int) -> int:
    """Values per rank: buffers are padded to a multiple of the world size."""
    return -(-numel // world)


def estimates(*, bucket: BucketTrace, world: int) -> list[CodecEstimate]:
    """The bucket's codecs as cost-model candidates at this world size.

    The traced ``wire_ratio`` is applied to the shard's raw bytes and then clamped by the codec's
    own size accounting (fixed part, worst case, alignment) at this shard size.
    """
    n = shard_numel(numel=bucket.numel, world=world)
    out = []
    for name, ct in bucket.codecs.items():
        codec = _codec(name, bucket.torch_dtype, n)
        wire = codec.clamp_capacity(math.ceil(ct.wire_ratio * codec.raw_bytes))
        out.append(CodecEstimate(name, wire_ratio=wire / codec.raw_bytes, speed=ct.speed()))
    return out


def plan_bucket(*, bucket: BucketTrace, world: int, link: Link, mode: str, overlap_encode: bool) -> Prediction:
    """Predicted encode/comm/decode of one bucket's gather in ``mode`` (``raw``, a codec, or ``auto``)."""
    raw_bytes = shard_numel(numel=bucket.numel, world=world) * bucket.torch_dtype.itemsize
    if mode == RAW:
        return predict_raw(raw_bytes_per_rank=raw_bytes, world=world, link=link)
    cands = estimates(bucket=bucket, world=world)
    if mode == AUTO:
        d = decide(raw_bytes_per_rank=raw_bytes, world=world, link=link, candidates=cands,
                   overlapped_encode=overlap_encode)
        return next(p for p in d.predictions if p.name == d.choice)
    est = next((c for c in cands if c.name == mode), None)
    if est is None:
        raise ValueError(f"bucket {bucket.name}: no trace figures for codec {mode!r} (have {sorted(bucket.codecs)})")
    return predict_compressed(raw_bytes_per_rank=raw_bytes, world=world, link=link, estimate=est,
                              overlapped_encode=overlap_encode)


@dataclass(frozen=True)
class BucketTiming:
    """Where one bucket's work fell on the timeline (seconds from the start of forward)."""

    name: str
    choice: str
    """``raw`` or the codec used."""
    wire_bytes_per_rank: float
    gather_start_s: float
    gather_done_s: float
    compute_start_s: float
    """When its forward compute began (after the wait and the decode)."""
    stall_s: float
    """Compute-stream time spent waiting for this bucket's gather."""


@dataclass(frozen=True)
class IterationResult:
    """One simulated iteration."""

    trace: str
    world: int
    mode: str
    overlap_encode: bool
    iteration_s: float
    """Predicted iteration time."""
    forward_s: float
    """End of the forward pass (gathers, decodes, encodes on the compute stream, forward compute)."""
    comm_s: float
    """Sum of gather durations on the comm stream (hidden or not)."""
    compute_s: float
    """Pure compute of the iteration (the trace's ``iteration_compute_s``)."""
    buckets: tuple[BucketTiming, ...]

    @property
    def exposed_s(self) -> float:
        """Iteration time beyond pure compute: what the gathers and the codecs cost."""
        return self.iteration_s - self.compute_s


def simulate_iteration(*, trace: Trace, world: int, link: Link, mode: str = RAW,
                       overlap_encode: bool = False, overlap_comm: bool = True) -> IterationResult:
    """Place every bucket's encode, gather and decode on the timeline described in the module doc.

    ``overlap_comm=False`` collapses the streams into one (encode, gather, decode, compute of each
    bucket back to back): the right model where communication needs the same processors as
    compute, as gloo on a CPU-only machine does.
    """
    plans = [plan_bucket(bucket=b, world=world, link=link, mode=mode, overlap_encode=overlap_encode)
             for b in trace.buckets]
    n = len(plans)
    c = m = e = 0.0
    start, done = [0.0] * n, [0.0] * n

    def dispatch(k: int) -> None:
        nonlocal c, m, e
        if not overlap_comm:
            c += plans[k].encode_s
            start[k] = c
            c = m = done[k] = c + plans[k].comm_s
            return
        if overlap_encode:
            e += plans[k].encode_s
            ready = max(c, e)
        else:
            c += plans[k].encode_s
            ready = c
        start[k] = max(m, ready)
        m = done[k] = start[k] + plans[k].comm_s

    timings = []
    if n:
        dispatch(0)
    for k, (b, p) in enumerate(zip(trace.buckets, plans)):
        if k + 1 < n and overlap_comm:
            dispatch(k + 1)
        elif not overlap_comm and k > 0:
            dispatch(k)
        stall = max(0.0, done[k] - c)
        c = max(c, done[k]) + p.decode_s
        timings.append(BucketTiming(b.name, p.name, p.wire_bytes_per_rank, start[k], done[k], c, stall))
        c += b.compute_s
    tail = trace.iteration_compute_s - trace.forward_s
    return IterationResult(trace=trace.name, world=world, mode=mode, overlap_encode=overlap_encode,
                           iteration_s=c + tail, forward_s=c, comm_s=sum(p.comm_s for p in plans),
                           compute_s=trace.iteration_compute_s, buckets=tuple(timings))


def modes_for(trace: Trace) -> list[str]:
    """``raw``, every traced codec, then ``auto``."""
    return [RAW, *trace.codec_names(), AUTO]
