"""Every parallel layout trains bit for bit alike with and without ``--ciera-allgather`` (gloo).

Per layout: the loss of every iteration (float.hex) and the final params sha256 (all shards,
replicas cross-checked) are identical. CIERA binds to the distributed optimizer's groups: dense
buckets gather over the data-parallel group (TP/PP/CP peers excluded), expert buckets over the
expert-data-parallel group; the summaries name both. The 4-rank TP2xEP2 run is in the default
suite; the other layouts and the 8-rank combination are ``slow``.
Context parallelism needs transformer-engine's attention: on CPU it is a clear start-up error
(tested), and it runs in ``tools/gpu_check.sh``.
"""

import functools

import pytest

from megatron.ciera.launch import run_pretrain

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
                 "--expert-tensor-parallel-size", "1"], 4),
    "tp2": (["--tensor-model-parallel-size", "2", "--sequence-parallel", *OVERLAP], 4),
    "pp2": (["--pipeline-model-parallel-size", "2", *OVERLAP], 4),
    "pp2_vpp2": (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1", *OVERLAP], 4),
    "pp2_ep2": (["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"], 4),
    "tp2_pp2_ep2_8": (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size",
                       "2", "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1", *OVERLAP], 8),
    "tp2_ep2_etp2_8": (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size",
                        "2", "--global-batch-size", "16"], 8),
}
DEFAULT = {"tp2_ep2"}


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


def test_context_parallel_on_cpu_is_a_clear_error():
    from megatron.ciera import arguments

    args = arguments.build_parser().parse_args([*TINY, "--train-iters", "1", "--context-parallel-size", "2"])
    with pytest.raises(ValueError, match="--context-parallel-size 2 needs transformer-engine's attention"):
        arguments.validate_args(args, world_size=4)
