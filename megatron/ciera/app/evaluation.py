"""Validation and test evaluation for ``pretrain_gpt.py``, as Megatron-LM's ``evaluate``.

Every ``--eval-interval`` iterations, ``--eval-iters`` global batches of the valid split run
through megatron-core's forward-backward schedule with ``forward_only=True`` (so the same code
serves pipeline parallelism), the model in eval mode and, under ``--overlap-param-gather``, the
forward pre-hooks off after a forced parameter sync (as upstream). At the end of training the
valid and the test split are evaluated once more. The loss is the token-weighted mean over all
micro batches and data-parallel ranks; the PPL is ``exp(min(20, loss))`` as in Megatron-LM.

Evaluation consumes no random numbers and touches no training state: a run with evaluation
trains bit for bit like one without.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["evaluate", "report", "eval_index"]


def eval_index(iteration: int, eval_interval: int) -> int:
    """Which slice of the valid split the evaluation at ``iteration`` reads (see :mod:`.data`)."""
    return max(iteration // eval_interval - 1, 0) if eval_interval else 0


@torch.no_grad()
def evaluate(*, forward_step_func, data_iterator, model, args) -> dict[str, torch.Tensor]:
    """Collective: ``{"lm loss": mean}`` over ``--eval-iters`` batches (a device scalar on every rank)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    forward_backward = get_forward_backward_func()
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]  # one per (virtual) stage
    hooks = bool(getattr(chunks[0], "use_forward_hook", False))
    for chunk in chunks:
        if hooks:
            chunk.disable_forward_pre_hook(param_sync=True)
        chunk.eval()
    if isinstance(data_iterator, (list, tuple)) and len(chunks) == 1:
        data_iterator = data_iterator[0]
    total = None
    try:
        for _ in range(args.eval_iters):
            reports = forward_backward(
                forward_step_func=forward_step_func, data_iterator=data_iterator, model=chunks,
                num_microbatches=args.num_microbatches, seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size, forward_only=True)
            if reports:  # the last pipeline stage
                step = torch.stack([r["lm loss"] for r in reports]).sum(dim=0)
                total = step if total is None else total + step
    finally:
        for chunk in chunks:
            chunk.train()
            if hooks:
                chunk.enable_forward_pre_hook()
    if total is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        total = torch.zeros(2, dtype=torch.float32, device=device)
    dist.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
    if ps.get_pipeline_model_parallel_world_size() > 1:  # every stage learns the last stage's loss
        dist.broadcast(total, src=ps.get_pipeline_model_parallel_last_rank(),
                       group=ps.get_pipeline_model_parallel_group())
    return {"lm loss": total[0] / total[1]}


def report(losses: dict[str, torch.Tensor], *, prefix: str, name: str, iteration: int, writer=None,
           log_ppl: bool = False) -> str:
    """Megatron-LM's evaluation block (``name``: ``validation`` or ``test``); writes
    ``<key> <name>`` and, with ``log_ppl``, ``<key> <name> ppl`` (no "vs samples" series: every
    series is indexed by iteration, so that a resume's ``purge_step`` drops exactly the repeats)."""
    line = f" {name} loss at {prefix} | "
    for key, value in losses.items():
        loss = float(value)
        ppl = math.exp(min(20.0, loss))
        line += f"{key} value: {loss:.6E} | {key} PPL: {ppl:.6E} | "
        if writer is not None:
            writer.add_scalar(f"{key} {name}", loss, iteration)
            if log_ppl:
                writer.add_scalar(f"{key} {name} ppl", ppl, iteration)
    bar = "-" * (len(line) + 1)
    return f"{bar}\n{line}\n{bar}"
