"""The bindings' per-bucket report: CIERA's counters (:class:`ciera.stats.GatherStats` per bucket
or unit) as the table every engine's ``summary`` prints and ``--ciera-log-buckets`` prints per log
interval (:mod:`megatron.ciera.app.logging_utils`)."""

from __future__ import annotations

__all__ = ["MB", "ratio", "totals", "bucket_table"]

MB = 1 << 20


def ratio(raw: int, wire: int) -> float:
    """``raw / wire`` (1.0 for nothing sent)."""
    return raw / wire if wire else 1.0


def totals(stats) -> tuple[int, int]:
    """(raw bytes, wire bytes) summed over ``[(name, stats), ...]``."""
    return sum(s.raw_bytes for _, s in stats), sum(s.wire_bytes for _, s in stats)


def bucket_table(stats, title: str) -> str:
    """Compact per-bucket table of CIERA counters (bytes received by this rank). ``chg``: the
    fraction of the codec's variable section used (exponent_reuse: blocks whose exponent changed);
    ``enc``/``dec``: milliseconds encoding / decoding."""
    head = (f"{'bucket':<22} {'raw MB':>9} {'wire MB':>9} {'ratio':>6} {'chg':>6} {'enc ms':>8} {'dec ms':>8} "
            f"{'gathers':>7} {'raw':>5} {'ovfl':>5}  codec")
    lines = [f"{title}", head]
    for name, s in stats:
        lines.append(f"{name:<22} {s.raw_bytes / MB:9.3f} {s.wire_bytes / MB:9.3f} {ratio(s.raw_bytes, s.wire_bytes):5.2f}x "
                     f"{s.change_rate:6.3f} {s.encode_s * 1e3:8.1f} {s.decode_s * 1e3:8.1f} "
                     f"{s.gathers:7d} {s.raw_gathers:5d} {s.overflows:5d}  {s.codec}")
    raw, wire = totals(stats)
    lines.append(f"{'total':<22} {raw / MB:9.3f} {wire / MB:9.3f} {ratio(raw, wire):5.2f}x")
    return "\n".join(lines)
