"""pretrain_gpt.py --use-megatron-fsdp (megatron-core's own FSDP) on gloo ranks, made CPU-able by
megatron.ciera.binding.cpu_compat: every --data-parallel-sharding-strategy it accepts trains the tiny MoE
with the distributed optimizer's per-iteration losses (float.hex), and with --ciera-allgather bit
for bit as without (losses and the final params sha256: Megatron-FSDP's sharded parameters, read
whole), each bucket gathered once per step (ZeRO-3 layer buckets: forward and backward of every
micro batch) and encoded once per step. --ckpt-format fsdp_dtensor checkpoints resume the
uninterrupted run bit for bit."""

import functools
import os
import re

import pytest

from flag_args import TINY_FLAGS, parse_and_validate
from megatron.ciera.app import arguments
from megatron.ciera.app.launch import run_pretrain

from test_mc_training import TINY  # noqa: E402  (the same tiny MoE, with --use-distributed-optimizer)

pytestmark = pytest.mark.distributed

# Upstream's rule for --use-megatron-fsdp: the fsdp_dtensor checkpoint format.
MFSDP = TINY + ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor", "--no-gradient-accumulation-fusion"]
ITERS = 4  # global batch 8 = micro batch 2 x 2 ranks x 2 micro batches


@functools.lru_cache(maxsize=None)
def run(*flags, base=tuple(MFSDP), nproc=2, iters=ITERS, gbs=8):
    result = run_pretrain([*base, "--train-iters", str(iters), "--global-batch-size", str(gbs), *flags],
                          nproc=nproc, timeout=300)
    assert result.returncode == 0, result.output[-4000:]
    assert sorted(result.losses) == list(range(1, iters + 1)) and result.sha256
    return result


def ddp():
    """The distributed optimizer without FSDP: the reference."""
    return run(base=tuple(TINY))


def strategy(name):
    return ("--data-parallel-sharding-strategy", name)


CIERA = ("--ciera-allgather", "--ciera-selection", "always", "--ciera-codec", "exponent_reuse", "--ciera-log-buckets")
MICRO = 2  # micro batches per step


def last_table(result) -> dict:
    """The last per-interval CIERA table (iterations 3-4): bucket -> (gathers, raw gathers, codec)."""
    block = result.output.rsplit("CIERA buckets, iterations 3-4", 1)[1].split("\ntotal", 1)[0]
    rows = {}
    for line in block.strip().splitlines()[2:]:
        f = line.split()
        rows[f[0]] = (int(f[-4]), int(f[-3]), f[-1])
    return rows


def encodes(result) -> dict:
    line = re.search(r"^CIERA Megatron-FSDP encodes per bucket \(one per optimizer step\): (.*)$", result.output,
                     re.M).group(1)
    return {name: int(n) for name, n in (part.rsplit(" ", 1) for part in line.split(", "))}


def assert_bit_identical(name, *, zero3_buckets: int):
    """With and without CIERA: the same losses and params; in iterations 3-4 every bucket gathered
    compressed, ``zero3_buckets`` of them 2 x micro batches per step and the others once; every
    bucket encoded once at its first gather and once per optimizer step."""
    base, result = run(*strategy(name)), run(*strategy(name), *CIERA)
    assert result.losses == base.losses, "per-iteration losses differ"
    assert result.sha256 == base.sha256, "final params differ"
    rows = last_table(result)
    per_step = sorted(gathers // 2 for gathers, _, _ in rows.values())  # two steps in the table
    assert per_step == [1] * (len(rows) - zero3_buckets) + [2 * MICRO] * zero3_buckets, rows
    assert all(raw == 0 and codec == "exponent_reuse" for _, raw, codec in rows.values()), rows
    assert encodes(result) == {bucket: 1 + ITERS for bucket in rows}
    assert "ciera raw/wire" in result.iteration_lines()[-1] and "ciera raw/wire" not in base.output
    return result


@pytest.mark.slow
def test_megatron_fsdp_zero3_trains_like_the_distributed_optimizer():
    assert run(*strategy("optim_grads_params")).losses == ddp().losses


def test_megatron_fsdp_zero3_is_bit_identical_with_ciera():
    """optim_grads_params: the root unit's bucket persists (gathered once per step); the two layers'
    dense and expert buckets are freed after use and gathered in every forward and backward."""
    result = assert_bit_identical("optim_grads_params", zero3_buckets=4)
    agreed = re.search(r"^CIERA ZeRO-3 agreements: (\d+) after optimizer steps .*, (\d+) in gathers", result.output, re.M)
    steps, in_gathers = int(agreed.group(1)), int(agreed.group(2))
    assert in_gathers == len(encodes(result)) == 5, "each bucket agrees in a gather only at its first (2 micro-batches)"
    assert steps in (ITERS, 2 * ITERS), "one agreement per process group (dense, expert) and optimizer step"
    planned = re.search(r"^CIERA ZeRO-3 cache \([\w+]+\): [\d.]+ MiB \((\d+) bytes\) per rank", result.output, re.M)
    measured = re.search(r"^CIERA ZeRO-3 cache: [\d.]+ MiB \((\d+) bytes\) per rank .*\(measured\)$", result.output, re.M)
    assert int(planned.group(1)) == int(measured.group(1)) > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["optim", "optim_grads"])
def test_megatron_fsdp_zero1_zero2_bit_identical_with_ciera(name):
    assert_bit_identical(name, zero3_buckets=0)
    assert run(*strategy(name)).losses == ddp().losses


# -- fsdp_dtensor checkpoints: a resume continues the uninterrupted run bit for bit ------------------
def stop_and_resume(tmp_path, *flags, at=2, nproc=2, gbs=8):
    """Train to ``at`` saving a checkpoint there (``--exit-interval``), then resume to ``ITERS``."""
    ckpt = str(tmp_path / "ckpt")
    first = run_pretrain([*MFSDP, "--train-iters", str(ITERS), "--global-batch-size", str(gbs), *flags,
                          "--save", ckpt, "--save-interval", str(at), "--exit-interval", str(at)],
                         nproc=nproc, timeout=300)
    assert first.returncode == 0, first.output[-4000:]
    resumed = run_pretrain([*MFSDP, "--train-iters", str(ITERS), "--global-batch-size", str(gbs), *flags,
                            "--load", ckpt], nproc=nproc, timeout=300)
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert "--ckpt-format fsdp_dtensor" in resumed.output and "loaded checkpoint" in resumed.output
    return first, resumed


def assert_resumes_bit_exact(tmp_path, *flags, nproc=2, gbs=8):
    from megatron.ciera.app import checkpointing, fsdp_dtensor_checkpoint

    whole = run(*flags, nproc=nproc, gbs=gbs)
    first, resumed = stop_and_resume(tmp_path, *flags, nproc=nproc, gbs=gbs)
    folder = checkpointing.iteration_dir(str(tmp_path / "ckpt"), 2)
    assert sorted(os.listdir(folder)) == sorted([".metadata", checkpointing.CHECKSUMS]
                                                + [f"__{r}_0.distcp" for r in range(nproc)])
    assert fsdp_dtensor_checkpoint.saved_keys(folder) == {  # Megatron-LM's keys
        "model", "optimizer", "opt_param_scheduler", "rng_state", "iteration", "checkpoint_version", "args",
        "num_floating_point_operations_so_far"}
    assert first.losses == {i: whole.losses[i] for i in (1, 2)}
    assert resumed.losses == {i: whole.losses[i] for i in range(3, ITERS + 1)}, "losses after the resume differ"
    assert resumed.sha256 == whole.sha256, "final params differ"
    return whole, resumed


def test_megatron_fsdp_zero3_resume_is_bit_exact_with_ciera(tmp_path):
    """optim_grads_params with CIERA: saved at 2, resumed to 4, the uninterrupted run's losses and
    params (which equal the stock gather's: test_megatron_fsdp_zero3_is_bit_identical_with_ciera).
    The resumed run's gathers start from empty caches: each bucket's first gather after the load is
    raw (the uninterrupted run had none raw in iterations 3-4) and the losses show it was right."""
    whole, resumed = assert_resumes_bit_exact(tmp_path, *strategy("optim_grads_params"), *CIERA)
    assert {raw for _, raw, _ in last_table(whole).values()} == {0}
    assert {raw for _, raw, _ in last_table(resumed).values()} == {1}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["optim", "optim_grads", "optim_grads_params"])
@pytest.mark.parametrize("ciera", [False, True], ids=["plain", "ciera"])
def test_megatron_fsdp_resume_is_bit_exact(tmp_path, name, ciera):
    assert_resumes_bit_exact(tmp_path, *strategy(name), *(CIERA if ciera else ()))


@pytest.mark.slow
def test_megatron_fsdp_expert_parallel_resume_is_bit_exact(tmp_path):
    assert_resumes_bit_exact(tmp_path, *strategy("optim_grads_params"), "--expert-model-parallel-size", "2", *CIERA,
                             nproc=4, gbs=16)


# -- the flags: upstream's rules for --use-megatron-fsdp ------------------------------------------
ARGS = [*TINY_FLAGS, "--use-megatron-fsdp", "--use-distributed-optimizer",
        "--no-gradient-accumulation-fusion", "--device", "cpu"]


def parse(extra, base=ARGS):
    return parse_and_validate(base + extra, world=2)


def test_megatron_fsdp_flags_accepted():
    args = parse(["--ckpt-format", "fsdp_dtensor", *strategy("optim_grads_params")])
    assert args.use_megatron_fsdp and args.data_parallel_sharding_strategy == "optim_grads_params"
    assert "--no-gradient-accumulation-fusion" not in args.cpu_ignored  # off is what runs on CPU


@pytest.mark.parametrize("extra, message", [
    ([*strategy("optim")], "--ckpt-format torch_dist: Megatron FSDP only supports the fsdp_dtensor"),
    (["--ckpt-format", "fsdp_dtensor", *strategy("no_shard")], "--data-parallel-sharding-strategy no_shard"),
    (["--ckpt-format", "fsdp_dtensor", *strategy("optim"), "--save", "/tmp/x", "--async-save"],
     "--async-save with --ckpt-format fsdp_dtensor: not implemented by this entry point"),
    (["--ckpt-format", "fsdp_dtensor", *strategy("optim_grads_params"),
      "--check-weight-hash-across-dp-replicas-interval", "2"], "--check-weight-hash-across-dp-replicas-interval"),
])
def test_megatron_fsdp_rejections_name_the_flag(extra, message):
    with pytest.raises(ValueError, match="invalid arguments") as info:
        parse(extra)
    assert message in str(info.value)


def test_megatron_fsdp_needs_the_distributed_optimizer():
    with pytest.raises(ValueError) as info:
        parse(["--ckpt-format", "fsdp_dtensor", *strategy("optim")],
              base=[a for a in ARGS if a != "--use-distributed-optimizer"])
    assert "--use-megatron-fsdp needs --use-distributed-optimizer" in str(info.value)


def test_fsdp_dtensor_without_megatron_fsdp_is_refused():
    with pytest.raises(ValueError) as info:
        parse(["--ckpt-format", "fsdp_dtensor"], base=[a for a in ARGS if a != "--use-megatron-fsdp"])
    assert "--ckpt-format fsdp_dtensor" in str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize("flags", [("--ciera-selection", "auto"),
                                   ("--ciera-selection", "always", "--ciera-cache", "values", "--ciera-codec", "delta"),
                                   ("--ciera-selection", "always", "--ciera-cache", "none")])
def test_megatron_fsdp_zero3_other_selections_and_caches(flags):
    base, result = run(*strategy("optim_grads_params")), run(*strategy("optim_grads_params"), "--ciera-allgather", *flags)
    assert (result.losses, result.sha256) == (base.losses, base.sha256)
    assert sorted(g // 2 for g, _, _ in last_table(result).values()) == [1] + [2 * MICRO] * 4


@pytest.mark.slow
@pytest.mark.parametrize("name", ["optim", "optim_grads_params"])
def test_megatron_fsdp_overlap_bit_identical_with_ciera(name):
    flags = (*strategy(name), "--overlap-grad-reduce", "--overlap-param-gather")
    base, result = run(*flags), run(*flags, *CIERA)
    assert (result.losses, result.sha256) == (base.losses, base.sha256)
    assert set(encodes(result).values()) == {1 + ITERS}


@pytest.mark.slow
@pytest.mark.parametrize("nproc, gbs", [(2, 8), (4, 16)])
def test_megatron_fsdp_zero3_expert_parallel_bit_identical_with_ciera(nproc, gbs):
    """EP 2: at 2 ranks the experts' data-parallel group is one rank (their buckets gather nothing:
    upstream's copy); at 4 ranks every bucket is CIERA's."""
    flags = (*strategy("optim_grads_params"), "--expert-model-parallel-size", "2")
    base, result = run(*flags, nproc=nproc, gbs=gbs), run(*flags, *CIERA, nproc=nproc, gbs=gbs)
    assert (result.losses, result.sha256) == (base.losses, base.sha256)
    assert len(encodes(result)) == (3 if nproc == 2 else 5)
    assert set(encodes(result).values()) == {1 + ITERS}


# -- the version gate of megatron.ciera.binding.upstream_patch.megatron_fsdp ----------------------------------------
def test_megatron_fsdp_patch_version_gate():
    from megatron.ciera.binding.upstream_patch import megatron_fsdp as patch

    patch.check_upstream()  # the installed megatron-core's methods are the checked ones
    changed = dict(patch.installed_digests(patch.UPSTREAM_METHODS))
    name = next(iter(changed))
    changed[name] = "0" * 16
    with pytest.raises(RuntimeError, match=re.escape(name)):
        patch.check_upstream(digests=changed)


@pytest.mark.filterwarnings("ignore:.*all_gather_into_tensor.*:FutureWarning")
def test_gathers_start_inside_the_coalescing_manager(tmp_path):
    """Inside torch's ``_coalescing_manager`` (where Megatron-FSDP launches its bucket gathers) a
    collective is only recorded; the binding's start runs at once, and what the manager recorded
    before and after is still run at its end."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _coalescing_manager

    from megatron.ciera.binding.upstream_patch.megatron_fsdp import _start_outside_coalescing

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    group = dist.new_group([0])
    outs = [torch.zeros(4) for _ in range(3)]
    with _coalescing_manager(group, async_ops=True) as cm:
        dist.all_gather_into_tensor(outs[0], torch.full((4,), 1.0), group=group, async_op=True)
        work = _start_outside_coalescing(group, lambda: dist.all_gather_into_tensor(
            outs[1], torch.full((4,), 2.0), group=group, async_op=True))
        work.wait()
        assert outs[1].tolist() == [2.0] * 4 and outs[0].tolist() == [0.0] * 4  # ran now; the other waits
        dist.all_gather_into_tensor(outs[2], torch.full((4,), 3.0), group=group, async_op=True)
    cm.wait()
    assert [o[0].item() for o in outs] == [1.0, 2.0, 3.0]


def test_megatron_fsdp_zero3_with_evaluation_is_bit_identical_with_ciera():
    """Evaluation's forward passes gather (replays under CIERA) and leave the last buckets gathered:
    the parameters read at the end (sha256, checkpoint) are the shards again, equal with and without
    CIERA and to a run without evaluation."""
    evals = ("--eval-iters", "1", "--eval-interval", "2")
    base = run(*strategy("optim_grads_params"), *evals)
    result = run(*strategy("optim_grads_params"), *evals, *CIERA)
    assert result.losses == base.losses and result.sha256 == base.sha256
    assert result.sha256 == run(*strategy("optim_grads_params")).sha256
    assert "validation loss" in result.output


def test_megatron_fsdp_fp8_param_gather_is_accepted_with_ciera():
    """As under the distributed optimizer: fp8 buckets keep Megatron-FSDP's own gather (a start-up
    line says so), the others gather through CIERA; the command is not refused."""
    args = parse(["--ckpt-format", "fsdp_dtensor", *strategy("optim_grads_params"), "--fp8-format", "hybrid",
                  "--fp8-param-gather", "--ciera-allgather"])
    assert args.fp8_param_gather and args.ciera_allgather


@pytest.mark.slow
def test_megatron_fsdp_zero3_one_micro_batch_agrees_once_per_step():
    """One micro-batch per step (global batch 4 on 2 ranks): the same counts as with two."""
    base, result = run(*strategy("optim_grads_params"), gbs=4), run(*strategy("optim_grads_params"), *CIERA, gbs=4)
    assert result.losses == base.losses and result.sha256 == base.sha256
    agreed = re.search(r"^CIERA ZeRO-3 agreements: (\d+) after optimizer steps .*, (\d+) in gathers", result.output, re.M)
    assert int(agreed.group(2)) == len(encodes(result)) and int(agreed.group(1)) in (ITERS, 2 * ITERS)


@pytest.mark.slow  # (4 ranks, two launches; the default run gathers two levels on 4 ranks in tests/ciera/test_two_level.py)
def test_megatron_fsdp_zero3_two_level_cache_is_bit_identical_on_two_nodes_of_two():
    """Four ranks as two nodes of two (--ciera-node-size 2): every ZeRO-3 bucket gathers compressed
    across nodes from a cache of half the values, raw within the node; bit for bit, and the cache
    planned at start-up is the one measured."""
    flags = strategy("optim_grads_params")
    base = run(*flags, nproc=4, gbs=16)
    result = run(*flags, "--ciera-allgather", "--ciera-selection", "always", "--ciera-codec", "delta",
                 "--ciera-cache", "two_level", "--ciera-node-size", "2", nproc=4, gbs=16)
    assert (result.losses, result.sha256) == (base.losses, base.sha256)
    planned = re.search(r"^CIERA ZeRO-3 cache \(two_level\): [\d.]+ MiB \((\d+) bytes\) per rank", result.output, re.M)
    measured = re.search(r"^CIERA ZeRO-3 cache: [\d.]+ MiB \((\d+) bytes\) per rank .*\(measured\)$", result.output, re.M)
    assert planned and measured and int(planned.group(1)) == int(measured.group(1)) > 0, result.output[-3000:]
