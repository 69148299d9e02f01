"""Megatron-LM's legacy checkpoint format, ``--ckpt-format torch``: per-rank ``torch.save`` files.

Layout inside a checkpoint folder (the folder, its checksums, its atomic publication and the
tracker are :mod:`megatron.ciera.app.checkpointing`'s, as for ``torch_dist``)::

    mp_rank_<tp:02d>[_<pp:03d>][_<ep:03d>]/model_optim_rng.pt   model, optimizer common part, RNG, args
    mp_rank_<tp:02d>[_<pp:03d>][_<ep:03d>]/distrib_optim.pt     distributed optimizer state (DP rank 0)

The ``_<pp>`` part appears with pipeline parallelism, ``_<ep>`` with expert parallelism, as
upstream names them. ``model_optim_rng.pt`` is written by the ranks of expert-data-parallel rank 0
(one per model-parallel shard); ``distrib_optim.pt`` by megatron-core's
``save_parameter_state``, which gathers each optimizer's shards on its data-parallel rank 0. The
format holds local shards, so it loads only at the layout that wrote it (``torch_dist``
reshards); a different layout is refused by name before anything is read into the model.
"""

from __future__ import annotations

import argparse
import os

import torch

__all__ = ["MODEL_FILE", "OPTIM_FILE", "is_torch_checkpoint", "rank_dir", "save", "check_layout", "load", "optimizer_file"]

MODEL_FILE = "model_optim_rng.pt"
OPTIM_FILE = "distrib_optim.pt"
# The layout a torch checkpoint fixes: (flag, dest).
_LAYOUT = (("--tensor-model-parallel-size", "tensor_model_parallel_size"),
           ("--pipeline-model-parallel-size", "pipeline_model_parallel_size"),
           ("--expert-model-parallel-size", "expert_model_parallel_size"),
           ("--num-layers-per-virtual-pipeline-stage", "num_layers_per_virtual_pipeline_stage"))


def is_torch_checkpoint(folder: str) -> bool:
    """Whether ``folder`` holds a legacy (``--ckpt-format torch``) checkpoint."""
    try:
        return any(name.startswith("mp_rank_") and os.path.isfile(os.path.join(folder, name, MODEL_FILE))
                   for name in os.listdir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return False


def rank_dir(folder: str) -> str:
    """This rank's sub-folder, named as Megatron-LM's ``get_checkpoint_name`` names it."""
    from megatron.core import parallel_state as ps

    name = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
    if ps.get_pipeline_model_parallel_world_size() > 1:
        name += f"_{ps.get_pipeline_model_parallel_rank():03d}"
    if ps.get_expert_model_parallel_world_size() > 1:
        name += f"_{ps.get_expert_model_parallel_rank():03d}"
    return os.path.join(folder, name)


def _writes_model_file() -> bool:
    from megatron.core import parallel_state as ps

    return ps.get_expert_data_parallel_rank() == 0  # one writer per (tp, pp, ep) shard, as upstream


def save(folder: str, *, state: dict, model_chunks: list[tuple[str, object]], optimizer, with_optimizer: bool) -> None:
    """Collective: write this rank's files of a torch checkpoint into ``folder``.

    ``state`` holds the non-model entries (iteration, args, scheduler, RNG, ...); the models'
    ``state_dict_for_save_checkpoint`` and the optimizer's common part are added here."""
    out = dict(state)
    for key, chunk in model_chunks:
        out[key] = chunk.state_dict_for_save_checkpoint()
    if with_optimizer:
        out["optimizer"] = optimizer.state_dict()
    mine = rank_dir(folder)
    if _writes_model_file():
        os.makedirs(mine, exist_ok=True)
        torch.save(out, os.path.join(mine, MODEL_FILE))
    if with_optimizer:
        os.makedirs(mine, exist_ok=True)
        optimizer.save_parameter_state(os.path.join(mine, OPTIM_FILE))  # gathers on each DP group's rank 0


def check_layout(saved: argparse.Namespace, args: argparse.Namespace) -> None:
    """A torch checkpoint holds local shards: refuse another parallel layout, naming the flags."""
    diffs = [f"{flag}: checkpoint {getattr(saved, dest, None)!r}, this run {getattr(args, dest, None)!r}"
             for flag, dest in _LAYOUT if (getattr(saved, dest, None) or 1) != (getattr(args, dest, None) or 1)]
    if diffs:
        raise SystemExit("a --ckpt-format torch checkpoint loads only at the layout that wrote it (save with "
                         "--ckpt-format torch_dist to change layouts):\n  " + "\n  ".join(diffs))


def load(folder: str) -> dict:
    """This rank's ``model_optim_rng.pt`` of checkpoint ``folder`` (``weights_only=False``: it holds
    the ``args`` namespace, as Megatron-LM's)."""
    path = os.path.join(rank_dir(folder), MODEL_FILE)
    if not os.path.isfile(path):
        raise SystemExit(f"{path} is missing: the checkpoint was written at another layout or is incomplete")
    return torch.load(path, map_location="cpu", weights_only=False)


def optimizer_file(folder: str) -> str:
    """This rank's ``distrib_optim.pt`` of checkpoint ``folder``."""
    return os.path.join(rank_dir(folder), OPTIM_FILE)
