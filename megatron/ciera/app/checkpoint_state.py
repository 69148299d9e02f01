"""Assembling the state dict of a checkpoint, as Megatron-LM keys it, and restoring the RNG from it.

Keys: ``model`` (or ``model0``, ``model1``, ... with virtual pipeline stages: each chunk's own
``sharded_state_dict``), ``optimizer`` (the distributed optimizer, ``fully_reshardable``: canonical
per-parameter state, so a checkpoint reshards to any DP / TP / PP / EP layout),
``opt_param_scheduler``, ``iteration``, ``checkpoint_version`` 3.0, ``args``, ``rng_state`` (a
ShardedObject over (pp, tp) with DP replicas) and ``num_floating_point_operations_so_far``.
"""

from __future__ import annotations

import argparse
import copy
import random

import numpy as np
import torch

from megatron.ciera.binding.checkpoint_fixes import bucket_padding_fix, sub_optimizers

__all__ = ["CHECKPOINT_VERSION", "CONTENT_METADATA", "unwrap", "rng_state", "set_rng_state", "sharded_rng_state",
           "parallel_layout", "materialise_optimizer_state", "model_keys", "sharded_state_dict", "saved_args",
           "common_entries"]

CHECKPOINT_VERSION = 3.0
# Optimizer layout: canonical per-parameter state (Megatron-LM's --dist-ckpt-optim-fully-reshardable),
# loadable at any DP / TP / PP / EP layout. Loading reads the layout from the checkpoint's content
# metadata, so Megatron-LM's default 'dp_reshardable' checkpoints load too (at a new DP size only).
CONTENT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable",
                    "singleton_local_shards": False, "chained_optim_avoid_prefix": True}


def unwrap(model):
    """The module inside ``model``'s wrappers (DDP, Float16Module)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def rng_state() -> dict:
    """This rank's RNG states, under Megatron-LM's keys."""
    from megatron.core import tensor_parallel

    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(),
             "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restores :func:`rng_state`'s ``state``."""
    from megatron.core import tensor_parallel

    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if "cuda_rng_state" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def sharded_rng_state():
    """Megatron-LM's layout: one object per (pp, tp) grid point, DP ranks are replicas."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject("rng_state", [rng_state()],
                         (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
                         (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
                         replica_id=ps.get_data_parallel_rank())


def parallel_layout(args) -> tuple[int, int]:
    """(pipeline, tensor) model-parallel sizes of ``args``: the grid the RNG state is saved over."""
    return (getattr(args, "pipeline_model_parallel_size", 1) or 1, getattr(args, "tensor_model_parallel_size", 1) or 1)


@torch.no_grad()
def materialise_optimizer_state(optimizer) -> None:
    """A fresh torch optimizer has no state yet (no ``step``, no moments), and megatron-core's
    distributed optimizer cannot describe (hence load) a state it does not have. One step on zero
    gradients creates it; the parameters are restored bit for bit (weight decay moved them) and
    the load overwrites the state itself."""
    for opt in sub_optimizers(optimizer):
        inner = opt.optimizer
        if inner.state:
            continue
        params = [p for g in inner.param_groups for p in g["params"] if p.numel()]
        saved = [p.detach().clone() for p in params]
        for p in params:
            p.grad = torch.zeros_like(p)
        inner.step()
        for p, s in zip(params, saved):
            p.copy_(s)
            p.grad = None


def model_keys(model) -> list[tuple[str, object]]:
    """(state dict key, chunk) as Megatron-LM names them: ``model``, or ``model0``, ``model1``, ...
    with virtual pipeline stages (``model`` may be one module or the list of chunks)."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if len(chunks) == 1:
        return [("model", chunks[0])]
    return [(f"model{i}", chunk) for i, chunk in enumerate(chunks)]


def sharded_state_dict(model, optimizer, *, metadata: dict, with_optimizer: bool, with_rng: bool,
                       is_loading: bool) -> dict:
    """The sharded state dict to save or to load into: the model chunks (:func:`model_keys`), the
    optimizer (``with_optimizer``; the bucket-padding workaround applied) and the RNG (``with_rng``)."""
    state = {key: unwrap(chunk).sharded_state_dict(metadata=metadata) for key, chunk in model_keys(model)}
    model_sd = state["model"] if "model" in state else dict(state)
    if with_optimizer and is_loading:
        materialise_optimizer_state(optimizer)
    if with_optimizer:
        with bucket_padding_fix(optimizer):
            state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
    if with_rng:
        state["rng_state"] = sharded_rng_state()
    return state


def saved_args(args, iteration: int) -> argparse.Namespace:
    """``args`` as a checkpoint of ``iteration`` stores them (Megatron-LM's consumed-samples fields)."""
    saved = copy.copy(args)
    vars(saved).pop("ckpt_loaded_folder", None)  # this run's, not the checkpoint's
    saved.iteration = iteration
    saved.consumed_train_samples = iteration * args.global_batch_size
    saved.consumed_valid_samples = 0
    return saved


def common_entries(args, *, iteration: int, scheduler, flops_so_far: float) -> dict:
    """The checkpoint entries besides model, optimizer and RNG, in both formats (Megatron-LM's keys)."""
    out = dict(iteration=iteration, checkpoint_version=CHECKPOINT_VERSION, args=saved_args(args, iteration),
               num_floating_point_operations_so_far=flops_so_far)
    if not args.no_save_optim:
        out["opt_param_scheduler"] = scheduler.state_dict()
    return out
