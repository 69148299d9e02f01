"""tools/gpu_check.sh and its Python parts without a GPU: the dry run lists every section's
commands; tools/gloo_one_gpu.py runs the same code on CPU tensors (short here, the GPU check runs
hundreds of steps on CUDA tensors)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

SECTIONS = ["env_info", "gloo_one_gpu", "pretrain_gloo", "kernels", "throughput", "nvcomp", "decode_many",
            "report", "megatron_gpu_paths"]


def test_dry_run_prints_every_sections_commands_and_exits_0(tmp_path):
    out = subprocess.run(["bash", str(ROOT / "tools/gpu_check.sh"), "--dry-run"], capture_output=True, text=True,
                         env=dict(os.environ, OUT=str(tmp_path)), timeout=60)
    assert out.returncode == 0, out.stderr
    assert re.findall(r"^== (\w+) \(limit \d+s\)$", out.stdout, re.M) == SECTIONS
    assert "tools/gloo_one_gpu.py --device cuda --world 2" in out.stdout
    assert "tools/gloo_one_gpu.py --device cuda --world 4" in out.stdout
    assert "--parts pretrain" in out.stdout
    assert not list(tmp_path.iterdir()), "a dry run writes nothing"
    limits = [int(n) for n in re.findall(r"\(limit (\d+)s\)", out.stdout)]
    assert sum(limits) <= 450  # the whole check stays under 8 minutes with start-up


def test_dry_run_of_one_section(tmp_path):
    out = subprocess.run(["bash", str(ROOT / "tools/gpu_check.sh"), "--dry-run", "gloo_one_gpu"], capture_output=True,
                         text=True, env=dict(os.environ, OUT=str(tmp_path)), timeout=60)
    assert out.returncode == 0 and re.findall(r"^== (\w+)", out.stdout, re.M) == ["gloo_one_gpu"]


@pytest.mark.distributed
def test_gloo_one_device_zero1_buckets_on_cpu(tmp_path):
    import gloo_one_gpu

    md = tmp_path / "gloo.md"
    rc = gloo_one_gpu.main(["--device", "cpu", "--world", "2", "--steps", "6", "--buckets", "3", "--parts", "zero1",
                            "--codecs", "exponent_reuse", "--out-md", str(md)])
    text = md.read_text()
    assert rc == 0, text
    rows = [line for line in text.splitlines() if line.startswith("| zero1")]
    assert len(rows) == 1 and "| yes |" in rows[0], text
    zero1 = rows[0].split("|")
    assert zero1[4].strip() == "18 (15)"  # 3 buckets x 6 steps, the first of each raw (warmup)
    assert zero1[7].strip() == "0", "CIERA's device bytes changed after the first compressed gather"


@pytest.mark.slow
@pytest.mark.distributed
def test_gloo_one_device_fsdp2_units_on_cpu(tmp_path):
    import gloo_one_gpu

    md = tmp_path / "fsdp2.md"
    rc = gloo_one_gpu.main(["--device", "cpu", "--world", "2", "--fsdp2-steps", "2", "--parts", "fsdp2",
                            "--codecs", "exponent_reuse", "delta_ans", "--out-md", str(md)])
    assert rc == 0 and md.read_text().count("| yes (losses") == 2, md.read_text()


@pytest.mark.slow
@pytest.mark.distributed
def test_gloo_pretrain_part_on_cpu(tmp_path):
    import gloo_one_gpu

    md = tmp_path / "pretrain.md"
    rc = gloo_one_gpu.main(["--device", "cpu", "--world", "2", "--parts", "pretrain", "--pretrain-iters", "3",
                            "--codecs", "exponent_reuse", "--out-md", str(md)])
    assert rc == 0, md.read_text()
