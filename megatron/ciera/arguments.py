"""Command line of ``pretrain_gpt.py``: Megatron-LM's flag names plus the ``--ciera-*`` flags.

Only the flags our launch scripts use are accepted; anything else is an error (argparse rejects
unknown flags), so a misspelled option never silently trains a different model. Validation
errors name the flags involved and show the arithmetic that failed.

    args = parse_args(["--num-layers", "2", ...])
    ciera_config = ciera_config_from_args(args)   # None without --ciera-allgather
"""

from __future__ import annotations

import argparse
import os
import re

from .feature_args import add_checkpoint_eval_data_logging_args, validate_checkpoint_eval_data_logging_args

__all__ = ["build_parser", "parse_args", "validate_args", "ciera_config_from_args"]


def _moe_layer_freq(text: str):
    """``--moe-layer-freq``: an int (every N-th layer is MoE) or a Python list pattern such as
    ``([0]*1+[1]*3)`` or ``[0]+[1]*27`` (1 = MoE layer, 0 = dense), as in Megatron-LM."""
    if re.fullmatch(r"\d+", text.strip()):
        return int(text)
    if not re.fullmatch(r"[\s\[\]\(\)0-9*+,]+", text):
        raise argparse.ArgumentTypeError(f"invalid --moe-layer-freq {text!r}: use N or a list pattern like [0]+[1]*3")
    try:
        value = eval(text, {"__builtins__": {}}, {})  # only brackets, digits, * + , survive the regex
    except Exception as exc:
        raise argparse.ArgumentTypeError(f"invalid --moe-layer-freq {text!r}: {exc}") from None
    if not isinstance(value, list) or any(v not in (0, 1) for v in value):
        raise argparse.ArgumentTypeError(f"--moe-layer-freq {text!r} must give a list of 0/1")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        description="GPT / MoE pretraining on Megatron-Core with the CIERA compressed parameter all-gather",
        allow_abbrev=False,
    )

    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=True)
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 x hidden size")
    g.add_argument("--num-attention-heads", type=int, required=True)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=1)
    g.add_argument("--kv-channels", type=int, default=None, help="default: hidden / heads")
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default: seq length")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope", "none"], default="learned_absolute")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--use-mcore-models", action="store_true", help="accepted for compatibility (always Megatron-Core)")
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default="local")
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--vocab-size", type=int, default=None, help="with --tokenizer-type NullTokenizer")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)

    g = p.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int, default=None)
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None)
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None)
    g.add_argument("--moe-router-load-balancing-type", choices=["aux_loss", "seq_aux_loss", "sinkhorn", "none"], default="aux_loss")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="softmax before top-k (megatron-core requires it for top-1 routing)")
    g.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall"], default="allgather")
    g.add_argument("--moe-layer-freq", type=_moe_layer_freq, default=1)
    g.add_argument("--moe-grouped-gemm", action="store_true", help="needs transformer-engine / grouped_gemm")
    g.add_argument("--expert-model-parallel-size", type=int, default=1)

    g = p.add_argument_group("parallelism and precision")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--ddp-bucket-size", type=int, default=None, help="elements per DDP bucket (with --overlap-grad-reduce)")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None, help="fp16 static loss scale (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=float, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None, help="default: nccl on cuda, gloo on cpu")
    g.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available, else cpu")

    g = p.add_argument_group("optimizer and schedule")
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    g.add_argument("--lr", type=float, required=True)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root"], default="linear")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--deterministic-mode", action="store_true",
                   help="deterministic kernels (GPU: needed to compare two runs bit for bit; CPU runs are deterministic anyway)")

    g = p.add_argument_group("data")
    g.add_argument("--tokenizer-type", default=None,
                   help="NullTokenizer (needs --vocab-size, no files) or HuggingFaceTokenizer (--tokenizer-model)")
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--micro-batch-size", type=int, required=True)
    g.add_argument("--global-batch-size", type=int, default=None, help="default: micro x data-parallel size")
    g.add_argument("--train-iters", type=int, required=True)

    add_checkpoint_eval_data_logging_args(p)

    g = p.add_argument_group("exact-comparison logging")
    g.add_argument("--ciera-loss-log", default=None, metavar="FILE",
                   help="rank 0 writes 'iteration loss.hex()' per iteration (exact comparisons)")

    g = p.add_argument_group("CIERA compressed parameter all-gather")
    g.add_argument("--ciera-allgather", action="store_true", help="gather parameters with CIERA (needs --use-distributed-optimizer)")
    g.add_argument("--ciera-codec", choices=["raw", "exponent_reuse", "delta", "auto"], default=None)
    g.add_argument("--ciera-block-size", type=int, default=None)
    g.add_argument("--ciera-warmup-iters", type=int, default=None, help="gathers per bucket sent raw first (>= 1)")
    g.add_argument("--ciera-selection", choices=["auto", "always", "never"], default=None)
    g.add_argument("--ciera-verify-interval", type=int, default=None)
    g.add_argument("--ciera-snapshot-dir", default=None, metavar="DIR")
    g.add_argument("--ciera-snapshot-interval", type=int, default=None, metavar="N")
    return p


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def validate_args(args: argparse.Namespace, world_size: int | None = None) -> argparse.Namespace:
    """Check flag combinations and fill derived defaults (in place, returns ``args``).

    Raises ``ValueError`` whose message names the flags and shows the numbers."""
    world = _world_size() if world_size is None else world_size
    errors = []

    def err(msg):
        errors.append(msg)

    if args.tensor_model_parallel_size != 1:
        err(f"--tensor-model-parallel-size {args.tensor_model_parallel_size}: only 1 is supported")
    if args.pipeline_model_parallel_size != 1:
        err(f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}: only 1 is supported")
    if args.bf16 and args.fp16:
        err("--bf16 and --fp16 are mutually exclusive")
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        err("--overlap-param-gather requires --use-distributed-optimizer")
    if args.overlap_param_gather and not args.overlap_grad_reduce:
        err("--overlap-param-gather requires --overlap-grad-reduce (as in Megatron-LM)")
    if args.ciera_allgather and not args.use_distributed_optimizer:
        err("--ciera-allgather requires --use-distributed-optimizer (it replaces the distributed "
            "optimizer's parameter all-gather)")
    # --ciera-codec etc. without --ciera-allgather are inert (launch scripts pass the same tuning
    # flags to the baseline and the CIERA run, so that --ciera-allgather is the only difference).
    if (args.ciera_snapshot_dir is None) != (args.ciera_snapshot_interval is None):
        err("--ciera-snapshot-dir and --ciera-snapshot-interval go together")
    if args.ciera_snapshot_interval is not None and args.ciera_snapshot_interval < 1:
        err(f"--ciera-snapshot-interval {args.ciera_snapshot_interval} must be >= 1")

    tp, pp, ep = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size
    if world % (tp * pp) != 0:
        err(f"world size {world} is not divisible by tensor x pipeline parallel size {tp} x {pp} = {tp * pp}")
    dp = max(world // (tp * pp), 1)
    args.world_size, args.data_parallel_size = world, dp
    if ep < 1 or dp % ep != 0:
        err(f"data-parallel size {dp} (world {world} / (tp {tp} x pp {pp})) is not divisible by "
            f"--expert-model-parallel-size {ep}")
    if ep > 1 and args.num_experts is None:
        err(f"--expert-model-parallel-size {ep} needs --num-experts")
    if args.num_experts is not None:
        if args.num_experts % ep != 0:
            err(f"--num-experts {args.num_experts} is not divisible by --expert-model-parallel-size {ep}")
        if not 1 <= args.moe_router_topk <= args.num_experts:
            err(f"--moe-router-topk {args.moe_router_topk} must be in [1, --num-experts {args.num_experts}]")
        if isinstance(args.moe_layer_freq, list) and len(args.moe_layer_freq) != args.num_layers:
            err(f"--moe-layer-freq gives {len(args.moe_layer_freq)} layers, --num-layers is {args.num_layers}")
        if ep > 1 and args.moe_token_dispatcher_type != "alltoall":
            err(f"--expert-model-parallel-size {ep} needs --moe-token-dispatcher-type alltoall")
    if args.moe_grouped_gemm:
        err("--moe-grouped-gemm is not supported by this entry point (local spec, no grouped_gemm)")

    if args.hidden_size % args.num_attention_heads != 0 and args.kv_channels is None:
        err(f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
            f"{args.num_attention_heads}; give --kv-channels")
    if args.group_query_attention and args.num_attention_heads % args.num_query_groups != 0:
        err(f"--num-attention-heads {args.num_attention_heads} is not divisible by "
            f"--num-query-groups {args.num_query_groups}")

    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    per_step = args.micro_batch_size * dp
    if args.global_batch_size % per_step != 0:
        err(f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {dp} = {per_step}")
    args.num_microbatches = max(args.global_batch_size // per_step, 1)

    if args.tokenizer_type is None:
        args.tokenizer_type = "NullTokenizer"
    if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
        err("--tokenizer-type NullTokenizer needs --vocab-size")
    if args.tokenizer_type == "HuggingFaceTokenizer" and not args.tokenizer_model:
        err("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model")
    if args.tokenizer_type not in ("NullTokenizer", "HuggingFaceTokenizer"):
        err(f"--tokenizer-type {args.tokenizer_type}: supported are NullTokenizer and HuggingFaceTokenizer")

    validate_checkpoint_eval_data_logging_args(args, err)
    if args.train_iters < 1:
        err(f"--train-iters {args.train_iters} must be >= 1")
    if args.device == "cpu" and args.distributed_backend == "nccl":
        err("--device cpu needs --distributed-backend gloo")

    if args.ciera_allgather and not errors:
        try:
            ciera_config_from_args(args)
        except ValueError as exc:
            err(f"--ciera-* flags: {exc}")

    if errors:
        raise ValueError("invalid arguments:\n  " + "\n  ".join(errors))

    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.kv_channels is None:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if not args.group_query_attention:
        args.num_query_groups = None
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    args.params_dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and validate; on an invalid combination exit with argparse's usage error (status 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return validate_args(args)
    except ValueError as exc:
        parser.error(str(exc))


def ciera_config_from_args(args: argparse.Namespace):
    """The :class:`ciera.CieraConfig` the ``--ciera-*`` flags ask for, or ``None`` without
    ``--ciera-allgather``. Unset flags keep CieraConfig's defaults; a new config is built."""
    if not args.ciera_allgather:
        return None
    from ciera.config import CieraConfig

    fields = {
        "codec": args.ciera_codec,
        "block_size": args.ciera_block_size,
        "warmup_gathers": args.ciera_warmup_iters,
        "selection": args.ciera_selection,
        "verify_interval": args.ciera_verify_interval,
    }
    return CieraConfig(**{k: v for k, v in fields.items() if v is not None})
