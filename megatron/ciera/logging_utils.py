"""Log lines of ``pretrain_gpt.py``: Megatron-LM's iteration line and CIERA's per-bucket tables."""

from __future__ import annotations

import datetime

MB = 1 << 20


def _ratio(raw: int, wire: int) -> float:
    return raw / wire if wire else 1.0


def iteration_line(*, iteration, train_iters, consumed_samples, elapsed_ms, lr, global_batch_size,
                   losses: dict, loss_scale, grad_norm, skipped, nan_iters, ciera_totals=None) -> str:
    """One line in Megatron-LM's ``training_log`` layout; with CIERA, ``ciera_totals`` = (raw, wire)
    bytes this rank received over the log interval is appended."""
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    parts = [
        f" [{now}] iteration {iteration:8d}/{train_iters:8d}",
        f" consumed samples: {consumed_samples:12d}",
        f" elapsed time per iteration (ms): {elapsed_ms:.1f}",
        f" learning rate: {lr:.6E}",
        f" global batch size: {global_batch_size:5d}",
    ]
    parts += [f" {name}: {value:.6E}" for name, value in losses.items()]
    parts.append(f" loss scale: {loss_scale:.1f}")
    if grad_norm is not None:
        parts.append(f" grad norm: {grad_norm:.3f}")
    parts.append(f" number of skipped iterations: {skipped:3d}")
    parts.append(f" number of nan iterations: {nan_iters:3d}")
    if ciera_totals is not None:
        raw, wire = ciera_totals
        parts.append(f" ciera raw/wire: {raw / MB:.2f} MB / {wire / MB:.2f} MB ({_ratio(raw, wire):.2f}x)")
    return " |".join(parts) + " |"


def totals(stats) -> tuple[int, int]:
    """(raw bytes, wire bytes) summed over ``[(name, stats), ...]``."""
    return sum(s.raw_bytes for _, s in stats), sum(s.wire_bytes for _, s in stats)


def since(stats, earlier) -> list:
    """Per-bucket counters accumulated since ``earlier`` (same layout; buckets new since then
    count from zero)."""
    before = dict(earlier)
    return [(name, s.minus(before[name]) if name in before else s) for name, s in stats]


def bucket_table(stats, title: str) -> str:
    """Compact per-bucket table of CIERA counters (bytes received by this rank). ``chg``: the
    fraction of the codec's variable section used (exponent_reuse: blocks whose exponent changed);
    ``enc``/``dec``: milliseconds encoding / decoding."""
    head = (f"{'bucket':<22} {'raw MB':>9} {'wire MB':>9} {'ratio':>6} {'chg':>6} {'enc ms':>8} {'dec ms':>8} "
            f"{'gathers':>7} {'raw':>5} {'ovfl':>5}  codec")
    lines = [f"{title}", head]
    for name, s in stats:
        lines.append(f"{name:<22} {s.raw_bytes / MB:9.3f} {s.wire_bytes / MB:9.3f} {_ratio(s.raw_bytes, s.wire_bytes):5.2f}x "
                     f"{s.change_rate:6.3f} {s.encode_s * 1e3:8.1f} {s.decode_s * 1e3:8.1f} "
                     f"{s.gathers:7d} {s.raw_gathers:5d} {s.overflows:5d}  {s.codec}")
    raw, wire = totals(stats)
    lines.append(f"{'total':<22} {raw / MB:9.3f} {wire / MB:9.3f} {_ratio(raw, wire):5.2f}x")
    return "\n".join(lines)


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
