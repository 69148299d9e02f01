#!/usr/bin/env bash
# Llama-4-Scout-17B-16E on one node with torchrun: 16 experts top-1 plus one shared expert in every layer, GQA 40/8.
# Defaults reproduce the paper's setting (48 layers truncated to 4, seq 1024, Adam lr 1e-4, bf16,
# distributed optimizer with overlapped grad reduce / param gather); see examples/common.sh for
# every knob (FULL_DEPTH, CIERA, TINY, DRY_RUN, DATA_PATH, TOKENIZER, CHECKPOINT_DIR, TP/EP, ...).
#
#   examples/scout/train_scout.sh                  # CIERA all-gather, 8 GPUs, 4 layers
#   CIERA=0 examples/scout/train_scout.sh          # the uncompressed baseline, otherwise identical
#   TINY=1 examples/scout/train_scout.sh           # same layout, tiny widths, 2 CPU ranks
#   DRY_RUN=1 FULL_DEPTH=1 examples/scout/train_scout.sh   # print the full-depth command
set -euo pipefail
# shellcheck source=examples/common.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/common.sh"

MODEL_NAME=scout
MODEL_LAYERS=48
MODEL_HIDDEN=5120
MODEL_FFN=8192
MODEL_HEADS=40
MODEL_KV_HEADS=8
MODEL_EXPERTS=16
MODEL_TOPK=1
MODEL_MOE_FFN=8192
MODEL_SHARED_FFN=8192
MODEL_VOCAB=202048
MODEL_TIED=0
MODEL_DENSE_LAYERS=0

# megatron-core requires softmax before top-k when k = 1 (else every routing weight is 1.0).
MODEL_EXTRA_ARGS=(--rotary-base 500000 --moe-router-pre-softmax)

ciera_train "$@"
