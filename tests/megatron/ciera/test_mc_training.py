"""pretrain_gpt.py on gloo ranks: --ciera-allgather trains bit for bit like the stock gather.

Every comparison is exact: per-iteration losses (float.hex) and the final params sha256.
Runs are shared between tests of this module (each costs ~10-30 s on 2 cores)."""

import functools
import os
import tempfile

import pytest
import torch

from megatron.ciera.app.launch import run_pretrain

pytestmark = pytest.mark.distributed

TINY = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
        "--untie-embeddings-and-output-weights", "--num-experts", "4", "--moe-router-topk", "2",
        "--moe-ffn-hidden-size", "64", "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2",
        "--moe-token-dispatcher-type", "alltoall", "--use-distributed-optimizer", "--bf16", "--lr", "1e-3",
        "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--micro-batch-size", "2", "--seed", "1234",
        "--device", "cpu", "--log-interval", "2", "--eval-iters", "0", "--num-workers", "0"]
OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "20000"]
# selection 'always': on CPU the cost model would (rightly) send every bucket raw, and these tests
# are about the compressed path being bit-exact.
CIERA = ["--ciera-allgather", "--ciera-selection", "always", "--ciera-codec", "exponent_reuse",
         "--ciera-warmup-iters", "2"]
ITERS = 6
SNAPSHOTS = tempfile.mkdtemp(prefix="ciera-snapshots-")


@functools.lru_cache(maxsize=None)
def run(*flags, nproc=2, iters=ITERS, gbs=8):
    result = run_pretrain([*TINY, "--train-iters", str(iters), "--global-batch-size", str(gbs), *flags],
                          nproc=nproc, timeout=240)
    assert result.returncode == 0, result.output[-4000:]
    assert sorted(result.losses) == list(range(1, iters + 1)) and result.sha256
    return result


def assert_identical(a, b):
    assert a.losses == b.losses, "per-iteration losses differ"
    assert a.sha256 == b.sha256


def test_sync_gather_is_bit_identical():
    base, ciera = run(), run(*CIERA, "--ciera-snapshot-dir", SNAPSHOTS, "--ciera-snapshot-interval", "3")
    assert_identical(base, ciera)
    assert sorted(os.listdir(SNAPSHOTS)) == ["iter_0000003.pt", "iter_0000006.pt"]
    snapshot = torch.load(os.path.join(SNAPSHOTS, "iter_0000006.pt"))
    assert "embedding.word_embeddings.weight" in snapshot
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in snapshot.values())
    lines = ciera.iteration_lines()
    assert len(lines) == ITERS // 2 and all("ciera raw/wire:" in line for line in lines)
    assert "lm loss:" in lines[0] and "grad norm:" in lines[0] and "ciera raw/wire" not in base.output
    summary = ciera.summary_block()
    assert "dense0.bucket0" in summary and f"{ITERS:7d}" in summary  # one gather per step
    row = next(line for line in summary.splitlines() if line.startswith("dense0.bucket0")).split()
    gathers, raw_gathers, codec = int(row[-4]), int(row[-3]), row[-1]
    assert (gathers, raw_gathers, codec) == (ITERS, 2, "exponent_reuse")  # warmup raw, then compressed


def test_overlapped_gather_is_bit_identical():
    base, ciera = run(*OVERLAP), run(*OVERLAP, *CIERA)
    assert_identical(base, ciera)
    assert_identical(base, run())  # overlapping changes when, not what, is gathered
    assert ciera.summary_block().count(".bucket0") > 1  # several bucket groups


@pytest.mark.slow  # by default: test_mc_layouts' tp2_ep2 (EP 2 with overlapped gathers, dense and expert buckets)
def test_expert_parallel_four_ranks_is_bit_identical():
    flags = ("--expert-model-parallel-size", "2", "--overlap-grad-reduce", "--overlap-param-gather")
    base, ciera = run(*flags, nproc=4), run(*flags, *CIERA, nproc=4)
    assert_identical(base, ciera)
    summary = ciera.summary_block()
    assert "dense0.bucket0" in summary and "expert0.bucket0" in summary


# Checkpoint save / resume exactness: tests/megatron/ciera/app/test_mc_checkpointing.py.


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["exponent_reuse", "delta", "auto"])
def test_longer_run_with_microbatches_each_codec(codec):
    flags = ("--lr", "1e-4", "--ciera-warmup-iters", "1")
    base = run(*flags, iters=40, gbs=16)
    ciera = run(*flags, "--ciera-allgather", "--ciera-codec", codec, "--ciera-selection", "always",
                iters=40, gbs=16)
    assert_identical(base, ciera)


@pytest.mark.slow
def test_expert_parallel_sync_resume(tmp_path):
    flags = ["--expert-model-parallel-size", "2", *CIERA]
    whole = run(*flags, nproc=4, iters=10)
    ckpt = str(tmp_path / "ckpt")
    first = run_pretrain([*TINY, "--train-iters", "10", "--global-batch-size", "8", *flags, "--save", ckpt,
                          "--save-interval", "5", "--exit-interval", "5"], nproc=4, timeout=300)
    assert first.returncode == 0 and first.losses == {i: whole.losses[i] for i in range(1, 6)}
    second = run_pretrain([*TINY, "--train-iters", "10", "--global-batch-size", "8", *flags, "--load", ckpt],
                          nproc=4, timeout=300)
    assert second.returncode == 0, second.output[-4000:]
    assert second.losses == {i: whole.losses[i] for i in range(6, 11)} and second.sha256 == whole.sha256


def test_fp32_accumulating_reduce_scatter_is_bit_identical():
    """--ddp-reduce-scatter-with-fp32-accumulation (upstream's all-to-all reduce-scatter: on gloo
    also the one that moves the all-gather's bytes, not an all-reduce's) with bf16 gradients; the
    testbed's configuration: synchronous param gathers of several bucket groups, which a request
    starts all at once (megatron.ciera.binding.bucket_group._Binding.launch)."""
    flags = ("--overlap-grad-reduce", "--ddp-bucket-size", "20000", "--grad-reduce-in-bf16",
             "--ddp-reduce-scatter-with-fp32-accumulation")
    ciera = run(*flags, *CIERA)
    assert_identical(run(*flags), ciera)  # the flag reaching DDP: test_mc_arguments.py
    assert ciera.summary_block().count(".bucket0") > 1  # several bucket groups, gathered synchronously
