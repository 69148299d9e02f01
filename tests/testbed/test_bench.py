"""The testbed measurement and demo run end to end (slow: each launches pretrain_gpt on 2 hosts)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_cluster_smoke(netns_ok, tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "tools/testbed/bench_cluster.py"), "--smoke",
                          "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    md = (tmp_path / "bench_cluster.md").read_text()
    assert "| 2x1 | 1gbit | overlap | auto |" in md and "| yes |" in md
    assert (tmp_path / "bench_cluster.png").stat().st_size > 0


@pytest.mark.slow
def test_demo_cluster(netns_ok):
    res = subprocess.run([sys.executable, str(ROOT / "tools/testbed/demo_cluster.py"), "--iters", "4",
                          "--hidden", "32", "--experts", "2"], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0 and "bit-identical: yes" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]
