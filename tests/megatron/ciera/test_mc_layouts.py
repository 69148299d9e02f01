"""Every parallel layout trains bit for bit alike with and without ``--ciera-allgather`` (gloo).

Per layout: the loss of every iteration (float.hex) and the final params sha256 (all shards,
replicas cross-checked) are identical. CIERA binds to the distributed optimizer's groups: dense
buckets gather over the data-parallel group (TP/PP/CP peers excluded), expert buckets over the
expert-data-parallel group; the summaries name both. The 4-rank TP2xEP2 (with overlapped gathers)
and CP2xDP2 runs are in the default suite; the other layouts and the 8-rank combinations are ``slow``.
Context parallelism on CPU runs :mod:`megatron.ciera.app.cp_attention` (the local spec's all-gather-KV
attention); a slow test checks it against a CP 1 run on the same data (losses to fp32 tolerance).
"""

import functools

import pytest

from megatron.ciera.app.launch import run_pretrain

pytestmark = pytest.mark.distributed

TINY = ["--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
        "--untie-embeddings-and-output-weights", "--num-experts", "4", "--moe-router-topk", "2",
        "--moe-ffn-hidden-size", "64", "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type", "alltoall",
        "--use-distributed-optimizer", "--bf16", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
        "--lr-warmup-iters", "1", "--mock-data", "--eval-iters", "0", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--seed", "1234", "--device", "cpu",
        "--log-interval", "1"]
CIERA = ["--ciera-allgather", "--ciera-selection", "always", "--ciera-codec", "exponent_reuse",
         "--ciera-warmup-iters", "1"]
OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather"]

LAYOUTS = {  # name: (flags, ranks)
    "tp2_ep2": (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2",
                 "--expert-tensor-parallel-size", "1", *OVERLAP], 4),
    "tp2": (["--tensor-model-parallel-size", "2", "--sequence-parallel", *OVERLAP], 4),
    "pp2": (["--pipeline-model-parallel-size", "2", *OVERLAP], 4),
    "pp2_vpp2": (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1", *OVERLAP], 4),
    "pp2_ep2": (["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"], 4),
    "tp2_pp2_ep2_8": (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size",
                       "2", "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1", *OVERLAP], 8),
    "tp2_ep2_etp2_8": (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size",
                        "2", "--global-batch-size", "16"], 8),
    "cp2": (["--context-parallel-size", "2", "--num-layers", "2"], 4),
    "cp2_ep2": (["--context-parallel-size", "2", "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size",
                 "1", *OVERLAP], 4),
}
DEFAULT = {"tp2_ep2", "cp2"}


@functools.lru_cache(maxsize=None)
def run(name, ciera, iters=2):
    flags, ranks = LAYOUTS[name]
    result = run_pretrain([*TINY, "--train-iters", str(iters), *flags, *(CIERA if ciera else [])],
                          nproc=ranks, timeout=600)
    assert result.returncode == 0, result.output[-4000:]
    assert sorted(result.losses) == list(range(1, iters + 1)) and result.sha256
    return result


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in DEFAULT else pytest.mark.slow) for n in LAYOUTS])
def test_layout_is_bit_identical_with_ciera(name):
    base, ciera = run(name, False), run(name, True)
    assert base.losses == ciera.losses, "per-iteration losses differ"
    assert base.sha256 == ciera.sha256
    summary = ciera.summary_block()
    assert "dense0.bucket0" in summary  # the data-parallel group (size 2 here) gathers with CIERA
    flags, _ = LAYOUTS[name]
    if "--expert-tensor-parallel-size" in flags:  # expert-data-parallel size 2: experts on CIERA too
        assert "expert0.bucket0" in summary


def _without(flags, *options):
    """``flags`` without each of ``options`` and its value."""
    out, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag in options:
            skip = True
        else:
            out.append(flag)
    return out


@pytest.mark.slow
def test_context_parallel_trains_like_one_rank_holding_the_sequence():
    """CP2 x DP2 against CP1 x DP2 on the same data (dense, fp32, no dropout): the attention sees
    the same keys, so every iteration's loss agrees to fp32 rounding (not bit for bit: the
    sums run in another order)."""
    dense = _without(TINY, "--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size", "--moe-aux-loss-coeff",
                     "--moe-token-dispatcher-type")
    flags = [*[f for f in dense if f != "--bf16"], "--attention-dropout", "0", "--hidden-dropout", "0",
             "--train-iters", "3"]
    whole = run_pretrain(flags, nproc=2, timeout=600)
    split = run_pretrain([*flags, "--context-parallel-size", "2"], nproc=4, timeout=600)
    assert whole.returncode == 0 and split.returncode == 0, (whole.output[-3000:], split.output[-3000:])
    assert sorted(split.losses) == [1, 2, 3]
    for it, loss in whole.losses.items():
        assert split.losses[it] == pytest.approx(loss, rel=1e-5), (it, whole.losses, split.losses)
    assert "the local context-parallel attention all-gathers K/V" in split.output  # the CP path ran
