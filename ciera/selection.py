"""Benefit-driven selection: per bucket, raw or which codec, from measurement.

A bucket gets a selector with ``selection='auto'`` (raw or a codec) and with ``codec='auto'``
under ``selection='always'`` (which codec; never raw). Every ``reevaluate_interval`` gathers it:

1. one gather earlier, keeps a copy of the shard as it is sent (the values every receiver will hold);
2. at the decision gather, encodes the new shard with every candidate codec against that copy
   (local probes, nothing sent), and reads the real encode/decode timings of the recent gathers;
3. agrees the figures across the group (one small MAX all-reduce), so every rank passes identical
   inputs to the pure :func:`ciera.cost_model.decide` and takes the same decision;
4. switches mode if the decision says so. A codec chosen afresh starts from the copy of the
   previous shard, so switching costs no raw round.

Codec speeds start from a short synthetic measurement at construction and then follow
exponential averages of the real gathers; the link is measured once per group.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch

from . import cost_model as cm

if TYPE_CHECKING:  # pragma: no cover
    from .gather import CieraAllGather

logger = logging.getLogger(__name__)

_PROBE_NUMEL = 1 << 20  # synthetic speed measurement size cap: throughput, not latency


class Measurements:
    """Link and codec-speed measurements shared by the gathers of one process group.

    Each figure is measured once, collectively and rank-agreed, by the first gather that needs it;
    later gathers reuse it. Keep one instance per group (every rank builds its gathers in the same
    order, so every rank measures at the same point) and pass it to each ``CieraAllGather``.
    """

    def __init__(self, *, link: cm.Link | None = None):
        self.link = link
        """The group's link model; measured by the first selector when ``None``."""
        self.codec_seconds_per_byte: dict[tuple, tuple[float, float]] = {}
        """(codec, dtype, block size, device type) -> agreed (encode, decode) seconds per raw byte."""

    def link_for(self, *, group, device) -> cm.Link:
        if self.link is None:
            self.link = cm.measure_link(group=group, device=device)
        return self.link

    def codec_for(self, *, codec, group, device) -> tuple[float, float]:
        from .codecs import make_codec

        block = getattr(codec, "block_size", None)
        key = (codec.name, codec.dtype, block, torch.device(device).type)
        if key not in self.codec_seconds_per_byte:
            probe = make_codec(codec.name, dtype=codec.dtype, numel=min(codec.numel, _PROBE_NUMEL) or 1,
                               block_size=block)
            sp = cm.measure_codec_speed(codec=probe, device=device)
            enc, dec = cm.agree(values=[1 / sp.encode_bytes_per_s, 1 / sp.decode_bytes_per_s],
                                group=group, device=device)
            self.codec_seconds_per_byte[key] = (enc, dec)
        return self.codec_seconds_per_byte[key]


class Selector:
    """Decides raw vs codec (and which codec) for one :class:`ciera.CieraAllGather`."""

    def __init__(self, gather: "CieraAllGather", *, measurements: Measurements):
        self.gather = gather
        cfg = gather.config
        dev = gather.buffer.device
        self.link = measurements.link_for(group=gather.group, device=dev)
        self.speeds: dict[str, tuple[cm.Ewma, cm.Ewma]] = {}
        for name, codec in gather._codecs.items():
            enc, dec = measurements.codec_for(codec=codec, group=gather.group, device=dev)
            self.speeds[name] = (cm.Ewma().update(enc), cm.Ewma().update(dec))
        self.decide_at = cfg.warmup_gathers
        self.snapshot: torch.Tensor | None = None
        self.decision: cm.Decision | None = None
        self.decisions = 0
        self._last_stats = None

    def before_gather(self, index: int, *, warmup_left: int) -> None:
        """Called by the gather at ``start()`` of gather number ``index`` (0-based)."""
        g = self.gather
        if warmup_left > 0 and self.decide_at < index + warmup_left:
            self.decide_at = index + warmup_left  # invalidated: decide right after the raw gathers
        if index == self.decide_at and self.snapshot is not None:
            self._decide()
            self.snapshot = None
            self.decide_at = index + g.config.reevaluate_interval
        if index + 1 == self.decide_at:
            self.snapshot = g._shard.clone()

    def _decide(self) -> None:
        g = self.gather
        cfg = g.config
        names = list(g._codecs)
        needed = [float(g._encode_probe(n, self.snapshot)) for n in names]
        self._refresh_speeds()
        per_byte = [v for n in names for v in (self.speeds[n][0].value, self.speeds[n][1].value)]
        agreed = cm.agree(values=needed + per_byte, group=g.group, device=g.buffer.device)
        needed, per_byte = agreed[: len(names)], agreed[len(names):]
        raw_b = g._codecs[names[0]].raw_bytes
        candidates = []
        for i, n in enumerate(names):
            cap = g._codecs[n].clamp_capacity(math.ceil(cfg.capacity_headroom * needed[i]))
            candidates.append(cm.CodecEstimate(
                name=n, wire_ratio=cap / max(raw_b, 1),
                speed=cm.CodecSpeed(encode_bytes_per_s=1 / max(per_byte[2 * i], 1e-15),
                                    decode_bytes_per_s=1 / max(per_byte[2 * i + 1], 1e-15))))
        current = g._codec_name or cm.RAW if self.decision is not None else None
        d = cm.decide(raw_bytes_per_rank=raw_b, world=g.world, link=self.link, candidates=candidates,
                      current=current, hysteresis=cfg.hysteresis)
        choice = d.choice
        if choice == cm.RAW and cfg.selection == "always":  # codec='auto': choose among codecs only
            choice = min(candidates, key=lambda c: d.times[c.name]).name
        self.decision, self.decisions = d, self.decisions + 1
        if choice != current:
            logger.info("%s: selection -> %s (%s)", g.name, choice, d.reason)
        if choice == cm.RAW:
            g._switch(None, previous_shard=None, needed=None)
        elif choice != current:
            g._switch(choice, previous_shard=self.snapshot, needed=int(needed[names.index(choice)]))

    def _refresh_speeds(self) -> None:
        """Fold the real encode/decode timings since the last decision into the averages."""
        g = self.gather
        s = g.stats
        last, self._last_stats = self._last_stats, s
        if last is None or g._codec_name is None:
            return
        d = s.minus(last)
        n = d.compressed_gathers - d.overflows
        raw_b = g._codecs[g._codec_name].raw_bytes
        if n <= 0 or raw_b == 0 or d.encode_s <= 0 or d.decode_s <= 0:
            return
        enc, dec = self.speeds[g._codec_name]
        self.speeds[g._codec_name] = (enc.update(d.encode_s / (d.compressed_gathers * raw_b)),
                                      dec.update(d.decode_s / (n * max(g.world - 1, 1) * raw_b)))
