#!/usr/bin/env bash
# Qwen2-57B-A14B on one node with torchrun: 64 experts top-8 plus one 20480-wide shared expert, GQA 28/4.
# Defaults reproduce the paper's setting (28 layers truncated to 4, seq 1024, Adam lr 1e-4, bf16,
# distributed optimizer with overlapped grad reduce / param gather); see examples/common.sh for
# every knob (FULL_DEPTH, CIERA, TINY, DRY_RUN, DATA_PATH, TOKENIZER, CHECKPOINT_DIR, TP/EP, ...).
#
#   examples/qwen2/train_qwen2.sh                  # CIERA all-gather, 8 GPUs, 4 layers
#   CIERA=0 examples/qwen2/train_qwen2.sh          # the uncompressed baseline, otherwise identical
#   TINY=1 examples/qwen2/train_qwen2.sh           # same layout, tiny widths, 2 CPU ranks
#   DRY_RUN=1 FULL_DEPTH=1 examples/qwen2/train_qwen2.sh   # print the full-depth command
set -euo pipefail
# shellcheck source=examples/common.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/common.sh"

MODEL_NAME=qwen2
MODEL_LAYERS=28
MODEL_HIDDEN=3584
MODEL_FFN=2560
MODEL_HEADS=28
MODEL_KV_HEADS=4
MODEL_EXPERTS=64
MODEL_TOPK=8
MODEL_MOE_FFN=2560
MODEL_SHARED_FFN=20480
MODEL_VOCAB=151936
MODEL_TIED=0
MODEL_DENSE_LAYERS=0

MODEL_EXTRA_ARGS=(--rotary-base 1000000 --norm-epsilon 1e-6)

ciera_train "$@"
