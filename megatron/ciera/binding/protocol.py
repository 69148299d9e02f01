"""What the training loop asks of a binding: the one interface between a loop and the engine that
gathers its parameters (:class:`Binding`).

An engine is what wraps the model chunks and all-gathers their parameters: the distributed
optimizer's bucket groups (:mod:`megatron.ciera.binding.bucket_group`), FSDP2's units
(:mod:`megatron.ciera.binding.fsdp2`) or Megatron-FSDP's buckets
(:mod:`megatron.ciera.binding.megatron_fsdp`); a torchtitan binding would be a fourth class here
beside them (torchtitan's own integration is :mod:`ciera.integrations.torchtitan`). Each engine has
one small class implementing :class:`Binding`; :func:`megatron.ciera.binding.engines.binding_for`
picks it. The loop holds the object and never names an engine's module.

Every method but :meth:`Binding.wrap` and :meth:`Binding.full_tensor` takes the wrapped model (the
list of chunks :meth:`Binding.wrap` returned); the engine keeps its CIERA state on the chunks, so a
binding object holds only its settings.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

__all__ = ["Binding"]


class Binding(Protocol):
    """An engine's CIERA binding as the training loop calls it, in the order it calls it.

    The defaults of :meth:`sync_params` and :meth:`full_tensor` serve the engines whose
    parameters are whole tensors or DTensors; an engine subclasses this protocol to inherit them."""

    noun: str
    """What one gathering unit is called in the start-up line ("bucket group", "FSDP2 unit", ...)."""

    def wrap(self, chunks: list, *, config, ddp_config) -> list:
        """The model chunks (after ``Float16Module``) wrapped for data parallelism, replicas made
        equal. ``config``: the chunks' ``TransformerConfig``; ``ddp_config``: the
        ``DistributedDataParallelConfig`` built from the flags (an engine that does not read it
        says so)."""
        ...

    def install(self, model: list, *, config, optimizer_config=None, optimizer=None,
                log: Callable[[str], None] | None = None) -> int:
        """CIERA's gather on every unit of ``model`` (every rank, after the optimizer is built and
        before the first gather); ``config``: the :class:`ciera.CieraConfig`. Returns the number of
        units now gathering through CIERA (:attr:`noun`)."""
        ...

    def after_optimizer_step(self, model: list, *, overlap_param_gather: bool) -> None:
        """Right after ``optimizer.step()``: finish or prepare the step's gathers."""
        ...

    def sync_params(self, model: list, *, overlap_param_gather: bool) -> None:
        """Make every parameter hold its gathered value before the parameters are read (save,
        snapshot, evaluation's end). The default starts each chunk's gathers synchronously under
        ``overlap_param_gather`` (a no-op without: the optimizer step gathered)."""
        if overlap_param_gather:
            for chunk in model:
                chunk.start_param_sync(force_sync=True)

    def raise_pending_errors(self, model: list) -> None:
        """Raise a corrupt payload that a device decode found and has not reported (before a
        checkpoint is written)."""
        ...

    def invalidate_param_caches(self, model: list) -> None:
        """After anything but the optimizer wrote the parameters (a checkpoint load): every
        unit's next gather is raw and refills the caches."""
        ...

    def bucket_stats(self, model: list) -> list[tuple[str, object]]:
        """``(unit name, ciera.stats.GatherStats)`` of every unit that gathered, in a fixed order."""
        ...

    def summary(self, model: list) -> str:
        """The closing summary of a run (the counters as a table and the engine's own lines)."""
        ...

    def full_tensor(self, param: torch.Tensor) -> torch.Tensor:
        """The whole value of one of ``model``'s parameters (a collective where the engine shards
        it). The default: a DTensor's ``full_tensor()``, any other tensor as it is."""
        return param.full_tensor() if hasattr(param, "full_tensor") else param
