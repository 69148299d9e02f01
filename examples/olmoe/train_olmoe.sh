#!/usr/bin/env bash
# OLMoE-1B-7B-0924 on one node with torchrun: 64 experts top-8, no shared expert, MHA.
# Defaults reproduce the paper's setting (16 layers truncated to 4, seq 1024, Adam lr 1e-4, bf16,
# distributed optimizer with overlapped grad reduce / param gather); see examples/common.sh for
# every knob (FULL_DEPTH, CIERA, TINY, DRY_RUN, DATA_PATH, TOKENIZER, CHECKPOINT_DIR, TP/EP, ...).
#
#   examples/olmoe/train_olmoe.sh                  # CIERA all-gather, 8 GPUs, 4 layers
#   CIERA=0 examples/olmoe/train_olmoe.sh          # the uncompressed baseline, otherwise identical
#   TINY=1 examples/olmoe/train_olmoe.sh           # same layout, tiny widths, 2 CPU ranks
#   DRY_RUN=1 FULL_DEPTH=1 examples/olmoe/train_olmoe.sh   # print the full-depth command
set -euo pipefail
# shellcheck source=examples/common.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/common.sh"

MODEL_NAME=olmoe
MODEL_LAYERS=16
MODEL_HIDDEN=2048
MODEL_FFN=1024
MODEL_HEADS=16
MODEL_KV_HEADS=16
MODEL_EXPERTS=64
MODEL_TOPK=8
MODEL_MOE_FFN=1024
MODEL_SHARED_FFN=0
MODEL_VOCAB=50304
MODEL_TIED=0
MODEL_DENSE_LAYERS=0

ciera_train "$@"
