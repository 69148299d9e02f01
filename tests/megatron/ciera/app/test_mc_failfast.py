"""An error on one rank ends the whole job within seconds, said once, by the rank that failed;
no process outlives its rank; a stalled peer ends the job once, at the timeout, in one line naming
the collective, the group and the ranks that did not arrive (megatron.ciera.app.failfast).

Faults come from ``CIERA_FAULT_INJECT=KIND:RANK:ITERATION`` or from the test itself (kill -9 of a
DataLoader worker, of rank 0 in the middle of a save). Every run trains far longer than the test
waits (--train-iters 100000), so only the fault can end it."""

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from megatron.ciera.app.launch import torchrun_command, torchrun_env

from flag_args import async_save_flags  # noqa: E402

pytestmark = pytest.mark.distributed

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[3]
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
        "--use-distributed-optimizer", "--bf16", "--lr", "1e-3", "--mock-data", "--eval-iters", "0",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "127", "--micro-batch-size", "1", "--device", "cpu",
        "--log-interval", "1", "--distributed-timeout-minutes", "1", "--train-iters", "100000"]
FAST_S = 15  # an ended job: from the fault to the launcher's exit
SAVE_MODES = {"sync": [], "async": async_save_flags(persistent=False), "async-persistent": async_save_flags()}
"""--async-save with a writer forked per save (megatron-core 0.19 saves synchronously then, as
Megatron-LM 0.19) or with the persistent worker process."""


class Job:
    """``per_rank_pretrain.py`` on 2 ranks, its output read line by line with arrival times."""

    def __init__(self, flags, *, fault: str = "", script: Path = HERE / "per_rank_pretrain.py", env=None):
        extra = {"CIERA_FAULT_INJECT": fault} if fault else {}
        self.proc = subprocess.Popen(torchrun_command(script, flags), cwd=ROOT, env=env or torchrun_env(**extra),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self.pids: dict[int, int] = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.time(), line))
            m = re.match(r"per_rank_pretrain: rank (\d+) pid (\d+)", line)
            if m:
                self.pids[int(m.group(1))] = int(m.group(2))

    @property
    def output(self) -> str:
        return "".join(line for _, line in self.lines)

    def wait_for(self, pattern: str, timeout: float = 240) -> float:
        """Arrival time of the first line containing ``pattern``."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            for t, line in list(self.lines):
                if pattern in line:
                    return t
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.01)
        self.kill()
        raise AssertionError(f"no line with {pattern!r}:\n{self.output[-3000:]}")

    def end(self, timeout: float = 120) -> float:
        """Wait for the launcher to exit; returns the time it did."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        ended = time.time()
        self._reader.join(timeout=10)
        return ended

    def kill(self):
        for pid in [*self.pids.values(), self.proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def children(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return out


def forked_writer(pid: int) -> bool:
    """A process forked by a rank (its command line) holding files open (not the rank's
    sentinel, which closes them all: megatron.ciera.app.failfast)."""
    try:
        return "per_rank_pretrain" in open(f"/proc/{pid}/cmdline").read() and bool(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return False


def spawned(pid: int) -> bool:
    """A process a rank started by fork + exec (multiprocessing spawn: the persistent checkpoint
    worker, megatron-core's results Manager)."""
    try:
        return "multiprocessing.spawn" in open(f"/proc/{pid}/cmdline").read()
    except OSError:
        return False


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def assert_failed_once(job: Job, cause: str, *, rank: int):
    out = job.output
    assert job.proc.returncode != 0, out[-3000:]
    ranks_said, _, summary = out.partition("ChildFailedError")  # then the launcher's own summary
    assert ranks_said.count(cause) == 1, out[-3000:]  # said once
    assert cause in summary, out[-3000:]  # and named by the launcher (the rank's elastic error file)
    first = next(line for _, line in job.lines if re.match(r"rank \d+: ", line))
    assert first.startswith(f"rank {rank}: "), out[-3000:]  # and first, by the rank that failed


def test_exception_on_one_rank_ends_the_job_fast():
    job = Job(TINY, fault="raise:1:3")
    failed = job.wait_for("fault injected on rank 1 after iteration 3")
    assert job.end() - failed < FAST_S
    assert_failed_once(job, "RuntimeError: CIERA_FAULT_INJECT: fault injected on rank 1 after iteration 3", rank=1)
    assert "rank 0: a peer went away" in job.output or "rank 0:" not in job.output


def test_killed_dataloader_worker_ends_the_job_fast():
    job = Job([*TINY, "--num-workers", "1"])
    job.wait_for(" iteration        3/")
    workers = children(job.pids[1])
    assert workers, job.output[-2000:]
    killed = time.time()
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    assert job.end() - killed < FAST_S
    out = job.output
    assert job.proc.returncode != 0, out[-3000:]
    # named as what it was and where the loop was, by the watchdog or (should torch's DataLoader
    # notice first) by the error path
    assert re.search(r"rank 1: its DataLoader worker \(pid \d+\) was killed by SIGKILL during iteration \d+'s "
                     r"forward-backward|rank 1: its DataLoader worker [^\n]* during iteration \d+'s ", out), \
        out[-3000:]


# --async-save: megatron-core's TemporalAsyncCaller takes a writer killed by a signal for a finished
# one; checkpointing publishes a save only when every rank's writer left its mark (WRITER_DONE), so
# the job ends on the missing mark if the watchdog has not named the dead child first. A dead
# persistent worker is named by the watchdog, or by checkpoint_async before the run would wait on it.
def _kill_writer_mid_save(save: Path, mode: str) -> Path:
    """Every process rank 0 forks for the save of iteration 4 dies at once (rank 0 writes the
    replicated tensors: it always has a writer), or its persistent worker is killed as it takes
    that save: the job ends fast, naming it, and the save of iteration 2 stays the latest. Returns
    the tracker's path."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    if mode != "async-persistent" and not hasattr(FileSystemWriterAsync, "write_preloaded_data_multiproc"):
        pytest.skip("this megatron-core (0.19) writes a synchronous save with threads of the rank's own process "
                    "(and saves --async-save without the persistent worker synchronously): no writer to kill")
    job = Job([*TINY, "--save", str(save), "--save-interval", "2", *SAVE_MODES[mode]], fault="kill-writer:0:4")
    started = job.wait_for(" iteration        4/")
    assert job.end() - started < FAST_S
    out = job.output
    assert job.proc.returncode != 0, out[-3000:]
    # The watchdog names the dead child, unless megatron-core's async queue reaped it first and
    # raised on the missing results itself (then rank 0's traceback carries that error).
    # (the watchdog looks every second: the loop may be past the save by then)
    assert re.search(r"rank 0: its checkpoint writer \(pid \d+\) was killed by SIGKILL during iteration \d+'s ",
                     out) or (
        re.search(r"rank \d: \w+ \(ending this rank now", out)
        and re.search(r"Worker failure|results_queue|CheckpointException|background writer of rank\(s\) \[0\]|"
                      r"persistent checkpoint worker", out)), \
        out[-3000:]
    assert not (save / "iter_0000004").exists()
    # the save of iteration 2 was published before the one of 4 started (async: finalised first)
    tracker = save / "latest_checkpointed_iteration.txt"
    assert tracker.read_text() == "2" and (save / "iter_0000002" / "checksums.sha256").is_file()
    return tracker


# (async-persistent runs by default in test_mc_durable.py, with the resume from what it left)
@pytest.mark.parametrize("mode", [pytest.param(m, marks=pytest.mark.slow) if m == "async-persistent" else m
                                  for m in SAVE_MODES])
def test_killed_checkpoint_writer_ends_the_job_fast(tmp_path, mode):
    _kill_writer_mid_save(tmp_path / "ckpt", mode)


@pytest.mark.slow  # a second launch (~30 s on 2 vCPUs); the kill itself runs by default (above)
def test_what_a_killed_persistent_worker_left_loads(tmp_path):
    """After the persistent worker is killed mid-save, a resume loads what is left (iteration 2,
    or nothing published yet) and trains on."""
    from megatron.ciera.app.launch import run_pretrain

    mode = "async-persistent"
    tracker = _kill_writer_mid_save(tmp_path / "ckpt", mode)
    resumed = run_pretrain([*TINY, "--load", str(tmp_path / "ckpt"), "--train-iters", "3", *SAVE_MODES[mode]],
                           timeout=300)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert ("loaded checkpoint" in resumed.output) == tracker.exists(), resumed.output[-3000:]


# --async-save without the persistent worker: slow (on megatron-core 0.16 its writer is forked per
# save as the synchronous save's is; on 0.19 it saves synchronously).
@pytest.mark.parametrize("mode", [pytest.param(m, marks=pytest.mark.slow) if m == "async" else m for m in SAVE_MODES])
def test_no_process_outlives_rank_0_killed_mid_save(tmp_path, mode):
    """kill -9 of rank 0 while its checkpoint writer runs: the writer (and its own children)
    die with it, and every rank's process tree is gone when the launcher exits."""
    job = Job([*TINY, "--save", str(tmp_path / "ckpt"), "--save-interval", "1", "--num-workers", "0",
               *SAVE_MODES[mode]])
    job.wait_for(f"checkpoint {tmp_path / 'ckpt'} at iteration")  # saved, or started saving (async)
    deadline, writers = time.time() + 60, []
    while not writers and time.time() < deadline:
        writers = [pid for pid in children(job.pids[0]) if forked_writer(pid) or spawned(pid)]
    assert writers, "no checkpoint writer seen"
    family = [*children(job.pids[0]), *children(job.pids[1])]  # + the Manager, sentinels, ...
    seen = set(family) | {g for pid in family for g in children(pid)}
    os.kill(job.pids[0], signal.SIGKILL)
    job.end()
    time.sleep(1)
    left = [pid for pid in [*seen, *job.pids.values()] if alive(pid)]
    assert not left, f"processes outlived their rank: {left}"


@pytest.mark.parametrize("mode", ["backend", "watchdog"])
def test_stalled_peer_is_named_in_one_line(mode):
    """A fast stall (2 s timeout) outside training: rank 0 waits in all_reduce for rank 1, which
    never comes. The report names the collective, the group and rank 1; it comes from the error
    path when the backend's timeout fires, from the watchdog when the backend would wait longer."""
    job = Job([], script=HERE / "stall_ranks.py", env=torchrun_env(STALL_MODE=mode))
    start = time.time()
    job.end(timeout=60)
    out = job.output
    assert job.proc.returncode != 0 and time.time() - start < 25, out[-3000:]
    stalls = [line for _, line in job.lines if line.startswith("rank 0: stalled")]
    assert len(stalls) == 1, out[-3000:]
    assert "all_reduce called from <module> (tests/megatron/ciera/app/stall_ranks.py:" in stalls[0], stalls[0]
    assert "collective 2 of group 1 " in stalls[0] and "(ranks [0, 1])" in stalls[0], stalls[0]
    assert "did not arrive: rank 1 (its last word: collective 1 of the group" in stalls[0], stalls[0]


@pytest.mark.slow
def test_stopped_rank_ends_the_job_at_the_timeout():
    """SIGSTOP of rank 1 with --distributed-timeout-minutes 1: one line naming the collective, the
    group and rank 1, and the job ends once, within 80 s of the stop (rank 0 ends the stopped rank
    on its own host: torchrun would wait 30 s before its SIGKILL)."""
    job = Job(TINY, fault="stop:1:3")
    stopped = job.wait_for("rank 1 stops itself (SIGSTOP) after iteration 3")
    ended = job.end(timeout=200)
    out = job.output
    assert job.proc.returncode != 0 and ended - stopped < 80, (ended - stopped, out[-3000:])
    stalls = [line for _, line in job.lines if ": stalled" in line]
    assert len(stalls) == 1 and stalls[0].startswith("rank 0: stalled"), out[-3000:]
    assert "did not arrive: rank 1 " in stalls[0] and "(ranks [0, 1])" in stalls[0], stalls[0]
    assert stalls[0].endswith("; ended rank 1 on this host (SIGTERM + SIGCONT)\n"), stalls[0]


def _default_verify_worker(rank, world):
    """A receiver made stale after 3 gathers (rank 1's copy of shard 0 differs from its owner's,
    as a write outside the gather without invalidate() leaves it) under the default config:
    the gather that reaches the default interval raises on every rank."""
    import torch

    from ciera import CieraAllGather, CieraConfig
    from ciera.gather import CieraVerifyError

    n = 1024
    buf = torch.randn(n * world, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    config = CieraConfig(codec="exponent_reuse", selection="always")
    gather = CieraAllGather(buf, config=config)
    for _ in range(3):
        gather.start().wait()
    if rank == 1:
        buf[:n] += 1
    for _ in range(config.verify_interval):
        try:
            gather.start().wait()
        except CieraVerifyError as exc:
            return gather.stats.gathers, str(exc)
    return gather.stats.gathers, None


@pytest.mark.slow  # 10000 gathers (~40 s on 2 vCPUs); tests/ciera/test_gather.py checks interval 1
def test_verify_is_on_by_default_and_stops_a_stale_receiver():
    from ciera import CieraConfig
    from ciera.testing import run_on_ranks

    every = CieraConfig().verify_interval
    assert every > 0
    for gathers, message in run_on_ranks(_default_verify_worker, world=2, timeout_s=120):
        assert gathers == every and message is not None, (gathers, message)
        assert "shard 0 (owned by rank 0) differs from its owner's values on ranks [1]" in message


def _resume_with_another_schedule(tmp_path) -> list[str]:
    """A 4-iteration run saved, then resumed with --train-iters 8 (another LR schedule: its decay
    steps): upstream's scheduler refuses the checkpoint's and the error names the two flags that
    choose. Returns the resume's flags."""
    from megatron.ciera.app.launch import run_pretrain

    flags = [*TINY[:-2], "--save", str(tmp_path / "ckpt")]
    first = run_pretrain([*flags, "--train-iters", "4"], timeout=240)
    assert first.returncode == 0, first.output[-3000:]
    flags += ["--train-iters", "8", "--load", str(tmp_path / "ckpt")]
    second = run_pretrain(flags, timeout=240)
    assert second.returncode != 0
    assert "pass --override-opt_param-scheduler to use this run's schedule, or " \
           "--use-checkpoint-opt_param-scheduler to keep the checkpoint's" in second.output, second.output[-3000:]
    return flags


def _scheduler(*extra: str):
    """megatron-core's scheduler as pretrain_gpt.py builds it for TINY with ``extra`` (in process)."""
    import torch

    from flag_args import parse_and_validate
    from megatron.ciera.app import model as model_lib

    args = parse_and_validate([*TINY[:-2], *extra], world=2)
    return model_lib.scheduler(args, torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=args.lr))


def test_resume_with_another_schedule_names_the_flags_that_resolve_it(tmp_path):
    _resume_with_another_schedule(tmp_path)
    # The two flags reach the scheduler and settle the mismatch each its way (the resume that
    # trains on with one of them: the slow test below).
    saved = _scheduler("--train-iters", "4").state_dict()
    with pytest.raises(AssertionError, match="OptimizerParamScheduler"):
        _scheduler("--train-iters", "8").load_state_dict(saved)
    override = _scheduler("--train-iters", "8", "--override-opt_param-scheduler")
    override.load_state_dict(saved)
    assert override.lr_decay_steps == _scheduler("--train-iters", "8").lr_decay_steps != saved["lr_decay_steps"]
    keep = _scheduler("--train-iters", "8", "--use-checkpoint-opt_param-scheduler")
    keep.load_state_dict(saved)
    assert keep.lr_decay_steps == saved["lr_decay_steps"]


@pytest.mark.slow  # a third launch; the default test checks the refusal and the flags in process
def test_resume_with_override_opt_param_scheduler_trains_on(tmp_path):
    from megatron.ciera.app.launch import run_pretrain

    resumed = run_pretrain([*_resume_with_another_schedule(tmp_path), "--override-opt_param-scheduler"], timeout=240)
    assert resumed.returncode == 0 and sorted(resumed.losses) == [5, 6, 7, 8], resumed.output[-3000:]
