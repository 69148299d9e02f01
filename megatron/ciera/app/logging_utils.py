"""Logs of ``pretrain_gpt.py``: Megatron-LM's iteration line, CIERA's per-bucket tables
(``--ciera-log-buckets``) and selection line, and the metric sinks (TensorBoard, Weights & Biases,
the exact per-iteration loss log).

* :class:`IntervalLosses` keeps the losses of one log interval on the device (no host sync per
  iteration); the log line, TensorBoard and wandb all get the same interval mean.
* :class:`MetricWriter` writes each scalar to TensorBoard (``--tensorboard-dir``) and wandb
  (``--wandb-project``; ``WANDB_MODE=offline`` needs no network) on rank 0. After a resume,
  TensorBoard's ``purge_step`` drops the events of the iterations a previous run logged past the
  checkpoint, and :class:`LossLog` drops those lines, so no iteration appears twice.
"""

from __future__ import annotations

import datetime
import logging
import math
import os

import torch

from megatron.ciera.binding.report import MB, ratio as _ratio, totals


def iteration_line(*, iteration, train_iters, consumed_samples, elapsed_ms, lr, global_batch_size,
                   losses: dict, loss_scale, grad_norm, skipped, nan_iters, ciera_totals=None,
                   throughput=None, num_zeros=None, params_norm=None) -> str:
    """One line in Megatron-LM's ``training_log`` layout; with CIERA, ``ciera_totals`` = (raw, wire)
    bytes this rank received over the log interval is appended. ``throughput``: TFLOP/s per GPU
    (``--log-throughput``)."""
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    parts = [
        f" [{now}] iteration {iteration:8d}/{train_iters:8d}",
        f" consumed samples: {consumed_samples:12d}",
        f" elapsed time per iteration (ms): {elapsed_ms:.1f}",
    ]
    if throughput is not None:
        parts.append(f" throughput per GPU (TFLOP/s/GPU): {throughput:.1f}")
    parts += [
        f" learning rate: {lr:.6E}",
        f" global batch size: {global_batch_size:5d}",
    ]
    parts += [f" {name}: {value:.6E}" for name, value in losses.items()]
    parts.append(f" loss scale: {loss_scale:.1f}")
    if grad_norm is not None:
        parts.append(f" grad norm: {grad_norm:.3f}")
    if num_zeros is not None:
        parts.append(f" num zeros: {int(num_zeros)}")
    if params_norm is not None:
        parts.append(f" params norm: {params_norm:.3f}")
    parts.append(f" number of skipped iterations: {skipped:3d}")
    parts.append(f" number of nan iterations: {nan_iters:3d}")
    if ciera_totals is not None:
        raw, wire = ciera_totals
        parts.append(f" ciera raw/wire: {raw / MB:.2f} MB / {wire / MB:.2f} MB ({_ratio(raw, wire):.2f}x)")
    return " |".join(parts) + " |"


def since(stats, earlier) -> list:
    """Per-bucket counters accumulated since ``earlier`` (same layout; buckets new since then
    count from zero)."""
    before = dict(earlier)
    return [(name, s.minus(before[name]) if name in before else s) for name, s in stats]


class SelectionLog(logging.Handler):
    """Rank 0's view of ``ciera.selection``'s decisions (rank-identical, so one rank says them).

    With ``each`` (``--ciera-log-buckets``) every decision is printed as it happens, with its
    predicted times. Otherwise decisions are held and :meth:`interval_line` folds those of one
    log interval into a single line: the codecs chosen, how many buckets each, and why raw where
    compression was not faster."""

    def __init__(self, *, each: bool, out=print):
        super().__init__(level=logging.INFO)
        self.each, self._out = each, out
        self._pending: list[tuple[str, str]] = []  # (choice, reason) since the last interval line

    def emit(self, record: logging.LogRecord) -> None:
        if self.each:
            self._out(f"CIERA {record.getMessage()}")
            return
        a = record.args if isinstance(record.args, tuple) else ()
        self._pending.append((str(a[1]), str(a[2])) if len(a) == 3 else ("?", record.getMessage()))

    def interval_line(self) -> str | None:
        """One line for the decisions since the last call (None when there were none)."""
        if not self._pending:
            return None
        pending, self._pending = self._pending, []
        counts: dict[str, int] = {}
        for choice, _ in pending:
            counts[choice] = counts.get(choice, 0) + 1
        chosen = ", ".join(f"{c} on {n} bucket{'s' if n > 1 else ''}" for c, n in counts.items())
        why = ("raw: compressing is not faster on this link, --ciera-selection always compresses anyway; "
               if any(c == "raw" and "compressing is not faster" in r for c, r in pending) else "")
        return f"CIERA selection: {chosen} ({why}--ciera-log-buckets: each bucket's predicted times)"


def write_tensorboard(writer, stats, iteration: int) -> None:
    """Per-bucket and total CIERA figures of one log interval as TensorBoard scalars."""
    raw, wire = totals(stats)
    writer.add_scalar("ciera/raw_bytes", raw, iteration)
    writer.add_scalar("ciera/wire_bytes", wire, iteration)
    writer.add_scalar("ciera/ratio", _ratio(raw, wire), iteration)
    for name, s in stats:
        writer.add_scalar(f"ciera/{name}/ratio", s.ratio, iteration)
        writer.add_scalar(f"ciera/{name}/change_rate", s.change_rate, iteration)
        writer.add_scalar(f"ciera/{name}/encode_ms", s.encode_s * 1e3, iteration)
        writer.add_scalar(f"ciera/{name}/decode_ms", s.decode_s * 1e3, iteration)
        writer.add_scalar(f"ciera/{name}/overflows", s.overflows, iteration)
        writer.add_scalar(f"ciera/{name}/raw_gathers", s.raw_gathers, iteration)


# ---------------------------------------------------------------------------------------------
# interval losses, kept on the device

class IntervalLosses:
    """Per-iteration ``[loss sum, tokens]`` device tensors of one log interval (no host sync until
    :meth:`flush`, called at log lines)."""

    def __init__(self):
        self._steps: list[tuple[int, torch.Tensor]] = []

    def add(self, iteration: int, summed: torch.Tensor) -> None:
        """``summed``: ``[loss sum, token count]`` of one iteration, already reduced over DP."""
        self._steps.append((iteration, summed[0] / summed[1]))

    def __len__(self):
        return len(self._steps)

    def flush(self) -> list[tuple[int, float]]:
        """``[(iteration, loss)]`` of the interval (one device-to-host copy), and start a new one."""
        if not self._steps:
            return []
        values = torch.stack([loss for _, loss in self._steps]).float().cpu().tolist()
        out = [(it, v) for (it, _), v in zip(self._steps, values)]
        self._steps = []
        return out


def nonfinite(losses: list[tuple[int, float]]) -> list[int]:
    """Iterations whose loss is NaN or Inf."""
    return [it for it, v in losses if not math.isfinite(v)]


class LossLog:
    """``--ciera-loss-log``: rank 0 writes ``iteration loss.hex()`` per iteration (exact comparisons).
    On a resume from ``start_iteration`` the lines past it (written by the interrupted run after
    its last checkpoint) are dropped first, so every iteration appears once."""

    def __init__(self, path: str, *, start_iteration: int):
        kept = []
        if start_iteration and os.path.exists(path):
            with open(path) as f:
                kept = [line for line in f if line.strip() and int(line.split()[0]) <= start_iteration]
        self._file = open(path, "w")
        self._file.writelines(kept)
        self._file.flush()

    def write(self, losses: list[tuple[int, float]]) -> None:
        self._file.writelines(f"{it} {float(v).hex()}\n" for it, v in losses)
        self._file.flush()

    def close(self) -> None:
        self._file.close()


# ---------------------------------------------------------------------------------------------
# TensorBoard and Weights & Biases

def check_writer_packages(args) -> None:
    """On every rank before anything starts, so that a missing package fails everywhere."""
    if args.tensorboard_dir is not None:
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError:
            raise SystemExit("--tensorboard-dir needs the 'tensorboard' package (pip install tensorboard)") from None
    if args.wandb_project:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise SystemExit("--wandb-project needs the 'wandb' package (pip install wandb)") from None


class MetricWriter:
    """``add_scalar(tag, value, iteration)`` to TensorBoard and wandb (rank 0; other ranks and runs
    without either sink get a writer whose ``enabled`` is False and that drops everything)."""

    def __init__(self, args, *, start_iteration: int, rank: int):
        self._tb = self._wandb = None
        if rank != 0:
            return
        if args.tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=args.tensorboard_queue_size,
                                     purge_step=start_iteration + 1 if start_iteration else None)
        if args.wandb_project:
            import wandb

            save_dir = args.wandb_save_dir or os.path.join(args.save, "wandb")
            os.makedirs(save_dir, exist_ok=True)
            config = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, type(None)))}
            self._wandb = wandb.init(dir=save_dir, name=args.wandb_exp_name, project=args.wandb_project,
                                     entity=args.wandb_entity or None, config=config)

    @property
    def enabled(self) -> bool:
        return self._tb is not None or self._wandb is not None

    def add_scalar(self, tag: str, value, iteration: int) -> None:
        if self._tb is not None:
            self._tb.add_scalar(tag, value, iteration)
        if self._wandb is not None:
            self._wandb.log({tag: value}, step=iteration)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


# ---------------------------------------------------------------------------------------------
# throughput, parameter norm, memory

def flops_per_iteration(args) -> float:
    """Model FLOPs of one training iteration (forward + backward = 3 x forward), Megatron-LM's
    accounting: every matmul counts 2 FLOPs per multiply-add; attention adds the QK^T and the
    attention-times-V products over the full (unmasked) sequence; MoE layers count ``topk``
    routed experts plus the shared expert; the logits layer once per token."""
    h, s, layers = args.hidden_size, args.seq_length, args.num_layers
    heads = args.num_attention_heads
    kv = args.kv_channels or h // heads
    groups = (args.num_query_groups or heads) if args.group_query_attention else heads  # as Megatron-LM
    gated = 2 if args.swiglu else 1  # a gated MLP has two input projections
    attn = 2 * h * kv * (heads + 2 * groups) + 2 * kv * heads * h + 2 * 2 * s * kv * heads
    dense_mlp = 2 * (gated + 1) * h * args.ffn_hidden_size
    freq = args.moe_layer_freq
    if args.num_experts is None:
        moe_layers = 0
    elif isinstance(freq, list):
        moe_layers = sum(freq)
    else:
        moe_layers = sum(1 for i in range(layers) if i % freq == 0)
    moe_mlp = 0
    if args.num_experts is not None:
        ffn = args.moe_ffn_hidden_size or args.ffn_hidden_size
        shared = args.moe_shared_expert_intermediate_size or 0
        moe_mlp = 2 * (gated + 1) * h * (ffn * args.moe_router_topk + shared) + 2 * h * args.num_experts
    vocab = getattr(args, "padded_vocab_size", None) or args.vocab_size or 0
    per_token = layers * attn + (layers - moe_layers) * dense_mlp + moe_layers * moe_mlp + 2 * h * vocab
    return 3.0 * per_token * s * args.global_batch_size


def throughput_tflops(args, *, seconds_per_iteration: float, world_size: int) -> float:
    return flops_per_iteration(args) / (seconds_per_iteration * world_size * 1e12)


def params_norm(model, *, expert_group) -> float:
    """Collective: L2 norm of all parameters of the model (each expert counted once across EP;
    an FSDP2 parameter, a sharded DTensor, summed over its shards)."""
    dense = torch.zeros((), dtype=torch.float64)
    expert = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        sq = p.detach().double().pow(2).sum()
        sq = (sq.full_tensor() if hasattr(sq, "full_tensor") else sq).cpu()
        if getattr(p, "allreduce", True):
            dense += sq
        else:
            expert += sq
    if expert_group is not None and torch.distributed.get_world_size(group=expert_group) > 1:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        t = expert.to(device)
        torch.distributed.all_reduce(t, group=expert_group)
        expert = t.cpu()
    return float((dense + expert).sqrt())


def memory_scalars() -> dict[str, float]:
    """``--log-memory-to-tensorboard``: CUDA allocator figures (Megatron-LM's tags), or the
    process's peak resident memory on CPU."""
    if torch.cuda.is_available():
        stats = torch.cuda.memory_stats()
        return {"mem-reserved-bytes": stats.get("reserved_bytes.all.current", 0),
                "mem-allocated-bytes": stats.get("allocated_bytes.all.current", 0),
                "mem-max-allocated-bytes": stats.get("allocated_bytes.all.peak", 0),
                "mem-allocated-count": stats.get("allocation.all.current", 0)}
    import resource

    return {"mem-max-rss-bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
