"""Real SLURM on the testbed: `TINY=1 NNODES=2 sbatch examples/<model>/<model>.sbatch` runs a 2-node
job (slurmctld on host 0, one slurmd per host, torchrun per node over the shaped link) whose params
sha256 equals the single-node run's. One model by default at its smallest (1 layer, 4 iterations,
32 tokens: CIERA still compresses from iteration 3), all six at the TINY defaults with --runslow.
The single-node twin runs while the 2-node job does (both mostly wait on start-up)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tools.testbed import netns
from tools.testbed.netns import LinkSpec, Testbed, TestbedConfig
from tools.testbed.slurm import SlurmCluster

ROOT = Path(__file__).resolve().parents[3]
SHA = re.compile(r"^params sha256: ([0-9a-f]{64})$", re.M)
MODELS = ["olmoe", "deepseek", "qwen2", "minicpm", "mixtral", "scout"]
SMALLEST = {"NUM_LAYERS": "1", "TRAIN_ITERS": "4", "SEQ_LENGTH": "32"}
"""The default run's knobs (examples/common.sh): CIERA_WARMUP_ITERS stays 2 under TINY, so the
gathers after iteration 2 are compressed and the sha256 covers them."""


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "CIERA_")) and k not in ("NNODES", "GPUS_PER_NODE", "TINY")}
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **extra)
    return env


def _start_single_node(model, knobs, tmp_path) -> subprocess.Popen:
    log = open(tmp_path / f"single-{model}.log", "w")
    return subprocess.Popen([str(ROOT / "examples" / model / f"train_{model}.sh")], cwd=ROOT,
                            env=_env(TINY="1", **knobs), stdout=log, stderr=subprocess.STDOUT, text=True)


def _single_node_sha(proc: subprocess.Popen, model, tmp_path, *, timeout=600):
    try:
        code = proc.wait(timeout=timeout)
    finally:
        proc.kill()
    out = (tmp_path / f"single-{model}.log").read_text(errors="replace")
    m = SHA.search(out)
    assert code == 0 and m, out[-6000:]
    return m.group(1)


def _two_node_jobs(models, tmp_path, knobs):
    """Submit every model's sbatch (one job at a time: both nodes are exclusive) and wait."""
    out = {}
    with Testbed(TestbedConfig(hosts=2, link=LinkSpec(rate="1gbit"))) as tb, SlurmCluster(tb) as slurm:
        for model in models:
            job = slurm.submit([str(ROOT / "examples" / model / f"{model}.sbatch")], cwd=str(tmp_path),
                               env=_env(TINY="1", NNODES="2", CIERA_ROOT=str(ROOT), **knobs))
            state, code = slurm.wait_job(job, timeout=600)
            log = (tmp_path / f"ciera-{model}-{job}.out").read_text(errors="replace")
            assert (state, code) == ("COMPLETED", "0:0"), f"{model}: job {job} {state} {code}\n{log[-4000:]}"
            # Two nodes, one rank each, over the testbed's link.
            info = slurm.run(["scontrol", "show", "job", "-o", str(job)], timeout=20).stdout
            assert "NumNodes=2" in info and f"NodeList={tb.name}h[0-1]" in info, info
            assert SHA.search(log), log[-3000:]
            out[model] = SHA.search(log).group(1)
    # Torn down: no daemon of this cluster left, its temp config gone, no namespace left.
    left = subprocess.run(["pgrep", "-f", str(slurm.dir)], capture_output=True, text=True).stdout.split()
    assert left == [] and not slurm.dir.exists(), left
    assert not [n for n in netns.list_namespaces() if n.startswith(tb.name)]
    return out


def _check(models, tmp_path, knobs=None):
    knobs = knobs or {}
    single = _start_single_node(models[0], knobs, tmp_path)  # in parallel with the 2-node jobs
    try:
        two = _two_node_jobs(models, tmp_path, knobs)
    except BaseException:
        single.kill()
        raise
    for i, model in enumerate(models):
        proc = single if i == 0 else _start_single_node(model, knobs, tmp_path)
        one = _single_node_sha(proc, model, tmp_path)
        assert two[model] == one, f"{model}: 2-node params sha256 differs from 1-node"
    if knobs:  # the knobs reached the runs: the log shows the last iteration and no later one
        last = f"iteration {int(knobs['TRAIN_ITERS']):8d}/{int(knobs['TRAIN_ITERS']):8d}"
        assert last in (tmp_path / f"single-{models[0]}.log").read_text(), "TRAIN_ITERS did not reach the run"


def test_sbatch_two_nodes_equals_single_node(slurm_ok, tmp_path):
    _check(["olmoe"], tmp_path, SMALLEST)


@pytest.mark.slow
def test_sbatch_two_nodes_every_model(slurm_ok, tmp_path):
    _check(MODELS, tmp_path)
