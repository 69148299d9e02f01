"""Counters of one compressed all-gather, and timers that do not stall the device.

Bytes are counted as this rank receives them: a plain all-gather of a bucket delivers the whole
bucket (``raw_bytes``); a compressed one delivers ``world x size`` bytes of payloads, ``size``
being the agreed (largest, 16-aligned) payload of the gather (``wire_bytes``). Both include the
rank's own shard, so their ratio is the traffic ratio of the collective; ``payload_bytes`` is what
the codec itself needed, so ``wire_bytes / payload_bytes`` is the price of equal-size payloads.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch


@dataclass
class GatherStats:
    """Cumulative figures of one :class:`ciera.CieraAllGather` (a snapshot when read from it)."""

    codec: str
    """Codec of the most recent compressed gather (``raw`` if none yet)."""
    raw_bytes: int = 0
    """Bytes plain all-gathers would have delivered to this rank."""
    wire_bytes: int = 0
    """Bytes actually delivered to this rank (payloads at the agreed size, raw gathers in full)."""
    payload_bytes: int = 0
    """Bytes the payloads of compressed gathers needed (sum of their headers' sizes, all ranks)."""
    variable_bytes: int = 0
    """Bytes of the payloads' variable sections (all ranks)."""
    variable_bytes_max: int = 0
    """What those sections would have been with every value changed: see :attr:`change_rate`."""
    gathers: int = 0
    """Completed gathers."""
    raw_gathers: int = 0
    """Gathers sent uncompressed (warmup, after invalidate, codec switches, selection chose raw)."""
    compressed_gathers: int = 0
    """Gathers that sent codec payloads."""
    overflows: int = 0
    """Always 0: payloads are sent at their agreed exact size and never overflow (kept so that logs
    and tools reading it keep working)."""
    replays: int = 0
    """Gathers that repeated the previous plan because no rank's shard had changed (ZeRO-3's
    gathers after the first of a step): no encode; a persistent buffer sends nothing at all."""
    failures: int = 0
    """Gathers sent raw on every rank because some rank reported a local failure."""
    encode_s: float = 0.0
    """Time encoding this rank's shard (device time on CUDA, host time on CPU)."""
    decode_s: float = 0.0
    """Time decoding the other ranks' payloads in place."""
    comm_s: float = 0.0
    """Host time from launching the collective to its completion in ``wait()`` (includes any
    work the caller overlapped with it)."""

    @property
    def ratio(self) -> float:
        """raw / wire: the traffic reduction (1.0 when nothing was sent)."""
        return self.raw_bytes / self.wire_bytes if self.wire_bytes else 1.0

    @property
    def change_rate(self) -> float:
        """Fraction of the codec's worst-case variable section the payloads used: for
        ``exponent_reuse`` the fraction of blocks whose exponents changed; for ``delta`` the
        fraction of the widest possible packing. 0.0 before any compressed gather."""
        return self.variable_bytes / self.variable_bytes_max if self.variable_bytes_max else 0.0

    def minus(self, earlier: "GatherStats") -> "GatherStats":
        """Counters accumulated since ``earlier`` (the codec is the current one)."""
        out = dataclasses.replace(self)
        for f in dataclasses.fields(self):
            if f.name != "codec":
                setattr(out, f.name, getattr(self, f.name) - getattr(earlier, f.name))
        return out

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["ratio"] = self.ratio
        d["change_rate"] = self.change_rate
        return d


@dataclass
class SectionTimer:
    """Accumulates durations of code sections without a device sync on the hot path.

    On CUDA each section records a pair of events; their elapsed times are summed lazily in
    :meth:`total`, which waits only for events already recorded. On CPU it uses the host clock.
    """

    device: torch.device
    _pending: list = field(default_factory=list)
    _total: float = 0.0

    def start(self):
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, token) -> None:
        if self.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((token, end))
        else:
            self._total += time.perf_counter() - token

    def total(self) -> float:
        for begin, end in self._pending:
            end.synchronize()
            self._total += begin.elapsed_time(end) / 1e3
        self._pending.clear()
        return self._total
