"""The collectives CIERA issues: the equal-size all-gather under the name the installed torch
prefers, and an all-gather of per-rank sizes."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor to all_gather_single (same semantics; the old name warns).
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""``all_gather_into(output, input, group=None, async_op=False)``: every rank's ``input`` concatenated
into ``output`` in rank order."""


def all_gather_uneven(output: torch.Tensor, input: torch.Tensor, *, sizes: Sequence[int], group=None,
                      async_op: bool = True):
    """Every rank's ``input`` (``sizes[r]`` elements on rank ``r``) concatenated into ``output`` in
    rank order; ``output`` holds ``sum(sizes)`` elements. Each rank receives ``sum(sizes) -
    sizes[rank]`` elements, not ``(world - 1) x max(sizes)`` as an equal all-gather.

    NCCL: torch's all-gather of unequal tensors (grouped broadcasts). Other backends (gloo rejects
    unequal all-gathers): every rank sends its block to each other rank and receives theirs, all
    posted at once as one batch of point-to-point transfers (no transfer waits on another, so the
    gather stays asynchronous like the equal one: the returned work's ``wait()`` waits for them).
    Ranks post their gathers on a group in the same order (as every collective), so each pair's
    transfers match in order. ``input`` and ``output`` must stay untouched until ``wait()``."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if len(sizes) != world or sum(sizes) != output.numel() or sizes[rank] != input.numel():
        raise ValueError(f"all_gather_uneven: sizes {list(sizes)} do not fit output {output.numel()} and "
                         f"this rank's input {input.numel()} at world {world}")
    views = list(output.split(list(sizes)))
    if dist.get_backend(group) == "nccl":
        return dist.all_gather(views, input, group=group, async_op=async_op)
    views[rank].copy_(input)
    peer = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    ops = []
    for k in range(1, world):  # the k-th neighbour each way: every rank's sends spread over peers
        to, frm = (rank + k) % world, (rank - k) % world
        if sizes[rank]:
            ops.append(dist.P2POp(dist.isend, views[rank], peer(to), group))
        if sizes[frm]:
            ops.append(dist.P2POp(dist.irecv, views[frm], peer(frm), group))
    work = _Works(dist.batch_isend_irecv(ops) if ops else [])
    if not async_op:
        work.wait()
    return work


class _Works:
    """Point-to-point transfers completed as one collective: ``wait()`` waits for each."""

    def __init__(self, works):
        self._works = list(works)

    def wait(self, timeout=None) -> bool:
        for w in self._works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)
