"""The testbed measurement and demo run end to end (slow: each launches pretrain_gpt on 2 hosts)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_bench_cluster_smoke(netns_ok, tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "tools/testbed/bench_cluster.py"), "--smoke",
                          "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    md = (tmp_path / "bench_cluster.md").read_text()
    assert "| 2x1 | 1gbit | overlap | auto |" in md and "| yes |" in md
    assert (tmp_path / "bench_cluster.png").stat().st_size > 0
    import json

    from tools.testbed.sim_testbed import MeasuredLink

    (cfg,) = json.loads((tmp_path / "results.json").read_text())["results"]
    link = MeasuredLink.from_probe(cfg["gloo_probe"], rate=cfg["rate"])  # the simulator's link, probed
    assert len(link.points) == 3 and all(t > 0 for _, t in link.points)


@pytest.mark.slow
def test_demo_cluster(netns_ok):
    res = subprocess.run([sys.executable, str(ROOT / "tools/testbed/demo_cluster.py"), "--iters", "4",
                          "--hidden", "32", "--experts", "2", "--moe-ffn", "64"], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0 and "bit-identical: yes" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


def test_bench_gather_pipelined_buckets_bit_exact(tmp_path):
    """bench_gather on 2 local gloo ranks (no testbed): 4 pipelined buckets per step, every mode
    bit-exact every step (asserted inside), bytes and auto's decision recorded."""
    import json
    import os

    out = tmp_path / "g.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", "29531", str(ROOT / "tools/testbed/bench_gather.py"),
                          "--numel", str(1 << 13), "--buckets", "4", "--warmup", "2", "--steps", "1",
                          "--out", str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    g = json.loads(out.read_text())
    assert g["buckets"] == 4 and g["bit_exact_steps"] == 3 and g["gloo_link"]["bandwidth_bytes_per_s"] > 0
    for name in ("exponent_reuse", "delta"):
        m = g["modes"][name]
        assert m["gathers"] == 4 * 1 and m["raw_gathers"] == 0 and 0 < m["wire_bytes"] < m["raw_bytes"]
    assert g["modes"]["auto"]["decision"]["reason"]  # auto's logged reason, kept for the report
