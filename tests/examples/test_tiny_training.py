"""TINY=1 launches train on 2 CPU ranks, and the CIERA all-gather is lossless end to end: the
baseline (CIERA=0) and the CIERA run (CIERA=1) print the same loss at every iteration and the same
``params sha256`` at the end. One model runs by default; the other five are ``slow``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
SHA = re.compile(r"^params sha256: ([0-9a-f]{64})$", re.M)

# Mixtral's tiny twin (8 experts top-2, GQA) is the quickest; the rest run with --runslow.
DEFAULT_MODEL = "mixtral"
SLOW_MODELS = ("olmoe", "deepseek", "qwen2", "minicpm", "scout")

pytestmark = pytest.mark.skipif(
    not (ROOT / "pretrain_gpt.py").exists(), reason="pretrain_gpt.py has not landed yet"
)


def train_tiny(model: str, ciera: str, tmp_path: Path, **env: str) -> tuple[str, dict[int, float], str]:
    """Run examples/<model>/train_<model>.sh with TINY=1; returns (sha256, losses, output)."""
    loss_log = tmp_path / f"losses_{model}_{ciera}.txt"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CIERA_"))}
    for var in ("DATA_PATH", "TOKENIZER", "CHECKPOINT_DIR", "FULL_DEPTH", "DRY_RUN", "NNODES",
                "GPUS_PER_NODE", "EP", "TP", "PP", "MICRO_BATCH", "GLOBAL_BATCH", "TRAIN_ITERS",
                "NUM_LAYERS", "SEQ_LENGTH", "TORCHRUN"):
        full_env.pop(var, None)
    # CIERA_SELECTION=always: on CPU the cost model would send every bucket raw.
    full_env.update(TINY="1", CIERA=ciera, CIERA_SELECTION="always", PYTHON=sys.executable, OMP_NUM_THREADS="1",
                    PYTHONWARNINGS="ignore", **env)
    proc = subprocess.run(
        ["bash", str(EXAMPLES / model / f"train_{model}.sh"), "--ciera-loss-log", str(loss_log)],
        cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=900,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    shas = SHA.findall(proc.stdout)
    assert len(shas) == 1, output[-6000:]
    losses = {}
    for line in loss_log.read_text().splitlines():
        iteration, value = line.split()
        losses[int(iteration)] = float.fromhex(value)
    return shas[0], losses, output


def ciera_lines_per_interval(output: str) -> list[int]:
    """Lines starting with 'CIERA' after each iteration line, up to the closing summary."""
    counts: list[int] = []
    for line in output.splitlines():
        if line.startswith("CIERA summary"):
            break
        if "] iteration " in line and "consumed samples" in line:
            counts.append(0)
        elif line.startswith("CIERA") and counts:
            counts[-1] += 1
    return counts


def check_lossless(model: str, tmp_path: Path) -> None:
    base_sha, base_losses, base_out = train_tiny(model, "0", tmp_path)
    ciera_sha, ciera_losses, ciera_out = train_tiny(model, "1", tmp_path)
    # Not a vacuous comparison: CIERA really gathered compressed buckets, the baseline did not.
    assert "CIERA summary" in ciera_out and "CIERA summary" not in base_out
    # Quiet by default: no per-bucket tables, at most one CIERA line per log interval (the selection's).
    counts = ciera_lines_per_interval(ciera_out)
    assert len(counts) == 10 and max(counts) <= 1 and "CIERA selection:" in ciera_out, ciera_out[-4000:]
    assert "CIERA buckets" not in ciera_out
    assert sorted(base_losses) == list(range(1, 11))
    assert ciera_losses == base_losses
    assert ciera_sha == base_sha


def test_tiny_default_model_is_lossless(tmp_path):
    check_lossless(DEFAULT_MODEL, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("model", SLOW_MODELS)
def test_tiny_model_is_lossless(model, tmp_path):
    check_lossless(model, tmp_path)


@pytest.mark.slow
def test_tiny_trains_on_preprocessed_byte_data(tmp_path):
    """tools/preprocess_data.py output feeds the launch scripts (DATA_PATH + TOKENIZER=byte)."""
    corpus = tmp_path / "sample.csv"
    tool = ROOT / "tools" / "preprocess_data.py"
    subprocess.run([sys.executable, str(tool), "--make-sample", str(corpus), "--sample-docs", "300"],
                   check=True, capture_output=True, timeout=120)
    subprocess.run([sys.executable, str(tool), "--input", str(corpus), "--csv-column", "1,2",
                    "--output-prefix", str(tmp_path / "sample")], check=True, capture_output=True, timeout=300)
    sha, losses, output = train_tiny("deepseek", "1", tmp_path, DATA_PATH=str(tmp_path / "sample_text_document"),
                                     TOKENIZER="byte")
    assert len(losses) == 10 and all(loss == loss for loss in losses.values())


@pytest.mark.slow
def test_two_node_launch_on_localhost_matches_one_node(tmp_path):
    """The multi-node path (static rendezvous, NODE_RANK) as srun would run it, with two 'nodes'
    of one rank each on this machine: the same run as one node with two ranks."""
    from ciera.testing import free_port

    port = str(free_port())
    one_node_sha, _, _ = train_tiny("olmoe", "1", tmp_path)
    env = dict(os.environ, TINY="1", CIERA="1", NNODES="2", GPUS_PER_NODE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=port, PYTHON=sys.executable, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for var in ("DATA_PATH", "TOKENIZER", "CHECKPOINT_DIR", "FULL_DEPTH", "DRY_RUN", "EP", "TORCHRUN"):
        env.pop(var, None)
    script = str(EXAMPLES / "olmoe" / "train_olmoe.sh")
    nodes = [subprocess.Popen(["bash", script], env=dict(env, NODE_RANK=str(rank)), cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = [node.communicate(timeout=900)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-4000:] + outputs[1][-4000:]
    assert SHA.findall(outputs[0]) == [one_node_sha]
