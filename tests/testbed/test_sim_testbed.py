"""tools/testbed/sim_testbed.py and bench_cluster's report on constructed measurements (no testbed)."""

import pytest

from tools.testbed.bench_cluster import report
from tools.testbed.sim_testbed import predict


def _cfg():
    mode = dict(ms=20.0, raw_bytes=8 << 20, wire_bytes=4 << 20, gathers=4, raw_gathers=0, overflows=0,
                encode_ms=5.0, decode_ms=5.0, codec="exponent_reuse")
    auto = dict(mode, ms=10.6, wire_bytes=8 << 20, raw_gathers=4, encode_ms=0.0, decode_ms=0.0, codec="raw")
    return {"layout": "2x1", "hosts": 2, "nproc": 1, "rate": "1gbit", "link_probe_bytes_per_s": 1e8,
            "link_latency_s": 0.0, "model": {"iters": 9},
            "gather": {"world": 2, "numel": 1 << 20, "plain_ms": 10.5, "bit_exact_steps": 8, "steps": 4,
                       "modes": {"exponent_reuse": mode, "auto": auto}},
            "train": [
                {"mode": "baseline", "overlap": False, "ms": 100.0, "sha256": "a" * 64, "losses": ["1", "0x1p0"],
                 "raw_mb": None, "wire_mb": None},
                # 10 gathers of a 2 MB bucket: 1 MB per rank per iteration, half of it on the wire
                {"mode": "exponent_reuse", "overlap": False, "ms": 105.0, "sha256": "a" * 64,
                 "losses": ["1", "0x1p0"], "raw_mb": 20.0, "wire_mb": 10.0},
                {"mode": "delta", "overlap": False, "ms": 99.0, "sha256": "b" * 64, "losses": ["1", "0x1p0"],
                 "raw_mb": 20.0, "wire_mb": 5.0},
            ]}


def test_gather_prediction_hand_computed():
    sim = predict(_cfg())
    shard = (1 << 20) // 2 * 2  # bf16 bytes per rank
    assert sim["gather"]["plain_ms"] == pytest.approx(shard / 1e8 * 1e3)
    # encode 5 ms + half the bytes on the link + the 16-byte size agreement + decode 5 ms (speeds
    # derived from those timers)
    assert sim["gather"]["exponent_reuse"] == pytest.approx(5 + shard / 2 / 1e8 * 1e3 + 16 / 1e8 * 1e3 + 5)
    assert sim["gather"]["auto"] == sim["gather"]["plain_ms"]  # auto sent raw throughout


def test_sync_training_prediction_hand_computed():
    sim = predict(_cfg())
    shard = 20e6 / 10 / 2
    raw_ms = shard / 1e8 * 1e3
    # the codec's speeds (bytes/s) from the gather bench, applied to the training bucket
    enc_ms = shard / ((1 << 20) / 5e-3) * 1e3
    dec_ms = shard / ((1 << 20) / 5e-3) * 1e3
    agree_ms = 16 / 1e8 * 1e3
    assert sim["train"]["exponent_reuse:sync"] == pytest.approx(100 - raw_ms + enc_ms + raw_ms / 2 + agree_ms + dec_ms)
    assert "delta:sync" not in sim["train"]  # no codec speeds measured for it


def test_report_flags_a_mismatch():
    cfg = _cfg()
    cfg["sim"] = predict(cfg)
    md = report([cfg], {"date": "d", "machine": "m", "command": "c"})
    rows = {line.split("|")[4].strip(): line for line in md.splitlines() if line.startswith("| 2x1 | 1gbit | sync")}
    assert rows["exponent_reuse"].rstrip().endswith("| yes | 104.5 |"), rows["exponent_reuse"]
    assert "| NO |" in rows["delta"]
    assert "0.95x" in rows["exponent_reuse"]


def test_baseline_predicted_from_another_rate_and_collated(tmp_path):
    """The baseline at a slow link = the baseline at a fast one + the change in the predicted
    all-gather and reduce-scatter (same bytes) on each configuration's fitted gloo link; collate
    joins a gather-only and a training-only run of one configuration into one report."""
    import json

    from tools.testbed.collate import main as collate
    from tools.testbed.sim_testbed import predict_baseline

    slow, fast = _cfg(), _cfg()
    slow["gather"]["gloo_link"] = {"bandwidth_bytes_per_s": 1e8, "latency_s": 0.0}
    fast["gather"]["gloo_link"] = {"bandwidth_bytes_per_s": 1e9, "latency_s": 0.0}
    fast["rate"] = "10gbit"
    shard = 20e6 / 10 / 2
    want = 100 + 2 * (shard / 1e8 - shard / 1e9) * 1e3
    assert predict_baseline(slow, fast, overlap=False) == pytest.approx(want)
    assert predict_baseline(slow, fast, overlap=True) is None  # no overlapped baseline measured

    files = []
    for i, (cfg, part) in enumerate([(slow, "gather"), (slow, "train"), (fast, "train"), (fast, "gather")]):
        r = {k: v for k, v in cfg.items() if k not in ("gather", "train")}
        r.update({"gathers": [cfg["gather"]], "train": []} if part == "gather" else {"train": cfg["train"]})
        f = tmp_path / f"{i}.json"
        f.write_text(json.dumps({"meta": {"date": "d", "machine": "m", "command": f"c{i}"}, "results": [r]}))
        files.append(f)
    assert collate([*map(str, files), "--out-dir", str(tmp_path / "out")]) == 1  # delta's sha256 differs: NO
    md = (tmp_path / "out" / "bench_cluster.md").read_text()
    assert f"| train sync baseline (from the baseline at 10gbit) | 100.0 | {want:.1f} |" in md
    assert (tmp_path / "out" / "bench_cluster.png").stat().st_size > 0


def test_ranks_sharing_cores_use_single_core_speeds_times_the_share():
    """2 hosts x 2 ranks on a 2-core machine: the codec phases and the agreement's steps take
    ranks/cores = 2x, from the single-core speeds of a configuration whose ranks had a core each;
    the sync params-all-gather prediction is one iteration's buckets, each its own gather."""
    from ciera.cost_model import CodecSpeed
    from tools.testbed.sim_testbed import single_core_speeds

    one = _cfg() | {"cores": 2}
    four = _cfg() | {"cores": 2, "nproc": 2, "layout": "2x2"}
    four["gather"] = dict(four["gather"], world=4)
    four["train"] = [dict(t, log_lines=["CIERA all-gather on 2 bucket group(s): ..."]) for t in four["train"]]
    single = single_core_speeds([one, four])["1gbit"]
    assert set(single) == {"exponent_reuse"}  # from the 2x1 configuration only (auto sent raw)
    sim = predict(four, single_core=single)
    shard = (1 << 20) // 4 * 2
    sp: CodecSpeed = single["exponent_reuse"]
    codec_ms = 2 * (shard / sp.encode_bytes_per_s + 3 * shard / sp.decode_bytes_per_s) * 1e3
    link_ms = 3 * shard / 2 / 1e8 * 1e3  # flat ring of 4, half the bytes (TCP-probe link, no latency)
    agree_ms = 2 * 3 * 16 / 1e8 * 1e3
    assert sim["gather"]["exponent_reuse"] == pytest.approx(codec_ms + link_ms + agree_ms)
    assert predict(four)["gather"]["exponent_reuse"] != pytest.approx(sim["gather"]["exponent_reuse"])
    it = 20e6 / 10 / 4  # bytes per rank per iteration, in 2 buckets
    assert sim["train_gather"]["baseline:sync"] == pytest.approx(2 * 3 * it / 2 / 1e8 * 1e3)
