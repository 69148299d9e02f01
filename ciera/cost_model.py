"""The cost model: is compressing this bucket's all-gather worth it, and with which codec?

Compression must never make a run slower. For one bucket the model compares two predicted times:

* **raw**: an all-gather of ``raw_bytes_per_rank`` over the group's link;
* **compressed** with codec ``c``: encode of the own shard (unless overlapped with earlier work)
  + an all-gather of ``wire_ratio(c) x raw_bytes_per_rank`` + decode of the ``world - 1`` received
  payloads (always on the critical path: the layer cannot run before its weights exist).

Everything here is a pure function of measured numbers or a frozen dataclass; the measurements
(timing real collectives and codecs, MAX-reduced across the group so that every rank holds the
same numbers) are :mod:`ciera.measure`'s. With equal inputs :func:`decide` is deterministic,
hence rank-identical.

:class:`LinkModel` is one homogeneous link, ring algorithm: ``(world - 1)`` steps, each one
``latency + bytes_per_rank / bandwidth``; anything with ``allgather_time`` is a :class:`Link`
(the simulator's two-level cluster link is ``tools.sim.links.TwoLevelLink``). Bandwidths are per
rank and per direction, in bytes per second of payload.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

RAW = "raw"


# ---------------------------------------------------------------------------------------------
# Links
# ---------------------------------------------------------------------------------------------
class Link(Protocol):
    """Anything that predicts the time of one all-gather."""

    def allgather_time(self, *, bytes_per_rank: float, world: int) -> float: ...


@dataclass(frozen=True)
class LinkModel:
    """A homogeneous link between every pair of neighbouring ranks of a ring."""

    bandwidth_bytes_per_s: float
    """Payload bytes per second one rank sends (and receives) per ring step."""

    latency_s: float = 0.0
    """Fixed cost of one ring step (launch, synchronisation, wire latency), in seconds."""

    def __post_init__(self):
        if not self.bandwidth_bytes_per_s > 0:
            raise ValueError(f"LinkModel: bandwidth_bytes_per_s={self.bandwidth_bytes_per_s} must be > 0")
        if not self.latency_s >= 0:
            raise ValueError(f"LinkModel: latency_s={self.latency_s} must be >= 0")

    def allgather_time(self, *, bytes_per_rank: float, world: int) -> float:
        """Ring all-gather: ``(world - 1) * (latency + bytes_per_rank / bandwidth)`` seconds."""
        if world <= 1:
            return 0.0
        return (world - 1) * (self.latency_s + bytes_per_rank / self.bandwidth_bytes_per_s)


# ---------------------------------------------------------------------------------------------
# Codecs
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CodecSpeed:
    """Measured throughput of one codec on this device, in bytes of raw (uncompressed) shard per second."""

    encode_bytes_per_s: float
    """Raw shard bytes encoded per second (one rank encodes its own shard)."""

    decode_bytes_per_s: float
    """Raw shard bytes decoded per second (one rank decodes ``world - 1`` received shards)."""

    def __post_init__(self):
        for name in ("encode_bytes_per_s", "decode_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"CodecSpeed: {name}={getattr(self, name)} must be > 0")


@dataclass(frozen=True)
class CodecEstimate:
    """What a bucket's recent history says about one codec."""

    name: str
    """Codec name (``ciera.available_codecs()``); must not be ``raw``."""

    wire_ratio: float
    """Bytes on the wire / raw bytes of a shard: the payload capacity actually sent (header and
    capacity headroom included), over the shard's bytes. Depends on the bucket's change rate."""

    speed: CodecSpeed
    """Encode and decode throughput of this codec on this device."""

    def __post_init__(self):
        if self.name == RAW:
            raise ValueError("CodecEstimate: 'raw' is the baseline, not a candidate")
        if not self.wire_ratio > 0:
            raise ValueError(f"CodecEstimate({self.name}): wire_ratio={self.wire_ratio} must be > 0")


@dataclass(frozen=True)
class Prediction:
    """The predicted cost of one bucket's gather in one mode, broken down."""

    name: str
    """``raw`` or a codec name."""

    wire_bytes_per_rank: float
    """Bytes each rank contributes to the all-gather."""

    encode_s: float
    """Encode of the own shard (0 for raw). Counted in ``total_s`` only when not overlapped."""

    comm_s: float
    """All-gathers of ``wire_bytes_per_rank`` on the link (a step's, see :class:`StepShape`)."""

    decode_s: float
    """Decodes of the ``world - 1`` received payloads and receiver-cache passes (0 for raw)."""

    total_s: float
    """Critical-path seconds: ``comm_s + decode_s`` plus ``encode_s`` when encode is not overlapped."""


@dataclass(frozen=True)
class Decision:
    """The cost model's choice for one bucket, with the evidence it rests on."""

    choice: str
    """``raw`` or the chosen codec's name."""

    raw_bytes_per_rank: int
    """Bytes of one rank's shard."""

    world: int
    """Ranks in the group."""

    predictions: tuple[Prediction, ...]
    """One entry per mode: raw first, then every candidate in the order given."""

    current: str | None = None
    """The mode the bucket used before this decision (``None``: first decision)."""

    hysteresis: float = 0.0
    """The fraction by which an alternative had to beat ``current`` to be chosen."""

    reason: str = ""
    """One human-readable line explaining the choice."""

    @property
    def times(self) -> dict[str, float]:
        """Predicted critical-path seconds per mode."""
        return {p.name: p.total_s for p in self.predictions}

    @property
    def raw_s(self) -> float:
        return self.predictions[0].total_s

    @property
    def predicted_s(self) -> float:
        """Predicted seconds of the chosen mode."""
        return self.times[self.choice]

    @property
    def compress(self) -> bool:
        return self.choice != RAW


@dataclass(frozen=True)
class StepShape:
    """How often a shard is gathered per optimizer step and what its later gathers cost. The
    default is the distributed optimizer's (one gather per step); ZeRO-3 gathers each unit in the
    forward and again in the backward of every micro-batch (:mod:`ciera.zero3`)."""

    gathers: int = 1
    """Gathers of the shard per step, all of the same values (the first encodes, the others replay)."""
    replays_send: bool = True
    """A replay sends the step's payloads again and decodes them (exponent cache); ``False``: it
    sends nothing (values cache: the receivers already hold the step's values, whether the fresh
    gather was compressed or raw)."""
    cache_passes: int = 0
    """Passes over the gathered values per gather besides the decode (exponent cache: seeding the
    fresh buffer with the cached exponents and refreshing them), each costed like a decode."""

    def __post_init__(self):
        if self.gathers < 1 or self.cache_passes < 0:
            raise ValueError(f"StepShape: gathers={self.gathers} must be >= 1, cache_passes={self.cache_passes} >= 0")


ONE_GATHER = StepShape()


def predict_raw(*, raw_bytes_per_rank: float, world: int, link: Link, shape: StepShape = ONE_GATHER) -> Prediction:
    """Predicted cost of a plain all-gather (per step: ``shape.gathers`` of them, or one when
    replays send nothing)."""
    sending = shape.gathers if shape.replays_send else 1
    comm = sending * link.allgather_time(bytes_per_rank=raw_bytes_per_rank, world=world)
    return Prediction(RAW, float(raw_bytes_per_rank), 0.0, comm, 0.0, comm)


def agreement_time(*, link: Link, world: int, buckets: int = 1) -> float:
    """Cost of the per-step size agreement charged to each of ``buckets`` compressed buckets of a
    group: one all-gather of 24 bytes per bucket and rank (latency-bound), shared by the buckets."""
    return link.allgather_time(bytes_per_rank=24 * max(buckets, 1), world=world) / max(buckets, 1)


def predict_compressed(*, raw_bytes_per_rank: float, world: int, link: Link, estimate: CodecEstimate,
                       overlapped_encode: bool = False, agreement_s: float = 0.0,
                       codec_slowdown: float = 1.0, shape: StepShape = ONE_GATHER) -> Prediction:
    """Predicted cost of a compressed all-gather with ``estimate``'s codec: encode (unless
    overlapped), this bucket's share ``agreement_s`` of the size agreement, the collective of the
    exact payloads (``wire_ratio`` of raw per rank) and the batched decode of ``world - 1`` of them.
    Both codec phases take ``codec_slowdown`` times ``estimate.speed``'s time: 1 where each rank
    has its own compute; more where ranks share CPU cores (the simulator's ``HostShare``).
    Per step under ``shape``: one encode and one agreement (replays reuse the plan without one);
    the fresh gather and every replay that sends (``replays_send``) pay the collective, the decode
    and the cache passes."""
    if not codec_slowdown >= 1.0:
        raise ValueError(f"predict_compressed: codec_slowdown={codec_slowdown} must be >= 1")
    share = codec_slowdown
    wire = estimate.wire_ratio * raw_bytes_per_rank
    sending = shape.gathers if shape.replays_send else 1
    enc = share * raw_bytes_per_rank / estimate.speed.encode_bytes_per_s
    comm = sending * link.allgather_time(bytes_per_rank=wire, world=world) + agreement_s
    one_decode = share * max(world - 1, 0) * raw_bytes_per_rank / estimate.speed.decode_bytes_per_s
    dec = sending * one_decode + shape.gathers * shape.cache_passes * one_decode * world / max(world - 1, 1)
    total = comm + dec + (0.0 if overlapped_encode else enc)
    return Prediction(estimate.name, wire, enc, comm, dec, total)


def decide(*, raw_bytes_per_rank: int, world: int, link: Link, candidates: Sequence[CodecEstimate],
           current: str | None = None, hysteresis: float = 0.1, overlapped_encode: bool = False,
           agreement_s: float = 0.0, shape: StepShape = ONE_GATHER) -> Decision:
    """Choose ``raw`` or one of ``candidates`` for a bucket; deterministic in its inputs.

    The fastest predicted mode wins (ties go to raw, then to the earlier candidate). When ``current``
    is one of the modes, the bucket leaves it only for a mode predicted faster by more than
    ``hysteresis`` x current's time, so noisy estimates near the break-even point cannot make it
    flap between modes. Times are per step: ``shape`` says how many gathers a step makes.
    """
    if world < 1:
        raise ValueError(f"decide: world={world} must be >= 1")
    if raw_bytes_per_rank < 0:
        raise ValueError(f"decide: raw_bytes_per_rank={raw_bytes_per_rank} must be >= 0")
    if hysteresis < 0:
        raise ValueError(f"decide: hysteresis={hysteresis} must be >= 0")
    preds = [predict_raw(raw_bytes_per_rank=raw_bytes_per_rank, world=world, link=link, shape=shape)]
    preds += [predict_compressed(raw_bytes_per_rank=raw_bytes_per_rank, world=world, link=link, estimate=c,
                                 overlapped_encode=overlapped_encode, agreement_s=agreement_s, shape=shape)
              for c in candidates]
    names = [p.name for p in preds]
    if len(set(names)) != len(names):
        raise ValueError(f"decide: duplicate candidate names {names}")
    best = min(preds, key=lambda p: p.total_s)  # min keeps the first of equals: raw wins ties
    common = dict(raw_bytes_per_rank=int(raw_bytes_per_rank), world=world, predictions=tuple(preds),
                  current=current, hysteresis=hysteresis)
    by_name = {p.name: p for p in preds}
    if current in by_name and best.name != current:
        cur = by_name[current]
        if not best.total_s < cur.total_s * (1.0 - hysteresis):
            return Decision(choice=current, reason=(
                f"keep {current}: {best.name} {best.total_s * 1e6:.1f} us is not {hysteresis:.0%} better "
                f"than {cur.total_s * 1e6:.1f} us"), **common)
    raw = preds[0]
    where = f"({raw_bytes_per_rank} B/rank, world {world})"
    if best is raw:  # say what compression would have cost: the log shows why it sends raw
        alts = ", ".join(f"{p.name} {p.total_s * 1e6:.1f} us" for p in preds[1:])
        return Decision(choice=RAW, reason=(
            f"raw {raw.total_s * 1e6:.1f} us; compressing is not faster{': ' + alts if alts else ''} {where}"), **common)
    return Decision(choice=best.name, reason=(
        f"{best.name} {best.total_s * 1e6:.1f} us vs raw {raw.total_s * 1e6:.1f} us {where}"), **common)


# ---------------------------------------------------------------------------------------------
# Running averages
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ewma:
    """An exponentially weighted moving average; immutable, :meth:`update` returns the next one.

    ``value = alpha * x + (1 - alpha) * value``; the first sample is taken as is (no bias toward 0).
    """

    alpha: float = 0.2
    """Weight of the newest sample, in (0, 1]. 0.2 remembers roughly the last 10 samples."""

    value: float | None = None
    """Current average; ``None`` until the first sample."""

    count: int = 0
    """Samples folded in so far."""

    def __post_init__(self):
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"Ewma: alpha={self.alpha} must be in (0, 1]")

    def update(self, x: float) -> "Ewma":
        x = float(x)
        v = x if self.value is None else self.alpha * x + (1.0 - self.alpha) * self.value
        return Ewma(alpha=self.alpha, value=v, count=self.count + 1)

    def get(self, default: float) -> float:
        """The average, or ``default`` before any sample."""
        return default if self.value is None else self.value


# ---------------------------------------------------------------------------------------------
# Fitting a link to measured times (:mod:`ciera.measure` takes them)
# ---------------------------------------------------------------------------------------------
def fit_latency_bandwidth(*, sizes: Sequence[float], times: Sequence[float], world: int) -> LinkModel:
    """Least-squares fit of ``time = (world-1) * (latency + size / bandwidth)`` to measurements.

    A negative fitted latency is clamped to 0 (and the bandwidth refitted through the origin); a
    non-positive slope (timings dominated by noise) gives an effectively infinite bandwidth.
    """
    if len(sizes) != len(times) or len(sizes) < 2:
        raise ValueError(f"fit_latency_bandwidth: need >= 2 (size, time) pairs; got {len(sizes)}/{len(times)}")
    steps = max(world - 1, 1)
    xs = [float(s) for s in sizes]
    ys = [float(t) / steps for t in times]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    if sxx == 0:
        raise ValueError("fit_latency_bandwidth: sizes must not all be equal")
    slope = sxy / sxx
    latency = my - slope * mx
    if latency < 0:
        latency = 0.0
        slope = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    bandwidth = 1.0 / slope if slope > 0 else 1e30
    return LinkModel(bandwidth_bytes_per_s=bandwidth, latency_s=latency)


__all__ = [
    "RAW", "CodecEstimate", "CodecSpeed", "Decision", "Ewma", "Link", "LinkModel", "Prediction", "agreement_time",
    "decide", "fit_latency_bandwidth", "predict_compressed", "predict_raw",
]
