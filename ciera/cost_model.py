"""The cost model: is compressing this bucket's all-gather worth it, and with which codec?

Compression must never make a run slower. For one bucket the model compares two predicted times:

* **raw**: an all-gather of ``raw_bytes_per_rank`` over the group's link;
* **compressed** with codec ``c``: encode of the own shard (unless overlapped with earlier work)
  + an all-gather of ``wire_ratio(c) x raw_bytes_per_rank`` + decode of the ``world - 1`` received
  payloads (always on the critical path: the layer cannot run before its weights exist).

Everything here is a pure function of measured numbers or a frozen dataclass, except the
measurement helpers at the bottom (:func:`measure_link`, :func:`measure_codec_speed`,
:func:`agree`), which time real collectives and codecs. Every rank of a group must take the same
decision, so measurements are MAX-reduced across the group before anything is derived from them:
with equal inputs :func:`decide` is deterministic, hence rank-identical.

Link models (``allgather_time``):

* :class:`LinkModel` -- one homogeneous link, ring algorithm: ``(world - 1)`` steps, each one
  ``latency + bytes_per_rank / bandwidth``.
* :class:`TwoLevelLink` -- ``gpus_per_node`` ranks per node on a fast link, nodes joined by
  ``nics_per_node`` NICs each of ``inter`` speed. ``algorithm='ring'`` is a flat ring split into
  ``nics_per_node`` channels (as NCCL does), every step paced by the slower of the intra link and
  the node's NICs together; ``algorithm='hierarchical'`` gathers across nodes first (every local
  rank rings over the nodes, the local ranks sharing the node's NICs) then within the node (each
  rank forwards ``nodes`` shards over the fast link).

Bandwidths are per rank and per direction, in bytes per second of payload.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Protocol, Sequence

ALGORITHMS = ("ring", "hierarchical")
RAW = "raw"


# ---------------------------------------------------------------------------------------------
# Links
# ---------------------------------------------------------------------------------------------
class Link(Protocol):
    """Anything that predicts the time of one all-gather."""

    def allgather_time(self, *, bytes_per_rank: float, world: int) -> float: ...


def _ring_time(*, steps: int, bytes_per_step: float, bandwidth: float, latency: float) -> float:
    if steps <= 0:
        return 0.0
    return steps * (latency + bytes_per_step / bandwidth)


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
        return _ring_time(steps=world - 1, bytes_per_step=bytes_per_rank,
                          bandwidth=self.bandwidth_bytes_per_s, latency=self.latency_s)


@dataclass(frozen=True)
class TwoLevelLink:
    """Nodes of ``gpus_per_node`` ranks on ``intra``, joined by ``inter``; ranks fill nodes in order."""

    intra: LinkModel
    """The link inside a node (NVLink / NVSwitch)."""

    inter: LinkModel
    """One NIC between nodes (bandwidth per direction, latency per hop)."""

    gpus_per_node: int
    """Ranks per node. A group of at most this many ranks stays on ``intra``."""

    nics_per_node: int = 1
    """NICs per node. 1: one shared port per node; ``gpus_per_node``: one per GPU (DGX-style, rail
    optimised), which lets ring channels or the local ranks cross nodes in parallel."""

    algorithm: str = "ring"
    """``ring`` (one flat ring; each step is paced by the slowest link it crosses) or
    ``hierarchical`` (inter-node ring among same-local-rank peers, then an intra-node ring of
    node-sized chunks)."""

    def __post_init__(self):
        if self.gpus_per_node < 1:
            raise ValueError(f"TwoLevelLink: gpus_per_node={self.gpus_per_node} must be >= 1")
        if not 1 <= self.nics_per_node <= self.gpus_per_node:
            raise ValueError(f"TwoLevelLink: nics_per_node={self.nics_per_node} must be in [1, gpus_per_node="
                             f"{self.gpus_per_node}]")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"TwoLevelLink: algorithm={self.algorithm!r}; expected one of {ALGORITHMS}")

    def allgather_time(self, *, bytes_per_rank: float, world: int) -> float:
        """Predicted seconds of one all-gather of ``bytes_per_rank`` from each of ``world`` ranks."""
        if world <= self.gpus_per_node:
            return self.intra.allgather_time(bytes_per_rank=bytes_per_rank, world=world)
        if world % self.gpus_per_node:
            raise ValueError(
                f"TwoLevelLink: world={world} is not a multiple of gpus_per_node={self.gpus_per_node}")
        nodes = world // self.gpus_per_node
        nic_bw = self.inter.bandwidth_bytes_per_s * self.nics_per_node
        if self.algorithm == "ring":
            # each of nics_per_node channels carries 1/nics of every shard across its own NIC
            slow_bw = min(self.intra.bandwidth_bytes_per_s, nic_bw)
            slow_lat = max(self.intra.latency_s, self.inter.latency_s)
            return _ring_time(steps=world - 1, bytes_per_step=bytes_per_rank, bandwidth=slow_bw, latency=slow_lat)
        # all local ranks ring over the nodes at once, sharing the node's NICs
        across = _ring_time(steps=nodes - 1, bytes_per_step=bytes_per_rank, latency=self.inter.latency_s,
                            bandwidth=nic_bw / self.gpus_per_node)
        within = self.intra.allgather_time(bytes_per_rank=nodes * bytes_per_rank, world=self.gpus_per_node)
        return across + within


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
class HostShare:
    """Ranks whose codec work and transport share CPU cores (CPU hosts: CPU codecs, gloo over
    TCP). A GPU codec runs on the GPU, so GPU clusters pass no ``HostShare``.

    Where ``ranks > cores`` the codec phases are paced by the machine's cores, not one rank's:
    every rank encodes (and decodes) at once, so each phase takes ``ranks / cores`` times a
    single-core codec's time, and a collective waits for the last rank to finish it. Speeds given
    with a ``HostShare`` are single-core speeds (measured where each rank had a core); the link is
    untouched (a link fitted on these hosts already includes the transport's share of the cores)."""

    cores: float
    """CPU cores the ranks below run on (the machine's, when every rank of the group is on it)."""

    ranks: int
    """Ranks competing for ``cores``: each one runs its own codec and its own transport."""

    def __post_init__(self):
        if not self.cores > 0:
            raise ValueError(f"HostShare: cores={self.cores} must be > 0")
        if self.ranks < 1:
            raise ValueError(f"HostShare: ranks={self.ranks} must be >= 1")

    @property
    def slowdown(self) -> float:
        """Wall time of a codec phase over a single-core codec's time: ``max(1, ranks / cores)``."""
        return max(1.0, self.ranks / self.cores)


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
    """All-gather of ``wire_bytes_per_rank`` on the link."""

    decode_s: float
    """Decode of the ``world - 1`` received payloads (0 for raw)."""

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


def predict_raw(*, raw_bytes_per_rank: float, world: int, link: Link) -> Prediction:
    """Predicted cost of a plain all-gather."""
    comm = link.allgather_time(bytes_per_rank=raw_bytes_per_rank, world=world)
    return Prediction(RAW, float(raw_bytes_per_rank), 0.0, comm, 0.0, comm)


def agreement_time(*, link: Link, world: int, buckets: int = 1) -> float:
    """Cost of the per-step size agreement charged to each of ``buckets`` compressed buckets of a
    group: one all-gather of 16 bytes per bucket and rank (latency-bound), shared by the buckets."""
    return link.allgather_time(bytes_per_rank=16 * max(buckets, 1), world=world) / max(buckets, 1)


def predict_compressed(*, raw_bytes_per_rank: float, world: int, link: Link, estimate: CodecEstimate,
                       overlapped_encode: bool = False, agreement_s: float = 0.0,
                       host: HostShare | None = None) -> Prediction:
    """Predicted cost of a compressed all-gather with ``estimate``'s codec: encode (unless
    overlapped), this bucket's share ``agreement_s`` of the size agreement, the collective of the
    exact payloads (``wire_ratio`` of raw per rank) and the batched decode of ``world - 1`` of them.
    With ``host``, ``estimate.speed`` is a single-core codec's and both codec phases take
    ``host.slowdown`` times as long (ranks sharing cores, :class:`HostShare`)."""
    share = 1.0 if host is None else host.slowdown
    wire = estimate.wire_ratio * raw_bytes_per_rank
    enc = share * raw_bytes_per_rank / estimate.speed.encode_bytes_per_s
    comm = link.allgather_time(bytes_per_rank=wire, world=world) + agreement_s
    dec = share * max(world - 1, 0) * raw_bytes_per_rank / estimate.speed.decode_bytes_per_s
    total = comm + dec + (0.0 if overlapped_encode else enc)
    return Prediction(estimate.name, wire, enc, comm, dec, total)


def decide(*, raw_bytes_per_rank: int, world: int, link: Link, candidates: Sequence[CodecEstimate],
           current: str | None = None, hysteresis: float = 0.1, overlapped_encode: bool = False,
           agreement_s: float = 0.0) -> Decision:
    """Choose ``raw`` or one of ``candidates`` for a bucket; deterministic in its inputs.

    The fastest predicted mode wins (ties go to raw, then to the earlier candidate). When ``current``
    is one of the modes, the bucket leaves it only for a mode predicted faster by more than
    ``hysteresis`` x current's time, so noisy estimates near the break-even point cannot make it
    flap between modes.
    """
    if world < 1:
        raise ValueError(f"decide: world={world} must be >= 1")
    if raw_bytes_per_rank < 0:
        raise ValueError(f"decide: raw_bytes_per_rank={raw_bytes_per_rank} must be >= 0")
    if hysteresis < 0:
        raise ValueError(f"decide: hysteresis={hysteresis} must be >= 0")
    preds = [predict_raw(raw_bytes_per_rank=raw_bytes_per_rank, world=world, link=link)]
    preds += [predict_compressed(raw_bytes_per_rank=raw_bytes_per_rank, world=world, link=link, estimate=c,
                                 overlapped_encode=overlapped_encode, agreement_s=agreement_s)
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
# Measurement (touches torch and the process group)
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


def _sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def agree(*, values: Sequence[float], group=None, device=None) -> list[float]:
    """MAX-reduce ``values`` over ``group`` so every rank holds the same numbers.

    Timings differ slightly per rank; taking the maximum (the slowest rank paces a collective)
    makes every derived decision identical everywhere. ``device`` defaults to CPU on gloo and to
    the current CUDA device otherwise.
    """
    import torch
    import torch.distributed as dist

    if device is None:
        device = "cpu" if dist.get_backend(group) == "gloo" else torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [float(v) for v in t.cpu().tolist()]


DEFAULT_LINK_SIZES = (1 << 14, 1 << 17, 1 << 20, 1 << 22)


def measure_link_times(*, group=None, device="cpu", sizes: Sequence[int] = DEFAULT_LINK_SIZES, repeats: int = 3,
                       warmup: int = 1) -> list[float]:
    """Seconds of one ``all_gather_into_tensor`` of each of ``sizes`` bytes per rank on ``group``.

    Collective: every rank of ``group`` must call it with equal arguments. Each figure is the
    fastest of ``repeats`` runs on this rank, then MAX-reduced across the group, so every rank
    holds the same list. A group of one rank returns zeros (nothing is sent).
    """
    import torch
    import torch.distributed as dist

    from .comm import all_gather_into

    world = dist.get_world_size(group)
    if world == 1:
        return [0.0] * len(sizes)
    times = []
    for size in sizes:
        src = torch.zeros(int(size), dtype=torch.uint8, device=device)
        dst = torch.empty(int(size) * world, dtype=torch.uint8, device=device)
        best = math.inf
        for i in range(warmup + repeats):
            dist.barrier(group=group)
            _sync(device)
            t0 = time.perf_counter()
            all_gather_into(dst, src, group=group)
            _sync(device)
            if i >= warmup:
                best = min(best, time.perf_counter() - t0)
        times.append(best)
    return agree(values=times, group=group, device=device if torch.device(device).type == "cuda" else "cpu")


def measure_link(*, group=None, device="cpu", sizes: Sequence[int] = DEFAULT_LINK_SIZES, repeats: int = 3,
                 warmup: int = 1) -> LinkModel:
    """Time ``all_gather_into_tensor`` of ``sizes`` bytes per rank on ``group`` and fit a
    :class:`LinkModel` (:func:`measure_link_times`, then :func:`fit_latency_bandwidth`): collective,
    and identical on every rank."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    if world == 1:
        return LinkModel(bandwidth_bytes_per_s=1e30, latency_s=0.0)
    times = measure_link_times(group=group, device=device, sizes=sizes, repeats=repeats, warmup=warmup)
    return fit_latency_bandwidth(sizes=sizes, times=times, world=world)


def measure_codec_speed(*, codec, device="cpu", repeats: int = 3, warmup_steps: int = 3, lr: float = 1e-4,
                        seed: int = 0) -> CodecSpeed:
    """Time ``codec`` (a :class:`ciera.codecs.Codec`) encoding and decoding a synthetic shard.

    The shard follows an :class:`ciera.trajectory.AdamTrajectory` for ``warmup_steps`` steps, so the
    codec sees a realistic change between the previous and new values. Local only: reduce the two
    throughputs with :func:`agree` (as seconds, or negate rates) to make them rank-identical.
    """
    import torch

    from ciera.trajectory import AdamTrajectory

    n = codec.numel
    traj = AdamTrajectory(numel=n, dtype=codec.dtype, lr=lr, seed=seed, device=device)
    for _ in range(warmup_steps):
        traj.step()
    prev = traj.current().clone()
    new = traj.step().contiguous()
    state = codec.new_state(shard=prev)
    out = torch.empty(codec.clamp_capacity(codec.max_bytes), dtype=torch.uint8, device=device)
    enc = dec = math.inf
    for _ in range(repeats + 1):
        codec.reset_state(state=state, shard=prev)
        _sync(device)
        t0 = time.perf_counter()
        codec.encode(shard=new, state=state, out=out)
        _sync(device)
        enc = min(enc, time.perf_counter() - t0)
        target = prev.clone()
        _sync(device)
        t0 = time.perf_counter()
        codec.decode(payload=out, target=target)
        _sync(device)
        dec = min(dec, time.perf_counter() - t0)
    raw = max(codec.raw_bytes, 1)
    return CodecSpeed(encode_bytes_per_s=raw / max(enc, 1e-9), decode_bytes_per_s=raw / max(dec, 1e-9))


__all__ = [
    "ALGORITHMS", "RAW", "CodecEstimate", "CodecSpeed", "Decision", "Ewma", "HostShare", "Link", "LinkModel",
    "Prediction",
    "TwoLevelLink", "agree", "agreement_time", "decide", "fit_latency_bandwidth", "measure_codec_speed", "measure_link",
    "measure_link_times",
    "predict_compressed", "predict_raw",
]
