"""Megatron-LM's own checks of the two ZeRO-3 engines' flags (``--use-torch-fsdp2``,
``--use-megatron-fsdp``) and what this entry point does not do with them, called by
:func:`megatron.ciera.app.arguments.validate_args`. The engines themselves
(:mod:`megatron.ciera.binding.fsdp2`, :mod:`megatron.ciera.binding.megatron_fsdp`) take no
arguments namespace: the application builds their configs (:mod:`megatron.ciera.app.model`,
:func:`megatron.ciera.app.arguments.ciera_config_from_args`).

``ciera_config``: a call returning the run's :class:`ciera.CieraConfig` (it may raise ``ValueError``,
reported as the flags' error like :class:`ciera.zero3.Zero3Gather`'s own checks).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from .flag_table import option

__all__ = ["check_fsdp2_args", "check_megatron_fsdp_args"]

# Upstream flags megatron.ciera.app.model.ddp_config maps onto DistributedDataParallelConfig fields of
# another name (the fields themselves are read from the dataclass).
_DDP_RENAMED = ("accumulate_allreduce_grads_in_fp32", "grad_reduce_in_bf16", "ddp_bucket_size",
                "ddp_average_in_collective", "ddp_pad_buckets_for_high_nccl_busbw",
                "ddp_reduce_scatter_with_fp32_accumulation")
# DDP-config flags upstream's FSDP2 path still reads elsewhere (or checks itself, below).
_DDP_KEPT = ("use_distributed_optimizer", "fp8_param_gather", "delay_wgrad_compute")


def check_fsdp2_args(args, *, err: Callable[[str], None], ciera_config: Callable[[], object]) -> None:
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
    else:
        _fusion_off_applies_on_cpu(args)
    if args.ckpt_format != "torch_dist":
        err(f"--use-torch-fsdp2 with --ckpt-format {args.ckpt_format}: Megatron-LM takes torch_dist or torch_dcp; "
            "this entry point writes torch_dist")
    for dest in ("save", "load"):
        if getattr(args, dest):
            err(f"{option(dest)} with --use-torch-fsdp2: not supported yet (megatron-core's torch_dist state "
                "dicts do not fit FSDP2's DTensor parameters here: the optimizer's parameter map finds none of "
                "them, the MoE experts' shardings overlap, and the model's load_state_dict refuses them); to "
                "checkpoint a ZeRO-3 run use --use-megatron-fsdp --use-distributed-optimizer --ckpt-format "
                "fsdp_dtensor --data-parallel-sharding-strategy optim_grads_params")
    if not args.untie_embeddings_and_output_weights:  # upstream checks it from core 0.19 on; 0.16.1 fails later
        err("--use-torch-fsdp2 requires --untie-embeddings-and-output-weights (as Megatron-LM core 0.19 checks: "
            "tied, the output layer multiplies by the embedding unit's resharded DTensor weight)")
    ddp_only = {f.name for f in dataclasses.fields(DistributedDataParallelConfig)} | set(_DDP_RENAMED)
    for dest in sorted((ddp_only - set(_DDP_KEPT)) & set(args.explicit)):
        err(f"{option(dest)}: only Megatron's DDP wrapper reads it; --use-torch-fsdp2 reduce-scatters the "
            "gradients through FSDP2 (as in Megatron-LM, which ignores it there)")
    _check_ciera_config(args, err=err, ciera_config=ciera_config, engine="--use-torch-fsdp2")


def check_megatron_fsdp_args(args, *, err: Callable[[str], None], ciera_config: Callable[[], object]) -> None:
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
    if args.async_save and args.ckpt_format == "fsdp_dtensor":
        err("--async-save with --ckpt-format fsdp_dtensor: not implemented by this entry point (Megatron-LM 0.16 "
            "refuses it too; 0.19 writes it through torch DCP's asynchronous planner); save without --async-save")
    _check_ciera_config(args, err=err, ciera_config=ciera_config, engine="--use-megatron-fsdp")
    _fusion_off_applies_on_cpu(args)  # (upstream warns about the fusion under FSDP)


def _check_ciera_config(args, *, err: Callable[[str], None], ciera_config: Callable[[], object], engine: str) -> None:
    """With ``--ciera-allgather`` under a ZeRO-3 engine: :class:`ciera.zero3.Zero3Gather`'s own
    checks of the run's config (no collective), a refusal reported as the flags' error."""
    if not args.ciera_allgather:
        return
    from ciera.zero3 import Zero3Gather

    try:
        Zero3Gather(config=ciera_config())
    except ValueError as exc:
        err(f"--ciera-* flags with {engine}: {exc}")


def _fusion_off_applies_on_cpu(args) -> None:
    """On CPU, gradient-accumulation fusion off is what runs: ``--no-gradient-accumulation-fusion`` is
    not reported among the flags the CPU run leaves unapplied."""
    if args.device == "cpu":
        args.cpu_ignored = [o for o in args.cpu_ignored if o != "--no-gradient-accumulation-fusion"]
