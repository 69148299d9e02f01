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
    unequal all-gathers): a ring of point-to-point steps, as gloo's own all-gather. Step ``k`` sends
    to the next rank the block received at step ``k - 1`` (its own at step 1) while receiving the
    next one from the previous rank, so every link carries ``sum(sizes)`` less one block, the
    smallest bottleneck any shape has (sending each block straight to every peer instead puts a
    block on a shared host link once per remote rank). The first step is posted here; the others,
    which each need the block the step before received, run in ``wait()``: the later steps of a
    ring wider than 2 do not overlap the caller's work. Ranks post their gathers on a group in the
    same order, and wait for them in the same order (as every collective), so each pair's
    transfers match in order. ``input`` and ``output`` must stay untouched until ``wait()``."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if len(sizes) != world or sum(sizes) != output.numel() or sizes[rank] != input.numel():
        raise ValueError(f"all_gather_uneven: sizes {list(sizes)} do not fit output {output.numel()} and "
                         f"this rank's input {input.numel()} at world {world}")
    views = list(output.split(list(sizes)))
    if dist.get_backend(group) == "nccl":
        return dist.all_gather(views, input, group=group, async_op=async_op)
    views[rank].copy_(input)
    work = _Ring(views, rank=rank, group=group)
    if not async_op:
        work.wait()
    return work


class _Ring:
    """The point-to-point ring of :func:`all_gather_uneven` off NCCL: step ``k`` (1 .. world - 1)
    sends block ``rank - k + 1`` to the next rank and receives block ``rank - k`` from the previous
    one (indices mod world); a step with nothing to move in one direction posts nothing there."""

    def __init__(self, views: list, *, rank: int, group):
        self._views, self._rank, self._group = views, rank, group
        self._world = len(views)
        g = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
        self._next, self._prev = g((rank + 1) % self._world), g((rank - 1) % self._world)
        self._step = 0
        self._works: list = []
        self._post()

    def _post(self) -> None:
        self._step += 1
        if self._step >= self._world:
            self._works = []
            return
        send, recv = self._views[(self._rank - self._step + 1) % self._world], \
            self._views[(self._rank - self._step) % self._world]
        ops = []
        if send.numel():
            ops.append(dist.P2POp(dist.isend, send, self._next, self._group))
        if recv.numel():
            ops.append(dist.P2POp(dist.irecv, recv, self._prev, self._group))
        self._works = dist.batch_isend_irecv(ops) if ops else []

    def wait(self, timeout=None) -> bool:
        while self._step < self._world:
            for w in self._works:
                w.wait()
            self._post()
        return True

    def is_completed(self) -> bool:
        return self._step >= self._world
