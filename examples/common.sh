# shellcheck shell=bash
#
# Launch plumbing shared by every examples/<model>/train_<model>.sh and <model>.sbatch.
#
# A model script only declares the published architecture and calls `ciera_train "$@"`:
#
#   MODEL_NAME          short name (olmoe, deepseek, ...)
#   MODEL_LAYERS        depth of the published model (used with FULL_DEPTH=1)
#   MODEL_HIDDEN        hidden size
#   MODEL_FFN           dense FFN width (layers that are not MoE); all-MoE models repeat the expert width
#   MODEL_HEADS         attention heads
#   MODEL_KV_HEADS      key/value heads (== MODEL_HEADS means plain multi-head attention)
#   MODEL_EXPERTS       routed experts per MoE layer
#   MODEL_TOPK          experts per token
#   MODEL_MOE_FFN       expert FFN width
#   MODEL_SHARED_FFN    total shared-expert FFN width (0: no shared expert)
#   MODEL_VOCAB         vocabulary size
#   MODEL_TIED          1 if input embedding and output layer share weights
#   MODEL_DENSE_LAYERS  leading dense (non-MoE) layers (DeepSeek-MoE: 1)
#   MODEL_EXTRA_ARGS    optional array of further width-independent flags (RoPE base, norm
#                       epsilon), kept as they are with TINY=1
#
# Everything that is not architecture is decided here, from the environment:
#
#   FULL_DEPTH=1     use MODEL_LAYERS instead of the paper's truncated NUM_LAYERS (default 4)
#   CIERA=0|1        add --ciera-allgather (the only difference between a baseline and a CIERA run)
#   TINY=1           same layout at tiny widths on 2 CPU ranks (hidden 64, 2 layers, seq 64, 10 iters)
#   DRY_RUN=1        print the command as one shell-quoted line instead of running it
#   DATA_PATH        Megatron data prefix(es), e.g. "data/agnews_text_document" (unset: --mock-data)
#   TOKENIZER        unset: NullTokenizer with the model's vocab; "byte": NullTokenizer matching
#                    tools/preprocess_data.py --tokenizer byte (EOD 260; the --vocab-size that puts
#                    it there is asked of the installed megatron-core); anything else: a
#                    --tokenizer-type (with TOKENIZER_MODEL -> --tokenizer-model); VOCAB_SIZE ->
#                    --vocab-size in every case
#   CHECKPOINT_DIR   --save/--load directory (unset: no checkpoints), SAVE_INTERVAL (default 500)
#   NNODES, GPUS_PER_NODE, NODE_RANK, MASTER_ADDR, MASTER_PORT
#   TP, PP, EP       tensor / pipeline / expert model-parallel sizes (default 1)
#   MICRO_BATCH, GLOBAL_BATCH (default MICRO_BATCH * data-parallel size), TRAIN_ITERS
#   NUM_LAYERS, SEQ_LENGTH, LR, WEIGHT_DECAY, SEED, LOG_INTERVAL, TENSORBOARD_DIR
#   CIERA_CODEC, CIERA_BLOCK_SIZE, CIERA_WARMUP_ITERS, CIERA_SELECTION, CIERA_VERIFY_INTERVAL
#                    passed (in both modes) only when set; TINY sets CIERA_WARMUP_ITERS=2
#   TORCHRUN         launcher words (default: "$PYTHON -m torch.distributed.run" when PYTHON is
#                    set, else torchrun from PATH, else the repository's .venv/bin/python)
#
# Arguments given to the script ("$@") are appended last, so they override anything above.

CIERA_EXAMPLES_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CIERA_ROOT="$(cd "$CIERA_EXAMPLES_DIR/.." && pwd)"

# Must equal BYTE_EOD in tools/preprocess_data.py (tests check it): ids 0-3 reserved, bytes at
# 4-259, EOD 260 after every document. The --vocab-size that puts NullTokenizer's EOD there depends
# on the installed megatron-core (ciera_null_vocab_size asks it).
CIERA_BYTE_EOD=260

ciera_die() {
    printf '%s: error: %s\n' "${MODEL_NAME:-ciera}" "$*" >&2
    exit 2
}

# The Python that runs pretrain_gpt.py: PYTHON, else TORCHRUN's interpreter when it is
# "PY -m torch.distributed.run ...", else python3 beside torchrun on PATH, else the repository's .venv
# (the same choice as ciera_launcher).
ciera_python() {
    local -a words
    read -r -a words <<<"${TORCHRUN:-}"
    if [[ -n "${PYTHON:-}" ]]; then
        printf '%s\n' "$PYTHON"
    elif ((${#words[@]} >= 2)) && [[ "${words[1]}" == -m ]]; then
        printf '%s\n' "${words[0]}"
    elif [[ -n "${TORCHRUN:-}" ]] || command -v torchrun >/dev/null 2>&1 || [[ ! -x "$CIERA_ROOT/.venv/bin/python" ]]; then
        printf 'python3\n'
    else
        printf '%s\n' "$CIERA_ROOT/.venv/bin/python"
    fi
}

# The --vocab-size that puts the installed megatron-core's NullTokenizer EOD at id $1: NullTokenizer
# put it at --vocab-size up to megatron-core 0.17 and at --vocab-size - 1 from 0.18 on. Asked of
# megatron.ciera.app.upstream_features with the Python that trains (a few seconds: it imports megatron-core).
ciera_null_vocab_size() {
    local eod=$1 py out
    py=$(ciera_python)
    if out=$(PYTHONPATH="$CIERA_ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONWARNINGS=ignore "$py" -c \
        'import sys; from megatron.ciera.app.upstream_features import null_tokenizer_vocab_size as v; print(v(int(sys.argv[1])))' \
        "$eod" 2>&1) && [[ "${out##*$'\n'}" =~ ^[0-9]+$ ]]; then
        printf '%s\n' "${out##*$'\n'}"
    else
        ciera_die "cannot ask $py which --vocab-size puts megatron-core's NullTokenizer EOD at id $eod" \
            "(${out##*$'\n'}); set PYTHON to the interpreter that trains, or VOCAB_SIZE" \
            "($eod on megatron-core 0.16-0.17, $((eod + 1)) from 0.18 on)"
    fi
}

# Print the arguments as one line that bash reads back as the same words: plain words as they
# are, others in single quotes, and words with control characters (a newline) in bash's $'...'.
ciera_quote() {
    local IFS=' ' arg
    local -a out=()
    for arg in "$@"; do
        if [[ -n "$arg" && "$arg" != *[!A-Za-z0-9_./:=,+@%^-]* ]]; then
            out+=("$arg")
        elif [[ "$arg" == *[[:cntrl:]]* ]]; then
            out+=("$(printf '%q' "$arg")")
        else
            out+=("'${arg//\'/\'\\\'\'}'")
        fi
    done
    printf '%s\n' "${out[*]}"
}

# Run a command, or print it when DRY_RUN=1.
ciera_exec() {
    if [[ "${DRY_RUN:-0}" == 1 ]]; then
        ciera_quote "$@"
    else
        exec "$@"
    fi
}

ciera_require_model() {
    local var
    for var in MODEL_NAME MODEL_LAYERS MODEL_HIDDEN MODEL_FFN MODEL_HEADS MODEL_KV_HEADS \
        MODEL_EXPERTS MODEL_TOPK MODEL_MOE_FFN MODEL_SHARED_FFN MODEL_VOCAB MODEL_TIED \
        MODEL_DENSE_LAYERS; do
        [[ -n "${!var:-}" ]] || ciera_die "the model script must set $var before ciera_train"
    done
}

# Architecture flags: the published widths, or (TINY=1) the same layout at tiny widths.
# Fills the global array CIERA_MODEL_ARGS; NUM_LAYERS must be set.
ciera_model_args() {
    local hidden=$MODEL_HIDDEN ffn=$MODEL_FFN heads=$MODEL_HEADS kv=$MODEL_KV_HEADS
    local experts=$MODEL_EXPERTS moe_ffn=$MODEL_MOE_FFN shared=$MODEL_SHARED_FFN
    local topk=$MODEL_TOPK
    if [[ "${TINY:-0}" == 1 ]]; then
        # Keep the layout (GQA or not, shared expert or not, dense first layer, tied or not, top-k),
        # shrink the widths; more than 16 experts become 16 (top-k never exceeds 8 here).
        hidden=64 ffn=128 moe_ffn=128 heads=4
        if ((kv < MODEL_HEADS)); then kv=2; else kv=4; fi
        if ((shared > 0)); then shared=128; fi
        if ((experts > 16)); then experts=16; fi
    fi
    CIERA_MODEL_ARGS=(
        --use-mcore-models
        --num-layers "$NUM_LAYERS"
        --hidden-size "$hidden"
        --ffn-hidden-size "$ffn"
        --num-attention-heads "$heads"
        --seq-length "$SEQ_LENGTH"
        --max-position-embeddings "$SEQ_LENGTH"
        --normalization RMSNorm
        --position-embedding-type rope
        --swiglu
        --disable-bias-linear
        --attention-dropout 0.0
        --hidden-dropout 0.0
        --init-method-std 0.02
    )
    if ((kv < heads)); then
        CIERA_MODEL_ARGS+=(--group-query-attention --num-query-groups "$kv")
    fi
    if [[ "$MODEL_TIED" != 1 ]]; then
        CIERA_MODEL_ARGS+=(--untie-embeddings-and-output-weights)
    fi
    CIERA_MODEL_ARGS+=(
        --num-experts "$experts"
        --moe-router-topk "$topk"
        --moe-ffn-hidden-size "$moe_ffn"
        --moe-router-load-balancing-type aux_loss
        --moe-aux-loss-coeff 1e-2
        --moe-token-dispatcher-type alltoall
    )
    if ((shared > 0)); then
        CIERA_MODEL_ARGS+=(--moe-shared-expert-intermediate-size "$shared")
    fi
    if ((MODEL_DENSE_LAYERS > 0)); then
        # Megatron-LM's pattern syntax: one entry per layer, 0 = dense MLP, 1 = MoE.
        CIERA_MODEL_ARGS+=(--moe-layer-freq "([0]*$MODEL_DENSE_LAYERS+[1]*$((NUM_LAYERS - MODEL_DENSE_LAYERS)))")
    fi
    if [[ -n "${MODEL_EXTRA_ARGS+set}" ]]; then
        CIERA_MODEL_ARGS+=("${MODEL_EXTRA_ARGS[@]}")
    fi
}

# Everything after `pretrain_gpt.py`: model, parallelism, optimizer, data, CIERA, then "$@".
# Fills the global array CIERA_TRAIN_ARGS and the launch geometry (NNODES, GPUS_PER_NODE).
ciera_build_args() {
    ciera_require_model
    local tiny=${TINY:-0}
    if [[ "$tiny" == 1 ]]; then
        NNODES=${NNODES:-1} GPUS_PER_NODE=${GPUS_PER_NODE:-2}
        NUM_LAYERS=${NUM_LAYERS:-2} SEQ_LENGTH=${SEQ_LENGTH:-64}
        MICRO_BATCH=${MICRO_BATCH:-2} TRAIN_ITERS=${TRAIN_ITERS:-10} LOG_INTERVAL=${LOG_INTERVAL:-1}
        CIERA_WARMUP_ITERS=${CIERA_WARMUP_ITERS:-2}
    fi
    if [[ "${FULL_DEPTH:-0}" == 1 ]]; then
        NUM_LAYERS=$MODEL_LAYERS
    fi
    NNODES=${NNODES:-1} GPUS_PER_NODE=${GPUS_PER_NODE:-8}
    NUM_LAYERS=${NUM_LAYERS:-4} SEQ_LENGTH=${SEQ_LENGTH:-1024}
    TP=${TP:-1} PP=${PP:-1} EP=${EP:-1}
    MICRO_BATCH=${MICRO_BATCH:-1}
    # The paper measures 1000 iterations after ~30 warm-up iterations.
    TRAIN_ITERS=${TRAIN_ITERS:-1030}
    LR=${LR:-1e-4} WEIGHT_DECAY=${WEIGHT_DECAY:-0.0} SEED=${SEED:-1234}
    LOG_INTERVAL=${LOG_INTERVAL:-10}

    ((NUM_LAYERS > MODEL_DENSE_LAYERS)) ||
        ciera_die "NUM_LAYERS($NUM_LAYERS) must exceed the dense leading layers ($MODEL_DENSE_LAYERS)"
    local world=$((NNODES * GPUS_PER_NODE))
    ((world % (TP * PP) == 0)) ||
        ciera_die "world size NNODES($NNODES) * GPUS_PER_NODE($GPUS_PER_NODE) = $world is not divisible by TP($TP) * PP($PP)"
    local dp=$((world / (TP * PP)))
    ((dp % EP == 0)) ||
        ciera_die "data-parallel size $world / (TP($TP) * PP($PP)) = $dp is not divisible by EP($EP)"
    local experts=$MODEL_EXPERTS
    if [[ "$tiny" == 1 ]] && ((experts > 16)); then experts=16; fi
    ((experts % EP == 0)) || ciera_die "experts($experts) is not divisible by EP($EP)"
    GLOBAL_BATCH=${GLOBAL_BATCH:-$((MICRO_BATCH * dp))}
    ((GLOBAL_BATCH % (MICRO_BATCH * dp) == 0)) ||
        ciera_die "GLOBAL_BATCH($GLOBAL_BATCH) is not a multiple of MICRO_BATCH($MICRO_BATCH) * DP($dp) = $((MICRO_BATCH * dp))"

    ciera_model_args
    CIERA_TRAIN_ARGS=("${CIERA_MODEL_ARGS[@]}")

    CIERA_TRAIN_ARGS+=(
        --tensor-model-parallel-size "$TP"
        --pipeline-model-parallel-size "$PP"
        --expert-model-parallel-size "$EP"
        --use-distributed-optimizer
        --overlap-grad-reduce
        --overlap-param-gather
        --bf16
        --optimizer adam
        --lr "$LR"
        --min-lr "$LR"
        --lr-decay-style constant
        --lr-warmup-iters 0
        --weight-decay "$WEIGHT_DECAY"
        --clip-grad 1.0
        --seed "$SEED"
        --micro-batch-size "$MICRO_BATCH"
        --global-batch-size "$GLOBAL_BATCH"
        --train-iters "$TRAIN_ITERS"
        --log-interval "$LOG_INTERVAL"
        --eval-interval "${EVAL_INTERVAL:-1000}"
        --eval-iters "${EVAL_ITERS:-0}"
    )
    if [[ "$tiny" == 1 ]]; then
        CIERA_TRAIN_ARGS+=(--device cpu)
    fi

    # Data and tokenizer.
    if [[ -n "${DATA_PATH:-}" ]]; then
        local -a prefixes
        read -r -a prefixes <<<"$DATA_PATH"
        # All documents train by default; give SPLIT (e.g. 969,30,1) and EVAL_ITERS for valid /
        # test evaluation (pretrain_gpt.py rejects a split that would get no document up front).
        CIERA_TRAIN_ARGS+=(--data-path "${prefixes[@]}" --split "${SPLIT:-100,0,0}")
    else
        CIERA_TRAIN_ARGS+=(--mock-data)
    fi
    local tokenizer=${TOKENIZER:-}
    if [[ -z "$tokenizer" ]]; then
        # The model's N rows (padded to a multiple of 128 x TP) on every release: NullTokenizer
        # holds --vocab-size + 1 ids up to megatron-core 0.17 and --vocab-size from 0.18 on, so N - 1
        # gives N or N - 1 ids, which pad alike unless N - 1 is a multiple of the padding; then N
        # (N + 1 or N ids) does.
        local vocab=$MODEL_VOCAB pad=$((128 * TP))
        if [[ "$tiny" == 1 ]]; then vocab=512; fi
        local null_vocab=$((vocab % pad == 1 ? vocab : vocab - 1))
        CIERA_TRAIN_ARGS+=(--tokenizer-type NullTokenizer --vocab-size "${VOCAB_SIZE:-$null_vocab}")
    elif [[ "$tokenizer" == byte ]]; then
        local byte_vocab=${VOCAB_SIZE:-}
        if [[ -z "$byte_vocab" ]]; then
            byte_vocab=$(ciera_null_vocab_size "$CIERA_BYTE_EOD") || exit 2  # it said why
        fi
        CIERA_TRAIN_ARGS+=(--tokenizer-type NullTokenizer --vocab-size "$byte_vocab")
    else
        CIERA_TRAIN_ARGS+=(--tokenizer-type "$tokenizer")
        if [[ -n "${TOKENIZER_MODEL:-}" ]]; then
            CIERA_TRAIN_ARGS+=(--tokenizer-model "$TOKENIZER_MODEL")
        fi
        if [[ -n "${VOCAB_SIZE:-}" ]]; then
            CIERA_TRAIN_ARGS+=(--vocab-size "$VOCAB_SIZE")
        fi
    fi

    # Outputs.
    if [[ -n "${CHECKPOINT_DIR:-}" ]]; then
        CIERA_TRAIN_ARGS+=(--save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR"
            --save-interval "${SAVE_INTERVAL:-500}")
    fi
    if [[ -n "${TENSORBOARD_DIR:-}" ]]; then
        CIERA_TRAIN_ARGS+=(--tensorboard-dir "$TENSORBOARD_DIR")
    fi

    # CIERA: the switch, then knobs that are passed identically in both modes when set.
    case "${CIERA:-1}" in
        1) CIERA_TRAIN_ARGS+=(--ciera-allgather) ;;
        0) ;;
        *) ciera_die "CIERA must be 0 or 1, got '${CIERA}'" ;;
    esac
    local pair flag var
    for pair in codec:CIERA_CODEC block-size:CIERA_BLOCK_SIZE warmup-iters:CIERA_WARMUP_ITERS \
        selection:CIERA_SELECTION verify-interval:CIERA_VERIFY_INTERVAL; do
        flag=${pair%%:*} var=${pair#*:}
        if [[ -n "${!var:-}" ]]; then
            CIERA_TRAIN_ARGS+=("--ciera-$flag" "${!var}")
        fi
    done
}

# The launcher words: torchrun on one node (standalone rendezvous, free port), or a static
# multi-node rendezvous from NNODES / NODE_RANK / MASTER_ADDR / MASTER_PORT (set by SLURM below).
ciera_launcher() {
    local -a torchrun
    # TORCHRUN wins; an explicit PYTHON means "that interpreter's torch"; else torchrun on PATH,
    # else the repository's own .venv (what `make demo` / `make setup` build).
    if [[ -n "${TORCHRUN:-}" ]]; then
        read -r -a torchrun <<<"$TORCHRUN"
    elif [[ -n "${PYTHON:-}" ]]; then
        torchrun=("$PYTHON" -m torch.distributed.run)
    elif command -v torchrun >/dev/null 2>&1; then
        torchrun=(torchrun)
    elif [[ -x "$CIERA_ROOT/.venv/bin/python" ]]; then
        torchrun=("$CIERA_ROOT/.venv/bin/python" -m torch.distributed.run)
    else
        torchrun=(python3 -m torch.distributed.run)
    fi
    CIERA_LAUNCHER=("${torchrun[@]}" --nproc-per-node "$GPUS_PER_NODE")
    if ((NNODES == 1)); then
        CIERA_LAUNCHER+=(--standalone --nnodes 1)
    else
        CIERA_LAUNCHER+=(--nnodes "$NNODES" --node-rank "${NODE_RANK:-${SLURM_NODEID:-0}}"
            --master-addr "${MASTER_ADDR:?MASTER_ADDR must be set when NNODES > 1}"
            --master-port "${MASTER_PORT:-29500}")
    fi
}

# Entry point of train_<model>.sh.
ciera_train() {
    ciera_build_args
    ciera_launcher
    # torchrun's own default, set here so that it does not print a banner about it on every run.
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    ciera_exec "${CIERA_LAUNCHER[@]}" "$CIERA_ROOT/pretrain_gpt.py" "${CIERA_TRAIN_ARGS[@]}" "$@"
}

# Entry point of <model>.sbatch: one torchrun per allocated node, all pointed at the first node.
ciera_slurm() {
    local train_script=$1
    shift
    [[ -n "${SLURM_JOB_NODELIST:-}" ]] ||
        ciera_die "SLURM_JOB_NODELIST is not set: submit with sbatch (or run $train_script directly)"
    local -a hosts
    mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    ((${#hosts[@]} > 0)) || ciera_die "scontrol show hostnames '$SLURM_JOB_NODELIST' listed no host"
    export MASTER_ADDR=${MASTER_ADDR:-${hosts[0]}}
    # A port derived from the job id, so two jobs sharing a first node do not collide.
    export MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}
    export NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-${#hosts[@]}}}
    # SLURM_GPUS_ON_NODE is a count; SLURM_GPUS_PER_NODE may read "a100:8".
    local gpus=${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-8}}
    if [[ "${TINY:-0}" == 1 ]]; then
        # TINY is the 2-rank CPU run: on 2 nodes, one rank each (same world, same params sha256).
        gpus=$((NNODES >= 2 ? 1 : 2))
    fi
    export GPUS_PER_NODE=${GPUS_PER_NODE:-${gpus##*:}}
    # Each srun task is one node; the train script reads its NODE_RANK from SLURM_NODEID.
    ciera_exec srun --nodes "$NNODES" --ntasks "$NNODES" --ntasks-per-node 1 --kill-on-bad-exit=1 \
        "$train_script" "$@"
}
