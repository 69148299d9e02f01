"""Run ``pretrain_gpt.py`` on local ranks and read back what it reports (demo and tests).

    result = run_pretrain(flags, nproc=2)
    result.losses      # {iteration: float}, exact (read from --ciera-loss-log's float.hex)
    result.sha256      # the 'params sha256:' line
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from ciera.testing import free_port

ROOT = Path(__file__).resolve().parents[3]
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
# peer on its host itself: megatron.ciera.app.failfast).
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


class LaunchTimeout(AssertionError):
    """A launch that did not end in time; the message names what was awaited, the last output
    and where every process of the launch waited."""


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def _where(pid: int) -> str:
    """One process's command and Python stacks (py-spy, when installed), or its kernel wait."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:160]
        with open(f"/proc/{pid}/wchan") as f:
            wchan = f.read()
    except OSError:
        return f"pid {pid}: gone"
    text = f"pid {pid} ({wchan}): {cmd}"
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if spy:
        try:
            dump = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30).stdout
            text += "\n" + "\n".join(f"    {line}" for line in dump.splitlines()[2:42])
        except (subprocess.TimeoutExpired, OSError):
            pass
    return text


def _run_or_explain(cmd: list[str], *, env: dict, timeout: float, what: str) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd)`` with output captured, in a session of its own; past ``timeout`` every
    process of the session is killed and :class:`LaunchTimeout` names ``what`` was awaited, the
    last output and where each process waited (nothing of it outlives the call)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stacks = "\n".join(_where(pid) for pid in [proc.pid, *_descendants(proc.pid)])
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        stdout, stderr = proc.communicate()
        tail = "\n".join((stdout + stderr).splitlines()[-30:])
        raise LaunchTimeout(f"{what} did not end within {timeout:.0f} s (waited for the launcher to exit). "
                            f"Its last output:\n{tail}\nWhere each process waited:\n{stacks}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def run_pretrain(flags: list[str], nproc: int = 2, timeout: float = 300, threads_per_rank: int = 1,
                 workdir: str | None = None, loss_log: str | None = None) -> RunResult:
    """Launch ``pretrain_gpt.py flags`` with torchrun on ``nproc`` local ranks and wait.
    ``loss_log``: the ``--ciera-loss-log`` file to use (default: a temporary one)."""
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        loss_log = loss_log or os.path.join(tmp, "losses.txt")
        cmd = torchrun_command(ROOT / "pretrain_gpt.py", [*flags, "--ciera-loss-log", loss_log], nproc=nproc)
        env = torchrun_env(threads_per_rank=threads_per_rank)
        proc = _run_or_explain(cmd, env=env, timeout=timeout, what=f"pretrain_gpt.py on {nproc} rank(s)")
        losses = {}
        if os.path.exists(loss_log):
            for line in open(loss_log):
                it, hexval = line.split()
                losses[int(it)] = float.fromhex(hexval)
    output = proc.stdout + proc.stderr
    match = re.search(r"^params sha256: ([0-9a-f]{64})$", proc.stdout, re.M)
    return RunResult(proc.returncode, output, losses, match.group(1) if match else None)
