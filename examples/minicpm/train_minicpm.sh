#!/usr/bin/env bash
# MiniCPM-MoE-8x2B on one node with torchrun: 8 experts top-2, MHA 36 heads of 64, tied embeddings.
# Defaults reproduce the paper's setting (40 layers truncated to 4, seq 1024, Adam lr 1e-4, bf16,
# distributed optimizer with overlapped grad reduce / param gather); see examples/common.sh for
# every knob (FULL_DEPTH, CIERA, TINY, DRY_RUN, DATA_PATH, TOKENIZER, CHECKPOINT_DIR, TP/EP, ...).
#
#   examples/minicpm/train_minicpm.sh                  # CIERA all-gather, 8 GPUs, 4 layers
#   CIERA=0 examples/minicpm/train_minicpm.sh          # the uncompressed baseline, otherwise identical
#   TINY=1 examples/minicpm/train_minicpm.sh           # same layout, tiny widths, 2 CPU ranks
#   DRY_RUN=1 FULL_DEPTH=1 examples/minicpm/train_minicpm.sh   # print the full-depth command
set -euo pipefail
# shellcheck source=examples/common.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/common.sh"

MODEL_NAME=minicpm
MODEL_LAYERS=40
MODEL_HIDDEN=2304
MODEL_FFN=5760
MODEL_HEADS=36
MODEL_KV_HEADS=36
MODEL_EXPERTS=8
MODEL_TOPK=2
MODEL_MOE_FFN=5760
MODEL_SHARED_FFN=0
MODEL_VOCAB=122753
MODEL_TIED=1
MODEL_DENSE_LAYERS=0

ciera_train "$@"
