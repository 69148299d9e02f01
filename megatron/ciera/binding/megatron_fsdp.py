"""``--use-megatron-fsdp``: Megatron-Core's own FSDP (``megatron.core.distributed.fsdp``).

Each model chunk is wrapped in megatron-core's ``FullyShardedDataParallel`` (the adapter around
``MegatronFSDP``) with the ``DistributedDataParallelConfig`` built from the flags, as Megatron-LM's
``get_model`` does. ``--data-parallel-sharding-strategy`` chooses what is sharded: ``optim``
(ZeRO-1) and ``optim_grads`` (ZeRO-2) keep a persistent model-weight buffer gathered once per
optimizer step; ``optim_grads_params`` (ZeRO-3) keeps only the shard, every transformer layer's
bucket gathered in its forward and again in its backward.

With ``--ciera-allgather`` :func:`install` makes every bucket's gather CIERA's (through
:mod:`megatron.ciera.binding.upstream_patch.megatron_fsdp`, the one dispatch point): a bucket whose model-weight
buffer persists (``optim``, ``optim_grads``; the root unit's bucket too) is a
:class:`ciera.CieraAllGather` over that buffer, gathered (and encoded) once per optimizer step; a
ZeRO-3 bucket (``optim_grads_params``), whose gathered storage is freed between gathers, is a
:class:`ciera.zero3.Zero3Gather`: right after each optimizer step (learned where the optimizer
writes the shards) every ZeRO-3 bucket's shard is encoded and ONE agreement per process group covers
them all (:class:`ciera.zero3.Zero3Units`); the step's gathers, forward and backward, then launch
with no host read and no other collective, the later ones replaying against the receiver cache
(``--ciera-cache``).

The functions after :func:`wrap` are this engine's CIERA binding, with the names and arguments of
:mod:`megatron.ciera.binding.bucket_group`'s; :class:`MegatronFsdpBinding` offers them to a training
loop as a :class:`megatron.ciera.binding.protocol.Binding`.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import sharded_binding as shared

__all__ = ["MegatronFsdpBinding", "wrap", "sync_params", "full_tensor", "install", "after_optimizer_step",
           "bucket_stats", "summary", "planned_units"]

_ATTR = "_ciera_megatron_fsdp_gathers"  # the _Gathers of a wrapped chunk


def wrap(chunks: list, *, config, ddp_config, cpu: bool = False) -> list:
    """Each model chunk in megatron-core's ``FullyShardedDataParallel`` with the flags' DDP config
    (``ddp_config``, its ``use_megatron_fsdp`` set, as Megatron-LM's ``validate_args`` does for the
    deprecated ``use_custom_fsdp``); with ``cpu`` the buffers live on the CPU."""
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    ddp_config.use_megatron_fsdp = ddp_config.use_custom_fsdp = True
    device = torch.device("cpu") if cpu else None
    return [FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=chunk, device=device,
                                     disable_bucketing=i > 0)
            for i, chunk in enumerate(chunks)]


def sync_params(model: list) -> None:
    """Finish every gather Megatron-FSDP started ahead (it prefetches the next forward's buckets
    after the optimizer step and waits for them only when it uses them) and make the chunks'
    parameters its sharded DTensors again (what it checkpoints; :func:`full_tensor` reads them)."""
    for chunk in model:
        fsdp = chunk.module
        fsdp.synchronize_param_gather()
        for name, param in fsdp.module.named_parameters():  # what upstream's raw parameters say of themselves
            raw = fsdp.raw_param.get(name)
            if raw is not None and param is not raw and hasattr(raw, "allreduce"):
                param.allreduce = raw.allreduce  # False: an expert parameter (expert-data-parallel replicas)


def full_tensor(param: torch.Tensor) -> torch.Tensor:
    """The whole value of a parameter Megatron-FSDP holds as a (possibly unevenly) sharded DTensor
    (a collective over its mesh); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    if not (isinstance(param, DTensor) and getattr(param, "__fsdp_param__", False)):
        return param
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import gather_uneven_dtensor_to_full_tensor

    return gather_uneven_dtensor_to_full_tensor(param).to_local()


_GATHER_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class _Gathers:
    """CIERA's gathers of one wrapped chunk, one per bucket, each built at the bucket's first gather
    (a collective: every rank gathers the buckets in the same order)."""

    def __init__(self, *, config, prefix: str, budget=None):
        self.config, self.prefix = config, prefix
        self.gathers: dict[int, object] = {}  # bucket id -> CieraAllGather | Zero3Gather
        from ciera.zero3 import Zero3Units

        self.units = Zero3Units(budget=budget)  # the ZeRO-3 buckets, prepared together after each step
        self.encodes: dict[int, int] = {}  # bucket id -> fresh (encoding) gathers of a persistent bucket
        self._measurements: dict = {}  # process group -> ciera.selection.Measurements

    def __call__(self, *, bucket_id: int, output: torch.Tensor, input: torch.Tensor, group, persistent: bool,
                 shard: Callable[[], torch.Tensor] | None = None):
        """Start the bucket's gather of ``input`` into ``output``; returns the handle to ``wait()``.
        ``shard()`` returns the bucket's current shard (what ``input`` will be at its next gather)."""
        import torch.distributed as dist
        from ciera import CieraAllGather
        from ciera.selection import Measurements
        from ciera.zero3 import Zero3Gather

        if output.dtype not in _GATHER_DTYPES or dist.get_world_size(group) == 1:  # fp8 storage, or alone
            return dist.all_gather_into_tensor(output, input, group=group, async_op=True)
        name = f"{self.prefix}bucket{bucket_id}"
        measurements = self._measurements.setdefault(group, Measurements())
        gather = self.gathers.get(bucket_id)
        if not persistent:
            if gather is None:
                source = None if shard is None else (lambda out: out.copy_(shard()))
                gather = self.gathers[bucket_id] = Zero3Gather(group=group, config=self.config, name=name,
                                                               measurements=measurements, source=source,
                                                               units=self.units)
            return gather.start(output=output, input=input, group=group)
        if gather is None:
            gather = self.gathers[bucket_id] = CieraAllGather(output, group=group, config=self.config, name=name,
                                                              measurements=measurements)
            self.encodes[bucket_id] = 0
        elif gather.buffer.data_ptr() != output.data_ptr() or gather.buffer.numel() != output.numel():
            raise RuntimeError(f"{name}: Megatron-FSDP moved a persistent model-weight buffer between gathers")
        own = output.view(gather.world, gather.shard_numel)[gather.rank]
        if own.data_ptr() != input.data_ptr():  # (upstream passes the buffer's own slot)
            own.copy_(input)
        self.encodes[bucket_id] += 1
        return gather.start()

    def step(self) -> None:
        """The optimizer wrote this rank's shards: every ZeRO-3 bucket is encoded now, one agreement
        per process group for all of them."""
        self.units.step()

    def invalidate(self) -> None:
        for gather in self.gathers.values():
            gather.invalidate()

    def raise_pending_errors(self, *, wait: bool = True) -> None:
        """See :meth:`ciera.CieraAllGather.raise_pending_errors`, for every bucket."""
        for gather in self.gathers.values():
            gather.raise_pending_errors(wait=wait)

    def fresh(self, bucket_id: int) -> int:
        """Gathers of the bucket that encoded (one per optimizer step)."""
        gather = self.gathers[bucket_id]
        return gather.fresh_gathers if hasattr(gather, "fresh_gathers") else self.encodes[bucket_id]

    @property
    def cache_bytes(self) -> int:
        return sum(g.cache_bytes for g in self.gathers.values() if hasattr(g, "cache_bytes"))


def _fsdp(chunk):
    """The ``MegatronFSDP`` inside a wrapped chunk."""
    return chunk.module


def planned_units(model, *, node_size: int = 0) -> tuple[list[tuple[int, int, torch.dtype, int]], int]:
    """Every ZeRO-3 bucket that gathers through CIERA, as ``(numel gathered, world, dtype, nodes)``
    in bucket order, and the bytes of the sharded model weights per rank: from the buffers before any
    gather. ``nodes``: see :func:`ciera.two_level.nodes_of`."""
    import torch.distributed as dist
    from ciera.two_level import nodes_of

    units, sharded = [], 0
    for chunk in model:
        for group in _fsdp(chunk).param_and_grad_buffer.parameter_groups:
            wbuf = group.model_weight_buffer
            if wbuf is None or not wbuf.is_data_distributed:
                continue
            shard = wbuf.get_shard_from_local_buffer()
            world = dist.get_world_size(wbuf.data_parallel_group)
            sharded += shard.numel() * shard.element_size()
            if shard.dtype in _GATHER_DTYPES:
                units.append((world * shard.numel(), world, shard.dtype,
                              nodes_of(wbuf.data_parallel_group, configured=node_size)))
    return units, sharded


def install(model: list, config, optimizer_config=None, log: Callable[[str], None] | None = None,
            optimizer=None) -> int:
    """CIERA's gather on every bucket of every wrapped chunk (before the first forward). Returns the
    number of buckets. ``optimizer_config`` and ``optimizer`` are unused (the shards' writes are
    learned from the model's own buffer)."""
    from .upstream_patch import megatron_fsdp as patch

    budget = shared.measure_budget(model, config)
    n = 0
    for i, chunk in enumerate(model):
        fsdp = _fsdp(chunk)
        if getattr(chunk, _ATTR, None) is not None:
            raise RuntimeError("CIERA already installed on this Megatron-FSDP model")
        gathers = _Gathers(config=config, prefix="" if len(model) == 1 else f"chunk{i}.", budget=budget)
        patch.attach(fsdp.all_gather_pipeline, gathers)
        patch.on_shard_written(fsdp.param_and_grad_buffer, gathers.step)
        setattr(chunk, _ATTR, gathers)
        n += fsdp.all_gather_pipeline.num_buckets
    units, sharded = planned_units(model, node_size=config.node_size)
    shared.log_planned_cache(log, config=config, units=units, sharded=sharded, budget=budget)
    plain = _plain_buckets(model)
    if plain and log is not None:
        log(f"CIERA: {plain} Megatron-FSDP bucket(s) hold parameters that are not bf16/fp16/fp32 (fp8 under "
            "--fp8-param-gather): they keep Megatron-FSDP's own all-gather, the others gather through CIERA")
    return n


def _plain_buckets(model) -> int:
    """Buckets whose gathered storage CIERA does not compress (fp8 parameters, stored as uint8)."""
    return sum(1 for chunk in model for group in _fsdp(chunk).param_and_grad_buffer.parameter_groups
               if group.model_weight_buffer is not None and group.model_weight_buffer.dtype not in _GATHER_DTYPES)


def _gathers(model) -> list:
    return shared.gathers_of(model, _ATTR)


def after_optimizer_step(model, *, overlap_param_gather: bool = False) -> None:
    """Nothing: the step's write of the shards marked them changed, and the step gathered."""




def bucket_stats(model) -> list[tuple[str, object]]:
    """``(bucket name, stats)`` of every bucket that gathered, in bucket order."""
    return [(f"{g.prefix}bucket{i}", g.gathers[i].stats) for g in _gathers(model) for i in sorted(g.gathers)]


def summary(model) -> str:
    """The closing summary: the buckets' counters as a table, the encodes per bucket (one per
    optimizer step) and the ZeRO-3 cache measured."""
    encodes = ", ".join(f"{g.prefix}bucket{i} {g.fresh(i)}" for g in _gathers(model) for i in sorted(g.gathers))
    units = [u for g in _gathers(model) for u in g.units.units]
    preparing = (f"\nCIERA ZeRO-3 agreements: {sum(g.units.agreements for g in _gathers(model))} after optimizer "
                 f"steps (one per process group and step), {sum(u.gather_prepares for u in units)} in gathers "
                 f"(a bucket's first, or the first after a load)") if units else ""
    return shared.summary(bucket_stats(model), encodes_title="CIERA Megatron-FSDP encodes per bucket",
                          encodes=encodes, measured_cache=shared.cache_bytes(model, _ATTR)) + preparing



class MegatronFsdpBinding(shared.ShardedBinding):
    """:class:`~megatron.ciera.binding.protocol.Binding` of megatron-core's Megatron-FSDP: this
    module's functions; ``raise_pending_errors``, ``invalidate_param_caches`` and ``cache_bytes``
    are the shared base's."""

    noun = "Megatron-FSDP bucket"
    attr = _ATTR

    def __init__(self, *, cpu: bool = False):
        self.cpu = cpu

    def wrap(self, chunks: list, *, config, ddp_config) -> list:
        """See :func:`wrap`. Megatron-FSDP shards the parameters itself: nothing is broadcast
        (equal seeds made them equal)."""
        return wrap(chunks, config=config, ddp_config=ddp_config, cpu=self.cpu)

    def install(self, model: list, *, config, optimizer_config=None, optimizer=None,
                log: Callable[[str], None] | None = None) -> int:
        """See :func:`install`."""
        return install(model, config, optimizer_config=optimizer_config, log=log, optimizer=optimizer)

    def after_optimizer_step(self, model: list, *, overlap_param_gather: bool = False) -> None:
        """See :func:`after_optimizer_step`."""
        after_optimizer_step(model, overlap_param_gather=overlap_param_gather)

    def sync_params(self, model: list, *, overlap_param_gather: bool = False) -> None:
        """See :func:`sync_params` (Megatron-FSDP's own prefetched gathers, whatever
        ``overlap_param_gather`` says)."""
        sync_params(model)

    def bucket_stats(self, model: list) -> list[tuple[str, object]]:
        """See :func:`bucket_stats`."""
        return bucket_stats(model)

    def summary(self, model: list) -> str:
        """See :func:`summary`."""
        return summary(model)

    def full_tensor(self, param: torch.Tensor) -> torch.Tensor:
        """See :func:`full_tensor`; a DTensor it does not hold as the protocol's default reads it."""
        return super().full_tensor(full_tensor(param))
