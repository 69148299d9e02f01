#!/usr/bin/env bash
# The one prepared GPU check, for a session that is lent a GPU: Triton kernels against the pure-torch
# references on CUDA, then codec throughput on the device (Triton, and the torch reference for
# comparison) side by side with clone(). Tables land in $OUT (default /tmp/ciera_gpu) for
# BENCHMARKS.md. Multi-GPU gather and training benchmarks need >= 2 GPUs (NCCL cannot put two
# ranks on one device).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${OUT:-/tmp/ciera_gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
$PY -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)"
$PY -m pytest -q -p no:cacheprovider tests/kernels tests/codecs/test_delta.py -k "triton or Triton" 2>&1 | tee "$OUT/kernels.log"
$PY tools/bench_codec.py --device cuda --numel "${NUMEL:-67108864}" --out-md "$OUT/codec_triton.md"
$PY tools/bench_codec.py --device cuda --numel "${NUMEL:-67108864}" --backend torch --codecs exponent_reuse delta \
    --out-md "$OUT/codec_torch_reference.md"

# --- Megatron GPU code paths (issue 13): one short pretrain_gpt.py run on the default GPU path ---
# transformer-engine spec (upstream's default --transformer-impl when TE is installed), grouped GEMM
# experts, the alltoall dispatcher, upstream's default fusions, with and without --ciera-allgather:
# losses and params sha256 must match. With >= 2 GPUs the run uses EP (and TP2+SP with >= 4).
megatron_gpu_paths() {
    local ngpu layout=() te
    ngpu=$($PY -c "import torch; print(torch.cuda.device_count())")
    te=$($PY -c "import transformer_engine" 2>/dev/null && echo yes || echo no)
    [ "$ngpu" -ge 2 ] && layout+=(--expert-model-parallel-size 2)
    [ "$ngpu" -ge 4 ] && layout+=(--tensor-model-parallel-size 2 --sequence-parallel)
    [ "$te" = yes ] && layout+=(--moe-grouped-gemm)
    local flags=(--num-layers 4 --hidden-size 512 --ffn-hidden-size 1024 --num-attention-heads 8 --seq-length 512
        --normalization RMSNorm --position-embedding-type rope --swiglu --disable-bias-linear
        --untie-embeddings-and-output-weights --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 512
        --moe-token-dispatcher-type alltoall --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
        --bf16 --lr 1e-4 --micro-batch-size 2 --global-batch-size $((8 * ngpu)) --train-iters 20 --mock-data
        --tokenizer-type NullTokenizer --vocab-size 32000 --deterministic-mode --log-interval 10 "${layout[@]}")
    echo "megatron GPU paths: $ngpu GPU(s), transformer-engine: $te, layout: ${layout[*]:-none}" | tee "$OUT/megatron_paths.log"
    for mode in base ciera; do
        local extra=()
        [ "$mode" = ciera ] && extra=(--ciera-allgather --ciera-selection always --ciera-warmup-iters 2)
        $PY -m torch.distributed.run --nproc-per-node "$ngpu" pretrain_gpt.py "${flags[@]}" "${extra[@]}" \
            --ciera-loss-log "$OUT/losses_$mode.txt" 2>&1 | tee "$OUT/megatron_$mode.log" | grep -E "iteration |sha256|GPU-only|Error"
    done
    cmp "$OUT/losses_base.txt" "$OUT/losses_ciera.txt" && echo "losses identical" | tee -a "$OUT/megatron_paths.log"
    diff <(grep "params sha256" "$OUT/megatron_base.log") <(grep "params sha256" "$OUT/megatron_ciera.log") \
        && echo "params sha256 identical" | tee -a "$OUT/megatron_paths.log"
}
megatron_gpu_paths
