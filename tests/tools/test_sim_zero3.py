"""tools/sim/zero3.py: the ZeRO-3 timeline by hand on a tiny trace, and the CLI's --zero3 table."""

import pytest

from ciera.cost_model import LinkModel
from tools.sim import simulate
from tools.sim.trace import BucketTrace, CodecTrace, Trace
from tools.sim.zero3 import simulate_zero3_step

MS = 1e-3
LINK = LinkModel(bandwidth_bytes_per_s=1e9, latency_s=0.0)


def trace(codecs) -> Trace:
    """Units A (shard 2 MB at world 2: a raw gather takes 2 ms) and B (4 MB: 4 ms); forward 1 + 3 ms,
    backward 6 ms split 1.5 / 4.5 like the forward."""
    return Trace(name="tiny", iteration_compute_s=10 * MS, buckets=(
        BucketTrace("A", numel=2_000_000, dtype="bfloat16", kind="dense", compute_s=1 * MS, codecs=codecs),
        BucketTrace("B", numel=4_000_000, dtype="bfloat16", kind="expert", compute_s=3 * MS, codecs=codecs),
    ))


def test_raw_gathers_every_unit_in_forward_and_backward_by_hand():
    # gathers, one at a time, each dispatched before the previous one is waited on:
    # fwd A [0,2] -> B [2,6]; compute A [2,3], wait B, compute B [6,9];
    # bwd B dispatched at 2 after B fwd: comm free at 6 -> [6,10]; A bwd dispatched at 6: [10,12];
    # compute B bwd [10,14.5], A bwd [14.5,16]
    r = simulate_zero3_step(trace=trace({}), world=2, link=LINK, mode="raw")
    assert r.iteration_s == pytest.approx(16 * MS)
    assert r.comm_s == pytest.approx(12 * MS)
    two = simulate_zero3_step(trace=trace({}), world=2, link=LINK, mode="raw", micro_batches=2)
    assert two.comm_s == pytest.approx(24 * MS)  # 2 x micro-batches gathers of each unit


def test_values_cache_gathers_once_per_step_and_replays_for_free():
    c = {"delta": CodecTrace(wire_ratio=0.25, encode_bytes_per_s=1e12, decode_bytes_per_s=1e12)}
    r = simulate_zero3_step(trace=trace(c), world=2, link=LINK, mode="delta", cache="values")
    assert r.comm_s == pytest.approx(0.25 * 6 * MS, rel=1e-3)  # the two fresh gathers only
    e = {"exponent_reuse": CodecTrace(wire_ratio=0.5, encode_bytes_per_s=1e12, decode_bytes_per_s=1e12)}
    x = simulate_zero3_step(trace=trace(e), world=2, link=LINK, mode="exponent_reuse", cache="exponents")
    assert x.comm_s == pytest.approx(0.5 * 12 * MS, rel=0.02)  # the exponent cache resends (plus its bitmap)
    assert r.iteration_s < x.iteration_s < simulate_zero3_step(trace=trace(e), world=2, link=LINK).iteration_s


def test_delta_is_refused_with_the_exponent_cache():
    c = {"delta": CodecTrace(wire_ratio=0.25, encode_bytes_per_s=1e12, decode_bytes_per_s=1e12)}
    with pytest.raises(ValueError, match="not usable with cache='exponents'"):
        simulate_zero3_step(trace=trace(c), world=2, link=LINK, mode="delta", cache="exponents")


def test_cli_zero3_table(tmp_path, capsys):
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "tools" / "sim"
    out = tmp_path / "z3.md"
    assert simulate.main(["--zero3", "--trace", str(root / "traces" / "olmoe.json"), "--cluster",
                          str(root / "clusters" / "a100_paper.json"), "--gpus", "8", "16", "--out-md", str(out)]) == 0
    text = out.read_text()
    assert "ZeRO-3" in text and "| 16 |" in text and "values cache" in text
