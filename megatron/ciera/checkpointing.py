"""Per-rank checkpoints: exact resume for ``pretrain_gpt.py``.

Every rank writes ``<dir>/iter_XXXXXXX/rank_XXXXX.pt`` holding its full (gathered) model parameters,
its shard of the distributed optimizer (fp32 main parameters and Adam moments), the LR scheduler,
the iteration, and the RNG states; rank 0 then writes ``<dir>/latest_checkpointed_iteration.txt``.
Resume needs the same world size and parallel layout (the optimizer shards are per rank); the
loader checks both. This is deliberately the simplest correct format, not Megatron's
distributed-checkpoint format.

Loading writes the parameter buffers outside the all-gather, so the caller must invalidate CIERA's
caches afterwards (``bucket_group.invalidate_param_caches``); :func:`load` returns the iteration.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch
import torch.distributed as dist

TRACKER = "latest_checkpointed_iteration.txt"


def _dist_optimizers(optimizer):
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _rank_file(root: str, iteration: int, rank: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}", f"rank_{rank:05d}.pt")


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def save(root: str, iteration: int, model, optimizer, scheduler, layout: dict) -> None:
    """Collective: every rank writes its file; returns after rank 0 updated the tracker.

    The model's parameter buffers must hold the gathered parameters (the caller forces a sync
    gather first under ``--overlap-param-gather``)."""
    rank = dist.get_rank()
    path = _rank_file(root, iteration, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    optim = []
    for opt in _dist_optimizers(optimizer):
        optim.append({
            "inner": opt.optimizer.state_dict(),
            "main": [[p.detach().clone() for p in g] for g in getattr(opt, "shard_fp32_from_float16_groups", [])],
            "fp32": [[p.detach().clone() for p in g] for g in getattr(opt, "shard_fp32_groups", [])],
            "grad_scaler": opt.grad_scaler.state_dict() if getattr(opt, "grad_scaler", None) else None,
        })
    state = {
        "iteration": iteration,
        "layout": layout,
        "model": {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)},
        "optimizer": optim,
        "scheduler": scheduler.state_dict(),
        "rng": _rng_state(),
    }
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)
    dist.barrier()
    if rank == 0:
        with open(os.path.join(root, TRACKER), "w") as f:
            f.write(f"{iteration}\n")
    dist.barrier()


def latest_iteration(root: str) -> int | None:
    try:
        with open(os.path.join(root, TRACKER)) as f:
            return int(f.read().strip())
    except FileNotFoundError:
        return None


@torch.no_grad()
def load(root: str, model, optimizer, scheduler, layout: dict, iteration: int | None = None) -> int:
    """Restore checkpoint ``iteration`` (default: the latest) under ``root``; returns its
    iteration (0 when there is none)."""
    iteration = latest_iteration(root) if iteration is None else iteration
    if iteration is None:
        return 0
    state = torch.load(_rank_file(root, iteration, dist.get_rank()), map_location="cpu", weights_only=False)
    if state["layout"] != layout:
        raise SystemExit(f"checkpoint {root} iteration {iteration} was written with layout {state['layout']}, "
                         f"this run has {layout}: resume needs the same world size and parallel sizes")
    expected = {k for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    if expected != set(state["model"]):
        raise SystemExit(f"checkpoint model state does not match: missing {sorted(expected - set(state['model']))}, "
                         f"unexpected {sorted(set(state['model']) - expected)}")
    model.load_state_dict(state["model"], strict=False)
    for opt, saved in zip(_dist_optimizers(optimizer), state["optimizer"], strict=True):
        for groups, saved_groups in ((getattr(opt, "shard_fp32_from_float16_groups", []), saved["main"]),
                                     (getattr(opt, "shard_fp32_groups", []), saved["fp32"])):
            for g, sg in zip(groups, saved_groups, strict=True):
                for p, sp in zip(g, sg, strict=True):
                    p.copy_(sp)
        opt.optimizer.load_state_dict(saved["inner"])
        if saved["grad_scaler"] is not None:
            opt.grad_scaler.load_state_dict(saved["grad_scaler"])
    scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(state["rng"])
    return iteration
