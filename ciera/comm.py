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


class _Completed:
    """The work of a collective that completed before it was returned."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def all_gather_uneven(output: torch.Tensor, input: torch.Tensor, *, sizes: Sequence[int], group=None,
                      async_op: bool = True):
    """Every rank's ``input`` (``sizes[r]`` elements on rank ``r``) concatenated into ``output`` in
    rank order; ``output`` holds ``sum(sizes)`` elements. Each rank sends and receives about
    ``sum(sizes)`` elements, not ``world x max(sizes)`` as an equal all-gather.

    NCCL: torch's all-gather of unequal tensors (grouped broadcasts). Other backends (gloo rejects
    unequal all-gathers): a ring of ``world - 1`` rounds of point-to-point transfers, round ``k``
    passing block ``rank - k`` to the right neighbour while receiving block ``rank - k - 1`` from
    the left; it completes before returning (a work whose ``wait()`` is free)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if len(sizes) != world or sum(sizes) != output.numel() or sizes[rank] != input.numel():
        raise ValueError(f"all_gather_uneven: sizes {list(sizes)} do not fit output {output.numel()} and "
                         f"this rank's input {input.numel()} at world {world}")
    views = list(output.split(list(sizes)))
    if dist.get_backend(group) == "nccl":
        return dist.all_gather(views, input, group=group, async_op=async_op)
    views[rank].copy_(input)
    right = dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world
    left = dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world
    for k in range(world - 1):
        send, recv = views[(rank - k) % world], views[(rank - k - 1) % world]
        ops = ([dist.P2POp(dist.isend, send, right, group)] if send.numel() else []) + \
              ([dist.P2POp(dist.irecv, recv, left, group)] if recv.numel() else [])
        for work in dist.batch_isend_irecv(ops) if ops else ():
            work.wait()
    return _Completed()
