"""Process group, Megatron-Core's parallel layout and the start-up agreement of every rank.

    initialize(args)        # process group (timeout from --distributed-timeout-minutes), CPU shims,
                            # TP / PP (+ virtual) / CP / EP / ETP groups, seeds, argument agreement
"""

from __future__ import annotations

import datetime
import os
import random

import numpy as np
import torch
import torch.distributed as dist

from megatron.ciera.binding import cpu_compat

from .upstream_features import features

__all__ = ["initialize", "check_agreement", "differing_flags"]

# Per-rank values that legitimately differ between ranks.
_RANK_LOCAL = frozenset({"local_rank", "rank", "explicit"})


def _comparable(args) -> dict:
    return {k: repr(v) for k, v in sorted(vars(args).items()) if k not in _RANK_LOCAL}


def differing_flags(mine: dict, everyone: list[dict]) -> list[str]:
    """``'--flag: rank r has X, rank 0 has Y'`` for each value that differs from rank 0's."""
    out = []
    for rank, theirs in enumerate(everyone):
        for key in sorted(set(theirs) | set(everyone[0])):
            a, b = everyone[0].get(key), theirs.get(key)
            if a != b:
                out.append(f"--{key.replace('_', '-')}: rank {rank} has {b}, rank 0 has {a}")
    return out


def check_agreement(args) -> None:
    """Every rank parsed the same flags (compared after parsing, so ``--lr 1e-3`` == ``--lr 0.001``);
    otherwise every rank fails naming the flags that differ."""
    mine = _comparable(args)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    diff = differing_flags(mine, everyone)
    if diff:
        raise SystemExit("ranks were launched with different arguments:\n  " + "\n  ".join(diff[:20]))


def initialize(args) -> None:
    """Process group, CPU shims, argument agreement, Megatron parallel state, seeds."""
    if args.device == "cpu":
        cpu_compat.enable()
    else:
        if args.deterministic_mode:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before the first cuBLAS call
        # Modulo the device count: several gloo ranks may share one GPU (tools/gpu_check.sh pretrain_gloo).
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    if args.deterministic_mode:
        torch.use_deterministic_algorithms(True)
    timeout = datetime.timedelta(minutes=args.distributed_timeout_minutes)
    if not dist.is_initialized():
        dist.init_process_group(backend=args.distributed_backend, init_method="env://", timeout=timeout)
    if dist.get_world_size() != args.world_size:
        raise SystemExit(f"WORLD_SIZE {args.world_size} at parse time != process group size {dist.get_world_size()}")
    check_agreement(args)

    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        create_gloo_process_groups=getattr(args, features().gloo_groups_dest),
    )
    # Megatron-LM offsets the seed by the pipeline rank (and keeps TP/EP offsets inside the tracker).
    seed = args.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
