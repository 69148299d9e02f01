"""``--ckpt-format fsdp_dtensor``: Megatron-FSDP's checkpoints, as Megatron-LM writes and reads them.

One state dict written with ``torch.distributed.checkpoint`` (a ``.metadata`` file and one
``__<rank>_0.distcp`` per rank), its tensors Megatron-FSDP's sharded DTensors, under Megatron-LM's
keys: ``model`` (each chunk's ``state_dict``: the optimizer's main weights, sharded), ``optimizer``
(the distributed optimizer's ``fsdp_dtensor`` state: per parameter name its moments and step, and
its parameter group), ``opt_param_scheduler``, ``iteration``, ``checkpoint_version``, ``args``,
``num_floating_point_operations_so_far`` and ``rng_state`` (``{"(pp, tp)": [RNG states]}``; the
data-parallel ranks of one (pp, tp) are replicas). Before DCP sees it the state dict goes through
megatron-core's own rewriting (:func:`_for_dcp`): FP8 extra state dropped, SwiGLU ``linear_fc1``
split into ``_w`` / ``_v``, expert indices made global, uneven-shard metadata attached; so the
checkpoint's keys are the ones Megatron-LM writes.

Publication, verification and the start-up refusals are :mod:`megatron.ciera.app.checkpointing`'s
(the same as torch_dist's); this module only builds, writes and reads the state dict.
"""

from __future__ import annotations

import argparse
import os

import torch

from megatron.ciera.app.checkpoint_state import CHECKPOINT_VERSION, rng_state, saved_args, set_rng_state
from megatron.ciera.binding.checkpoint_fixes import fsdp_dtensor_every_param_state

__all__ = ["SHARDING_TYPE", "is_fsdp_dtensor_checkpoint", "save", "saved_keys", "saved_args_of", "load"]

SHARDING_TYPE = "fsdp_dtensor"
"""The distributed optimizer's ``distrib_optim_sharding_type`` for this format."""


def is_fsdp_dtensor_checkpoint(folder: str) -> bool:
    """Whether ``folder`` holds a torch.distributed.checkpoint written without megatron-core's
    dist_checkpointing (which adds ``metadata.json``): the fsdp_dtensor (or torch_dcp) layout."""
    return os.path.exists(os.path.join(folder, ".metadata")) and \
        not os.path.exists(os.path.join(folder, "metadata.json"))


def _metadata() -> dict:
    """The content metadata the distributed optimizer's ``sharded_state_dict`` is given."""
    from megatron.core import parallel_state as ps

    return {"distrib_optim_sharding_type": SHARDING_TYPE, "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True, "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}


def _rng_key() -> str:
    """Megatron-LM's key of this rank's RNG entry: its (pipeline, tensor) coordinates."""
    from megatron.core import parallel_state as ps

    return f"({ps.get_pipeline_model_parallel_rank()}, {ps.get_tensor_model_parallel_rank()})"


def _fsdp(chunk):
    """The ``MegatronFSDP`` inside a chunk wrapped by ``megatron_fsdp.wrap`` (what Megatron-LM's
    ``unwrap_model`` returns for it: the module whose ``state_dict`` is checkpointed)."""
    return chunk.module


def _model_entries(model) -> dict:
    """``model`` (or ``model0``, ``model1``, ...): each chunk's state dict of sharded DTensors."""
    from megatron.ciera.app.checkpoint_state import model_keys

    return {key: _fsdp(chunk).state_dict() for key, chunk in model_keys(model)}


def _state(args, *, model, optimizer, scheduler, with_optimizer: bool, with_rng: bool, is_loading: bool) -> dict:
    """The state dict to save, or (``is_loading``) the one to load into: the same keys, whose
    tensors are the live ones (a load writes them in place). Building the optimizer's part for a
    load runs one optimizer step on zero gradients (megatron-core's way to create the state the
    load overwrites): the main weights it moves are overwritten by the model's part."""
    state = _model_entries(model)
    if with_optimizer:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=_metadata())
        state["opt_param_scheduler"] = scheduler.state_dict()
    if with_rng:
        state["rng_state"] = {_rng_key(): [rng_state()]}
    return state


def _for_dcp(args, state: dict, *, model, optimizer) -> dict:
    """``state`` as Megatron-LM hands it to DCP (megatron-core's rewriting; see the module
    docstring), the optimizer's entries listing every parameter on every rank
    (:func:`~megatron.ciera.binding.checkpoint_fixes.fsdp_dtensor_every_param_state`: the rewriting's
    collectives pair up by entry). The tensors stay views of the live ones, so a load into the
    result fills them."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor)
    from megatron.core.transformer.fsdp_dtensor_checkpoint import (handle_experts_in_state_dict,
                                                                  handle_fp8_extra_state_case,
                                                                  handle_swiglu_in_state_dict)

    out = dict(state)
    fsdp = _fsdp(model[0])
    optimizers = None
    if "optimizer" in out:
        out["optimizer"] = fsdp_dtensor_every_param_state(optimizer, out["optimizer"])
        chained = "state" not in out["optimizer"]
        optimizers = list(out["optimizer"].values()) if chained else [out["optimizer"]]
        if args.swiglu:
            optimizers = [handle_swiglu_in_state_dict(fsdp, {}, part)[1] for part in optimizers]
            out["optimizer"] = dict(enumerate(optimizers)) if chained else optimizers[0]
    for key in [k for k in out if k.startswith("model")]:
        handle_fp8_extra_state_case(out[key])
        if args.swiglu:
            out[key] = handle_swiglu_in_state_dict(fsdp, out[key], None)[0]
        if args.num_experts:
            out[key] = handle_experts_in_state_dict(out[key], args.num_experts)
    preprocess_state_dict_for_uneven_dtensor(out)
    return out


def save(args: argparse.Namespace, *, folder: str, iteration: int, model, optimizer, scheduler,
         flops_so_far: float) -> None:
    """Collective: write checkpoint ``iteration`` into ``folder`` (the caller publishes it)."""
    import torch.distributed.checkpoint as dcp

    state = _state(args, model=model, optimizer=optimizer, scheduler=scheduler,
                   with_optimizer=not args.no_save_optim, with_rng=not args.no_save_rng, is_loading=False)
    state.update(iteration=iteration, checkpoint_version=CHECKPOINT_VERSION, args=saved_args(args, iteration),
                 num_floating_point_operations_so_far=flops_so_far)
    dcp.save(_for_dcp(args, state, model=model, optimizer=optimizer), storage_writer=dcp.FileSystemWriter(folder))


def saved_keys(folder: str) -> set[str]:
    """The top-level keys of the checkpoint in ``folder`` (from its ``.metadata``)."""
    import torch.distributed.checkpoint as dcp

    return {k.split(".", 1)[0] for k in dcp.FileSystemReader(folder).read_metadata().state_dict_metadata}


def saved_args_of(folder: str):
    """Collective: the ``args`` the checkpoint in ``folder`` was written with (``None`` if absent),
    read alone, before anything of this run is touched."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    if "args" not in saved_keys(folder):
        return None
    request = {"args": None}
    dcp.load(request, storage_reader=dcp.FileSystemReader(folder), planner=DefaultLoadPlanner(allow_partial_load=True))
    return request["args"]


@torch.no_grad()
def load(args: argparse.Namespace, *, folder: str, model, optimizer, scheduler,
         with_optimizer: bool, with_rng: bool) -> dict:
    """Collective: read the checkpoint in ``folder`` into the live model (and optimizer, scheduler,
    RNG); returns its non-tensor entries (``iteration``, ``args``, ...). Every key this run asks
    for must be in the checkpoint, unless ``--dist-ckpt-strictness`` ignores missing keys."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    state = _state(args, model=model, optimizer=optimizer, scheduler=scheduler, with_optimizer=with_optimizer,
                   with_rng=with_rng, is_loading=True)
    state.update(iteration=0, checkpoint_version=0.0, args=None, num_floating_point_operations_so_far=0.0)
    request = _for_dcp(args, state, model=model, optimizer=optimizer)
    partial = args.dist_ckpt_strictness in ("log_all", "ignore_all", "return_all", "log_unexpected")
    dcp.load(request, storage_reader=dcp.FileSystemReader(folder), planner=DefaultLoadPlanner(allow_partial_load=partial))
    from megatron.ciera.app.checkpoint_state import model_keys

    for key, chunk in model_keys(model):  # the values are in place; this installs them in the model weights
        chunk.load_state_dict(state[key], strict=True)  # (the wrapper's: it adds MegatronFSDP's key prefix)
    if with_optimizer:  # (without it nothing to reload: the model's entries are the main weights themselves)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(request["opt_param_scheduler"])
    if with_rng:
        set_rng_state(request["rng_state"][_rng_key()][0])
    return {k: request[k] for k in ("iteration", "checkpoint_version", "args", "num_floating_point_operations_so_far")}
