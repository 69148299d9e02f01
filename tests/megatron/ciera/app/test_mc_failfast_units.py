"""The small fail-fast pieces in one process: optimizer and schedule ranges refused up front by
flag, inert --ciera-* flags named, a full disk named with its free bytes, the fault switch and
faults that cannot fire."""

import errno
import shutil

import pytest

from megatron.ciera.app import failfast

from test_mc_arguments import error, parse


@pytest.mark.parametrize("extra, needle", [
    (["--lr=-1e-4"], "--lr -0.0001: out of range (adam optimizer: Invalid learning rate: -0.0001)"),
    (["--adam-beta1", "1.5"], "--adam-beta1 1.5: out of range (adam optimizer: Invalid beta parameter at index 0"),
    (["--adam-beta2", "-0.1"], "--adam-beta2 -0.1: out of range"),
    (["--adam-eps", "-1"], "--adam-eps -1.0: out of range (adam optimizer: Invalid epsilon value"),
    (["--weight-decay", "-0.1"], "--weight-decay -0.1: out of range (adam optimizer: Invalid weight_decay value"),
    (["--optimizer", "sgd", "--sgd-momentum", "-1"], "--sgd-momentum -1.0: out of range (sgd optimizer"),
    (["--min-lr", "-1"], "--min-lr -1.0: megatron-core's OptimizerParamScheduler requires min_lr >= 0.0"),
    (["--min-lr", "1e-3"], "--lr 0.0001, --min-lr 0.001: megatron-core's OptimizerParamScheduler requires max_lr >= min_lr"),
])
def test_out_of_range_hyperparameters_are_refused_by_flag(extra, needle):
    assert needle in error(extra)


def test_in_range_hyperparameters_pass():
    parse(["--adam-beta1", "0", "--weight-decay", "0", "--min-lr", "1e-5", "--optimizer", "sgd", "--sgd-momentum", "0"])


def test_ciera_flags_without_ciera_allgather_are_named():
    args = parse(["--ciera-selection", "always", "--ciera-codec", "delta", "--ciera-loss-log", "x"])
    assert args.ciera_inert == ["--ciera-codec delta", "--ciera-selection always"]  # not --ciera-loss-log
    assert parse(["--ciera-allgather", "--ciera-codec", "delta"]).ciera_inert == []
    assert parse([]).ciera_inert == []


class _Usage:
    def __init__(self, free):
        self.total, self.used, self.free = 10 * free + 1, 9 * free, free


def test_a_full_disk_is_named_with_its_free_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: _Usage(4096))
    worker = RuntimeError("Worker failure: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    message = failfast.disk_full_message(worker, str(tmp_path / "ckpt"))
    assert message.startswith(f"saving a checkpoint under {tmp_path / 'ckpt'} failed: the disk is full "
                              f"(4096 bytes free on {tmp_path})"), message
    with pytest.raises(SystemExit) as info, failfast.explain_save_errors(str(tmp_path)):
        raise RuntimeError("write failed") from OSError(errno.ENOSPC, "No space left on device")
    assert "the disk is full (4096 bytes free" in str(info.value.code)
    with pytest.raises(KeyError), failfast.explain_save_errors(str(tmp_path)):
        raise KeyError("unrelated")  # passes unchanged
    # a rank whose own write did not fail sees megatron-core's gathered failure; the bytes needed
    # ride on the exception (failfast.noting_bytes_needed)
    with pytest.raises(SystemExit) as info, failfast.explain_save_errors(str(tmp_path)), \
            failfast.noting_bytes_needed(123456):
        raise RuntimeError("CheckpointException ranks: dict_keys([])")
    assert "the disk is full (the checkpoint needs about 123456 bytes, 4096 bytes free on" in str(info.value.code)


def test_a_writer_error_with_space_left_is_not_called_a_full_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: _Usage(10 << 30))
    worker = RuntimeError("Worker failure: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert failfast.disk_full_message(worker, str(tmp_path)) is None


def test_fault_switch():
    assert failfast.FaultPlan.from_env({}) is None
    plan = failfast.FaultPlan.from_env({failfast.FAULT_ENV: "raise:1:3"})
    assert plan.fires("raise", rank=1, iteration=3) and not plan.fires("raise", rank=0, iteration=3)
    with pytest.raises(RuntimeError, match="fault injected on rank 1 after iteration 3"):
        failfast.inject_after_step(plan, rank=1, iteration=3)
    failfast.inject_after_step(plan, rank=1, iteration=4)
    with pytest.raises(SystemExit, match="expected KIND:RANK:ITERATION"):
        failfast.FaultPlan.from_env({failfast.FAULT_ENV: "explode:1"})


def test_verify_is_on_by_default():
    """On by default, at a cadence measured to cost under 0.5% of the gather time
    (tools/bench_verify.py); a mismatch stops training: test_mc_failfast.py (slow, the default
    interval) and tests/ciera/test_gather.py (interval 1)."""
    from ciera import CieraConfig

    assert CieraConfig().verify_interval > 0


_FORK_PROBE = """
import os, signal
from megatron.ciera.app import failfast
failfast.guard_children()
plan = failfast.FaultPlan("kill-writer", 1, 4)
with failfast.kill_forked_children(True, plan=plan) as block:
    pass  # a rank with nothing to write in the background: no writer to kill
assert not block.forked
with failfast.kill_forked_children(True, plan=plan) as block:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    _, status = os.waitpid(pid, 0)
assert block.forked and os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
print("probe done", flush=True)
"""


def test_a_kill_writer_fault_that_cannot_fire_says_so():
    """kill-writer on a rank that forks no writer warns, naming the injection; one that forks is
    killed, without a warning (in a child process: the fork hooks stay out of the test's)."""
    import subprocess
    import sys

    from megatron.ciera.app.launch import ROOT

    out = subprocess.run([sys.executable, "-c", _FORK_PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "probe done" in out.stdout, out.stdout + out.stderr
    warnings = [line for line in out.stdout.splitlines() if line.startswith("WARNING")]
    assert warnings == [f"WARNING: {failfast.FAULT_ENV}=kill-writer:1:4: this rank forked no checkpoint writer for "
                        "this save (nothing of its own to write in a background process); the injected fault "
                        "cannot fire"], out.stdout


def test_a_fault_whose_target_does_not_exist_says_so(capsys):
    import argparse

    args = argparse.Namespace(save="/ckpt", save_interval=2, train_iters=10)
    failfast.FaultPlan("raise", 2, 3).warn_if_unreachable(rank=0, world_size=2, args=args)
    failfast.FaultPlan("kill-writer", 1, 3).warn_if_unreachable(rank=0, world_size=2, args=args)
    failfast.FaultPlan("kill-writer", 1, 4).warn_if_unreachable(rank=0, world_size=2, args=args)  # fine
    failfast.FaultPlan("kill-writer", 1, 3).warn_if_unreachable(rank=1, world_size=2, args=args)  # rank 0 says it
    assert capsys.readouterr().out.splitlines() == [
        f"WARNING: {failfast.FAULT_ENV}=raise:2:3: there is no rank 2 (world size 2); the injected fault cannot fire",
        f"WARNING: {failfast.FAULT_ENV}=kill-writer:1:3: no checkpoint is saved at iteration 3 (--save-interval 2); "
        "the injected fault cannot fire"]


def test_a_dead_dataloader_worker_is_named_from_torchs_error():
    def chained():
        try:
            raise RuntimeError("DataLoader worker (pid 5) is killed by signal: Killed. ")
        except RuntimeError as exc:
            raise ConnectionResetError("Connection reset by peer") from exc

    with pytest.raises(ConnectionResetError) as info:
        chained()
    assert failfast._dataloader_worker_error(info.value) == "(pid 5) is killed by signal: Killed"
    assert failfast._dataloader_worker_error(RuntimeError("Connection reset by peer")) is None  # a peer rank
