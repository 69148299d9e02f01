"""pretrain_gpt.py --use-megatron-fsdp (megatron-core's own FSDP) on gloo ranks, made CPU-able by
megatron.ciera.cpu_compat: every --data-parallel-sharding-strategy it accepts trains the tiny MoE
exactly as the distributed optimizer without FSDP does (per-iteration losses, float.hex).

``optim_grads_params`` (ZeRO-3) also ends on the same parameters (params sha256: its parameters
are the bf16 model weights); under ``optim`` / ``optim_grads`` Megatron-FSDP exposes the fp32 main
weights as the parameters, so their digest is another one."""

import functools
import os
import sys

import pytest

from megatron.ciera import arguments
from megatron.ciera.launch import run_pretrain

sys.path.insert(0, os.path.dirname(__file__))
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


def test_megatron_fsdp_zero3_trains_like_the_distributed_optimizer():
    result = run(*strategy("optim_grads_params"))
    assert result.losses == ddp().losses
    assert result.sha256 == ddp().sha256


@pytest.mark.slow
@pytest.mark.parametrize("name", ["optim", "optim_grads"])
def test_megatron_fsdp_zero1_zero2_train_like_the_distributed_optimizer(name):
    assert run(*strategy(name)).losses == ddp().losses


# -- the flags: upstream's rules for --use-megatron-fsdp ------------------------------------------
ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--lr", "1e-4", "--micro-batch-size", "2", "--train-iters", "5", "--mock-data", "--tokenizer-type",
        "NullTokenizer", "--vocab-size", "255", "--bf16", "--use-megatron-fsdp", "--use-distributed-optimizer",
        "--no-gradient-accumulation-fusion", "--device", "cpu"]


def parse(extra, base=ARGS):
    argv = base + extra
    parser = arguments.build_parser()
    args = parser.parse_args(argv)
    args.explicit = arguments.explicit_dests(parser, argv)
    return arguments.validate_args(args, world_size=2)


def test_megatron_fsdp_flags_accepted():
    args = parse(["--ckpt-format", "fsdp_dtensor", *strategy("optim_grads_params")])
    assert args.use_megatron_fsdp and args.data_parallel_sharding_strategy == "optim_grads_params"
    assert "--no-gradient-accumulation-fusion" not in args.cpu_ignored  # off is what runs on CPU


@pytest.mark.parametrize("extra, message", [
    ([*strategy("optim")], "--ckpt-format torch_dist: Megatron FSDP only supports the fsdp_dtensor"),
    (["--ckpt-format", "fsdp_dtensor", *strategy("no_shard")], "--data-parallel-sharding-strategy no_shard"),
    (["--ckpt-format", "fsdp_dtensor", *strategy("optim"), "--save", "/tmp/x"], "--save with --use-megatron-fsdp"),
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
