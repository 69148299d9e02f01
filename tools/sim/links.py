"""The simulators' links and hosts: what a cluster adds to the cost model's single :class:`LinkModel`.

* :class:`TwoLevelLink` -- ``gpus_per_node`` ranks per node on a fast link, nodes joined by
  ``nics_per_node`` NICs each of ``inter`` speed. ``algorithm='ring'`` is a flat ring split into
  ``nics_per_node`` channels (as NCCL does), every step paced by the slower of the intra link and
  the node's NICs together; ``algorithm='hierarchical'`` gathers across nodes first (every local
  rank rings over the nodes, the local ranks sharing the node's NICs) then within the node (each
  rank forwards ``nodes`` shards over the fast link).
* :class:`HostShare` -- ranks whose codecs share a machine's CPU cores (the network-namespace testbed).

Both feed the pure model (:mod:`ciera.cost_model`): a :class:`TwoLevelLink` is a ``Link``; a
:class:`HostShare`'s ``slowdown`` is ``predict_compressed``'s ``codec_slowdown``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ciera.cost_model import LinkModel

__all__ = ["ALGORITHMS", "HostShare", "TwoLevelLink"]

ALGORITHMS = ("ring", "hierarchical")


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
            slowest = LinkModel(min(self.intra.bandwidth_bytes_per_s, nic_bw),
                                max(self.intra.latency_s, self.inter.latency_s))
            return slowest.allgather_time(bytes_per_rank=bytes_per_rank, world=world)
        # all local ranks ring over the nodes at once, sharing the node's NICs
        across = LinkModel(nic_bw / self.gpus_per_node, self.inter.latency_s).allgather_time(
            bytes_per_rank=bytes_per_rank, world=nodes)
        within = self.intra.allgather_time(bytes_per_rank=nodes * bytes_per_rank, world=self.gpus_per_node)
        return across + within


@dataclass(frozen=True)
class HostShare:
    """Ranks whose codec work and transport share CPU cores (CPU hosts: CPU codecs, gloo over
    TCP). A GPU codec runs on the GPU, so GPU clusters pass no ``HostShare``.

    Where ``ranks > cores`` the codec phases are paced by the machine's cores, not one rank's:
    every rank encodes (and decodes) at once, so each phase takes ``ranks / cores`` times a
    single-core codec's time, and a collective waits for the last rank to finish it. Speeds given
    with a ``HostShare`` are single-core speeds (measured where each rank had a core); the link is
    untouched (a link fitted on these hosts already includes the transport's share of the cores).
    Pass :attr:`slowdown` as ``codec_slowdown`` to :func:`ciera.cost_model.predict_compressed`."""

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
