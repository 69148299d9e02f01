"""examples/fsdp2/train_fsdp2.py, the plain-PyTorch FSDP2 example, as a user launches it: torchrun
on 2 CPU ranks, FSDP2's own gather and CIERA's print the same losses and params sha256."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHA = re.compile(r"^params sha256: ([0-9a-f]{64})$", re.M)
GATHERS = re.compile(r"ciera gathers: (\d+) \((\d+) compressed, (\d+) replayed\)")
TIMEOUT_S = 300  # one run takes ~16 s on 2 idle vCPUs

pytestmark = pytest.mark.distributed


def _train(log: Path, *extra: str) -> tuple[str, str, str]:
    """(params sha256, loss log, stdout) of one launch. No --master-port: torchrun on one node binds
    its rendezvous store to a port the kernel picks (c10d on localhost:0), so no other process can
    take the port between choosing and binding it. Past the timeout the whole launch (torchrun and
    its ranks, one session) is killed and its output shown, rather than waited for."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           str(ROOT / "examples" / "fsdp2" / "train_fsdp2.py"), "--steps", "4", "--loss-log", str(log), *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the launch did not end within {TIMEOUT_S} s:\n{stdout[-3000:]}{stderr[-3000:]}")
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    sha = SHA.search(stdout)
    assert sha, stdout[-2000:]
    return sha.group(1), log.read_text(), stdout


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory) -> tuple[str, str]:
    """FSDP2's own gather, once for every variant: (params sha256, loss log)."""
    sha, losses, _ = _train(tmp_path_factory.mktemp("fsdp2") / "losses.txt")
    return sha, losses


# The example's default cache by default; both caches of ciera.fsdp2 are compared with FSDP2's own
# gather by default in tests/ciera/test_zero3.py.
@pytest.mark.parametrize("cache", ["exponents", pytest.param("values", marks=pytest.mark.slow)])
def test_fsdp2_example_is_bit_identical_with_ciera(tmp_path, fsdp2_run, cache):
    sha0, losses0 = fsdp2_run
    sha1, losses1, out = _train(tmp_path / "losses.txt", "--ciera", "--cache", cache, "--selection", "always")
    assert losses0 and losses1 == losses0
    assert sha1 == sha0
    total, compressed, replayed = map(int, GATHERS.findall(out)[-1])
    # 3 units (2 blocks, root) x 4 steps; blocks gathered in forward and backward of 2 micro-batches
    assert compressed >= 3 * 2  # every fresh gather after the warmup step (some may be raw)
    assert replayed == total - 3 * 4
