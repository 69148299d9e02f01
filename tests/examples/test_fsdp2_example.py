"""examples/fsdp2/train_fsdp2.py, the plain-PyTorch FSDP2 example, as a user launches it: torchrun
on 2 CPU ranks, FSDP2's own gather and CIERA's print the same losses and params sha256."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ciera.testing import free_port

ROOT = Path(__file__).resolve().parents[2]
SHA = re.compile(r"^params sha256: ([0-9a-f]{64})$", re.M)
GATHERS = re.compile(r"ciera gathers: (\d+) \((\d+) compressed, (\d+) replayed\)")

pytestmark = pytest.mark.distributed


def _train(tmp_path: Path, *extra: str) -> tuple[str, str, str]:
    log = tmp_path / f"losses{'_'.join(extra)}.txt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         str(ROOT / "examples" / "fsdp2" / "train_fsdp2.py"), "--steps", "4", "--loss-log", str(log), *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sha = SHA.search(proc.stdout)
    assert sha, proc.stdout[-2000:]
    return sha.group(1), log.read_text(), proc.stdout


@pytest.mark.parametrize("cache", ["exponents", "values"])
def test_fsdp2_example_is_bit_identical_with_ciera(tmp_path, cache):
    sha0, losses0, _ = _train(tmp_path)
    sha1, losses1, out = _train(tmp_path, "--ciera", "--cache", cache, "--selection", "always")
    assert losses0 and losses1 == losses0
    assert sha1 == sha0
    total, compressed, replayed = map(int, GATHERS.findall(out)[-1])
    # 3 units (2 blocks, root) x 4 steps; blocks gathered in forward and backward of 2 micro-batches
    assert compressed >= 3 * 2  # every fresh gather after the warmup step (some may be raw)
    assert replayed == total - 3 * 4
