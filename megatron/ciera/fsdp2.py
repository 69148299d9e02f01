"""``--use-torch-fsdp2``: Megatron-Core's FSDP2 wrapper and CIERA on its units (ZeRO-3).

The model chunk is wrapped in megatron-core's ``TorchFullyShardedDataParallel`` exactly as
Megatron-LM's ``get_model`` does (every transformer layer and the embedding its own FSDP2 unit, the
root last; ``--torch-fsdp2-no-reshard-after-forward`` keeps the gathered parameters for the
backward). Every unit's parameters are gathered in its forward and, resharded after it, again in
its backward. With ``--ciera-allgather`` :func:`install` puts :func:`ciera.fsdp2.enable` on every
unit: right after each optimizer step (:func:`after_optimizer_step`, once Megatron's optimizer has
copied its main parameters into the model's) every unit's shard is encoded with one agreement for
all units, and the step's later gathers replay against the receiver cache (``--ciera-cache``).

The functions after :func:`wrap` are the training loop's CIERA binding, with the same names and
arguments as :mod:`megatron.ciera.bucket_group`'s (the distributed optimizer's): the loop picks one
module and calls it the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Iterable

import torch

from . import sharded_binding as shared

__all__ = ["check_args", "wrap", "install", "after_optimizer_step", "invalidate_param_caches", "bucket_stats",
           "summary", "cache_bytes", "planned_units"]

# Upstream flags megatron.ciera.model.ddp_config maps onto DistributedDataParallelConfig fields of
# another name (the fields themselves are read from the dataclass).
_DDP_RENAMED = ("accumulate_allreduce_grads_in_fp32", "grad_reduce_in_bf16", "ddp_bucket_size",
                "ddp_average_in_collective", "ddp_pad_buckets_for_high_nccl_busbw",
                "ddp_reduce_scatter_with_fp32_accumulation")
# DDP-config flags upstream's FSDP2 path still reads elsewhere (or checks itself, below).
_DDP_KEPT = ("use_distributed_optimizer", "fp8_param_gather", "delay_wgrad_compute")
_ATTR = "_ciera_fsdp2_gathers"  # the Fsdp2Gathers of a wrapped chunk


def _option(dest: str) -> str:
    from .arguments import _option as option

    return option(dest)


def check_args(args, err: Callable[[str], None]) -> None:
    """Megatron-LM's own checks of ``--use-torch-fsdp2`` (``megatron/training/arguments.py``:
    no pipeline or expert parallelism, not with the distributed optimizer, no gradient-accumulation
    fusion, ``--ckpt-format torch_dist``, untied embeddings: core 0.19's check, which 0.16.1 needs as
    well but fails later without), the flags only
    Megatron's DDP wrapper reads (upstream builds FSDP2's config from
    ``--torch-fsdp2-no-reshard-after-forward`` alone), and the ``--ciera-*`` combination."""
    from megatron.core.distributed import DistributedDataParallelConfig

    if args.pipeline_model_parallel_size != 1:
        err("--use-torch-fsdp2 is not supported with pipeline parallelism (as in Megatron-LM)")
    if args.expert_model_parallel_size != 1:
        err("--use-torch-fsdp2 is not supported with expert parallelism (as in Megatron-LM)")
    if args.use_distributed_optimizer:
        err("--use-torch-fsdp2 is not supported with MCore's distributed optimizer (as in Megatron-LM: "
            "FSDP2 shards the optimizer state itself); drop --use-distributed-optimizer")
    if args.gradient_accumulation_fusion:
        err("--use-torch-fsdp2 is not supported with gradient accumulation fusion (as in Megatron-LM): "
            "pass --no-gradient-accumulation-fusion")
    elif args.device == "cpu":  # the fusion off is what runs on CPU: nothing to report as not applied
        args.cpu_ignored = [o for o in args.cpu_ignored if o != "--no-gradient-accumulation-fusion"]
    if args.ckpt_format != "torch_dist":
        err(f"--use-torch-fsdp2 with --ckpt-format {args.ckpt_format}: Megatron-LM takes torch_dist or torch_dcp; "
            "this entry point writes torch_dist")
    for dest in ("save", "load"):
        if getattr(args, dest):
            err(f"{_option(dest)} with --use-torch-fsdp2: not supported yet (megatron-core's torch_dist state "
                "dicts do not fit FSDP2's DTensor parameters here: the optimizer's parameter map finds none of "
                "them, the MoE experts' shardings overlap, and the model's load_state_dict refuses them); to "
                "checkpoint a ZeRO-3 run use --use-megatron-fsdp --use-distributed-optimizer --ckpt-format "
                "fsdp_dtensor --data-parallel-sharding-strategy optim_grads_params")
    if not args.untie_embeddings_and_output_weights:  # upstream checks it from core 0.19 on; 0.16.1 fails later
        err("--use-torch-fsdp2 requires --untie-embeddings-and-output-weights (as Megatron-LM core 0.19 checks: "
            "tied, the output layer multiplies by the embedding unit's resharded DTensor weight)")
    ddp_only = {f.name for f in dataclasses.fields(DistributedDataParallelConfig)} | set(_DDP_RENAMED)
    for dest in sorted((ddp_only - set(_DDP_KEPT)) & set(args.explicit)):
        err(f"{_option(dest)}: only Megatron's DDP wrapper reads it; --use-torch-fsdp2 reduce-scatters the "
            "gradients through FSDP2 (as in Megatron-LM, which ignores it there)")
    if args.ciera_allgather:
        from ciera.zero3 import Zero3Gather

        from .arguments import ciera_config_from_args

        try:
            Zero3Gather(config=ciera_config_from_args(args))  # its own checks; no collective
        except ValueError as exc:
            err(f"--ciera-* flags with --use-torch-fsdp2: {exc}")


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


def wrap(chunks: list, *, config, args) -> list:
    """Each model chunk in megatron-core's ``TorchFullyShardedDataParallel`` with upstream's config
    (``reshard_after_forward`` from ``--torch-fsdp2-no-reshard-after-forward``, every other field
    its default, as Megatron-LM's ``get_model``)."""
    from megatron.core.distributed.torch_fully_sharded_data_parallel_config import (
        TorchFullyShardedDataParallelConfig)

    ddp_config = TorchFullyShardedDataParallelConfig(reshard_after_forward=args.torch_fsdp2_reshard_after_forward)
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


def raise_pending_errors(model) -> None:
    """Before a checkpoint: raise a corrupt payload that a device decode found and has not reported."""
    shared.raise_pending_errors(model, _ATTR)


def invalidate_param_caches(model) -> None:
    """After a checkpoint load: every unit's next gather is raw and refills the caches."""
    shared.invalidate(model, _ATTR)


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
                          measured_cache=cache_bytes(model))


def cache_bytes(model) -> int:
    """Bytes this rank keeps between gathers, measured (known after the first forward)."""
    return shared.cache_bytes(model, _ATTR)
