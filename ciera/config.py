"""CieraConfig: the one configuration object of the compressed all-gather.

Frozen: derive variants with :func:`dataclasses.replace`, never by mutation. Every rank of a group
must hold an equal config; :class:`ciera.CieraAllGather` checks this at construction.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

from .codecs.registry import codec_choices
from .memory import parse_budget

CODECS = codec_choices()
"""The codecs registered when this module loads (the built-in ones) and ``auto``, for argument
parsers; validation asks the registry, so a codec registered later is accepted too."""
CACHES = ("auto", "values", "two_level", "exponents", "none")
SELECTIONS = ("auto", "always", "never")


@dataclass(frozen=True)
class CieraConfig:
    """How one bucket's parameter all-gather is compressed. Defaults suit bf16 MoE training."""

    codec: str = "auto"
    """Codec for compressed gathers: ``raw``, ``exponent_reuse``, ``delta``, ``delta_ans`` (delta's
    changes entropy-coded: fewest bytes, slowest), or ``auto`` (the cost model picks per bucket
    among the concrete codecs from measured speeds and payload sizes).
    ``raw`` never compresses: every gather is a plain ``all_gather_into_tensor``."""

    block_size: int = 8
    """Values per block for ``exponent_reuse``: a block whose exponents changed resends all its
    exponents. Small blocks isolate the (independent, mostly small-magnitude) exponent changes at a
    bitmap cost of 1/B bit per value: on bf16 AdamW trajectories B=8 sends 1.81x less than raw
    against 1.31x at B=64 and 1.00x at the paper's 512 (B=4: 3-7% better still, at twice the
    bitmap; see ``ciera/codecs/exponent_reuse/codec.py``). Must be a power of two in [1, 4096]."""

    delta_block_size: int = 128
    """Values per block of the ``delta`` codec (exception lists, raw escape). 128 measured as good
    as 256 and better than 64 (see ``ciera/codecs/delta/codec.py``). Power of two in [8, 4096]."""

    warmup_gathers: int = 1
    """Gathers sent raw after construction and after every :meth:`CieraAllGather.invalidate`.
    At least 1: the first gather has no previous values to reuse."""

    selection: str = "auto"
    """``auto`` lets the cost model decide per bucket, from the measured link and codec speeds,
    whether compressing pays (a bucket where it loses is sent raw); ``always`` compresses every
    gather after warmup; ``never`` sends raw (a baseline that still exercises the code path)."""

    verify_interval: int = 10000
    """Every N gathers, compare a 64-bit hash of each shard of the gathered buffer across ranks
    (non-linear, salted per check: any change is caught but with probability ~2^-64). On a
    mismatch every rank raises :class:`ciera.gather.CieraVerifyError` together, naming the bucket,
    the shard's owner and the ranks that differ: training stops (nothing is resynchronised: a
    stale receiver means a broken ``invalidate()`` contract or codec, to be fixed, not hidden).
    0 disables. The default keeps the check under 0.5% of the gather time: one check costs 15-29
    plain all-gathers of the bucket on CPU gloo (``tools/bench_verify.py``), so a stale receiver
    is caught within 10000 gathers of the bucket."""

    reevaluate_interval: int = 50
    """With ``selection='auto'``: gathers between re-decisions of the cost model (a bucket whose
    first decision compressed is re-checked sooner, after ``ciera.selection.EARLY_RECHECK``; one
    where raw wins clearly backs off, up to ``ciera.selection.MAX_BACKOFF`` times this)."""

    hysteresis: float = 0.1
    """With ``selection='auto'``: a bucket switches between raw and compressed only when the
    predicted time of the other mode is better by this fraction (its first decision too: raw is
    the incumbent)."""

    cache: str = "auto"
    """ZeRO-3 only (:mod:`ciera.zero3`: FSDP2, Megatron-FSDP's ``optim_grads_params``), where the
    gathered buffer is freed after use: what each receiver keeps of the other ranks' shards between
    gathers, per parameter of a unit (its unsharded size), plus a copy of its own shard (the shard's
    bytes). ``values``: the gathered values themselves (2 bytes per bf16 parameter: the unsharded
    parameters' memory; any codec, ``delta`` included; a step's later gathers send nothing);
    ``exponents``: 1 byte per parameter (the exponent field; ``exponent_reuse`` only, sign and
    mantissa sent at every gather); ``two_level``: across nodes the ``values`` cache of the shards
    of this rank's local index on every node only (``1/L`` of ``values`` with ``L`` ranks per node,
    :mod:`ciera.two_level`), then a raw gather within the node; ``auto``: ``values`` for every unit
    that fits ``cache_budget`` (in first-gather order), else ``two_level`` where the group spans
    several nodes of several ranks and it fits, else ``exponents``; ``none``: nothing (every ZeRO-3
    gather plain). Ignored by the persistent-buffer gather."""

    node_size: int = 0
    """Ranks per node for ``cache='two_level'`` (global rank ``g`` is on node ``g // node_size``);
    0: the launcher's ``LOCAL_WORLD_SIZE``."""

    cache_budget: str = "50%"
    """With ``cache='auto'``: the bytes per rank the receiver caches may keep, as a share of the
    memory free once the model and optimizer are built (``"50%"``; on CPU the host's available RAM
    shared by its ranks) or a size (``"8GiB"``). See :mod:`ciera.memory`."""

    per_rank_sizes: bool = True
    """Compressed gathers send each rank's own payload size (16-aligned; an uneven all-gather) when
    that saves at least :data:`ciera.agreement.UNEVEN_MIN_SAVING` of the equal-size gather, where
    every rank sends the largest payload (a shard of experts next to one of router, norms and
    attention). ``False``: always the equal-size gather (one collective; the baseline that measures
    the saving). The gathered values are the same either way."""

    def __post_init__(self):
        def bad(msg):
            raise ValueError(f"CieraConfig: {msg}")

        if self.codec not in codec_choices():
            bad(f"codec={self.codec!r}; expected one of {codec_choices()}")
        if self.cache not in CACHES:
            bad(f"cache={self.cache!r}; expected one of {CACHES}")
        try:
            parse_budget(self.cache_budget)
        except ValueError as e:
            bad(str(e))
        if self.selection not in SELECTIONS:
            bad(f"selection={self.selection!r}; expected one of {SELECTIONS}")
        for name, lo, hi in (("block_size", 1, 4096), ("delta_block_size", 8, 4096)):
            v = getattr(self, name)
            if not (lo <= v <= hi) or v & (v - 1):
                bad(f"{name}={v} must be a power of two in [{lo}, {hi}]")
        if self.warmup_gathers < 1:
            bad(f"warmup_gathers={self.warmup_gathers} must be >= 1 (the first gather is always raw)")
        if not isinstance(self.node_size, int) or self.node_size < 0:
            bad(f"node_size={self.node_size!r} must be an int >= 0 (0: LOCAL_WORLD_SIZE)")
        if self.verify_interval < 0:
            bad(f"verify_interval={self.verify_interval} must be >= 0")
        if self.reevaluate_interval < 1:
            bad(f"reevaluate_interval={self.reevaluate_interval} must be >= 1")
        if not isinstance(self.per_rank_sizes, bool):
            bad(f"per_rank_sizes={self.per_rank_sizes!r} must be a bool")
        if self.hysteresis < 0:
            bad(f"hysteresis={self.hysteresis} must be >= 0")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The fields :meth:`field_digests` covers, in its order (prefixed ``config.``)."""
        return tuple(f"config.{f.name}" for f in dataclasses.fields(cls))

    def field_digests(self) -> list[int]:
        """One 63-bit digest per field (order of :meth:`field_names`), so that ranks comparing
        them can name the field that differs (process-independent)."""
        return [int.from_bytes(hashlib.sha256(repr(getattr(self, f.name)).encode()).digest()[:8], "little") >> 1
                for f in dataclasses.fields(self)]

    def fingerprint(self) -> int:
        """A 63-bit digest of every field, equal on ranks with equal configs (process-independent)."""
        text = repr(sorted(dataclasses.asdict(self).items()))
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1
