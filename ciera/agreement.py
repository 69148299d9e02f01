"""The size agreement: once per step and process group, every rank learns every payload size.

After the shards are encoded (right after the optimizer step), :func:`agree_sizes` runs ONE small
all-gather over the group carrying, for each bucket prepared together, each rank's proposal and
payload size: ``[n_buckets, 2]`` int64 per rank (16 bytes a bucket). The host reads that table
once; this is the only host read of a compressed gather. From the same table every rank derives
the same :class:`Plan` for each bucket:

* any rank reports a failure (``FLAG_FAILED``): raw on every rank, caches invalidated everywhere;
* any rank asks for raw (``FLAG_RAW``: warmup, after ``invalidate()``, selection chose raw): raw;
* ranks propose different codecs: an error on every rank (it would be a bug in selection);
* the largest payload is not smaller than the shard: raw (a shard that would not shrink travels
  as a plain all-gather inside the same protocol: no extra round, no decode);
* otherwise compressed, every rank sending exactly ``align_up(max payload)`` bytes.

Where selection has chosen raw for every bucket of the call (an agreed, rank-identical choice), the
table is not needed and the collective is skipped: ``auto`` costs a plain gather nothing extra
between its re-decisions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from .codecs.base import align_up
from .comm import all_gather_into

if TYPE_CHECKING:  # pragma: no cover
    from .gather import CieraAllGather

FLAG_RAW = 0
"""Proposal word: this rank sends raw (no payload encoded)."""
FLAG_FAILED = -1
"""Proposal word: this rank failed locally (encode or an earlier decode); its caches are undefined."""


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


def plan_from_table(column: Sequence[tuple[int, int]], *, codec_names: dict[int, str], shard_bytes: int,
                    name: str = "bucket") -> Plan:
    """The plan of one bucket from its ``(proposal, needed)`` pair of every rank (pure, tested
    on its own). ``codec_names`` maps codec ids to names."""
    proposals = [p for p, _ in column]
    failed = tuple(r for r, p in enumerate(proposals) if p == FLAG_FAILED)
    if failed:
        return Plan(raw=True, failed_ranks=failed)
    if FLAG_RAW in proposals:
        return Plan(raw=True)
    if len(set(proposals)) != 1:
        raise RuntimeError(f"{name}: ranks propose different codecs {proposals} (by rank); every rank must "
                           f"build its gathers with the same config")
    if proposals[0] not in codec_names:
        raise RuntimeError(f"{name}: agreed codec id {proposals[0]} is not one of {codec_names}")
    needed = [n for _, n in column]
    size = align_up(max(needed))
    if size >= shard_bytes:
        return Plan(raw=True)
    return Plan(raw=False, codec_name=codec_names[proposals[0]], size=size, payload_bytes=sum(needed))


def agree_sizes(gathers: Sequence["CieraAllGather"], *, group=None) -> list[Plan]:
    """Encode every gather's shard, agree all their sizes in one collective, and leave each gather
    ready for ``start()``. Collective over ``group``: every rank passes its gathers of that group
    in the same order. Returns the plans (for tests and logs)."""
    gathers = list(gathers)
    if not gathers:
        return []
    if all(g.group is group and g._quiet_raw() for g in gathers):  # selection's raw, nothing due:
        return [g._take_quiet_raw() for g in gathers]  # a plain gather follows, no table needed
    device = gathers[0].buffer.device
    world = gathers[0].world
    if any(g.group is not group and g.group != group for g in gathers):
        raise ValueError("agree_sizes: every gather must belong to the given group")
    again = [g.name for g in gathers if g._plan is not None]
    if again:  # encoding twice would advance the sender state past what receivers hold
        raise RuntimeError(f"agree_sizes: {again} are already prepared; start() them first")
    if world == 1:
        plans = [Plan(raw=True) for _ in gathers]
        for g, p in zip(gathers, plans):
            g._encoded = ("raw", None)
            g._apply_plan(p)
        return plans
    chose_raw = [g._raw_by_selection() for g in gathers]
    proposals = [g._encode_local() for g in gathers]  # encodes queue on the side stream (CUDA)
    if all(chose_raw) and all(g._raw_by_selection() for g in gathers):
        # Selection chose raw for every bucket, before and after this gather's decision point. That
        # choice is agreed across ranks (the selector agrees its inputs), so every rank takes this
        # branch together: the plain gather needs no size table. (A rank's local failure, FLAG_FAILED,
        # stays pending in that gather and reaches the others at the next agreement.)
        plans = [Plan(raw=True) for _ in gathers]
        for g, p in zip(gathers, plans):
            g._apply_plan(p)
        return plans
    mine = torch.empty(len(gathers), 2, dtype=torch.int64, device=device)
    mine[:, 0] = torch.tensor([flag for flag, _ in proposals], dtype=torch.int64)
    events = [g._encoded[1] for g in gathers if g._encoded is not None and g._encoded[1] is not None]
    if events:  # the sizes are written on the side stream
        for ev in events:
            torch.cuda.current_stream(device).wait_event(ev)
    mine[:, 1] = torch.stack([needed for _, needed in proposals])
    everyone = torch.empty(world * mine.numel(), dtype=torch.int64, device=device)
    all_gather_into(everyone, mine.view(-1), group=group)
    table = everyone.view(world, len(gathers), 2).cpu().tolist()  # the one host read of the step
    plans = []
    for i, g in enumerate(gathers):
        plan = plan_from_table([tuple(table[r][i]) for r in range(world)],
                               codec_names={c.codec_id: n for n, c in g._codecs.items()},
                               shard_bytes=g._raw_bucket_bytes() // world, name=g.name)
        g._apply_plan(plan)
        plans.append(plan)
    return plans
