#!/usr/bin/env bash
# The one prepared GPU check (H200 or any CUDA GPU), under 8 minutes, to run on the first machine
# with a GPU. Sections, each a function, each bounded by a timeout, each writing its table to $OUT
# (default /tmp/ciera_gpu) for BENCHMARKS.md:
#
#   env         device, torch, triton
#   kernels     Triton kernels == pure-torch references, on CUDA (the interpreter tests, on a GPU)
#   throughput  each codec's encode/decode GB/s beside clone() (a device memcpy) of the same shard,
#               Triton kernels, and the torch references for comparison
#   nvcomp      nvCOMP Bitcomp and ANS (nvidia-nvcomp-cu12, installed if missing: offline from
#               build/gpu_wheels when present, see `wheels`) on the same
#               shards, on the raw values and on the XOR with the previous values: ratio and GB/s
#   report      the static kernel report, to set the measured figures beside the static ceilings
#   gloo_one_gpu  2 and 4 gloo ranks on the one GPU with CUDA tensors (NCCL cannot put two ranks on
#               one device; gloo can): the CIERA gather on its side streams with the Triton codecs,
#               ZeRO-1 buckets over hundreds of steps of a real trajectory and ZeRO-3 units through
#               FSDP2, bit-exact against the plain gather (tools/gloo_one_gpu.py; --device cpu runs
#               the same code on CPU, as the default test suite does)
#   pretrain_gloo pretrain_gpt.py on 2 gloo ranks on the one GPU, ZeRO-1 and FSDP2, with and
#               without --ciera-allgather: losses and params sha256 identical
#
# Multi-GPU NCCL benchmarks need >= 2 GPUs. Run one section: `bash tools/gpu_check.sh nvcomp`.
# Sections share a BUDGET (default 450 s; a section past it is skipped and reported).
# `bash tools/gpu_check.sh --dry-run [SECTION...]` prints every section's commands and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${OUT:-/tmp/ciera_gpu}
NUMEL=${NUMEL:-67108864}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_DEFAULT_FP_FUSION=1
STATUS=0
DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then
    DRY_RUN=1
    shift
fi
[ "$DRY_RUN" = 1 ] || mkdir -p "$OUT"
BUDGET=${BUDGET:-450}  # seconds for the whole check (under 8 minutes with start-up); a section gets at most what is left

section() {  # section NAME SECONDS: run the function NAME under a timeout (at most what is left of
             # BUDGET), note failures, go on: a section failing or timing out loses no other's figures
    local name=$1 limit=$2 t0=$SECONDS left
    if [ "$DRY_RUN" = 1 ]; then  # the commands, not run
        echo "== $name (limit ${limit}s)"
        declare -f "$name" | tail -n +3 | sed '$d'
        return
    fi
    left=$((BUDGET - SECONDS))
    if [ "$left" -lt 10 ]; then
        echo "!! section $name skipped: the ${BUDGET}s budget is spent" | tee -a "$OUT/failures.txt"
        STATUS=1
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
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
    $PY -m pytest -q -p no:cacheprovider tests/kernels tests/ciera/codecs/test_delta.py -k "triton or Triton or tiles or decode_many" \
        2>&1 | tee "$OUT/kernels.log"
    $PY -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tee "$OUT/gpu_tests.log"  # every test marked gpu
}

throughput() {  # two independent runs: the second runs (and reports) even if the first fails
    local rc=0
    $PY tools/bench_codec.py --device cuda --numel "$NUMEL" --steps 8 --warmup 10 --out-md "$OUT/codec_triton.md" || rc=1
    $PY tools/bench_codec.py --device cuda --numel $((NUMEL / 4)) --steps 3 --warmup 10 --backend torch \
        --codecs exponent_reuse delta --out-md "$OUT/codec_torch_reference.md" || rc=1
    return $rc
}

nvcomp() {
    # nvidia-nvcomp-cu12 (and its nvidia-libnvcomp-cu12, ~48 MB together): a GPU machine without a
    # network installs them from build/gpu_wheels (`bash tools/gpu_check.sh wheels` on a host with one,
    # then carry build/gpu_wheels along).
    if ! $PY -c "from nvidia import nvcomp" 2>/dev/null; then
        if [ -d build/gpu_wheels ]; then
            $PY -m pip install -q --no-index --find-links build/gpu_wheels nvidia-nvcomp-cu12 || return 1
        else
            $PY -m pip install -q nvidia-nvcomp-cu12 || return 1
        fi
    fi
    $PY - "$NUMEL" "$OUT/nvcomp.md" <<'EOF'
"""nvCOMP Bitcomp / ANS beside CIERA's codecs on the same bf16 shards (raw, and XOR with previous).

nvidia-nvcomp-cu12 API (nvCOMP 4-6): ``nvcomp.Codec(algorithm=..., **options)``; ``nvcomp.as_array(x)``
wraps any object with ``__cuda_array_interface__`` / ``__dlpack__`` without a copy; ``codec.encode(array)``
returns an ``nvcomp.Array`` of the compressed bytes (``buffer_size``: their number), asynchronous on the
codec's own stream, hence ``torch.cuda.synchronize()`` (a device-wide sync) around every timing;
``codec.decode(array, data_type="|u1")`` returns the decoded ``nvcomp.Array`` (it exports
``__dlpack__``). Every row is independent: a failure is written into its row and the next one runs."""
import sys
import traceback

import torch
from nvidia import nvcomp

from ciera.codecs import as_bits, make_codec
from ciera.testing.trajectory import AdamTrajectory
from tools._common import median_seconds

numel, out_md = int(sys.argv[1]), sys.argv[2]
dev = torch.device("cuda")
tr = AdamTrajectory(numel=numel, dtype=torch.bfloat16, lr=1e-4, seed=0)
for _ in range(10):
    prev = tr.step()
new = tr.step()
prev, new = prev.to(dev), new.to(dev)
raw_bytes = new.numel() * new.element_size()
print("nvcomp", nvcomp.__version__, "cuda", nvcomp.__cuda_version__, flush=True)


def timed(fn, reps=5):
    return median_seconds(fn, device=dev, repeats=reps, warmup=1)


def to_torch(arr) -> torch.Tensor:
    """A decoded nvcomp.Array as a flat uint8 CUDA tensor (no copy)."""
    try:
        t = torch.from_dlpack(arr)
    except Exception:
        t = torch.as_tensor(arr, device=dev)
    return t.reshape(-1).view(torch.uint8)


rows = []


def row(name, what, fn):
    try:
        rows.append((name, what, *fn()))
    except Exception as e:  # report, do not stop the check
        traceback.print_exc()
        rows.append((name, f"{what}: {type(e).__name__}: {e}"[:120], float("nan"), float("nan"), float("nan")))
    print(rows[-1], flush=True)


row("clone() (device memcpy)", "bf16 values",
    lambda: (1.0, raw_bytes / timed(lambda: new.clone()) / 1e9, float("nan")))
inputs = {"raw values": as_bits(new).view(torch.uint8),
          "XOR with previous": (as_bits(new) ^ as_bits(prev)).view(torch.uint8)}
# Bitcomp lossless on the 16-bit patterns (default and sparse); ANS on bytes and in its 16-bit mode.
configs = [("Bitcomp", dict(data_type="<u2")), ("Bitcomp", dict(data_type="<u2", algorithm_type=1)),
           ("ANS", dict()), ("ANS", dict(data_type="<f2"))]


def nvcomp_row(algorithm, options, data):
    def run():
        codec = nvcomp.Codec(algorithm=algorithm, **options)
        arr = nvcomp.as_array(data)
        enc = codec.encode(arr)
        torch.cuda.synchronize()
        size = int(enc.buffer_size)
        back = to_torch(codec.decode(enc, data_type="|u1"))
        torch.cuda.synchronize()
        if not torch.equal(back, data):
            raise AssertionError("nvCOMP round trip differs")
        enc_s = timed(lambda: codec.encode(arr))
        dec_s = timed(lambda: codec.decode(enc, data_type="|u1"))
        return raw_bytes / size, raw_bytes / enc_s / 1e9, raw_bytes / dec_s / 1e9
    return run


for algorithm, options in configs:
    for what, data in inputs.items():
        label = algorithm + "".join(f" {k}={v}" for k, v in options.items())
        row(f"nvCOMP {label}", what, nvcomp_row(algorithm, options, data))


def ciera_row(name):
    def run():
        codec = make_codec(name, dtype=torch.bfloat16, numel=numel)
        out = torch.empty(codec.clamp_capacity(codec.max_bytes), dtype=torch.uint8, device=dev)
        state = codec.new_state(shard=prev)
        codec.encode(shard=new, state=state, out=out)
        needed = int(out[16:24].view(torch.int64)[0])  # header word 2: the bytes needed
        target = prev.clone()
        codec.decode(payload=out, target=target)
        if not torch.equal(as_bits(target), as_bits(new)):
            raise AssertionError("CIERA round trip differs")
        enc_s = timed(lambda: (codec.reset_state(state=state, shard=prev),
                               codec.encode(shard=new, state=state, out=out)))
        reset_s = timed(lambda: codec.reset_state(state=state, shard=prev))
        dec_s = timed(lambda: (target.copy_(prev), codec.decode(payload=out, target=target)))
        copy_s = timed(lambda: target.copy_(prev))
        return (raw_bytes / needed, raw_bytes / max(enc_s - reset_s, 1e-9) / 1e9,
                raw_bytes / max(dec_s - copy_s, 1e-9) / 1e9)
    return run


for name in ("delta", "exponent_reuse"):
    row(f"CIERA {name} (Triton)", "new vs previous", ciera_row(name))
lines = [f"{numel} bf16 values, AdamW lr 1e-4 step after 10 warmup steps, {torch.cuda.get_device_name()}, "
         f"nvCOMP {nvcomp.__version__}; median of 5; CIERA times exclude the state reset / target copy "
         "(each timed alone and subtracted).", "",
         "| compressor | input | ratio | encode GB/s | decode GB/s |", "|---|---|---|---|---|"]
lines += [f"| {a} | {b} | {c:.2f}x | {d:.0f} | {e:.0f} |" for a, b, c, d, e in rows]
open(out_md, "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
}

wheels() {  # on a host with a network: the nvCOMP wheels that the nvcomp section installs offline
    mkdir -p build/gpu_wheels && $PY -m pip download -q nvidia-nvcomp-cu12 -d build/gpu_wheels && ls -la build/gpu_wheels
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

gloo_one_gpu() {  # several gloo ranks on the one GPU: the CIERA gather's CUDA branch, bit-exact
    local rc=0
    $PY tools/gloo_one_gpu.py --device cuda --world 2 --steps "${GLOO_STEPS:-300}" --fsdp2-steps 20 \
        --no-per-rank-sizes --out-md "$OUT/gloo_one_gpu_w2.md" || rc=1
    $PY tools/gloo_one_gpu.py --device cuda --world 4 --steps "${GLOO_STEPS_W4:-100}" --fsdp2-steps 10 \
        --codecs exponent_reuse delta --out-md "$OUT/gloo_one_gpu_w4.md" || rc=1  # per-rank sizes: the p2p ring
    return $rc
}

pretrain_gloo() {  # pretrain_gpt.py, ZeRO-1 and FSDP2, on 2 gloo ranks on the one GPU, +-CIERA
    $PY tools/gloo_one_gpu.py --device cuda --world 2 --parts pretrain --pretrain-iters 10 \
        --codecs exponent_reuse --out-md "$OUT/pretrain_gloo.md"
}

# --- Megatron GPU code paths: one short pretrain_gpt.py run on the default GPU path ---
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
    section env_info 15
    section gloo_one_gpu 110
    section pretrain_gloo 70
    section kernels 70
    section throughput 50
    section nvcomp 35
    section decode_many 25
    section report 25
    section megatron_gpu_paths 50
fi
exit $STATUS
