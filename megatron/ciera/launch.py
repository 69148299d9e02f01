"""Run ``pretrain_gpt.py`` on local ranks and read back what it reports (demo and tests).

    result = run_pretrain(flags, nproc=2)
    result.losses      # {iteration: float}, exact (read from --ciera-loss-log's float.hex)
    result.sha256      # the 'params sha256:' line
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from ciera.testing import free_port

ROOT = Path(__file__).resolve().parents[2]
TABLE_TOTAL = re.compile(r"^total\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x", re.M)


@dataclass
class RunResult:
    returncode: int
    output: str
    losses: dict
    sha256: str | None

    def iteration_lines(self) -> list[str]:
        return [line for line in self.output.splitlines() if " iteration " in line and "consumed samples" in line]

    def summary_block(self) -> str:
        """The final 'CIERA summary' table ('' without CIERA)."""
        text = self.output
        i = text.rfind("CIERA summary")
        if i < 0:
            return ""
        block = text[i:].splitlines()
        end = next((n for n, line in enumerate(block) if line.startswith("total")), len(block) - 1)
        return "\n".join(block[: end + 1])


# Seconds torchrun waits between SIGTERM and SIGKILL when it is itself signalled (its default is
# 30; after a rank's failure torch 2.13 keeps a fixed 30 s, which is why the watchdog ends a stopped
# peer on its host itself: megatron.ciera.failfast).
SHUTDOWN_TIMEOUT_S = 5


def torchrun_command(script: str | os.PathLike, args: list[str], *, nproc: int = 2) -> list[str]:
    """The torchrun command line for ``script args`` on ``nproc`` local ranks (a free port)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script), *args]


def torchrun_env(*, threads_per_rank: int = 1, **extra: str) -> dict:
    """The environment of a local launch: this repository importable, ``threads_per_rank`` OpenMP
    threads, torchrun's shutdown grace shortened to :data:`SHUTDOWN_TIMEOUT_S`, plus ``extra``."""
    return dict(os.environ, OMP_NUM_THREADS=str(threads_per_rank), PYTHONWARNINGS="ignore",
                TORCH_ELASTIC_SHUTDOWN_TIMEOUT=os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S)),
                PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep), **extra)


def run_pretrain(flags: list[str], nproc: int = 2, timeout: float = 300, threads_per_rank: int = 1,
                 workdir: str | None = None, loss_log: str | None = None) -> RunResult:
    """Launch ``pretrain_gpt.py flags`` with torchrun on ``nproc`` local ranks and wait.
    ``loss_log``: the ``--ciera-loss-log`` file to use (default: a temporary one)."""
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        loss_log = loss_log or os.path.join(tmp, "losses.txt")
        cmd = torchrun_command(ROOT / "pretrain_gpt.py", [*flags, "--ciera-loss-log", loss_log], nproc=nproc)
        env = torchrun_env(threads_per_rank=threads_per_rank)
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        losses = {}
        if os.path.exists(loss_log):
            for line in open(loss_log):
                it, hexval = line.split()
                losses[int(it)] = float.fromhex(hexval)
    output = proc.stdout + proc.stderr
    match = re.search(r"^params sha256: ([0-9a-f]{64})$", proc.stdout, re.M)
    return RunResult(proc.returncode, output, losses, match.group(1) if match else None)
