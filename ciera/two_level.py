"""The two-level ZeRO-3 gather (``CieraConfig.cache='two_level'``): compressed across nodes, raw
within them, with a receiver cache of ``1/L`` of the parameters.

A process group of ``W = N x L`` ranks, ``L`` on each of ``N`` nodes, its ranks numbered node by node
(``group rank = node x L + local``, the order torchrun and SLURM give). A unit's shard ``(n, l)`` is
gathered in two stages:

1. **Across nodes, compressed**: the ranks of local index ``l`` (one per node, the *inter* group)
   gather each other's shards with CIERA's ZeRO-3 gather and a ``values`` cache of those ``N``
   shards only: ``N x S`` values per rank instead of ``W x S``. A step's later gathers replay that
   cache and send nothing across nodes.
2. **Within the node, raw**: the ``L`` ranks of a node (the *intra* group) exchange their ``N``
   shards over the node's own links: block ``n'`` of every local rank lands in the output's row of
   node ``n'`` (``N`` all-gathers of ``S`` values each, straight into place; no copy).

Bit-exact against the plain all-gather: stage 1 is, stage 2 moves bits unchanged. What crosses nodes
is ``1/L`` of a plain gather's remote traffic before compression (ZeRO++'s hpZ grouping, lossless).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .comm import all_gather_into


@dataclass(frozen=True)
class NodeLayout:
    """Where a process group's ranks sit: ``nodes x local`` ranks, numbered node by node."""

    nodes: int
    """Nodes the group spans (``N``)."""
    local: int
    """The group's ranks on each node (``L``)."""

    def place(self, rank: int) -> tuple[int, int]:
        """``(node, local index)`` of a group rank."""
        return divmod(rank, self.local)

    @property
    def useful(self) -> bool:
        """Two levels differ from one: several nodes, several ranks on each."""
        return self.nodes > 1 and self.local > 1


def node_size(configured: int) -> int:
    """Ranks per node: ``configured`` when positive, else the launcher's ``LOCAL_WORLD_SIZE`` (0 when
    the launcher gives none)."""
    if configured > 0:
        return configured
    return int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)


def layout_of(*, ranks: list[int], ranks_per_node: int) -> NodeLayout | None:
    """The layout of a group whose global ``ranks`` (in group order) sit ``ranks_per_node`` to a
    node (global rank ``g`` on node ``g // ranks_per_node``); ``None`` when the group is not
    ``N x L`` numbered node by node (or ``ranks_per_node`` is unknown)."""
    if ranks_per_node < 1:
        return None
    nodes = [g // ranks_per_node for g in ranks]
    distinct = sorted(set(nodes), key=nodes.index)
    local = len(ranks) // len(distinct)
    if local * len(distinct) != len(ranks):
        return None
    if nodes != [n for n in distinct for _ in range(local)]:
        return None
    return NodeLayout(nodes=len(distinct), local=local)


def _global_ranks(group) -> list[int]:
    """The global ranks of ``group`` in group order (``None``: the default group)."""
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def group_layout(group, *, ranks_per_node: int) -> NodeLayout | None:
    """:func:`layout_of` for a process group (``None``: the default group)."""
    return layout_of(ranks=_global_ranks(group), ranks_per_node=ranks_per_node)


def nodes_of(group, *, configured: int) -> int:
    """The nodes a group spans when two levels are possible there (several nodes of several ranks,
    numbered node by node; ``configured``: :attr:`ciera.CieraConfig.node_size`), else 1."""
    layout = group_layout(group, ranks_per_node=node_size(configured))
    return layout.nodes if layout is not None and layout.useful else 1


@dataclass(frozen=True)
class NodeGroups:
    """The two process groups of one rank for a group with a :class:`NodeLayout`."""

    layout: NodeLayout
    inter: object
    """This rank's ranks of the same local index, one per node (stage 1, compressed)."""
    intra: object
    """This rank's node (stage 2, raw)."""
    node: int
    """This rank's node index within the group."""


def split_group(group, *, layout: NodeLayout) -> NodeGroups:
    """Create this rank's inter and intra groups (collective among their members only: every rank
    of ``group`` calls it at the same point, in the same order of groups)."""
    ranks = _global_ranks(group)
    rank = dist.get_rank(group)
    node, local = layout.place(rank)
    inter = [ranks[n * layout.local + local] for n in range(layout.nodes)]
    intra = [ranks[node * layout.local + k] for k in range(layout.local)]
    return NodeGroups(layout=layout, node=node,
                      inter=dist.new_group(ranks=inter, use_local_synchronization=True),
                      intra=dist.new_group(ranks=intra, use_local_synchronization=True))


class TwoLevel:
    """The two-level gather of one unit. ``stage1`` is a :class:`ciera.zero3.Zero3Gather` over
    ``groups.inter`` with the ``values`` cache (it registers with the unit's
    :class:`ciera.zero3.Zero3Units`, so its encode and agreement happen after the optimizer step
    with every other unit's of that group)."""

    def __init__(self, *, stage1, groups: NodeGroups):
        self.stage1, self.groups = stage1, groups

    def start(self, *, output: torch.Tensor, input: torch.Tensor) -> "TwoLevelHandle":
        """Stage 1 into its cache; stage 2 from the cache into ``output``. Stage 2 is posted here
        when stage 1 sends nothing (a replay: the cache holds the step's values), else at ``wait()``
        after stage 1's decode."""
        n = input.numel()
        nodes = self.groups.layout.nodes
        cache = self.stage1.allocate(numel=nodes * n, dtype=output.dtype, device=output.device)
        first = self.stage1.start(output=cache, input=input, group=self.groups.inter)
        handle = TwoLevelHandle(first=first, second=lambda: self._stage2(output=output, cache=cache, shard=n))
        if first.ready:
            handle.post()
        return handle

    def _stage2(self, *, output: torch.Tensor, cache: torch.Tensor, shard: int) -> list:
        """Block ``n'`` of the cache (shard ``(n', l)``) from every local rank ``l`` into row ``n'`` of
        the output: ``N`` async all-gathers within the node, each straight into place."""
        layout = self.groups.layout
        rows = output.view(layout.nodes, layout.local * shard)
        blocks = cache.view(layout.nodes, shard)
        return [all_gather_into(rows[k], blocks[k], group=self.groups.intra, async_op=True)
                for k in range(layout.nodes)]


class TwoLevelHandle:
    """Returned by :meth:`TwoLevel.start`; :meth:`wait` completes both stages. Idempotent."""

    ready = False  # (a Zero3Handle's attribute: a two-level gather always posts stage 2)

    def __init__(self, *, first, second):
        self._first, self._second = first, second
        self._works: list | None = None
        self.done = False

    def post(self) -> None:
        """Stage 1 is complete (waited, decoded): post stage 2."""
        self._first.wait()
        self._works = self._second()

    def wait(self) -> None:
        """Wait for stage 1, decode it, then stage 2."""
        if self.done:
            return
        self.done = True
        if self._works is None:
            self.post()
        for work in self._works:
            work.wait()
