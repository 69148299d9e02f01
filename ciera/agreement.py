"""The size agreement: once per step and process group, every rank learns every payload size.

After the shards are encoded (right after the optimizer step), ONE small all-gather over the group
carries, for each bucket prepared together, each rank's :class:`Proposal` (a flag, a payload size and
the count of values found changed in gathers that reused a plan without an agreement):
``[n_buckets, 3]`` int64 per rank (24 bytes a bucket). The host reads that table once; this is the
only host read of a compressed gather. A non-zero third word on any rank raises
:class:`ciera.errors.StaleReplayError` on every rank (those gathers delivered stale values: see
:meth:`ciera.CieraAllGather.replay`). From the same table every rank derives the same :class:`Plan`
for each bucket with the pure :func:`plan_from_table`:

* any rank found a corrupt payload in an earlier gather (``FLAG_CORRUPT``): an error on every rank
  (the values it trained on were not the ones sent; only a checkpoint restores bit-exactness);
* any rank reports a failure (``FLAG_FAILED``): raw on every rank, caches invalidated everywhere;
* any rank asks for raw (``FLAG_RAW``: warmup, after ``invalidate()``, selection chose raw): raw;
* ranks propose different codecs: an error on every rank (it would be a bug in selection);
* the largest payload is not smaller than the shard: raw (a shard that would not shrink travels
  as a plain all-gather inside the same protocol: no extra round, no decode);
* otherwise compressed: every rank sends its own payload, 16-aligned, when those sizes save at
  least :data:`UNEVEN_MIN_SAVING` of the bytes of an equal-size gather (:attr:`Plan.sizes`,
  :func:`ciera.comm.all_gather_uneven`); else every rank sends exactly ``align_up(max payload)``.

This module holds the rule and the one collective; the gather's own steps (propose, apply the plan,
launch, decode) are :class:`ciera.gather.CieraAllGather`'s public methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .codecs.base import align_up
from .codecs.registry import WIRE_WORDS
from .comm import all_gather_into

UNEVEN_MIN_SAVING = 0.015
"""Per-rank sizes are sent when they save at least this fraction of ``world x largest``: below it
the equal-size all-gather (one collective, the backend's tuned path) is as good; at or above it the
wire stays within 1.5% of the sum of the payloads."""

FLAG_RAW = WIRE_WORDS["raw"]  # 0: the proposal words are ciera.codecs.registry.WIRE_WORDS
"""Proposal word: this rank sends raw (no payload encoded)."""
FLAG_FAILED = WIRE_WORDS["failed"]  # -1
"""Proposal word: this rank failed locally (encode or an earlier decode); its caches are undefined."""
FLAG_CORRUPT = WIRE_WORDS["corrupt"]  # -3
"""Proposal word: a device decode on this rank found a corrupt payload in an earlier gather (reported
without a host sync, so found only now): its buffer held wrong values for at least one step."""


@dataclass(frozen=True)
class Proposal:
    """One rank's word for one bucket in the agreement."""

    flag: int
    """A codec id (this rank encoded with it), ``FLAG_RAW``, ``FLAG_FAILED`` or ``FLAG_CORRUPT``."""
    needed: torch.Tensor
    """0-d int64 device tensor: the payload's size in bytes. Not read on the host before the
    agreement."""
    stale: torch.Tensor | None = None
    """0-d int64 device tensor: values found changed, since the last agreement, in gathers that
    repeated a plan without one (:meth:`ciera.CieraAllGather.replay`; expected 0); ``None``: 0."""


@dataclass(frozen=True)
class Plan:
    """What one gather does, identical on every rank of its group."""

    raw: bool
    """A plain all-gather of the bucket (no payloads)."""
    codec_name: str | None = None
    """Codec of the payloads when compressed."""
    size: int = 0
    """Bytes every rank sends when compressed (16-aligned max payload over ranks)."""
    payload_bytes: int = 0
    """Sum over ranks of the payloads' own sizes when compressed."""
    failed_ranks: tuple[int, ...] = ()
    """Ranks that reported a local failure (the plan is then raw)."""
    corrupt_ranks: tuple[int, ...] = ()
    """Ranks that found a corrupt payload in an earlier gather (``FLAG_CORRUPT``): every rank raises."""
    replay: bool = False
    """Every rank's shard is unchanged since its last gather: the previous plan is repeated with the
    same payloads (a gather whose buffer persists needs no collective at all)."""
    sizes: tuple[int, ...] = ()
    """When compressed with per-rank sizes: the bytes each rank sends (its payload, 16-aligned), in
    rank order; empty when every rank sends ``size``."""


RAW_PLAN = Plan(raw=True)
REPLAY_PLAN = Plan(raw=False, replay=True)
"""What :meth:`ciera.CieraAllGather.replay` applies (no agreement): the gather substitutes its
previous plan (with ``replay=True``)."""


def plan_from_table(column: Sequence[tuple[int, int]], *, codec_names: dict[int, str], shard_bytes: int,
                    name: str = "bucket", per_rank_sizes: bool = True) -> Plan:
    """The plan of one bucket from its ``(flag, needed)`` pair of every rank (pure, tested on its
    own). ``codec_names`` maps codec ids to names; ``per_rank_sizes=False`` never plans per-rank
    sizes (:attr:`ciera.CieraConfig.per_rank_sizes`)."""
    proposals = [p for p, _ in column]
    corrupt = tuple(r for r, p in enumerate(proposals) if p == FLAG_CORRUPT)
    if corrupt:
        return Plan(raw=True, corrupt_ranks=corrupt)
    failed = tuple(r for r, p in enumerate(proposals) if p == FLAG_FAILED)
    if failed:
        return Plan(raw=True, failed_ranks=failed)
    if FLAG_RAW in proposals:
        return RAW_PLAN
    if len(set(proposals)) != 1:
        raise RuntimeError(f"{name}: ranks propose different codecs {proposals} (by rank); every rank must "
                           f"build its gathers with the same config")
    if proposals[0] not in codec_names:
        raise RuntimeError(f"{name}: agreed codec id {proposals[0]} is not one of {codec_names}")
    needed = [n for _, n in column]
    aligned = [align_up(n) for n in needed]
    size = max(aligned)
    if size >= shard_bytes:
        return RAW_PLAN
    return Plan(raw=False, codec_name=codec_names[proposals[0]], size=size, payload_bytes=sum(needed),
                sizes=tuple(aligned) if per_rank_sizes and uneven_pays(aligned) else ())


def uneven_pays(aligned: Sequence[int]) -> bool:
    """Whether ranks sending their own (16-aligned) payload sizes saves at least
    :data:`UNEVEN_MIN_SAVING` of every rank sending the largest."""
    return sum(aligned) <= (1.0 - UNEVEN_MIN_SAVING) * len(aligned) * max(aligned)


def ring_bytes_per_rank(aligned: Sequence[int], *, per_rank_sizes: bool = True) -> float:
    """The bytes per rank of the equal-size ring all-gather that takes as long as the gather these
    payloads would get: ``max`` when every rank sends the largest; with per-rank sizes, the busiest
    ring link carries every payload but the smallest, ``(sum - min) / (world - 1)`` per step. The
    cost model's wire for a codec whose ranks' payloads differ."""
    if len(aligned) < 2 or not (per_rank_sizes and uneven_pays(aligned)):
        return float(max(aligned, default=0))
    return (sum(aligned) - min(aligned)) / (len(aligned) - 1)


def exchange(proposals: Sequence[Proposal], *, group, world: int, device) -> list[list[tuple[int, int, int]]]:
    """The one collective: every rank's proposals for the same buckets, in the same order. Returns
    ``table[bucket][rank] = (flag, needed, stale)``; the host reads it here, once."""
    mine = torch.zeros(len(proposals), 3, dtype=torch.int64, device=device)
    mine[:, 0] = torch.tensor([p.flag for p in proposals], dtype=torch.int64)
    mine[:, 1] = torch.stack([p.needed for p in proposals])
    for i, p in enumerate(proposals):
        if p.stale is not None:
            mine[i, 2] = p.stale
    everyone = torch.empty(world * mine.numel(), dtype=torch.int64, device=device)
    all_gather_into(everyone, mine.view(-1), group=group)
    table = everyone.view(world, len(proposals), 3).cpu().tolist()  # the one host read of the step
    return [[tuple(table[r][i]) for r in range(world)] for i in range(len(proposals))]


def stale_ranks(column: Sequence[tuple[int, int, int]]) -> tuple[int, ...]:
    """Ranks whose third word (values changed under a plan reused without agreement) is not 0."""
    return tuple(r for r, word in enumerate(column) if word[2])
