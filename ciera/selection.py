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

Codec speeds start from a measurement at construction, at the bucket's real shard size (a
best-of-few probe on a synthetic shard: optimistic, especially on a loaded CPU host), and then
follow the real gathers: the first real figures replace the probe's, later ones are averaged in.
Because the first decision rests on the probe alone, it compresses only when a codec beats raw by
the ``hysteresis`` margin, and a bucket that starts compressing is re-decided after
``EARLY_RECHECK`` gathers on its real timings (then every ``reevaluate_interval``). Where raw
wins clearly (every codec predicted slower by the ``hysteresis`` margin, or its codec work alone
exceeding the raw gather), the interval doubles at each decision up to ``MAX_BACKOFF`` times. And
however close the call, decisions never cost more than ``DECISION_BUDGET`` of the gathers between
them: each one's measured cost (agreed) sets the least interval to the next, so the probes cost
next to nothing on a fast link. The schedule depends only on agreed figures, so every rank takes
each decision's collectives at the same gather; a decision due while any rank still owes raw
gathers after an ``invalidate()`` waits until they are sent.

The link is measured once per group at the sizes its first bucket sends, and once more at the
first early re-check in the group: a decision to compress that rests on one measurement is
checked against a second, the link keeping each size's faster time of the two (a measurement
slowed by a burst of other work can only make the link look slower than it is, which favours
compressing; the second one corrects it, and the first is never discarded as too fast). The
selector returns decisions (:class:`Switch`); the gather applies them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from . import cost_model as cm
from . import measure
from .agreement import ring_bytes_per_rank
from .codecs.base import align_up

logger = logging.getLogger(__name__)

EARLY_RECHECK = 4
"""Gathers after a first decision that compressed before the next decision, which then uses the
real encode/decode timings of those gathers (at most ``reevaluate_interval``)."""

MAX_BACKOFF = 16
"""Largest multiple of ``reevaluate_interval`` between decisions while raw wins clearly: every
candidate is predicted slower than raw by more than the ``hysteresis`` margin, or its encode +
decode alone takes longer than the raw gather (then no wire ratio could change the answer). Either
way leaving raw would need the codecs' speed, the link or the wire ratios to move by twice the
margin, and they move slowly. Each such decision doubles the interval, up to this factor; any other
decision resets it. A decision costs a copy of the shard and one probe encode per candidate: on a
fast link (one host's memcpy) that would otherwise be several percent of the raw gathers it sits
between."""


DECISION_BUDGET = 0.005
"""Largest share of the gathers' predicted time that re-decisions may cost. A decision copies the
shard and probe-encodes it with every candidate (milliseconds on a CPU host); after each, the next
waits at least that cost over this share of one gather's predicted time in the chosen mode: on a
fast link, where the probes outweigh a raw gather, decisions thin out until they are noise."""


class Measurements:
    """Link and codec-speed measurements shared by the gathers of one process group.

    Each figure is measured once, collectively and rank-agreed, by the first gather that needs it
    (at its construction, i.e. at install time), at that gather's real sizes; later gathers reuse
    it. Keep one instance per group (every rank builds its gathers in the same order, so every
    rank measures at the same point) and pass it to each ``CieraAllGather``.
    """

    def __init__(self, *, link: cm.Link | None = None):
        self.link = link
        """The group's link model; measured by the first gather that needs it when ``None``."""
        self.link_sizes: list[int] = []
        """Bytes per rank the link was measured at (empty when it was given)."""
        self.link_times: list[float] = []
        """Agreed seconds of one all-gather at each of ``link_sizes``: the fastest over all
        measurements so far."""
        self.link_measurements = 0
        """Times the link was measured (0 when it was given): 1 at start-up, 2 once refined."""
        self.codec_seconds_per_byte: dict[tuple, tuple[float, float]] = {}
        """(codec, dtype, block size, numel, device type) -> agreed (encode, decode) seconds per raw byte."""

    def link_for(self, *, group, device, shard_bytes: int) -> cm.Link:
        """The group's link, measured on first use at the sizes a bucket of ``shard_bytes`` per
        rank sends: its raw shard and the compressed payloads (1/8 and 1/4 of it)."""
        if self.link is None:
            top = max(int(shard_bytes), 1 << 12)
            self._measure_link(group=group, device=device,
                               sizes=sorted({max(top // 8, 1 << 9), max(top // 4, 1 << 10), top}))
        return self.link

    def refine_link(self, *, group, device) -> cm.Link:
        """The group's link, measured a second time on the first call (collective: every rank of
        the group calls it at the same gather, which the rank-identical schedule guarantees). Each
        size keeps the faster of its two times. A given link is kept as it is."""
        if self.link_measurements == 1:
            self._measure_link(group=group, device=device, sizes=self.link_sizes)
        return self.link

    def _measure_link(self, *, group, device, sizes: list[int]) -> None:
        import torch.distributed as dist

        times = measure.measure_link_times(group=group, device=device, sizes=sizes)
        if self.link_times:
            times = [min(a, b) for a, b in zip(self.link_times, times)]
        self.link_sizes, self.link_times = list(sizes), times
        self.link_measurements += 1
        # a group of one rank measures zeros, which fit to an infinitely fast link
        self.link = cm.fit_latency_bandwidth(sizes=sizes, times=times, world=dist.get_world_size(group))

    def codec_for(self, *, codec, group, device) -> tuple[float, float]:
        """Agreed (encode, decode) seconds per raw byte of ``codec`` at its real shard size."""
        block = getattr(codec, "block_size", None)
        key = (codec.name, codec.dtype, block, codec.numel, torch.device(device).type)
        if key not in self.codec_seconds_per_byte:
            sp = measure.measure_codec_speed(codec=codec, device=device)
            enc, dec = measure.agree(values=[1 / sp.encode_bytes_per_s, 1 / sp.decode_bytes_per_s],
                                     group=group, device=device)
            self.codec_seconds_per_byte[key] = (enc, dec)
        return self.codec_seconds_per_byte[key]


@dataclass(frozen=True)
class Switch:
    """A decision the gather applies: use ``codec`` (``None``: raw) from this gather on; the new
    codec's state starts from ``previous_shard`` (what every receiver holds)."""

    codec: str | None
    previous_shard: torch.Tensor | None


class Selector:
    """Decides raw vs codec (and which codec) for one bucket; knows nothing of the gather.

    Args:
        codecs: candidate name -> codec bound to the bucket's shard shape.
        config: the bucket's :class:`ciera.CieraConfig`.
        world, group, device: the bucket's process group.
        link: the group's link model.
        speeds: name -> agreed (encode, decode) seconds per raw byte, the starting averages.
        name: the bucket's name, for the decision's log line.
        measurements: the group's :class:`Measurements`, if any: each decision reads its link,
            and the early re-check refines it (:meth:`Measurements.refine_link`).
        rank: this rank's index in ``group``. Each decision agrees every rank's probed payload
            sizes, so a codec's wire is that of the gather the agreement would plan for them (per-rank
            sizes: :func:`ciera.agreement.ring_bytes_per_rank`), not ``world x`` the largest.
    """

    def __init__(self, *, codecs: dict, config, world: int, group, device, link: cm.Link,
                 speeds: dict[str, tuple[float, float]], name: str = "bucket", measurements=None, rank: int = 0):
        self.codecs, self.config, self.world, self.group, self.device = codecs, config, world, group, device
        self._rank = rank  # this rank's index in ``group``: its slot in the agreed table of probe sizes
        self.name = name
        self.link = link
        self.measurements = measurements
        self.speeds = {n: (cm.Ewma().update(e), cm.Ewma().update(d)) for n, (e, d) in speeds.items()}
        self.decide_at = config.warmup_gathers
        self.snapshot: torch.Tensor | None = None
        self.decision: cm.Decision | None = None
        self.decisions = 0
        self.backoff = 1
        """Multiple of ``reevaluate_interval`` until the next decision (see :data:`MAX_BACKOFF`)."""
        self.mode: str | None = None
        """The mode the last decision chose (``raw`` or a codec's name)."""
        self.cost_s = 0.0
        """Seconds the last decision cost its slowest rank (the shard's copy and the probes)."""
        self._snapshot_s = 0.0
        self._last_stats = None
        self.shape = cm.ONE_GATHER
        """How the bucket is gathered per step (:class:`ciera.cost_model.StepShape`); decisions compare
        per-step times. ZeRO-3 (:mod:`ciera.zero3`) sets it from the gathers it counts per step."""

    def before_gather(self, index: int, *, warmup_left: int, shard: torch.Tensor, current: str | None,
                      probe: Callable[[str, torch.Tensor], int], stats) -> Switch | None:
        """Called before encoding gather number ``index`` (0-based, before the size agreement).
        ``probe(name, previous)`` returns the bytes codec ``name`` needs for ``shard`` against
        ``previous``; ``stats()`` returns the gather's counters (read only when a decision is due:
        on CUDA it waits for the recorded timing events); ``warmup_left`` is this rank's raw gathers
        left after an ``invalidate()`` (a decision due while any rank has some is postponed until
        they are sent). Returns the switch to apply, if any."""
        # The schedule (decide_at, snapshot) depends only on the gather's index and agreed figures,
        # never on this rank's own state: every rank takes each decision's collectives together.
        switch = None
        if index == self.decide_at and self.snapshot is not None:
            early = self.decisions == 1 and self.decision.compress  # see EARLY_RECHECK
            if self.measurements is not None:
                self.link = (self.measurements.refine_link(group=self.group, device=self.device) if early
                             else self.measurements.link or self.link)
            postpone, switch = self._decide(current=current, probe=probe, stats=stats, warmup_left=warmup_left)
            self.snapshot = None
            if postpone:  # a rank invalidated: its snapshot is stale; decide right after the raw gathers
                self.decide_at = index + postpone
            else:
                clear = self.config.selection == "auto" and _raw_wins_clearly(self.decision, self.config.hysteresis)
                self.backoff = min(2 * self.backoff, MAX_BACKOFF) if clear else 1
                interval = max(self.config.reevaluate_interval * self.backoff, self._budget_interval())
                if self.decisions == 1 and self.decision.compress:  # rests on the start-up probe: check soon
                    interval = min(interval, EARLY_RECHECK)
                self.decide_at = index + interval
        if index + 1 == self.decide_at:
            t0 = time.perf_counter()
            self.snapshot = shard.clone()
            self._snapshot_s = time.perf_counter() - t0
        return switch

    def _budget_interval(self) -> int:
        """Fewest gathers until the next decision so that decisions cost at most
        :data:`DECISION_BUDGET` of the gathers between them (agreed figures: rank-identical), and
        never more than ``MAX_BACKOFF`` re-decision intervals."""
        per_gather = max(self.decision.times[self.mode], 1e-9)
        cap = MAX_BACKOFF * self.config.reevaluate_interval
        return min(math.ceil(self.cost_s / (DECISION_BUDGET * per_gather)), cap)

    def due(self, index: int) -> bool:
        """Whether :meth:`before_gather` has anything to do at gather ``index`` (a snapshot or a
        decision); rank-identical. When not, skipping the call changes nothing."""
        return index + 1 >= self.decide_at

    def _decide(self, *, current, probe, stats, warmup_left: int) -> tuple[int, Switch | None]:
        """``(postpone, switch)``: ``postpone > 0`` (no decision) when any rank has raw gathers
        left after an ``invalidate()``: the agreed largest count of them."""
        cfg = self.config
        names = list(self.codecs)
        t0 = time.perf_counter()
        needed = [float(probe(n, self.snapshot)) for n in names]
        cost = time.perf_counter() - t0 + self._snapshot_s  # the probes read their sizes: synchronous
        self._refresh_speeds(current=current, stats=stats)
        per_byte = [v for n in names for v in (self.speeds[n][0].value, self.speeds[n][1].value)]
        # Every rank's probe sizes through the same MAX-reduce: rank r fills its own slot of each
        # codec's row, the others hold 0 (sizes are > 0), so the maximum is the whole table.
        mine = [0.0] * (len(names) * self.world)
        mine[self._rank::self.world] = needed
        agreed = measure.agree(values=mine + per_byte + [float(self.shape.gathers), float(warmup_left), cost],
                               group=self.group, device=self.device)
        if agreed[-2] > 0:
            return int(agreed[-2]), None
        self.cost_s = agreed[-1]
        shape = dataclasses.replace(self.shape, gathers=int(agreed[-3]))  # the same on every rank
        table, per_byte = agreed[: len(mine)], agreed[len(mine):-3]
        raw_b = self.codecs[names[0]].raw_bytes
        candidates = []
        for i, n in enumerate(names):
            sizes = [align_up(math.ceil(v)) for v in table[i * self.world:(i + 1) * self.world]]
            # the gather the agreement would plan for these sizes, as equal-ring bytes per rank
            wire = ring_bytes_per_rank(sizes, per_rank_sizes=cfg.per_rank_sizes)
            candidates.append(cm.CodecEstimate(
                name=n, wire_ratio=min(wire, raw_b) / max(raw_b, 1),
                speed=cm.CodecSpeed(encode_bytes_per_s=1 / max(per_byte[2 * i], 1e-15),
                                    decode_bytes_per_s=1 / max(per_byte[2 * i + 1], 1e-15))))
        first = self.decision is None
        # Raw is the incumbent of the first decision too (the gathers before it were raw warmup,
        # whatever default codec the gather names): leaving raw needs the hysteresis margin.
        known = cm.RAW if first else (current or cm.RAW)
        if cfg.selection == "always" and (first or current is None):
            known = None  # codec='auto' under 'always' must pick a codec: no raw incumbent
        d = cm.decide(raw_bytes_per_rank=raw_b, world=self.world, link=self.link, candidates=candidates,
                      current=known, hysteresis=cfg.hysteresis,
                      agreement_s=cm.agreement_time(link=self.link, world=self.world), shape=shape)
        choice = d.choice
        if choice == cm.RAW and cfg.selection == "always":  # codec='auto': choose among codecs only
            choice = min(candidates, key=lambda c: d.times[c.name]).name
        self.decision, self.decisions, self.mode = d, self.decisions + 1, choice
        if first or choice != known:  # the first choice and every switch, raw included, with why
            logger.info("%s: selection -> %s (%s)", self.name, choice, d.reason)
        if choice == cm.RAW:
            return 0, Switch(None, None)
        if choice != known:
            return 0, Switch(choice, self.snapshot)
        return 0, None

    def _refresh_speeds(self, *, current, stats) -> None:
        """Fold the real encode/decode timings since the last decision into the averages."""
        stats = stats()
        last, self._last_stats = self._last_stats, stats
        if last is None or current is None:
            return
        d = stats.minus(last)
        n = d.compressed_gathers
        raw_b = self.codecs[current].raw_bytes
        if n <= 0 or raw_b == 0 or d.encode_s <= 0 or d.decode_s <= 0:
            return
        enc, dec = self.speeds[current]
        if enc.count <= 1:  # only the start-up probe so far: the real gathers replace it
            enc, dec = cm.Ewma(alpha=enc.alpha), cm.Ewma(alpha=dec.alpha)
        self.speeds[current] = (enc.update(d.encode_s / (n * raw_b)),
                                dec.update(d.decode_s / (n * max(self.world - 1, 1) * raw_b)))


def _raw_wins_clearly(decision: cm.Decision, hysteresis: float) -> bool:
    """Raw chosen, and every candidate either predicted slower than raw by more than the
    ``hysteresis`` margin, or its codec work alone (its prediction less the collective) already
    exceeding raw's whole gather (then no payload size could make compressing pay)."""
    raw = decision.predictions[0]
    return decision.choice == cm.RAW and all(
        p.total_s > raw.total_s * (1.0 + hysteresis) or p.total_s - p.comm_s >= raw.total_s
        for p in decision.predictions[1:])
