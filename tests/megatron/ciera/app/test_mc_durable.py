"""After any crash the newest checkpoint whose writes completed an iteration before is published
and resumes bit-exactly; SIGTERM with --exit-signal-handler saves the current iteration and exits
cleanly; an argument error or a full disk is one line (megatron.ciera.app.checkpoint_async,
megatron.ciera.app.exit_signal, megatron.ciera.app.failfast).

Short versions (2 ranks, a few iterations, --async-save with the persistent worker: the writer of
both megatron-core releases) run by default; the other save modes are ``slow``."""

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from megatron.ciera.app import checkpointing
from megatron.ciera.app.launch import ROOT, run_pretrain, torchrun_command, torchrun_env

from test_mc_failfast import SAVE_MODES, TINY, Job, _kill_writer_mid_save  # noqa: E402

pytestmark = pytest.mark.distributed

REF_ITERS = 30  # the uninterrupted reference run's length (--exit-interval; --train-iters stays TINY's)


MEGATRON_FSDP = ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor", "--no-gradient-accumulation-fusion",
                 "--data-parallel-sharding-strategy", "optim_grads_params"]
"""Megatron-FSDP (its fsdp_dtensor checkpoints are saved synchronously, as upstream)."""


def _reference(engine: tuple = ()):
    """The uninterrupted run: every iteration's loss to REF_ITERS."""
    result = run_pretrain([*TINY, *engine, "--exit-interval", str(REF_ITERS)], timeout=300)
    assert result.returncode == 0, result.output[-3000:]
    return result


@pytest.fixture(scope="module")
def reference():
    return _reference()


def _resumes_bit_exactly(ckpt: Path, reference, *, iteration: int, engine=()) -> None:
    """The published checkpoint ``iteration`` loads and training from it repeats the reference run."""
    assert checkpointing.latest_iteration(str(ckpt)) == iteration
    until = iteration + 1
    assert until <= REF_ITERS
    resumed = run_pretrain([*TINY, *engine, "--load", str(ckpt), "--exit-interval", str(until)], timeout=300)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert f"loaded checkpoint {checkpointing.iteration_dir(str(ckpt), iteration)}" in resumed.output
    assert resumed.losses == {until: reference.losses[until]}


def _mode_params(default: str):
    return [m if m == default else pytest.param(m, marks=pytest.mark.slow) for m in SAVE_MODES]


@pytest.mark.parametrize("mode", _mode_params("async-persistent"))
def test_killed_writer_leaves_the_save_before_published(tmp_path, reference, mode):
    """--save-interval 2, the writer of rank 0 killed at iteration 4: iteration 2 is published
    (finalised before the save of 4 started) and resumes bit-exactly; 4 never is."""
    ckpt = tmp_path / "ckpt"
    tracker = _kill_writer_mid_save(ckpt, mode)
    assert tracker.read_text() == "2"
    _resumes_bit_exactly(ckpt, reference, iteration=2)


@pytest.mark.parametrize("mode", _mode_params("async-persistent"))
def test_killed_rank_leaves_the_newest_written_save_published(tmp_path, reference, mode):
    """A save every iteration, kill -9 of rank 0 once the save of iteration 4 started: the saves
    whose writes were done are published (3 at least: a save starts only once the one before is
    published), and the newest resumes bit-exactly."""
    ckpt = tmp_path / "ckpt"
    job = Job([*TINY, "--save", str(ckpt), "--save-interval", "1", "--num-workers", "0", *SAVE_MODES[mode]])
    job.wait_for(f"checkpoint {ckpt} at iteration 4")
    os.kill(job.pids[0], signal.SIGKILL)
    job.end()
    assert job.proc.returncode != 0
    latest = checkpointing.latest_iteration(str(ckpt))
    assert latest is not None and latest >= 3, job.output[-3000:]
    _resumes_bit_exactly(ckpt, reference, iteration=latest)


@pytest.mark.parametrize("mode", _mode_params("sync"))
def test_sigterm_with_exit_signal_handler_saves_and_exits(tmp_path, reference, mode):
    """SIGTERM to the launcher (as SLURM sends it): every rank saves the iteration it is at and
    exits cleanly within torchrun's grace period; the checkpoint resumes bit-exactly."""
    ckpt = tmp_path / "ckpt"
    env = dict(torchrun_env(), TORCH_ELASTIC_SHUTDOWN_TIMEOUT="60")  # the grace of the final save
    job = Job([*TINY, "--save", str(ckpt), "--save-interval", "1000", "--exit-signal-handler", *SAVE_MODES[mode]],
              env=env)
    job.wait_for(" iteration        2/")
    job.proc.send_signal(signal.SIGTERM)
    job.end()
    out = job.output
    saved = [line for _, line in job.lines if "received SIGTERM: saving a checkpoint at iteration" in line]
    assert len(saved) == 1, out[-3000:]
    iteration = int(saved[0].split("at iteration")[1].split()[0])
    assert f"exiting after SIGTERM at iteration {iteration}" in out, out[-3000:]
    assert "params sha256:" in out, out[-3000:]  # the ranks ended normally
    _resumes_bit_exactly(ckpt, reference, iteration=iteration)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill-rank", "sigterm"])
def test_megatron_fsdp_crash_and_preemption_resume_bit_exactly(tmp_path, fault):
    """Megatron-FSDP, a save every iteration: kill -9 of rank 0, or SIGTERM to the launcher with
    --exit-signal-handler; the published checkpoint resumes bit-exactly."""
    reference = _reference(tuple(MEGATRON_FSDP))
    ckpt = tmp_path / "ckpt"
    flags = [*TINY, *MEGATRON_FSDP, "--save", str(ckpt), "--num-workers", "0"]
    if fault == "kill-rank":
        job = Job([*flags, "--save-interval", "1"])
        job.wait_for(f"checkpoint {ckpt} at iteration 3")
        os.kill(job.pids[0], signal.SIGKILL)
    else:
        job = Job([*flags, "--save-interval", "1000", "--exit-signal-handler"],
                  env=dict(torchrun_env(), TORCH_ELASTIC_SHUTDOWN_TIMEOUT="60"))
        job.wait_for(" iteration        2/")
        job.proc.send_signal(signal.SIGTERM)
    job.end()
    latest = checkpointing.latest_iteration(str(ckpt))
    assert latest is not None and latest >= (3 if fault == "kill-rank" else 2), job.output[-3000:]
    _resumes_bit_exactly(ckpt, reference, iteration=latest, engine=MEGATRON_FSDP)


def _launcher_summary_start(lines: list[str]) -> int:
    """Index of the first line of torchrun's own failure report."""
    return next(i for i, line in enumerate(lines) if line.startswith("Traceback") or "ChildFailedError" in line
                or line.startswith("====="))


def test_argument_error_is_one_line_on_four_ranks():
    """--lr=-1e-4 on 4 ranks: the message once, a usage hint, no usage wall; the launcher's
    summary names the cause."""
    cmd = torchrun_command(ROOT / "pretrain_gpt.py", [*TINY, "--lr=-1e-4"], nproc=4)
    proc = subprocess.run(cmd, cwd=ROOT, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    lines = (proc.stderr + proc.stdout).splitlines()
    assert proc.returncode != 0
    cause = "--lr -0.0001: out of range (adam optimizer: Invalid learning rate: -0.0001)"
    # (torch's CUDA build without a GPU, megatron-core 0.19.2's stack here, warns once per rank at
    # import that it found no CUDA runtime: the machine's, not the error's, and absent on GPU nodes)
    before = [line for line in lines[:_launcher_summary_start(lines)]
              if not re.search(r"cpp_extension\.py:\d+\] No CUDA runtime is found", line)]
    assert len(before) <= 10, "\n".join(before)
    assert sum(cause in line for line in before) == 1, "\n".join(before)
    assert not any(line.startswith("usage:") for line in lines)
    assert cause in "\n".join(lines[_launcher_summary_start(lines):]), "\n".join(lines[-40:])


@pytest.fixture
def small_disk(tmp_path):
    """A 5 MiB tmpfs (root only)."""
    path = tmp_path / "small"
    path.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a tmpfs needs root")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_full_disk_is_one_line_for_the_job(small_disk):
    """A checkpoint larger than the disk: one line naming the path, the bytes needed and free."""
    flags = [*TINY, "--hidden-size", "256", "--num-attention-heads", "4", "--save", str(small_disk),
             "--save-interval", "2", "--exit-interval", "3"]
    cmd = torchrun_command(ROOT / "pretrain_gpt.py", flags)
    proc = subprocess.run(cmd, cwd=ROOT, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    lines = (proc.stderr + proc.stdout).splitlines()
    assert proc.returncode != 0
    before = lines[:_launcher_summary_start(lines)]
    full = [line for line in before if "the disk is full" in line]
    assert len(full) == 1, "\n".join(before[-30:])
    assert f"under {small_disk} failed" in full[0] and "needs about" in full[0] and "bytes free" in full[0], full[0]
    assert not any("Traceback" in line for line in before), "\n".join(before[-30:])
