"""pretrain_gpt.py with expert parallelism: every CIERA bucket is gathered exactly once per step.

megatron-core's chained optimizers (dense + expert) each ask for every bucket group in synchronous
mode; the binding gathers only what some optimizer wrote since the last gather."""

import pytest

from megatron.ciera.app.launch import run_pretrain

pytestmark = pytest.mark.distributed

TINY = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
        "--untie-embeddings-and-output-weights", "--num-experts", "4", "--moe-router-topk", "2",
        "--moe-ffn-hidden-size", "64", "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2",
        "--moe-token-dispatcher-type", "alltoall", "--use-distributed-optimizer", "--bf16", "--lr", "1e-3",
        "--mock-data", "--eval-iters", "0", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--seed", "1234", "--device", "cpu", "--log-interval", "2",
        "--expert-model-parallel-size", "2", "--ciera-allgather", "--ciera-selection", "always",
        "--ciera-codec", "exponent_reuse", "--ciera-warmup-iters", "1"]
ITERS = 4


def _gathers_per_bucket(output: str) -> dict[str, int]:
    block = output[output.index("CIERA summary"):]
    rows = [line.split() for line in block.splitlines()[1:] if ".bucket" in line.split(" ")[0]]
    return {row[0]: int(row[-4]) for row in rows}


@pytest.mark.parametrize("overlap", [
    pytest.param(False, id="sync"),
    pytest.param(True, id="overlap", marks=pytest.mark.slow),
])
def test_each_bucket_gathered_once_per_step_with_expert_parallelism(overlap):
    flags = ["--overlap-grad-reduce", "--overlap-param-gather"] if overlap else []
    result = run_pretrain([*TINY, "--train-iters", str(ITERS), *flags], nproc=4, timeout=300)
    assert result.returncode == 0, result.output[-4000:]
    counts = _gathers_per_bucket(result.output)
    assert any(n.startswith("dense") for n in counts) and any(n.startswith("expert") for n in counts), counts
    assert set(counts.values()) == {ITERS}, counts
