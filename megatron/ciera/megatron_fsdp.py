"""``--use-megatron-fsdp``: Megatron-Core's own FSDP (``megatron.core.distributed.fsdp``).

Each model chunk is wrapped in megatron-core's ``FullyShardedDataParallel`` (the adapter around
``MegatronFSDP``) with the ``DistributedDataParallelConfig`` built from the flags, as Megatron-LM's
``get_model`` does. ``--data-parallel-sharding-strategy`` chooses what is sharded: ``optim``
(ZeRO-1) and ``optim_grads`` (ZeRO-2) keep a persistent model-weight buffer gathered once per
optimizer step; ``optim_grads_params`` (ZeRO-3) keeps only the shard, every transformer layer's
bucket gathered in its forward and again in its backward.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["check_args", "wrap"]


def _option(dest: str) -> str:
    from .arguments import _option as option

    return option(dest)


def check_args(args, err: Callable[[str], None]) -> None:
    """Megatron-LM's own checks of ``--use-megatron-fsdp`` (``megatron/training/arguments.py``:
    ``--ckpt-format fsdp_dtensor``, no ``--check-weight-hash-across-dp-replicas-interval`` under
    ``optim_grads_params``) and what this entry point does not do with it."""
    if args.ckpt_format != "fsdp_dtensor":
        err(f"--use-megatron-fsdp with --ckpt-format {args.ckpt_format}: Megatron FSDP only supports the "
            "fsdp_dtensor checkpoint format (as in Megatron-LM); pass --ckpt-format fsdp_dtensor")
    if args.data_parallel_sharding_strategy == "optim_grads_params" and \
            args.check_weight_hash_across_dp_replicas_interval is not None:
        err("--check-weight-hash-across-dp-replicas-interval is not supported with "
            "--data-parallel-sharding-strategy optim_grads_params (as in Megatron-LM)")
    if args.data_parallel_sharding_strategy == "no_shard":
        err("--use-megatron-fsdp with --data-parallel-sharding-strategy no_shard: megatron-core's distributed "
            "optimizer then gathers a bucket that has no model-weight buffer (AttributeError in "
            "AllGatherPipeline.async_bucket_gather); use optim, optim_grads or optim_grads_params")
    if not args.use_distributed_optimizer:
        err("--use-megatron-fsdp needs --use-distributed-optimizer (megatron-core's distributed optimizer is "
            "the one that steps Megatron-FSDP's shards)")
    if args.pipeline_model_parallel_size != 1:
        err("--use-megatron-fsdp with pipeline parallelism: not supported by this entry point")
    for dest in ("save", "load"):
        if getattr(args, dest):
            err(f"{_option(dest)} with --use-megatron-fsdp: fsdp_dtensor checkpoints are not written or read "
                "by this entry point yet")
    if args.ciera_allgather:
        err("--ciera-allgather with --use-megatron-fsdp: not bound yet (use --use-torch-fsdp2, or the distributed "
            "optimizer without FSDP)")
    if args.device == "cpu":  # the fusion off is what runs on CPU (upstream warns about it under FSDP)
        args.cpu_ignored = [o for o in args.cpu_ignored if o != "--no-gradient-accumulation-fusion"]


def wrap(chunks: list, *, config, args) -> list:
    """Each model chunk in megatron-core's ``FullyShardedDataParallel`` with the flags' DDP config
    (``use_megatron_fsdp`` set, as Megatron-LM's ``validate_args`` does for the deprecated
    ``use_custom_fsdp``); on CPU the buffers live on the CPU."""
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    from . import model as model_lib

    ddp_config = model_lib.ddp_config(args)
    ddp_config.use_megatron_fsdp = ddp_config.use_custom_fsdp = True
    device = torch.device("cpu") if args.device == "cpu" else None
    return [FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=chunk, device=device,
                                     disable_bucketing=i > 0)
            for i, chunk in enumerate(chunks)]


def full_tensor(param: torch.Tensor) -> torch.Tensor:
    """The whole value of a parameter Megatron-FSDP holds as a (possibly unevenly) sharded DTensor
    (a collective over its mesh); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    if not (isinstance(param, DTensor) and getattr(param, "__fsdp_param__", False)):
        return param
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import gather_uneven_dtensor_to_full_tensor

    return gather_uneven_dtensor_to_full_tensor(param).to_local()
