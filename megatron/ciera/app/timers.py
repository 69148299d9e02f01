"""Megatron's timers (``megatron.core.timers``) for ``pretrain_gpt.py``, with CIERA's codec times.

``--timing-log-level 1`` times the forward-backward, the optimizer and, inside megatron-core's
distributed optimizer, ``params-all-gather`` (the synchronous parameter all-gather after the
step; under ``--overlap-param-gather`` the gathers run in the next forward's pre-hooks, inside
``forward-compute``); level 2 adds the schedule's and the optimizer's sub-steps. With
``--ciera-allgather`` the block also shows ``ciera-encode`` and ``ciera-decode``: the milliseconds
per step CIERA spent in its codec, in the same (min, max) across ranks format. The block is
printed after each log line by rank 0; ``--log-timers-to-tensorboard`` writes the maxima.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["TIMER_NAMES", "build", "attach", "timers_block", "write_tensorboard", "ciera_codec_ms"]

TIMER_NAMES = (
    "forward-backward", "forward-compute", "backward-compute", "batch-generator", "forward-recv", "forward-send",
    "backward-recv", "backward-send", "forward-send-forward-recv", "forward-send-backward-recv",
    "backward-send-forward-recv", "backward-send-backward-recv", "forward-backward-send-forward-backward-recv",
    "layernorm-grads-all-reduce", "embedding-grads-all-reduce", "all-grads-sync", "params-all-gather",
    "optimizer-copy-to-main-grad", "optimizer-unscale-and-check-inf", "optimizer-clip-main-grad",
    "optimizer-count-zeros", "optimizer-inner-step", "optimizer-copy-main-to-model-params", "optimizer",
)
"""The timers Megatron-LM's training log reports, in its order."""


def build(args):
    """Megatron-Core ``Timers`` at ``--timing-log-level`` / ``--timing-log-option``."""
    from megatron.core.timers import Timers

    return Timers(args.timing_log_level, args.timing_log_option)


def attach(timers, *, model_config, optimizer_config, args) -> None:
    """Hand ``timers`` to the schedule (``model_config.timers``) and the optimizer
    (``optimizer_config.timers``, read at each step); also the optimizer's ``--log-num-zeros-in-grad``."""
    model_config.timers = timers  # the schedule times forward-backward and its parts itself
    model_config.barrier_with_L1_time = args.barrier_with_L1_time
    optimizer_config.timers = timers
    optimizer_config.barrier_with_L1_time = args.barrier_with_L1_time
    optimizer_config.log_num_zeros_in_grad = args.log_num_zeros_in_grad


def ciera_codec_ms(interval_stats, iterations: int) -> tuple[float, float]:
    """(encode, decode) milliseconds per step this rank spent in CIERA's codec over the interval."""
    enc = sum(s.encode_s for _, s in interval_stats)
    dec = sum(s.decode_s for _, s in interval_stats)
    return enc * 1e3 / max(iterations, 1), dec * 1e3 / max(iterations, 1)


def _min_max(values: list[float]) -> tuple[list[float], list[float]]:
    t = torch.tensor(values, dtype=torch.float64)
    lo, hi = t.clone(), t.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return lo.tolist(), hi.tolist()


def timers_block(timers, *, args, iterations: int, codec_ms: tuple[float, float] | None) -> str | None:
    """Collective: Megatron's timer block for the last ``iterations`` steps (per-step averages,
    timers reset), with the CIERA codec rows appended; ``None`` at ``--timing-log-level 0``."""
    if args.timing_log_level == 0:
        return None
    text = timers.get_all_timers_string(list(TIMER_NAMES), normalizer=iterations, reset=True,
                                        barrier=args.barrier_with_L1_time)
    if codec_ms is not None:
        lo, hi = _min_max(list(codec_ms))
        rows = [f"    {name} ".ljust(52, ".") + f": ({lo[i]:.2f}, {hi[i]:.2f})"
                for i, name in enumerate(("ciera-encode", "ciera-decode"))]
        text = (text or "(min, max) time across ranks (ms):") + "\n" + "\n".join(rows)
    return text


def write_tensorboard(timers, writer, *, args, iteration: int, iterations: int) -> None:
    """Collective: ``--log-timers-to-tensorboard`` (maximum across ranks, per step); resets nothing
    (call before :func:`timers_block`, which resets)."""
    if args.log_timers_to_tensorboard and args.timing_log_level > 0:
        timers.write(list(TIMER_NAMES), writer, iteration, normalizer=iterations, reset=False)
