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
# The gather's batched decode on one GPU: decode_many over world-1 payloads vs a loop of decode,
# and the kernel launches per bucket (fixed, independent of the world size, once decode_many_triton lands).
for W in 4 8; do
  $PY tools/bench_decode_many.py --device cuda --numel "${DECODE_NUMEL:-4194304}" --world "$W" \
      --out-md "$OUT/decode_many_w$W.md"
done
