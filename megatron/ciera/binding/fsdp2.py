"""``--use-torch-fsdp2``: Megatron-Core's FSDP2 wrapper and CIERA on its units (ZeRO-3).

The model chunk is wrapped in megatron-core's ``TorchFullyShardedDataParallel`` exactly as
Megatron-LM's ``get_model`` does (every transformer layer and the embedding its own FSDP2 unit, the
root last; ``--torch-fsdp2-no-reshard-after-forward`` keeps the gathered parameters for the
backward). Every unit's parameters are gathered in its forward and, resharded after it, again in
its backward. With ``--ciera-allgather`` :func:`install` puts :func:`ciera.fsdp2.enable` on every
unit: right after each optimizer step (:func:`after_optimizer_step`, once Megatron's optimizer has
copied its main parameters into the model's) every unit's shard is encoded with one agreement for
all units, and the step's later gathers replay against the receiver cache (``--ciera-cache``).

The functions after :func:`wrap` are this engine's CIERA binding, with the names and arguments of
:mod:`megatron.ciera.binding.bucket_group`'s (the distributed optimizer's); :class:`Fsdp2Binding`
offers them to a training loop as a :class:`megatron.ciera.binding.protocol.Binding`.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Iterable

import torch

from . import sharded_binding as shared

__all__ = ["Fsdp2Binding", "wrap", "install", "after_optimizer_step", "bucket_stats",
           "summary", "planned_units"]

_ATTR = "_ciera_fsdp2_gathers"  # the Fsdp2Gathers of a wrapped chunk


@functools.lru_cache(maxsize=None)
def _wrapper_class():
    """megatron-core's ``TorchFullyShardedDataParallel`` with the two gradient methods
    ``finalize_model_grads`` calls made to work: megatron-core (0.16.1, 0.19) calls
    ``finish_grad_sync(force_all_reduce=...)``, which the FSDP2 wrapper's base class does not take
    (a TypeError at the first step), and its ``scale_gradients`` (``--calculate-per-token-loss``)
    does nothing."""
    from megatron.core.distributed import TorchFullyShardedDataParallel

    class Fsdp2DataParallel(TorchFullyShardedDataParallel):
        """TorchFullyShardedDataParallel as Megatron-LM builds it, its gradient hooks callable."""

        def finish_grad_sync(self, force_all_reduce: bool = False):
            """Nothing to finish: FSDP2 reduce-scattered every unit's gradients in its backward."""

        def scale_gradients(self, scaling_factor: float) -> None:
            """Every (sharded) gradient times ``scaling_factor``."""
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.mul_(scaling_factor)

    return Fsdp2DataParallel


def wrap(chunks: list, *, config, reshard_after_forward: bool = True) -> list:
    """Each model chunk in megatron-core's ``TorchFullyShardedDataParallel`` with upstream's config
    (``reshard_after_forward``: not ``--torch-fsdp2-no-reshard-after-forward``; every other field
    its default, as Megatron-LM's ``get_model``)."""
    from megatron.core.distributed.torch_fully_sharded_data_parallel_config import (
        TorchFullyShardedDataParallelConfig)

    ddp_config = TorchFullyShardedDataParallelConfig(reshard_after_forward=reshard_after_forward)
    return [_wrapper_class()(config=config, ddp_config=ddp_config, module=chunk) for chunk in chunks]


def _units(chunk) -> Iterable[tuple[str, torch.nn.Module]]:
    from torch.distributed.fsdp import FSDPModule

    return [(n, m) for n, m in chunk.module.named_modules() if isinstance(m, FSDPModule)]


def _short(name: str) -> str:
    """A unit's name without the wrappers' ``module.`` prefixes (``root`` for the root)."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name or "root"


def _unit_shard(unit, world: int) -> tuple[int, torch.dtype | None]:
    """(values, dtype) of one rank's all-gather input of ``unit``: FSDP2 pads every parameter's
    dim 0 to a multiple of the world and concatenates the shards of the parameters the unit itself
    owns (none: a unit without parameters, e.g. the rotary embedding, never gathers)."""
    from torch.distributed.fsdp import FSDPModule

    nested = [m for m in unit.modules() if m is not unit and isinstance(m, FSDPModule)]
    owned = {id(p) for m in nested for p in m.parameters()}
    total, dtype = 0, None
    for p in unit.parameters():
        if id(p) not in owned:
            shape = tuple(p.shape)  # the DTensor's global shape
            total += math.ceil(shape[0] / world) * math.prod(shape[1:]) if shape else 1
            dtype = p.dtype
    return total, dtype


def planned_units(model, *, node_size: int = 0) -> tuple[list[tuple[int, int, torch.dtype, int]], int]:
    """Every unit that gathers, as ``(numel gathered, world, dtype, nodes)`` in module order, and the
    bytes of the sharded parameters per rank: from the units' parameters before any gather.
    ``nodes``: see :func:`ciera.two_level.nodes_of`."""
    from ciera.two_level import nodes_of

    units, sharded = [], 0
    for chunk in model:
        world = chunk.device_mesh.size()
        nodes = nodes_of(chunk.device_mesh.get_group(), configured=node_size)
        for _, unit in _units(chunk):
            n, dtype = _unit_shard(unit, world)
            if n:
                sharded += n * dtype.itemsize
                units.append((world * n, world, dtype, nodes))
    return units, sharded


def install(model: list, config, optimizer_config=None, log: Callable[[str], None] | None = None,
            optimizer=None) -> int:
    """CIERA's gather on every FSDP2 unit of every wrapped chunk (before the first forward), the
    shards encoded once per optimizer step (:func:`after_optimizer_step`). Returns the number of
    units with parameters (those that gather). ``optimizer_config`` and ``optimizer`` are unused
    (same signature as the distributed optimizer's binding)."""
    import ciera.fsdp2

    budget = shared.measure_budget(model, config)
    n = 0
    for chunk in model:
        if getattr(chunk, _ATTR, None) is not None:
            raise RuntimeError("CIERA already installed on this FSDP2 model")
        gathers = ciera.fsdp2.enable(chunk.module, config=config, group=chunk.process_group, budget=budget,
                                     stepped=True)
        setattr(chunk, _ATTR, gathers)
        n += sum(1 for _, unit in _units(chunk) if _unit_shard(unit, chunk.device_mesh.size())[0])
    units, sharded = planned_units(model, node_size=config.node_size)
    shared.log_planned_cache(log, config=config, units=units, sharded=sharded, budget=budget)
    return n


def _gathers(model) -> list:
    return shared.gathers_of(model, _ATTR)


def after_optimizer_step(model, *, overlap_param_gather: bool = False) -> None:
    """The step wrote every unit's shard (Megatron's optimizer has copied its main parameters into
    the model's; a step it skipped leaves them as they were, encoded again unchanged): every unit is
    encoded now, one agreement for all of them."""
    for g in _gathers(model):
        g.step()




def bucket_stats(model) -> list[tuple[str, object]]:
    """``(unit name, stats)`` for every unit that gathered, in module order
    (``bucket_group.bucket_stats``'s form; a unit without parameters never gathers)."""
    out = []
    for i, g in enumerate(_gathers(model)):
        for name, gather in g.gathers.items():
            if gather.stats.gathers:
                out.append((("" if i == 0 else f"chunk{i}.") + _short(name), gather.stats))
    return out


def summary(model) -> str:
    """The closing summary: the units' counters as a table (``bucket_group.summary``'s), then the
    encodes per unit (one per optimizer step) and the cache measured."""
    encodes = ", ".join(f"{_short(name)} {gather.fresh_gathers}" for g in _gathers(model)
                        for name, gather in g.gathers.items() if gather.stats.gathers)
    return shared.summary(bucket_stats(model), encodes_title="CIERA ZeRO-3 encodes per unit", encodes=encodes,
                          measured_cache=shared.cache_bytes(model, _ATTR))



class Fsdp2Binding(shared.ShardedBinding):
    """:class:`~megatron.ciera.binding.protocol.Binding` of megatron-core's FSDP2 wrapper: this
    module's functions; ``raise_pending_errors``, ``invalidate_param_caches`` and ``cache_bytes``
    are the shared base's."""

    noun = "FSDP2 unit"
    attr = _ATTR

    def __init__(self, *, reshard_after_forward: bool = True):
        self.reshard_after_forward = reshard_after_forward

    def wrap(self, chunks: list, *, config, ddp_config=None) -> list:
        """See :func:`wrap` (``ddp_config`` is not read: upstream builds FSDP2's config from
        ``reshard_after_forward`` alone); the parameters are then broadcast."""
        model = wrap(chunks, config=config, reshard_after_forward=self.reshard_after_forward)
        for chunk in model:
            chunk.broadcast_params()
        return model

    def install(self, model: list, *, config, optimizer_config=None, optimizer=None,
                log: Callable[[str], None] | None = None) -> int:
        """See :func:`install`."""
        return install(model, config, optimizer_config=optimizer_config, log=log, optimizer=optimizer)

    def after_optimizer_step(self, model: list, *, overlap_param_gather: bool = False) -> None:
        """See :func:`after_optimizer_step`."""
        after_optimizer_step(model, overlap_param_gather=overlap_param_gather)

    def bucket_stats(self, model: list) -> list[tuple[str, object]]:
        """See :func:`bucket_stats`."""
        return bucket_stats(model)

    def summary(self, model: list) -> str:
        """See :func:`summary`."""
        return summary(model)
