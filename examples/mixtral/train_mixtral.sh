#!/usr/bin/env bash
# Mixtral-8x7B on one node with torchrun: 8 experts top-2, GQA 32/8.
# Defaults reproduce the paper's setting (32 layers truncated to 4, seq 1024, Adam lr 1e-4, bf16,
# distributed optimizer with overlapped grad reduce / param gather); see examples/common.sh for
# every knob (FULL_DEPTH, CIERA, TINY, DRY_RUN, DATA_PATH, TOKENIZER, CHECKPOINT_DIR, TP/EP, ...).
#
#   examples/mixtral/train_mixtral.sh                  # CIERA all-gather, 8 GPUs, 4 layers
#   CIERA=0 examples/mixtral/train_mixtral.sh          # the uncompressed baseline, otherwise identical
#   TINY=1 examples/mixtral/train_mixtral.sh           # same layout, tiny widths, 2 CPU ranks
#   DRY_RUN=1 FULL_DEPTH=1 examples/mixtral/train_mixtral.sh   # print the full-depth command
set -euo pipefail
# shellcheck source=examples/common.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/common.sh"

MODEL_NAME=mixtral
MODEL_LAYERS=32
MODEL_HIDDEN=4096
MODEL_FFN=14336
MODEL_HEADS=32
MODEL_KV_HEADS=8
MODEL_EXPERTS=8
MODEL_TOPK=2
MODEL_MOE_FFN=14336
MODEL_SHARED_FFN=0
MODEL_VOCAB=32000
MODEL_TIED=0
MODEL_DENSE_LAYERS=0

MODEL_EXTRA_ARGS=(--rotary-base 1000000)

ciera_train "$@"
