"""What the two FSDP bindings (:mod:`megatron.ciera.binding.fsdp2`,
:mod:`megatron.ciera.binding.megatron_fsdp`) share: finding their gathers on the wrapped chunks,
invalidating them, the cache's figures and the lines that report them (:class:`ShardedBinding`,
their base). Each binding keeps its gathers on a chunk attribute of its own (``attr``)."""

from __future__ import annotations

from typing import Callable

from .protocol import Binding


def gathers_of(model, attr: str) -> list:
    """The binding's gathers object of every chunk that has one, in chunk order."""
    return [g for chunk in model if (g := getattr(chunk, attr, None)) is not None]


def invalidate(model, attr: str) -> None:
    """After a checkpoint load: every gather's next gather is raw and refills the caches."""
    for g in gathers_of(model, attr):
        g.invalidate()


def raise_pending_errors(model, attr: str) -> None:
    """Before a checkpoint: raise a corrupt payload that a device decode found and has not reported."""
    for g in gathers_of(model, attr):
        g.raise_pending_errors()


def cache_bytes(model, attr: str) -> int:
    """Bytes this rank keeps between ZeRO-3 gathers, measured (known after the first gathers)."""
    return sum(g.cache_bytes for g in gathers_of(model, attr))


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB ({nbytes} bytes)"


def measure_budget(model, config):
    """With ``--ciera-cache auto``: the caches' budget, measured once at install (a collective over
    the world: every rank installs); ``None`` otherwise."""
    if config.cache != "auto":
        return None
    import torch
    from ciera.memory import measure_budget as measure

    device = next((p.device for chunk in model for p in chunk.parameters()), torch.device("cpu"))
    return measure(spec=config.cache_budget, device=device)


def log_planned_cache(log: Callable[[str], None] | None, *, config, units: list, sharded: int, budget) -> None:
    """The start-up line: the cache each ZeRO-3 unit ``(numel, world, dtype, nodes)`` gets (``auto``: under
    ``budget``, in this order), its bytes per rank, beside the sharded parameters'."""
    if log is None or not sharded:
        return
    from ciera.zero3 import cache_bytes_per_rank, plan_caches

    caches = plan_caches(units, cache=config.cache, budget=budget)
    planned = sum(cache_bytes_per_rank(numel=n, world=w, dtype=d, cache=c, nodes=k) for (n, w, d, k), c in zip(units, caches))
    kinds = sorted(set(caches), key=caches.index)
    name = "+".join(kinds)
    if len(kinds) > 1:
        name += " (" + ", ".join(f"{caches.count(k)} units {k}" for k in kinds) + ")"
    why = f"; auto, within a budget of {budget.describe()}" if budget is not None else ""
    log(f"CIERA ZeRO-3 cache ({name}): {mib(planned)} per rank kept between gathers "
        f"(the sharded parameters: {mib(sharded)} per rank{why})")


def summary(stats: list, *, encodes_title: str, encodes: str, measured_cache: int) -> str:
    """The closing summary: the counters as a table (``bucket_group.summary``'s), the encodes (one
    per optimizer step) and the cache measured."""
    from .report import bucket_table

    return (bucket_table(stats, "CIERA summary (bytes received by rank 0):")
            + f"\n{encodes_title} (one per optimizer step): {encodes}"
            + f"\nCIERA ZeRO-3 cache: {mib(measured_cache)} per rank kept between gathers (measured)")


class ShardedBinding(Binding):
    """The base of the FSDP engines' :class:`~megatron.ciera.binding.protocol.Binding`: what reads
    their gathers off the chunks' ``attr``."""

    attr: str
    """The chunk attribute holding the engine's gathers object."""

    def raise_pending_errors(self, model: list) -> None:
        """Before a checkpoint: raise a corrupt payload that a device decode found and has not reported."""
        raise_pending_errors(model, self.attr)

    def invalidate_param_caches(self, model: list) -> None:
        """After a checkpoint load: every unit's next gather is raw and refills the caches."""
        invalidate(model, self.attr)

    def cache_bytes(self, model: list) -> int:
        """Bytes this rank keeps between ZeRO-3 gathers, measured (known after the first gathers)."""
        return cache_bytes(model, self.attr)
