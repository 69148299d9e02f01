#!/usr/bin/env bash
# The one prepared GPU check (H200 or any CUDA GPU), under 8 minutes, for a session that is lent a
# GPU. Sections, each a function, each bounded by a timeout, each writing its table to $OUT
# (default /tmp/ciera_gpu) for BENCHMARKS.md:
#
#   env         device, torch, triton
#   kernels     Triton kernels == pure-torch references, on CUDA (the interpreter tests, on a GPU)
#   throughput  each codec's encode/decode GB/s beside clone() (a device memcpy) of the same shard,
#               Triton kernels, and the torch references for comparison
#   nvcomp      nvCOMP Bitcomp and ANS (nvidia-nvcomp-cu12, installed here if missing) on the same
#               shards, on the raw values and on the XOR with the previous values: ratio and GB/s
#   report      the static kernel report, to set the measured figures beside the static ceilings
#
# Multi-GPU gather and training benchmarks need >= 2 GPUs (NCCL cannot put two ranks on one device).
# Run one section: `bash tools/gpu_check.sh nvcomp`.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${OUT:-/tmp/ciera_gpu}
NUMEL=${NUMEL:-67108864}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DEFAULT_FP_FUSION=1
STATUS=0

section() {  # section NAME SECONDS: run the function NAME under a timeout, note failures, go on
    local name=$1 limit=$2 t0=$SECONDS
    echo "== $name (limit ${limit}s)"
    if ! timeout "$limit" bash -c "$(declare -f "$name"); $(declare -p PY OUT NUMEL); $name"; then
        echo "!! section $name failed or timed out" | tee -a "$OUT/failures.txt"
        STATUS=1
    fi
    echo "== $name took $((SECONDS - t0))s"
}

env_info() {
    $PY -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'; \
print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)" | tee "$OUT/env.txt"
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv | tee -a "$OUT/env.txt" || true
}

kernels() {
    $PY -m pytest -q -p no:cacheprovider tests/kernels tests/codecs/test_delta.py -k "triton or Triton or tiles or decode_many" \
        2>&1 | tee "$OUT/kernels.log"
}

throughput() {
    $PY tools/bench_codec.py --device cuda --numel "$NUMEL" --steps 8 --warmup 10 --out-md "$OUT/codec_triton.md"
    $PY tools/bench_codec.py --device cuda --numel $((NUMEL / 4)) --steps 3 --warmup 10 --backend torch \
        --codecs exponent_reuse delta --out-md "$OUT/codec_torch_reference.md"
}

nvcomp() {
    $PY -c "from nvidia import nvcomp" 2>/dev/null || $PY -m pip install -q nvidia-nvcomp-cu12 || return 1
    $PY - "$NUMEL" "$OUT/nvcomp.md" <<'EOF'
"""nvCOMP Bitcomp / ANS beside CIERA's codecs on the same bf16 shards (raw, and XOR with previous)."""
import statistics
import sys
import time

import torch
from nvidia import nvcomp

from ciera.codecs import HEADER_BYTES, as_bits, make_codec
from ciera.trajectory import AdamTrajectory

numel, out_md = int(sys.argv[1]), sys.argv[2]
dev = torch.device("cuda")
tr = AdamTrajectory(numel=numel, dtype=torch.bfloat16, lr=1e-4, seed=0)
for _ in range(10):
    prev = tr.step()
new = tr.step()
prev, new = prev.to(dev), new.to(dev)
raw_bytes = new.numel() * new.element_size()


def timed(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


rows = []
clone_s = timed(lambda: new.clone())
rows.append(("clone() (device memcpy)", "-", 1.0, raw_bytes / clone_s / 1e9, raw_bytes / clone_s / 1e9))
inputs = {"raw values": as_bits(new), "XOR with previous": as_bits(new) ^ as_bits(prev)}
for algo in ("Bitcomp", "ANS"):
    for what, t in inputs.items():
        try:
            codec = nvcomp.Codec(algorithm=algo)
            arr = nvcomp.as_array(t.view(torch.uint8))
            enc = codec.encode(arr)
            size = enc.buffer_size
            enc_s = timed(lambda: codec.encode(arr))
            dec = codec.decode(enc)
            back = torch.as_tensor(dec, device=dev).view(torch.uint8)
            assert torch.equal(back, t.view(torch.uint8)), "nvCOMP round trip differs"
            dec_s = timed(lambda: codec.decode(enc))
            rows.append((f"nvCOMP {algo}", what, raw_bytes / size, raw_bytes / enc_s / 1e9, raw_bytes / dec_s / 1e9))
        except Exception as e:  # report, do not stop the check
            rows.append((f"nvCOMP {algo}", f"{what}: {type(e).__name__}: {e}"[:80], float("nan"), float("nan"),
                         float("nan")))
for name in ("delta", "exponent_reuse"):
    codec = make_codec(name, dtype=torch.bfloat16, numel=numel)
    out = torch.empty(codec.clamp_capacity(codec.max_bytes), dtype=torch.uint8, device=dev)

    codec.encode(shard=new, state=codec.new_state(shard=prev), out=out)
    needed = int(out[16:24].view(torch.int64))
    enc_s = timed(lambda: codec.encode(shard=new, state=codec.new_state(shard=prev), out=out))
    target = prev.clone()
    dec_s = timed(lambda: (target.copy_(prev), codec.decode(payload=out, target=target)))
    assert torch.equal(as_bits(target), as_bits(new))
    rows.append((f"CIERA {name} (Triton)", "new vs previous", raw_bytes / needed, raw_bytes / enc_s / 1e9,
                 raw_bytes / dec_s / 1e9))
lines = [f"{numel} bf16 values, AdamW lr 1e-4 step after 10 warmup steps, {torch.cuda.get_device_name()}; "
         "CIERA encode times include new_state (a clone) and decode a copy of the previous values.", "",
         "| compressor | input | ratio | encode GB/s | decode GB/s |", "|---|---|---|---|---|"]
lines += [f"| {a} | {b} | {c:.2f}x | {d:.0f} | {e:.0f} |" for a, b, c, d, e in rows]
open(out_md, "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
}

report() {
    TRITON_INTERPRET=0 $PY tools/kernel_report.py --numel "$NUMEL" --json "$OUT/kernel_report.json" > "$OUT/kernel_report.md"
    head -20 "$OUT/kernel_report.md"
}

decode_many() {  # the gather's batched decode: decode_many over world-1 payloads vs a loop of decode, launches per bucket
    for W in 4 8; do
        $PY tools/bench_decode_many.py --device cuda --numel "${DECODE_NUMEL:-4194304}" --world "$W" \
            --out-md "$OUT/decode_many_w$W.md"
    done
}

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
        --bf16 --lr 1e-4 --micro-batch-size 2 --global-batch-size $((8 * ngpu)) --train-iters 20 --mock-data --eval-iters 0
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

if [ $# -gt 0 ]; then
    for s in "$@"; do section "$s" 420; done
else
    section env_info 60
    section kernels 150
    section throughput 150
    section nvcomp 120
    section decode_many 60
    section report 60
    section megatron_gpu_paths 180
fi
exit $STATUS
