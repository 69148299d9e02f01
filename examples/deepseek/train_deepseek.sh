#!/usr/bin/env bash
# DeepSeek-MoE-16B on one node with torchrun: dense layer 0, then 64 routed experts top-6 plus 2 shared (2x1408).
# Defaults reproduce the paper's setting (28 layers truncated to 4, seq 1024, Adam lr 1e-4, bf16,
# distributed optimizer with overlapped grad reduce / param gather); see examples/common.sh for
# every knob (FULL_DEPTH, CIERA, TINY, DRY_RUN, DATA_PATH, TOKENIZER, CHECKPOINT_DIR, TP/EP, ...).
#
#   examples/deepseek/train_deepseek.sh                  # CIERA all-gather, 8 GPUs, 4 layers
#   CIERA=0 examples/deepseek/train_deepseek.sh          # the uncompressed baseline, otherwise identical
#   TINY=1 examples/deepseek/train_deepseek.sh           # same layout, tiny widths, 2 CPU ranks
#   DRY_RUN=1 FULL_DEPTH=1 examples/deepseek/train_deepseek.sh   # print the full-depth command
set -euo pipefail
# shellcheck source=examples/common.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/common.sh"

MODEL_NAME=deepseek
MODEL_LAYERS=28
MODEL_HIDDEN=2048
MODEL_FFN=10944
MODEL_HEADS=16
MODEL_KV_HEADS=16
MODEL_EXPERTS=64
MODEL_TOPK=6
MODEL_MOE_FFN=1408
MODEL_SHARED_FFN=2816
MODEL_VOCAB=102400
MODEL_TIED=0
MODEL_DENSE_LAYERS=1

MODEL_EXTRA_ARGS=(--norm-epsilon 1e-6)

ciera_train "$@"
