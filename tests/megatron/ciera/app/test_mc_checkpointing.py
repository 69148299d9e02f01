"""megatron.ciera.app.checkpointing: torch_dist checkpoints that resume bit for bit and lose nothing.

In-process tests (a one-rank gloo group) cover the rules: refuse a fresh start over existing
checkpoints, unwritable --save, checksums naming the damaged file, fallback to the previous good
checkpoint, atomic saves. Multi-process tests run pretrain_gpt.py: save / resume exactness with
CIERA (every iteration's loss and the params sha256), resume at another layout, a damaged
checkpoint failing on every rank, NaN stopping the run.
"""

import argparse
import inspect
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from megatron.ciera.app import checkpoint_async, checkpoint_publish, checkpoint_state, checkpointing
from megatron.ciera.binding import checkpoint_fixes
from megatron.ciera.app.launch import run_pretrain

from flag_args import async_save_flags, parse_and_validate  # noqa: E402
from test_mc_training import CIERA, OVERLAP, TINY, run  # noqa: E402  (shared, cached runs)


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    if not dist.is_initialized():
        store = str(tmp_path_factory.mktemp("pg") / "store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    # left initialised for the other tests of this process (destroying it is not re-entrant)


def _args(**kw):
    base = dict(save=None, load=None, finetune=False, exit_on_missing_checkpoint=False, overwrite_checkpoints=False,
                ckpt_step=None, ckpt_fallback_to_previous=False)
    base.update(kw)
    return argparse.Namespace(**base)


def _fake_checkpoint(root, iteration, payload=b"x" * 10000):
    """A folder shaped like a torch_dist checkpoint, with checksums, counted by the tracker."""
    folder = checkpointing.iteration_dir(str(root), iteration)
    os.makedirs(folder)
    for name in ("common.pt", "metadata.json", "__0_0.distcp", "__0_1.distcp"):
        with open(os.path.join(folder, name), "wb") as f:
            f.write(payload + name.encode())
    checkpoint_publish.write_checksums(folder)
    with open(os.path.join(root, checkpointing.TRACKER), "w") as f:
        f.write(str(iteration))
    return folder


def test_mistyped_load_refuses_to_overwrite_checkpoints(one_rank_group, tmp_path):
    save = tmp_path / "ckpt"
    save.mkdir()
    _fake_checkpoint(save, 60)
    for args in (_args(save=str(save), load=str(tmp_path / "ckpt-typo")), _args(save=str(save))):
        with pytest.raises(SystemExit, match=r"refusing to start.*latest iteration 60.*--overwrite-checkpoints"):
            checkpointing.preflight(args)
    checkpointing.preflight(_args(save=str(save), load=str(tmp_path / "typo"), overwrite_checkpoints=True))
    checkpointing.preflight(_args(save=str(save), load=str(save)))  # the normal resume
    with pytest.raises(SystemExit, match="holds no checkpoint"):
        checkpointing.preflight(_args(load=str(tmp_path / "typo"), exit_on_missing_checkpoint=True))
    assert checkpointing.latest_iteration(str(save)) == 60  # nothing was touched


def test_unwritable_save_fails_at_start_up(one_rank_group, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(SystemExit, match=r"--save .*a-file/ckpt is not writable by rank 0"):
        checkpointing.preflight(_args(save=str(blocker / "ckpt")))


def test_interrupted_save_leftovers_are_removed_and_never_loaded(one_rank_group, tmp_path):
    _fake_checkpoint(tmp_path, 10)
    half = tmp_path / "iter_0000020.incomplete"
    half.mkdir()
    (half / "__0_0.distcp").write_bytes(b"partial")
    assert checkpointing.complete_iterations(str(tmp_path)) == [10]
    checkpointing.preflight(_args(save=str(tmp_path), load=str(tmp_path)))
    assert not half.exists() and checkpointing.latest_iteration(str(tmp_path)) == 10


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_checkpoint_is_named_or_falls_back(one_rank_group, tmp_path, damage):
    _fake_checkpoint(tmp_path, 10)
    folder = _fake_checkpoint(tmp_path, 20)
    victim = os.path.join(folder, "__0_1.distcp")
    if damage == "flip":
        data = bytearray(open(victim, "rb").read())
        data[100:4196] = bytes(b ^ 0xFF for b in data[100:4196])  # 4 KB of flipped bytes
        open(victim, "wb").write(bytes(data))
    elif damage == "truncate":
        os.truncate(victim, 17)
    else:
        os.remove(victim)
    problems = checkpointing.verify(folder)
    assert len(problems) == 1 and victim in problems[0]
    with pytest.raises(SystemExit, match=r"iter_0000020 failed verification:\n  .*__0_1\.distcp"):
        checkpointing._choose(_args(load=str(tmp_path)))
    plan = checkpointing._choose(_args(load=str(tmp_path), ckpt_fallback_to_previous=True))
    assert plan.iteration == 10 and plan.folder.endswith("iter_0000010")
    assert checkpointing.verify(plan.folder) == []


def test_ckpt_step_and_checkpoints_without_checksums(one_rank_group, tmp_path, capsys):
    _fake_checkpoint(tmp_path, 10)
    _fake_checkpoint(tmp_path, 20)
    assert checkpointing._choose(_args(load=str(tmp_path), ckpt_step=10)).iteration == 10
    os.remove(os.path.join(checkpointing.iteration_dir(str(tmp_path), 20), checkpointing.CHECKSUMS))
    assert checkpointing._choose(_args(load=str(tmp_path))).iteration == 20  # Megatron-LM-written: unverified
    assert "loading it unverified" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="does not exist"):
        checkpointing._choose(_args(load=str(tmp_path), ckpt_step=30))


@pytest.mark.parametrize("persistent", [False, True], ids=["forked-writer", "persistent-worker"])
def test_async_save_is_published_only_once_written(one_rank_group, tmp_path, persistent):
    """--async-save (a writer forked per save, or --use-persistent-ckpt-worker): while the
    background write runs checkpoint 4 stays the latest and the new one is only an
    ``.incomplete`` folder; finalising publishes it whole (checksums, rename, tracker). A writer
    killed mid-save publishes nothing: the error names the rank, checkpoint 5 stays the latest and
    loads, and the next start removes the leftovers."""
    import contextlib

    import torch

    from megatron.ciera.binding import cpu_compat

    # megatron-core's async caller synchronises "the GPU": the CPU shims, as in pretrain_gpt.py
    with contextlib.nullcontext() if torch.cuda.is_available() else cpu_compat.enabled():
        _async_save_scenario(tmp_path, persistent=persistent)


def test_async_save_without_psutil_is_refused_at_start_up(monkeypatch):
    """megatron-core's forked writer dies without psutil and its parent then waits forever: the
    queue is refused up front, naming the package, instead of a save that never ends."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "psutil" else real(name, *a))
    with pytest.raises(SystemExit, match="--async-save needs psutil"):
        checkpointing.async_queue(argparse.Namespace(async_save=True))


def _async_args(persistent: bool, **kw) -> argparse.Namespace:
    """The --async-save flags of this megatron-core's table (0.19's has --async-strategy)."""
    from megatron.ciera.app.flag_table import upstream_flags

    base = dict(async_save=True, use_persistent_ckpt_worker=persistent, **kw)
    if any(flag["dest"] == "async_strategy" for flag in upstream_flags()):
        base.setdefault("async_strategy", "mcore")
    return argparse.Namespace(**base)


def _async_save_scenario(tmp_path, *, persistent: bool):
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    def state(value):
        return {"w": ShardedTensor.from_rank_offsets("w", torch.full((64,), value)), "iteration": 0}

    root = str(tmp_path)
    args = _async_args(persistent)
    checkpointing.write(state(4.0), root=root, iteration=4)
    queue = checkpointing.async_queue(args)
    if hasattr(args, "async_strategy") and not persistent:  # Megatron-LM 0.19: no async save without the worker
        assert queue is None and not args.async_save
        return
    try:
        checkpointing.write(state(5.0), root=root, iteration=5, queue=queue, args=args)
        assert checkpointing.latest_iteration(root) == 4 and checkpointing.complete_iterations(root) == [4]
        assert os.path.isdir(checkpointing.iteration_dir(root, 5) + ".incomplete")
        # published at the first (non-blocking) check after the write returned, whether or not
        # the writer process has ended yet
        mark = checkpoint_async.mark_path(checkpointing.iteration_dir(root, 5) + ".incomplete", 0)
        deadline = time.time() + 60
        while not os.path.exists(mark) and time.time() < deadline:
            time.sleep(0.01)
        queue.finalize(blocking=False)
        assert checkpointing.latest_iteration(root) == 5 and checkpointing.complete_iterations(root) == [4, 5]
        assert checkpointing.verify(checkpointing.iteration_dir(root, 5)) == []
        assert torch.equal(dist_checkpointing.load_plain_tensors(checkpointing.iteration_dir(root, 5))["w"],
                           torch.full((64,), 5.0))
        # the writer killed mid-save: nothing published, the rank named, 5 stays the latest
        checkpointing.write(state(6.0), root=root, iteration=6, queue=queue, args=args)
        writer = queue.worker() if persistent else queue.queue.async_calls[0].async_caller.process
        os.kill(writer.pid, signal.SIGKILL)
        writer.join(timeout=60)
        assert writer.exitcode == -signal.SIGKILL, "the writer did not die"
        with pytest.raises(RuntimeError, match=r"rank\(s\) \[0\]"):
            queue.finalize(blocking=True)
    finally:
        queue.queue.close(abort=True)  # nothing left running, whatever happened above
    checkpointing.preflight(_args(save=root, load=root))  # the next start
    assert checkpointing.complete_iterations(root) == [4, 5] and checkpointing.latest_iteration(root) == 5
    assert sorted(os.listdir(root)) == ["iter_0000004", "iter_0000005", checkpointing.TRACKER]
    assert checkpointing.verify(checkpointing.iteration_dir(root, 5)) == []
    assert checkpointing.async_queue(argparse.Namespace(async_save=False)) is None


def _published(root, iteration, *, retain=None, protect=None):
    """A fake checkpoint ``iteration`` written and published as a save does."""
    partial = checkpoint_publish.begin(root=str(root), iteration=iteration)
    with open(os.path.join(partial, "metadata.json"), "w") as f:
        f.write(str(iteration))
    checkpoint_publish.publish(root=str(root), iteration=iteration, retain_interval=retain, protect=protect)


def test_save_retain_interval_removes_the_previous_latest_unless_kept(one_rank_group, tmp_path):
    """As Megatron-LM: each save removes the checkpoint the tracker named before it unless its
    iteration is a multiple of --save-retain-interval; never the new latest, never the checkpoint
    this run loaded, never a symbolic link; without the flag nothing is removed."""
    for it in (2, 4, 6, 8):
        _published(tmp_path, it, retain=4)
    assert checkpointing.complete_iterations(str(tmp_path)) == [4, 8] and checkpointing.latest_iteration(str(tmp_path)) == 8
    _published(tmp_path, 10, retain=4, protect=checkpointing.iteration_dir(str(tmp_path), 10))  # the latest
    _published(tmp_path, 10, retain=4)  # re-saving the latest iteration keeps it
    loaded = checkpointing.iteration_dir(str(tmp_path), 10)
    _published(tmp_path, 12, retain=4, protect=loaded)  # 10 was loaded by this run: kept
    os.symlink(checkpointing.iteration_dir(str(tmp_path), 4), checkpointing.iteration_dir(str(tmp_path), 14))
    (tmp_path / checkpointing.TRACKER).write_text("14")
    _published(tmp_path, 16, retain=4)  # 14 is a link: kept
    _published(tmp_path, 18, retain=None)  # without the flag: 16 stays
    assert checkpointing.complete_iterations(str(tmp_path)) == [4, 8, 10, 12, 14, 16, 18]
    _published(tmp_path, 22, retain=4)  # 18 removed
    assert checkpointing.complete_iterations(str(tmp_path)) == [4, 8, 10, 12, 14, 16, 22]
    assert checkpointing.verify(checkpointing.iteration_dir(str(tmp_path), 22)) == []
    # an interrupted removal leaves iter_N.retired, removed (never loaded) at the next start
    (tmp_path / "iter_0000020.retired").mkdir()
    checkpointing.preflight(_args(save=str(tmp_path), load=str(tmp_path)))
    assert not (tmp_path / "iter_0000020.retired").exists()


def test_checkpoint_flags_as_upstream():
    """--finetune without --load starts from scratch (as upstream); --save-retain-interval must be
    a positive multiple of --save-interval (with --save; inert without it); the async flags are
    inert without --async-save and, with it, nvrx and its CPU-shm mode are written by megatron-core's
    own writer (the same files)."""
    from megatron.ciera.app import flag_policy
    from megatron.ciera.app.flag_table import upstream_flags

    table = {flag["dest"] for flag in upstream_flags()}
    for dest in ("use_persistent_ckpt_worker", "async_strategy", "async_ckpt_use_cpu_shm", "save_retain_interval",
                 "auto_detect_ckpt_format", "verify_integrity", "finetune", "async_save"):
        if dest in table:  # the checkpoint rows of the flag table: honoured by the checkpoint feature
            assert flag_policy.policy(dest).kind == "feature:checkpoint", dest
    for dest in ("use_persistent_ckpt_worker", "async_strategy", "async_ckpt_use_cpu_shm"):
        if dest in table:
            assert flag_policy.policy(dest).needs == ("async_save",), dest
    tiny = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--lr", "1e-4", "--micro-batch-size", "2", "--train-iters", "5", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--use-distributed-optimizer"]
    args = parse_and_validate([*tiny, "--finetune"], world=1)
    assert args.finetune and args.load is None
    assert checkpointing.load(args, model=None, optimizer=None, scheduler=None) == 0
    parse_and_validate([*tiny, "--save-retain-interval", "3"], world=1)  # inert without --save
    parse_and_validate([*tiny, "--save", "x", "--save-interval", "2", "--save-retain-interval", "4"], world=1)
    with pytest.raises(ValueError, match=r"--save-retain-interval 3 must be a multiple of --save-interval 2"):
        parse_and_validate([*tiny, "--save", "x", "--save-interval", "2", "--save-retain-interval", "3"], world=1)
    with pytest.raises(ValueError, match=r"--save-retain-interval 0 must be >= 1"):
        parse_and_validate([*tiny, "--save", "x", "--save-retain-interval", "0"], world=1)
    parse_and_validate([*tiny, "--use-persistent-ckpt-worker"], world=1)  # inert without --async-save
    if not any(flag["dest"] == "async_strategy" for flag in upstream_flags()):
        return  # megatron-core 0.16's table: no --async-strategy, --async-ckpt-use-cpu-shm, --verify-integrity
    parse_and_validate([*tiny, "--async-strategy", "nvrx", "--async-ckpt-use-cpu-shm"], world=1)  # inert
    parse_and_validate([*tiny, "--async-save"], world=1)  # 0.19 without the worker: saved synchronously
    # upstream's default strategy (nvrx) and its CPU-shm staging: accepted, written by mcore
    args = parse_and_validate([*tiny, "--async-save", "--use-persistent-ckpt-worker", "--async-ckpt-use-cpu-shm"],
                              world=1)
    assert (args.async_strategy, args.async_ckpt_use_cpu_shm) == ("mcore", False)
    assert args.async_writer_requested == "nvrx with --async-ckpt-use-cpu-shm"
    with pytest.raises(ValueError, match=r"--verify-integrity .*--ckpt-format torch has no such manifest"):
        parse_and_validate([*tiny, "--save", "x", "--ckpt-format", "torch", "--verify-integrity"], world=1)


def test_verify_integrity_is_megatron_cores_manifest(one_rank_group, tmp_path):
    """--verify-integrity (megatron-core 0.19): the save writes megatron-core's integrity manifest
    (inside the published, checksummed folder), the load checks it and names a damaged file."""
    import contextlib

    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron.ciera.binding import cpu_compat

    if "verify_integrity" not in inspect.signature(dist_checkpointing.save).parameters:
        pytest.skip("megatron-core 0.16 has no integrity manifest (--verify-integrity is 0.19's)")

    def state():
        return {"w": ShardedTensor.from_rank_offsets("w", torch.arange(64.0))}

    with contextlib.nullcontext() if torch.cuda.is_available() else cpu_compat.enabled():
        _integrity_scenario(tmp_path, state, torch, dist_checkpointing)


def _integrity_scenario(tmp_path, state, torch, dist_checkpointing):
    args = argparse.Namespace(verify_integrity=True)
    checkpointing.write(state(), root=str(tmp_path), iteration=3, args=args)
    folder = checkpointing.iteration_dir(str(tmp_path), 3)
    assert "integrity.json" in _checksummed(folder) and checkpointing.verify(folder) == []
    assert torch.equal(dist_checkpointing.load(state(), folder, verify_integrity=True)["w"], torch.arange(64.0))
    victim = sorted(n for n in os.listdir(folder) if n.endswith(".distcp"))[0]
    with open(os.path.join(folder, victim), "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
    with pytest.raises(Exception, match=victim):
        dist_checkpointing.load(state(), folder, verify_integrity=True)


# ---------------------------------------------------------------------------------------------
# pretrain_gpt.py on gloo ranks

ITERS = 6
EVAL = ["--eval-interval", "3", "--eval-iters", "1", "--num-workers", "1"]


def _flags(*extra, iters=ITERS):
    return [*TINY, "--train-iters", str(iters), "--global-batch-size", "8", *extra]


def _eval_lines(result):
    return [line for line in result.output.splitlines() if " loss at iteration" in line]


def _interval_means(result):
    """{iteration: 'lm loss'} of the log lines (printed with 7 significant digits)."""
    out = {}
    for line in result.iteration_lines():
        it = int(line.split("iteration")[1].split("/")[0])
        out[it] = float(line.split("lm loss:")[1].split("|")[0])
    return out


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """Uninterrupted run with CIERA, checkpoints every 3 iterations, evaluation, TensorBoard."""
    root = tmp_path_factory.mktemp("whole")
    result = run_pretrain(_flags(*CIERA, *EVAL, "--save", str(root / "ckpt"), "--save-interval", "3",
                                 "--tensorboard-dir", str(root / "tb")), nproc=2, timeout=300)
    assert result.returncode == 0, result.output[-4000:]
    return result, root


def test_saving_and_evaluation_do_not_perturb_training(whole):
    result, root = whole
    stock = run()  # no CIERA, no checkpoints, no evaluation (shared with test_mc_training)
    assert result.losses == stock.losses and result.sha256 == stock.sha256
    assert checkpointing.complete_iterations(str(root / "ckpt")) == [3, 6]
    assert checkpointing.latest_iteration(str(root / "ckpt")) == 6
    folder = checkpointing.iteration_dir(str(root / "ckpt"), 3)
    # the files are what this megatron-core writes (0.16: common.pt beside the .distcp files, 0.19:
    # the common state inside them): megatron-core's metadata, torch's, the data files its
    # metadata names, and our checksums of every one of them
    files = set(os.listdir(folder))
    assert {"metadata.json", ".metadata", checkpointing.CHECKSUMS} <= files
    assert _data_files(folder) and set(_data_files(folder)) <= files
    assert set(_checksummed(folder)) == files - {checkpointing.CHECKSUMS}


def _data_files(folder) -> list[str]:
    """The tensor files of a torch_dist checkpoint, largest first, as torch's checkpoint metadata
    (written by megatron-core's save) names them: no file name is assumed."""
    from torch.distributed.checkpoint import FileSystemReader

    sizes = {}
    for info in FileSystemReader(str(folder)).read_metadata().storage_data.values():
        sizes[info.relative_path] = sizes.get(info.relative_path, 0) + info.length
    return sorted(sizes, key=lambda name: (-sizes[name], name))


def _checksummed(folder) -> list[str]:
    with open(os.path.join(folder, checkpointing.CHECKSUMS)) as f:
        return [line.rstrip("\n").split("  ", 1)[1] for line in f if line.strip()]


def test_checkpoint_has_megatron_core_keys(whole):
    from megatron.core import dist_checkpointing

    _, root = whole
    folder = checkpointing.iteration_dir(str(root / "ckpt"), 3)
    common = dist_checkpointing.load_common_state_dict(folder)
    assert common["iteration"] == 3 and common["checkpoint_version"] == 3.0
    assert {"args", "opt_param_scheduler", "num_floating_point_operations_so_far"} <= set(common)
    keys = set(dist_checkpointing.load_tensors_metadata(folder))
    # GPTModel's own sharded keys (layers stacked along a leading axis, experts by global index)
    assert "embedding.word_embeddings.weight" in keys and "output_layer.weight" in keys
    assert "decoder.layers.self_attention.linear_qkv.weight" in keys
    assert any(k.startswith("decoder.layers.mlp.experts.") for k in keys)
    assert any(k.startswith("optimizer.") for k in keys)
    assert dist_checkpointing.load_content_metadata(folder)["distrib_optim_sharding_type"] == "fully_reshardable"


@pytest.mark.slow  # the default run resumes from an --async-save checkpoint (overlapped-gathers test)
def test_async_save_writes_the_same_checkpoints(one_rank_group, whole, tmp_path):
    """--async-save: training is unchanged and every checkpoint holds the same tensors as the
    synchronous run's (so a resume from it is the synchronous resume, tested above and below)."""
    result, root = whole
    ckpt = tmp_path / "ckpt"
    asynchronous = run_pretrain(_flags(*CIERA, *async_save_flags(), "--save", str(ckpt), "--save-interval", "3",
                                       "--eval-iters", "0"), nproc=2, timeout=300)
    assert asynchronous.returncode == 0, asynchronous.output[-4000:]
    assert "started saving checkpoint" in asynchronous.output
    assert asynchronous.losses == result.losses and asynchronous.sha256 == result.sha256
    assert checkpointing.complete_iterations(str(ckpt)) == [3, 6] and checkpointing.latest_iteration(str(ckpt)) == 6
    for it in (3, 6):
        folder = checkpointing.iteration_dir(str(ckpt), it)
        assert checkpointing.verify(folder) == []
        assert _digests(folder) == _digests(checkpointing.iteration_dir(str(root / "ckpt"), it))


def test_resume_after_a_crash_matches_the_uninterrupted_run(whole, tmp_path):
    """The state a run killed during iteration 5 leaves: checkpoint 3 is the latest, a half-written
    iter_6 folder, loss-log lines of iterations 4-5. The resume repeats no iteration and ends
    with the uninterrupted run's losses, validation numbers and params sha256."""
    result, root = whole
    ckpt = tmp_path / "ckpt"
    shutil.copytree(root / "ckpt" / "iter_0000003", ckpt / "iter_0000003")
    (ckpt / checkpointing.TRACKER).write_text("3")
    (ckpt / "iter_0000006.incomplete").mkdir()
    log = tmp_path / "losses.txt"
    log.write_text("".join(f"{i} {result.losses[i].hex()}\n" for i in range(1, 6)))
    shutil.copytree(root / "tb", tmp_path / "tb")  # the interrupted run's events, steps 2, 4 and 6
    resumed = run_pretrain(_flags(*CIERA, *EVAL, "--save", str(ckpt), "--load", str(ckpt),
                                  "--save-interval", "3", "--tensorboard-dir", str(tmp_path / "tb")),
                           nproc=2, timeout=300, loss_log=str(log))
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert "loaded checkpoint" in resumed.output and "removing" in resumed.output
    assert resumed.losses == result.losses  # iterations 1-3 kept, 4-6 rewritten, none twice
    assert [line.split()[0] for line in log.read_text().splitlines()] == [str(i) for i in range(1, ITERS + 1)]
    assert resumed.sha256 == result.sha256
    assert _eval_lines(resumed) == _eval_lines(result)[-len(_eval_lines(resumed)):]
    assert not (ckpt / "iter_0000006.incomplete").exists() and checkpointing.latest_iteration(str(ckpt)) == 6
    # TensorBoard: purge_step dropped the interrupted run's steps past 3; each step once, with the
    # interval mean its log line printed (step 4's interval is the resumed iteration 4 alone)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    loss = {e.step: e.value for e in acc.Scalars("lm loss")}
    assert sorted(loss) == [2, 4, 6] and [e.step for e in acc.Scalars("lm loss")] == [2, 4, 6]
    assert loss[2] == pytest.approx(_interval_means(result)[2], rel=1e-6)
    assert loss[4] == pytest.approx(_interval_means(resumed)[4], rel=1e-6) == pytest.approx(result.losses[4])
    assert loss[6] == pytest.approx((result.losses[5] + result.losses[6]) / 2, rel=1e-6)


def _stop_and_resume(tmp_path, *flags, at=3, iters=ITERS, save_flags=(), resume_flags=()):
    """Train to ``at`` saving a checkpoint there (``--exit-interval``; ``save_flags`` only in this
    first run), then resume to ``iters`` (with ``resume_flags``)."""
    ckpt = str(tmp_path / "ckpt")
    first = run_pretrain(_flags(*flags, *save_flags, "--save", ckpt, "--save-interval", str(at),
                                "--exit-interval", str(at), iters=iters), nproc=2, timeout=300)
    assert first.returncode == 0, first.output[-4000:]
    resumed = run_pretrain(_flags(*flags, *resume_flags, "--load", ckpt, iters=iters), nproc=2, timeout=300)
    assert resumed.returncode == 0, resumed.output[-4000:]
    return first, resumed


@pytest.mark.parametrize("ciera", [pytest.param(False, marks=pytest.mark.slow), True], ids=["plain", "ciera"])
def test_resume_under_overlapped_gathers_is_bit_exact(one_rank_group, tmp_path, ciera):
    """--overlap-grad-reduce --overlap-param-gather with several buckets per buffer (what the
    example launch scripts run): the checkpoint holds each bucket's optimizer state at its own
    place (megatron-core <= 0.19 misplaced every bucket after the first), so the resume continues
    the uninterrupted run bit for bit: every iteration's loss and the params sha256. The CIERA
    variant (default run) writes that checkpoint with --async-save, which the run finalises
    before --exit-interval ends it, on the persistent worker process (--use-persistent-ckpt-worker)."""
    flags = (*OVERLAP, *CIERA) if ciera else OVERLAP
    whole = run(*flags)  # shared with test_mc_training
    first, resumed = _stop_and_resume(tmp_path, *flags, save_flags=async_save_flags() if ciera else [])
    if ciera:
        assert "started saving checkpoint" in first.output
        assert checkpointing.verify(checkpointing.iteration_dir(str(tmp_path / "ckpt"), 3)) == []
    assert first.losses == {i: whole.losses[i] for i in (1, 2, 3)}  # iteration 3 logged at the exit too
    assert resumed.losses == {i: whole.losses[i] for i in (4, 5, 6)} and resumed.sha256 == whole.sha256


def test_legacy_torch_format_resumes_bit_exact(tmp_path):
    """--ckpt-format torch: Megatron-LM's per-rank files (mp_rank_00/model_optim_rng.pt and the
    distributed optimizer's distrib_optim.pt), published atomically with checksums like torch_dist;
    the resume, which reads the format from the checkpoint (--auto-detect-ckpt-format, its own
    --ckpt-format left at torch_dist), continues the uninterrupted run bit for bit (with CIERA)."""
    from megatron.ciera.app import torch_checkpoint

    whole = run(*CIERA)  # shared with test_mc_training
    first, resumed = _stop_and_resume(tmp_path, *CIERA, save_flags=["--ckpt-format", "torch"],
                                      resume_flags=["--auto-detect-ckpt-format"])
    folder = checkpointing.iteration_dir(str(tmp_path / "ckpt"), 3)
    assert sorted(os.listdir(folder)) == [checkpointing.CHECKSUMS, "mp_rank_00"]
    assert sorted(os.listdir(os.path.join(folder, "mp_rank_00"))) == [torch_checkpoint.OPTIM_FILE,
                                                                       torch_checkpoint.MODEL_FILE]
    assert "--ckpt-format torch" in resumed.output
    assert first.losses == {i: whole.losses[i] for i in (1, 2, 3)}
    assert resumed.losses == {i: whole.losses[i] for i in (4, 5, 6)} and resumed.sha256 == whole.sha256


def test_checkpoint_format_mismatch_is_named(one_rank_group, tmp_path):
    """A torch checkpoint loaded with --ckpt-format torch_dist (and the reverse) fails before
    anything is read, naming the flag to pass; a torch checkpoint at another layout names the
    flags that differ."""
    from megatron.ciera.app import torch_checkpoint

    folder = checkpointing.iteration_dir(str(tmp_path), 5)
    os.makedirs(os.path.join(folder, "mp_rank_00"))
    with open(os.path.join(folder, "mp_rank_00", torch_checkpoint.MODEL_FILE), "wb") as f:
        f.write(b"not read")
    checkpoint_publish.write_checksums(folder)
    (tmp_path / checkpointing.TRACKER).write_text("5")
    args = _args(load=str(tmp_path), ckpt_format="torch_dist")
    with pytest.raises(SystemExit, match="is a --ckpt-format torch checkpoint .* pass --ckpt-format torch"):
        checkpointing.load(args, model=None, optimizer=None, scheduler=None)
    saved = argparse.Namespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
    with pytest.raises(SystemExit, match=r"--tensor-model-parallel-size: checkpoint 2, this run 1"):
        torch_checkpoint.check_layout(saved, argparse.Namespace(tensor_model_parallel_size=1))
    torch_checkpoint.check_layout(saved, argparse.Namespace(tensor_model_parallel_size=2))


def _group(wd, ep, **kw):
    return {"wd_mult": wd, "lr_mult": 1.0, "is_expert_parallel": ep, "is_decoupled_lr": False, **kw}


def test_optimizer_state_follows_the_expert_parallel_size():
    """megatron-core chains a separate expert optimizer only at EP > 1: the common part of a
    checkpoint from another EP size (parameter groups, step) is regrouped for this run's
    optimizers, the fully_reshardable tensors stay where the load request put them."""
    from types import SimpleNamespace

    def opt(*groups):
        return SimpleNamespace(optimizer=SimpleNamespace(param_groups=[{**g, "params": [object()]} for g in groups]))

    dense = [_group(1.0, False, step=2.0, lr=3e-4), _group(0.0, False, step=2.0, lr=3e-4)]
    expert = [_group(1.0, True, step=2.0, lr=3e-4)]
    tensors = {"exp_avg": "loaded tensors"}
    # EP 2 checkpoint (two chained optimizers) -> EP 1 (one optimizer holding the experts too)
    ep2 = {0: {"optimizer": {"param_groups": dense}, "param_state_sharding_type": "fully_reshardable"},
           1: {"optimizer": {"param_groups": expert}, "param_state_sharding_type": "fully_reshardable"},
           "param_state": tensors}
    one = SimpleNamespace(chained_optimizers=[opt(_group(1.0, False), _group(0.0, False))])
    fitted = checkpoint_fixes.fit_optimizer_layout(ep2, one)
    assert fitted == {"optimizer": {"param_groups": dense}, "param_state_sharding_type": "fully_reshardable",
                      "param_state": tensors}
    # EP 1 checkpoint -> EP 2: the expert optimizer takes the dense group of the same multipliers
    ep1 = {"optimizer": {"param_groups": dense}, "param_state_sharding_type": "fully_reshardable"}
    loaded = {**ep1, 0: {"param_state": "dense tensors"}, 1: {"param_state": "expert tensors"}}
    two = SimpleNamespace(chained_optimizers=[opt(*dense), opt(_group(1.0, True))])
    fitted = checkpoint_fixes.fit_optimizer_layout(loaded, two)
    assert fitted[0] == {"optimizer": {"param_groups": dense}, "param_state_sharding_type": "fully_reshardable",
                         "param_state": "dense tensors"}
    assert fitted[1]["optimizer"]["param_groups"] == [_group(1.0, True, step=2.0, lr=3e-4)]
    assert fitted[1]["param_state"] == "expert tensors"
    # same structure: untouched; a layout-bound optimizer format or an unknown group: a clear error
    assert checkpoint_fixes.fit_optimizer_layout(ep1, one) is ep1
    with pytest.raises(SystemExit, match="only a fully reshardable optimizer state changes its expert-parallel"):
        checkpoint_fixes.fit_optimizer_layout({**ep1, "param_state_sharding_type": "dp_reshardable", 0: {}, 1: {}}, two)
    with pytest.raises(SystemExit, match="no optimizer parameter group like"):
        checkpoint_fixes.fit_optimizer_layout(ep2, SimpleNamespace(chained_optimizers=[opt(_group(0.5, False))]))


def test_world_tensors_are_put_back_in_the_buffer_layout():
    """Three buckets of 5, 3 and 4 elements padded to 8 each: every element lands at its buffer
    index (where upstream slices each parameter), the padding is zero."""
    import torch
    from types import SimpleNamespace

    buckets = [SimpleNamespace(offset=0, numel_unpadded=5), SimpleNamespace(offset=8, numel_unpadded=3),
               SimpleNamespace(offset=16, numel_unpadded=4)]
    buffer = SimpleNamespace(numel=24, buckets=buckets)
    world = torch.arange(1, 13, dtype=torch.float32)  # the buckets' elements back to back
    out = checkpoint_fixes.in_buffer_layout(world, buffer)
    assert out.tolist() == [1, 2, 3, 4, 5, 0, 0, 0, 6, 7, 8, 0, 0, 0, 0, 0, 9, 10, 11, 12, 0, 0, 0, 0]
    assert checkpoint_fixes.upstream_misplaces_padded_buckets()  # megatron-core 0.16.1: the fix is active


def test_checkpoint_workarounds_are_gated_on_the_upstream_sources_they_were_checked_against():
    """Every upstream method the workarounds replace or rely on is the one read in a checked
    megatron-core version; a changed one is named with what to re-check."""
    from megatron.ciera.binding import upstream_patch

    methods, known = checkpoint_fixes.UPSTREAM_METHODS, checkpoint_fixes.KNOWN_SOURCES
    digests = dict(upstream_patch.installed_digests(methods))
    for version, table in known.items():
        assert set(table) == {m.name for m in methods}, version
    assert upstream_patch.upstream_changes(methods=methods, known=known) == [], (
        "re-check these, then record their digests in checkpoint_fixes.KNOWN_SOURCES: " + str(digests))
    changes = upstream_patch.upstream_changes(methods=methods, known=known, digests={**digests, methods[0].name: "0" * 16})
    assert len(changes) == 1 and methods[0].name in changes[0] and methods[0].recheck in changes[0]


def _digests(folder) -> dict:
    """sha256 of the full (unsharded) model and optimizer tensors of a checkpoint, whatever layout
    wrote it: ``{"model": ..., "optimizer": ...}``. Needs a process group (dist-ckpt loads)."""
    import hashlib

    import torch
    from megatron.core import dist_checkpointing

    tensors = dist_checkpointing.load_plain_tensors(str(folder))
    out = {}
    for part in ("model", "optimizer"):
        h = hashlib.sha256()
        keys = sorted(k for k, v in tensors.items()
                      if isinstance(v, torch.Tensor) and k.startswith("optimizer.") == (part == "optimizer"))
        assert keys, f"{folder}: no {part} tensors"
        for key in keys:
            t = tensors[key]
            h.update(key.encode() + str(t.dtype).encode() + str(tuple(t.shape)).encode())
            h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
        out[part] = h.hexdigest()
    return out


def _reload_and_resave(tmp_path, source, iteration, flags, nproc, name="resaved"):
    """Load ``source`` at another layout and save it again at once (no training step): the full
    model and optimizer tensors of the two checkpoints must be bit-identical."""
    resaved = tmp_path / name
    # --use-checkpoint-opt-param-scheduler: the run stops at the loaded iteration, so its own
    # --train-iters schedule differs from the checkpoint's (as upstream, that is refused by default).
    again = run_pretrain(_flags(*flags, "--load", str(source), "--ckpt-step", str(iteration), "--save", str(resaved),
                                "--use-checkpoint-opt-param-scheduler", iters=iteration), nproc=nproc, timeout=400)
    assert again.returncode == 0 and "loaded checkpoint" in again.output, again.output[-4000:]
    assert _digests(checkpointing.iteration_dir(str(source), iteration)) == \
        _digests(checkpointing.iteration_dir(str(resaved), iteration))
    return resaved


def test_reshard_to_another_data_parallel_size_is_exact(one_rank_group, whole, tmp_path):
    """Checkpoint 3 of the 2-rank run (DP 2) loads on one rank (DP 1) and, saved again there,
    holds the same model and optimizer tensors bit for bit (the distributed optimizer's shards
    are re-cut by dist-ckpt)."""
    _, root = whole
    _reload_and_resave(tmp_path, root / "ckpt", 3, CIERA, nproc=1)


def test_virtual_pipeline_chunks_have_megatron_keys():
    """Megatron-LM's state dict names: ``model`` for one chunk, ``model0``, ``model1``, ... with
    virtual pipeline stages (``model`` given as the list of chunks)."""
    a, b = object(), object()
    assert checkpoint_state.model_keys(a) == [("model", a)]
    assert checkpoint_state.model_keys([a]) == [("model", a)]
    assert checkpoint_state.model_keys([a, b]) == [("model0", a), ("model1", b)]


# Layout changes (slow): save at one layout, load at another; the full tensors are bit-identical
# after the load, and training goes on from there.
_TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
_PP2 = ["--pipeline-model-parallel-size", "2"]
_EP2 = ["--expert-model-parallel-size", "2"]
_VPP = ["--num-layers", "4", *_PP2, "--num-layers-per-virtual-pipeline-stage", "1"]


@pytest.mark.slow
@pytest.mark.parametrize("before,after", [(_TP2, []), ([], _TP2), (_PP2, []), ([], _PP2), (_EP2, []), ([], _EP2),
                                          (_VPP, ["--num-layers", "4"])],
                         ids=["tp2-tp1", "tp1-tp2", "pp2-pp1", "pp1-pp2", "ep2-ep1", "ep1-ep2", "vpp2-pp1"])
def test_resume_at_another_layout(one_rank_group, tmp_path, before, after):
    """2 ranks each side. The checkpoint written at ``before`` loads at ``after`` with the same
    full model and optimizer tensors; two more iterations train with finite losses."""
    first = run_pretrain(_flags(*before, "--save", str(tmp_path / "ckpt"), iters=2), nproc=2, timeout=400)
    assert first.returncode == 0, first.output[-4000:]
    resaved = _reload_and_resave(tmp_path, tmp_path / "ckpt", 2, after, nproc=2)
    go_on = run_pretrain(_flags(*after, "--load", str(resaved), "--override-opt-param-scheduler", iters=4),
                         nproc=2, timeout=400)
    assert go_on.returncode == 0, go_on.output[-4000:]
    assert sorted(go_on.losses) == [3, 4] and all(math.isfinite(v) for v in go_on.losses.values())


@pytest.mark.slow
def test_virtual_pipeline_resume_is_bit_exact(tmp_path):
    """PP 2 x VPP 2 (chunks saved as model0 / model1): stop at 2, resume to 4, equal to the
    uninterrupted run, with and without CIERA."""
    for flags in (_VPP, [*_VPP, *CIERA]):
        whole = run_pretrain(_flags(*flags, iters=4), nproc=2, timeout=400)
        assert whole.returncode == 0, whole.output[-4000:]
        _, resumed = _stop_and_resume(tmp_path / str(len(flags)), *flags, at=2, iters=4)
        assert resumed.losses == {i: whole.losses[i] for i in (3, 4)} and resumed.sha256 == whole.sha256


@pytest.mark.slow
def test_resume_at_another_data_parallel_size(whole):
    """Checkpoint 3 of the 2-rank run (DP 2) loads on one rank (DP 1): dist-ckpt reshards the
    distributed optimizer; training goes on from the same state (not bit for bit: the reduction
    order differs), the first loss after the resume matches to bf16 precision."""
    result, root = whole
    resumed = run_pretrain(_flags(*CIERA, "--load", str(root / "ckpt"), "--ckpt-step", "3", "--eval-iters", "0",
                                  iters=4), nproc=1, timeout=300)
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert sorted(resumed.losses) == [4]
    assert abs(resumed.losses[4] - result.losses[4]) < 2e-2 * abs(result.losses[4])


def test_damaged_checkpoint_fails_on_every_rank(whole, tmp_path):
    _, root = whole
    ckpt = tmp_path / "ckpt"
    shutil.copytree(root / "ckpt", ckpt)
    name = _data_files(ckpt / "iter_0000006")[0]  # the largest tensor file, whatever megatron-core calls it
    victim = ckpt / "iter_0000006" / name
    data = bytearray(victim.read_bytes())
    data[-5000:-904] = bytes(b ^ 0xFF for b in data[-5000:-904])
    victim.write_bytes(bytes(data))
    failed = run_pretrain(_flags(*CIERA, "--load", str(ckpt)), nproc=2, timeout=300)
    assert failed.returncode != 0 and failed.sha256 is None
    # every rank raises the same message naming the file
    assert failed.output.count(f"iter_0000006/{name} is damaged") >= 2, failed.output[-3000:]
    assert "loaded checkpoint" not in failed.output


def test_nan_loss_stops_with_a_nonzero_exit(tmp_path):
    failed = run_pretrain(_flags("--init-method-std", "1e30", "--save", str(tmp_path / "ckpt"), iters=2),
                          nproc=2, timeout=300)
    assert failed.returncode != 0
    assert "NaN or Inf" in failed.output, failed.output[-3000:]
    assert checkpointing.complete_iterations(str(tmp_path / "ckpt")) == []  # nothing saved


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_is_bit_exact(tmp_path):
    """A real kill: SIGKILL the job after its checkpoint at 4, resume, compare with the whole run
    (plain gather and CIERA, synchronous and overlapped gathers)."""
    for flags in ([], CIERA, OVERLAP, [*OVERLAP, *CIERA]):
        whole = run(*flags, iters=8)
        ckpt, log = tmp_path / f"ckpt{len(flags)}", tmp_path / f"losses{len(flags)}.txt"  # distinct lengths
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29713",
                "pretrain_gpt.py", *_flags(*flags, "--save", str(ckpt), "--save-interval", "4", iters=8),
                "--ciera-loss-log", str(log)]
        proc = subprocess.Popen(argv, cwd=os.path.dirname(checkpointing.__file__) + "/../../..", start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 240
        while checkpointing.latest_iteration(str(ckpt)) != 4 and time.time() < deadline:
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        assert checkpointing.latest_iteration(str(ckpt)) == 4
        resumed = run_pretrain(_flags(*flags, "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "4",
                                      iters=8), nproc=2, timeout=300, loss_log=str(log))
        assert resumed.returncode == 0, resumed.output[-4000:]
        assert resumed.losses == whole.losses and resumed.sha256 == whole.sha256


@pytest.mark.slow
def test_resume_at_another_expert_parallel_layout(tmp_path):
    """EP 2 on 4 ranks -> EP 1 on 2 ranks and DP 4 -> DP 2 (experts and optimizer reshard)."""
    ckpt = tmp_path / "ckpt"
    first = run_pretrain(_flags("--expert-model-parallel-size", "2", *CIERA, "--save", str(ckpt), iters=3),
                         nproc=4, timeout=400)
    assert first.returncode == 0, first.output[-4000:]
    whole = run_pretrain(_flags("--expert-model-parallel-size", "2", *CIERA, iters=4), nproc=4, timeout=400)
    resumed = run_pretrain(_flags(*CIERA, "--load", str(ckpt), iters=4), nproc=2, timeout=400)
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert abs(resumed.losses[4] - whole.losses[4]) < 2e-2 * abs(whole.losses[4])


@pytest.mark.slow
def test_finetune_and_no_load_optim(whole, tmp_path):
    _, root = whole
    tuned = run_pretrain(_flags("--load", str(root / "ckpt"), "--finetune", "--save", str(tmp_path / "ft"),
                                iters=2), nproc=2, timeout=300)
    assert tuned.returncode == 0 and sorted(tuned.losses) == [1, 2], tuned.output[-3000:]
    fresh = run_pretrain(_flags("--load", str(root / "ckpt"), "--no-load-optim", "--no-load-rng", iters=7),
                         nproc=2, timeout=300)
    assert fresh.returncode == 0 and sorted(fresh.losses) == [7], fresh.output[-3000:]

