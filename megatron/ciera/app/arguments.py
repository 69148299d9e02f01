"""Command line of ``pretrain_gpt.py``: Megatron-LM's own flags plus ``--ciera-*``.

The parser is built from ``upstream_flags*.json`` (every flag of Megatron-LM
``megatron/training/arguments.py`` at the release matching the installed megatron-core, with
upstream's option strings, dest, type, default, nargs and choices; regenerate it with
``tools/dump_upstream_flags.py``). What each value does is :mod:`megatron.ciera.app.flag_policy`'s
table: honoured, GPU-only, a feature module's, or rejected with a reason. Unknown flags are
argparse errors; validation errors name the flags and show the arithmetic.

    args = parse_args(["--num-layers", "2", ...])
    ciera_config = ciera_config_from_args(args)   # None without --ciera-allgather
"""

from __future__ import annotations

import argparse
import os
import re

from . import batch_schedule, flag_policy, profiling
from .data import MODEL_FILE_TOKENIZERS, TOKENIZERS as _TOKENIZERS
from .feature_args import (add_checkpoint_eval_data_logging_args, feature_dests,
                           validate_checkpoint_eval_data_logging_args)
from .flag_table import newer_release_flags, option as _option, upstream_flags

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


def _attn_backend(text: str):
    from megatron.core.transformer.enums import AttnBackend

    try:
        return AttnBackend[text]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"invalid --attention-backend {text!r}: choose from {', '.join(b.name for b in AttnBackend)}") from None


def _int_tuple(text: str):
    return tuple(int(v) for v in text.strip("()[] ").split(",") if v.strip())


# Upstream's own converters (recorded as "custom" in the table): ours, with the same meaning.
_CUSTOM_TYPES = {"moe_layer_freq": _moe_layer_freq, "attention_backend": _attn_backend, "window_size": _int_tuple,
                 "exit_signal": int, "window_attn_skip_freq": _moe_layer_freq}  # upstream: moe_freq_type for both


def _upstream_default(flag: dict):
    if flag["dest"] == "attention_backend":
        from megatron.core.transformer.enums import AttnBackend

        return AttnBackend.auto
    if flag["type"] == "custom" and isinstance(flag["default"], str) and flag["default"].startswith("<"):
        return None
    return flag["default"]


def _add_upstream(group, flag: dict) -> None:
    # attention_backend's default as its name: argparse converts it at parse time, so building the
    # parser (and --help) does not import megatron-core.
    default = "auto" if flag["dest"] == "attention_backend" else _upstream_default(flag)
    kw = {"dest": flag["dest"], "default": default}
    action = flag["action"]
    if action in ("storetrue", "storefalse"):
        kw["action"] = "store_true" if action == "storetrue" else "store_false"
    elif action == "booleanoptional":
        kw["action"] = argparse.BooleanOptionalAction
    else:
        typ = flag["type"]
        kw["type"] = _CUSTOM_TYPES.get(flag["dest"], str) if typ == "custom" else {
            "int": int, "float": float, "str": str, "bool": _bool, None: None}[typ]
        if flag["nargs"] is not None:
            kw["nargs"] = flag["nargs"]
        if flag["choices"] is not None and typ != "custom":
            kw["choices"] = flag["choices"]
    group.add_argument(*flag["options"], **kw)


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes"):
        return True
    if text.lower() in ("0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pretrain_gpt.py",
        description="GPT / MoE pretraining on Megatron-Core with the CIERA compressed parameter all-gather. "
                    "Megatron-LM's flags keep upstream's names, types and defaults (see upstream's "
                    "megatron/training/arguments.py); only the flags under the 'CIERA' heading, at the end, are ours.",
        allow_abbrev=False,
    )
    # The checkpoint, evaluation, data and logging flags come with their features' own checks
    # (megatron.ciera.app.feature_args, upstream's names and defaults); every other upstream flag from
    # the table.
    add_checkpoint_eval_data_logging_args(p)
    g = p.add_argument_group("Megatron-LM (upstream names, types and defaults)")
    seen = {o for action in p._actions for o in action.option_strings}
    for flag in upstream_flags():
        options = [o for o in flag["options"] if o not in seen]
        if options:
            seen.update(options)
            _add_upstream(g, dict(flag, options=options))

    _add_modelopt_args(p)

    from ciera.agreement import UNEVEN_MIN_SAVING
    from ciera.codecs.registry import codec_help  # each codec's help line, from its descriptor
    from ciera.config import CODECS, CieraConfig  # the library's defaults and choices, quoted in the help below

    d = CieraConfig()
    g = p.add_argument_group(
        "CIERA and this entry point",
        "Ours. Without --ciera-allgather the other --ciera-* flags are accepted and do nothing, so a "
        "baseline and a CIERA run can share one command. Training is bit-identical either way.")
    g.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="default: cuda when available, else cpu. cpu runs on gloo (tests, the demos, "
                        "laptops); kernel and fusion flags are then listed once at start-up and not used")
    g.add_argument("--ciera-loss-log", default=None, metavar="FILE",
                   help="rank 0 writes 'iteration loss.hex()' per iteration, for exact comparisons of "
                        "two runs (default: not written)")
    g.add_argument("--ciera-allgather", action="store_true",
                   help="gather parameters with CIERA's lossless compressed all-gather (default: off, "
                        "Megatron's gather). Works with --use-distributed-optimizer (ZeRO-1), --use-megatron-fsdp or "
                        "--use-torch-fsdp2. Use it where the parameter all-gather is communication-bound "
                        "(slow links, MoE experts)")
    g.add_argument("--ciera-codec", choices=list(CODECS), default=None,
                   help=f"codec of compressed gathers (default {d.codec}: the cost model picks per bucket). "
                        + codec_help())
    g.add_argument("--ciera-block-size", type=int, default=None, metavar="N",
                   help=f"values per exponent_reuse block, a power of two in [1, 4096] (default {d.block_size}). "
                        "Smaller blocks resend fewer unchanged exponents; rarely worth changing")
    g.add_argument("--ciera-warmup-iters", type=int, default=None, metavar="N",
                   help=f"gathers per bucket sent raw first, and after each invalidation (default "
                        f"{d.warmup_gathers}, at least 1: the first gather has nothing to reuse)")
    g.add_argument("--ciera-selection", choices=["auto", "always", "never"], default=None,
                   help=f"default {d.selection}: per bucket, compress only where the cost model predicts "
                        "a gain from the measured link and codec speeds. always: compress every gather "
                        "(e.g. to see the bytes saved on one host, where raw is faster); never: send raw "
                        "through CIERA's code path (a baseline)")
    g.add_argument("--ciera-verify-interval", type=int, default=None, metavar="N",
                   help=f"every N gathers, compare a 64-bit hash of every gathered shard across ranks "
                        f"and stop naming the bucket on a mismatch (default {d.verify_interval}; 0: off). "
                        "For debugging or new hardware; costs one small collective per check")
    g.add_argument("--ciera-cache", choices=["auto", "values", "two_level", "exponents", "none"], default=None,
                   help=f"with --use-torch-fsdp2 or --use-megatron-fsdp (ZeRO-3: the gathered parameters are freed "
                        f"after use), what each rank keeps of the others' shards between gathers (default {d.cache}), "
                        "per parameter of the unsharded model, plus a copy of its own shard. values: the gathered "
                        "values (2 bytes per bf16 parameter), any codec, and a step's later gathers send nothing; "
                        "two_level: values of one shard per node (1/L of values with L ranks per node) gathered "
                        "compressed across nodes, then a raw gather within each node; "
                        "exponents: 1 byte per parameter, exponent_reuse only (the paper's design); auto: values for "
                        "every unit that fits --ciera-cache-budget, else two_level where the group spans several "
                        "nodes of several ranks and it fits, else exponents (the start-up log names the choice); "
                        "none: every gather plain. Ignored where the gathered buffer persists (the "
                        "distributed optimizer; Megatron-FSDP's optim and optim_grads)")
    g.add_argument("--ciera-node-size", type=int, default=None, metavar="N",
                   help="ranks per node for --ciera-cache two_level and auto (global rank g on node g // N; "
                        "default: the launcher's LOCAL_WORLD_SIZE)")
    g.add_argument("--ciera-cache-budget", default=None, metavar="SIZE",
                   help=f"with --ciera-cache auto: memory per rank the ZeRO-3 caches may keep, a share of what is free "
                        f"once the model and optimizer are built (on CPU: the host's available RAM shared by its "
                        f"ranks), e.g. 30%%, or a size, e.g. 8GiB (default {d.cache_budget.replace('%', '%%')})")
    g.add_argument("--ciera-per-rank-sizes", type=_bool, default=None, metavar="{true,false}",
                   help=f"compressed gathers send each rank's own payload size when that saves at least "
                        f"{UNEVEN_MIN_SAVING * 100:g}%% of the equal-size gather (default "
                        f"{str(d.per_rank_sizes).lower()}; false: every rank sends the largest payload, one equal "
                        "all-gather: the baseline that measures the saving)")
    g.add_argument("--ciera-log-buckets", action="store_true",
                   help="at every log interval, also print CIERA's per-bucket table (bytes, ratio, codec "
                        "times, gathers) and each bucket's selection decision with its predicted times "
                        "(default: off: the iteration line's 'ciera raw/wire' and at most one CIERA line "
                        "per interval)")
    g.add_argument("--ciera-snapshot-dir", default=None, metavar="DIR",
                   help="rank 0 saves the gathered parameters here for tools/exponent_stats.py "
                        "(default: none; needs --ciera-snapshot-interval)")
    g.add_argument("--ciera-snapshot-interval", type=int, default=None, metavar="N",
                   help="save a snapshot every N iterations (default: none; needs --ciera-snapshot-dir)")
    return p


# Upstream's pretrain_gpt.py adds ModelOpt's arguments (megatron/post_training/arguments.py) as its
# extra_args_provider when nvidia-modelopt is importable. Its GPT model builder, the only reader of
# these, runs only with a ModelOpt checkpoint in --load (or a distillation teacher); plain
# pretraining builds the standard GPT model and the flags do nothing. {option: what it does there}.
MODELOPT_FLAGS = {
    "--export-force-local-attention": "ModelOpt's builder takes megatron-core's local attention instead of TE's",
    "--enable-gpt-oss": "ModelOpt's builder sets GPT-OSS's YaRN RoPE on the config",
}


def _add_modelopt_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("ModelOpt (upstream pretrain_gpt.py's extra arguments)",
                             "Accepted as upstream accepts them; they act only in ModelOpt's model builder, "
                             "which upstream runs for a ModelOpt checkpoint in --load: here with --load they "
                             "are refused, without it they do nothing (named at start-up)")
    for option, what in MODELOPT_FLAGS.items():
        g.add_argument(option, action="store_true", help=f"{what} (default: off)")


def _check_modelopt_args(args, err) -> None:
    """The ModelOpt flags: refused with --load (this entry point has no ModelOpt builder), else inert."""
    for option, what in MODELOPT_FLAGS.items():
        if getattr(args, option[2:].replace("-", "_"), False):
            if args.load is not None:
                err(f"{option} with --load: ModelOpt checkpoints and ModelOpt's model builder ({what}) are "
                    "not implemented by this pretrain_gpt.py")
            else:
                args.upstream_inert.append(f"{option} (acts only in ModelOpt's model builder, which upstream runs "
                                           f"for a ModelOpt checkpoint in --load: {what})")


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _te_installed() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def _check_policies(args, err) -> list[str]:
    """Rejected flags set to a non-default value are errors; returns the GPU-only flags set to a
    non-default value (reported on CPU). Flags inert without the flags they need (all of those at
    upstream's default) are accepted and listed in ``args.upstream_inert`` (named at start-up)."""
    gpu_only, seen = [], set(feature_dests())  # the feature flags are checked by feature_args
    defaults = {}
    for flag in upstream_flags():
        defaults.setdefault(flag["dest"], _upstream_default(flag))
    args.upstream_inert = []
    for flag in upstream_flags():
        if flag["dest"] in seen:  # a dest two flags share takes the first one's default
            continue
        seen.add(flag["dest"])
        value = getattr(args, flag["dest"])
        if value == _upstream_default(flag):
            continue
        pol = flag_policy.policy(flag["dest"])
        if pol.needs and all(getattr(args, need, None) == defaults.get(need) for need in pol.needs):
            args.upstream_inert.append(f"{flag['options'][0]} ({pol.inert_reason})")
            continue
        if pol.kind == flag_policy.REJECTED:
            err(f"{flag['options'][0]}: {pol.reason}")
        elif pol.kind == flag_policy.GPU:
            gpu_only.append(flag["options"][0])
    return gpu_only


def _resolve_device(args, device, te_available) -> None:
    """Device, backend, transformer implementation and the GPU-only choices the run will use."""
    import torch

    args.device = device or args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    explicit_backend = args.distributed_backend if "distributed_backend" in args.explicit else None
    args.distributed_backend = explicit_backend or ("nccl" if args.device == "cuda" else "gloo")
    te = _te_installed() if te_available is None else te_available
    if args.device == "cpu" or not te:
        # upstream's default is transformer_engine; without TE (or on CPU) the local spec runs.
        args.transformer_impl_requested = args.transformer_impl
        if "transformer_impl" not in args.explicit or args.device == "cpu":
            args.transformer_impl = "local"
    args.te_available = te


def validate_args(args: argparse.Namespace, world_size: int | None = None, *, device: str | None = None,
                  te_available: bool | None = None) -> argparse.Namespace:
    """Check flag combinations and fill derived values (in place, returns ``args``).

    ``device`` / ``te_available`` override what this machine has (to validate the run a GPU
    node would do). Raises ``ValueError`` whose message names the flags and shows the numbers."""
    world = _world_size() if world_size is None else world_size
    if not hasattr(args, "explicit"):
        args.explicit = set()
    errors = []
    err = errors.append

    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "lr"):
        if getattr(args, name) is None:
            err(f"{_option(name)} is required")
    if args.train_iters is None and args.train_samples is None:
        err("give --train-iters or --train-samples")
    if errors:
        raise ValueError("invalid arguments:\n  " + "\n  ".join(errors))

    gpu_only = _check_policies(args, err)
    _check_modelopt_args(args, err)
    _resolve_device(args, device, te_available)
    if args.device == "cpu":
        args.cpu_ignored = gpu_only + (["--transformer-impl transformer_engine"]
                                       if args.transformer_impl_requested == "transformer_engine"
                                       and "transformer_impl" in args.explicit else [])
    else:
        args.cpu_ignored = []
        if args.transformer_impl == "transformer_engine" and not args.te_available:
            err("--transformer-impl transformer_engine: transformer-engine is not installed "
                "(pip install transformer-engine, or --transformer-impl local)")
        if not args.te_available:
            for dest, needs in (("moe_grouped_gemm", "TEGroupedMLP"), ("fp8_format", "FP8"), ("moe_permute_fusion",
                                "the fused permutation"), ("cuda_graph_impl", "CUDA graphs"), ("external_cuda_graph",
                                "CUDA graphs"), ("apply_rope_fusion", "the fused RoPE")):
                if dest in args.explicit and getattr(args, dest) not in (None, False, "none"):
                    err(f"{_option(dest)} needs transformer-engine ({needs}), which is not installed")
    if args.device == "cpu" and args.distributed_backend == "nccl":
        err("--device cpu needs --distributed-backend gloo")
    if args.moe_token_dispatcher_type == "flex" and args.device == "cuda":
        try:
            import deep_ep  # noqa: F401
        except ImportError:
            err("--moe-token-dispatcher-type flex needs DeepEP (the deep_ep package), which is not installed: "
                "build it for this CUDA from https://github.com/deepseek-ai/DeepEP (pip install . in its "
                "checkout, with NVSHMEM; no PyPI wheel), or use --moe-token-dispatcher-type alltoall")
    _check_local_context_parallel(args, err)
    if args.moe_token_dispatcher_type == "flex" and args.device == "cpu":
        err("--moe-token-dispatcher-type flex needs DeepEP on GPU; on CPU use alltoall")

    if args.bf16 and args.fp16:
        err("--bf16 and --fp16 are mutually exclusive")
    if args.squared_relu and args.swiglu:
        err("--squared-relu and --swiglu are exclusive (two activations; as in Megatron-LM)")
    if args.quick_geglu and args.swiglu:
        err("--quick-geglu and --swiglu are exclusive (two activations; as in Megatron-LM)")
    if not args.add_bias_linear:  # as upstream's validate_args: no linear bias, no bias-GeLU fusion
        args.bias_gelu_fusion = False
    if args.recompute_activations:  # upstream's older spelling of selective recompute
        args.recompute_granularity = "selective"
    if args.bf16 and args.accumulate_allreduce_grads_in_fp32 and args.main_grads_dtype != "fp32":
        err("--accumulate-allreduce-grads-in-fp32 needs --main-grads-dtype fp32 (as in Megatron-LM)")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        err("--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler are exclusive "
            "(which schedule wins on load: the command line's or the checkpoint's)")
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        err("--overlap-param-gather requires --use-distributed-optimizer")
    if args.overlap_param_gather and not args.overlap_grad_reduce:
        err("--overlap-param-gather requires --overlap-grad-reduce (as in Megatron-LM)")
    if args.ciera_allgather and not (args.use_distributed_optimizer or args.use_torch_fsdp2):
        err("--ciera-allgather requires --use-distributed-optimizer or --use-torch-fsdp2 (it replaces "
            "their parameter all-gather)")
    if args.use_torch_fsdp2:
        from .engine_args import check_fsdp2_args

        check_fsdp2_args(args, err=err, ciera_config=lambda: ciera_config_from_args(args))
    if args.use_megatron_fsdp:
        from .engine_args import check_megatron_fsdp_args

        check_megatron_fsdp_args(args, err=err, ciera_config=lambda: ciera_config_from_args(args))
    # --ciera-codec etc. without --ciera-allgather are inert (launch scripts pass the same tuning
    # flags to the baseline and the CIERA run, so that --ciera-allgather is the only difference):
    # training names them at start-up (args.ciera_inert) instead of ignoring them silently.
    args.ciera_inert = [] if args.ciera_allgather else _inert_ciera_flags(args)
    if (args.ciera_snapshot_dir is None) != (args.ciera_snapshot_interval is None):
        err("--ciera-snapshot-dir and --ciera-snapshot-interval go together")
    if args.ciera_snapshot_interval is not None and args.ciera_snapshot_interval < 1:
        err(f"--ciera-snapshot-interval {args.ciera_snapshot_interval} must be >= 1")

    _check_layout(args, world, err)
    _check_model(args, err)
    _check_batch_and_schedule(args, err)

    if args.tokenizer_type is None:
        args.tokenizer_type = "NullTokenizer" if args.vocab_size is not None else "GPT2BPETokenizer"
    if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
        err("--tokenizer-type NullTokenizer needs --vocab-size")
    if args.tokenizer_type in ("HuggingFaceTokenizer", *MODEL_FILE_TOKENIZERS) and not args.tokenizer_model:
        err(f"--tokenizer-type {args.tokenizer_type} needs --tokenizer-model")
    if args.tokenizer_type == "GPT2BPETokenizer" and not (args.vocab_file and args.merge_file):
        err("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file")
    if args.tokenizer_type not in _TOKENIZERS:
        err(f"--tokenizer-type {args.tokenizer_type}: this entry point builds {', '.join(_TOKENIZERS)}")
    validate_checkpoint_eval_data_logging_args(args, err)
    profiling.check_args(args, err)
    if args.log_interval < 1:
        err(f"--log-interval {args.log_interval} must be >= 1")
    if args.distributed_timeout_minutes is not None and args.distributed_timeout_minutes <= 0:
        err(f"--distributed-timeout-minutes {args.distributed_timeout_minutes} must be > 0")

    if args.ciera_allgather and not errors:
        try:
            ciera_config_from_args(args)
        except ValueError as exc:
            err(f"--ciera-* flags: {exc}")
    if not errors:
        _fill_model_defaults(args)
        try:  # the configs training builds: their own checks run now, on every rank
            from . import model

            model.transformer_config(args)
            model.ddp_config(args)
            model.optimizer_config(args)
        except Exception as exc:  # noqa: BLE001 - any failure of the config's own checks is reported
            err(f"megatron-core rejects this configuration: {type(exc).__name__}: {exc}")
        else:
            _check_optimizer_ranges(args, err)
    if errors:
        raise ValueError("invalid arguments:\n  " + "\n  ".join(errors))
    return args


def _inert_ciera_flags(args) -> list[str]:
    """The ``--ciera-*`` flags given on the command line that configure the compressed gather
    (those that change :func:`ciera_config_from_args`'s config), e.g. ``--ciera-codec delta``."""
    import copy

    out = []
    for dest in sorted(d for d in args.explicit if d.startswith("ciera_") and d != "ciera_allgather"):
        on = copy.copy(args)
        on.ciera_allgather = True
        off = copy.copy(on)
        setattr(off, dest, None)
        try:
            if ciera_config_from_args(on) != ciera_config_from_args(off):
                out.append(f"{_option(dest)} {getattr(args, dest)}")
        except ValueError:  # an invalid value: reported only where it is used
            out.append(f"{_option(dest)} {getattr(args, dest)}")
    return out


def _optimizer_rejects(config) -> str | None:
    """What the torch optimizer megatron-core builds from ``config`` says of its values (its own
    range checks: learning rate, betas, epsilon, weight decay, momentum), ``None`` if nothing.
    megatron-core's own builder runs on a one-element parameter; only its ``ValueError`` (torch's
    checks) counts: what follows the construction needs a device and is not a range."""
    import torch
    from megatron.core.optimizer import _get_megatron_optimizer_based_on_param_groups as build

    try:
        build(config, model_chunks=[], param_groups=[{"params": [torch.nn.Parameter(torch.zeros(1))]}])
    except ValueError as exc:
        return str(exc)
    except Exception:  # noqa: BLE001 - past the optimizer's construction (the checks passed)
        return None
    return None


def _scheduler_rejects(args) -> tuple[str, list[str]] | None:
    """The assertion megatron-core's OptimizerParamScheduler fails for this run's schedule, with
    the flags it reads (``(assertion, flags)``), ``None`` if it passes. The kwarg -> flag table
    is read from :func:`megatron.ciera.app.model.scheduler`'s own source (``kwarg=args.dest``)."""
    import inspect
    import re
    import traceback
    import types

    from . import model

    try:  # a stand-in optimizer: the scheduler only sets its groups' lr and weight decay
        model.scheduler(args, types.SimpleNamespace(param_groups=[{}]))
    except AssertionError as exc:
        line = (traceback.extract_tb(exc.__traceback__)[-1].line or "").strip()
        table = dict(re.findall(r"(\w+)=args\.(\w+)", inspect.getsource(model.scheduler)))
        names = re.findall(r"self\.(\w+)", line)
        return line.removeprefix("assert ").split(",")[0].replace("self.", ""), [_option(table[n]) for n in names if n in table]
    return None


def _check_optimizer_ranges(args, err) -> None:
    """Up front, on every rank, the ranges upstream states for the optimizer and the schedule,
    each error naming its flag: the optimizer's (torch's checks on megatron-core's own
    OptimizerConfig -> optimizer kwargs; a field that differs from the dataclass default and,
    set alone, is rejected is named) and the scheduler's (its assertions)."""
    import dataclasses

    from megatron.core.optimizer import OptimizerConfig

    from . import model

    config = dataclasses.replace(model.optimizer_config(args), use_distributed_optimizer=False, fp16=False,
                                 bf16=False, optimizer_cpu_offload=False, use_precision_aware_optimizer=False)
    problem = _optimizer_rejects(config)
    if problem is not None:
        defaults = {f.name: f.default for f in dataclasses.fields(OptimizerConfig)
                    if f.default is not dataclasses.MISSING and isinstance(f.default, (int, float))
                    and not isinstance(f.default, bool)}
        culprits = [name for name, default in defaults.items() if getattr(config, name) != default
                    and _optimizer_rejects(dataclasses.replace(config, **{name: default})) is None]
        if not culprits and config.lr is not None:  # lr has no default: rejected when nothing else is
            culprits = ["lr"]
        flags = ", ".join(f"{_option(n)} {getattr(config, n)}" for n in culprits) or "the optimizer flags"
        err(f"{flags}: out of range ({config.optimizer} optimizer: {problem})")
        return
    rejected = _scheduler_rejects(args)
    if rejected is not None:
        condition, flags = rejected
        values = ", ".join(f"{f} {getattr(args, f.lstrip('-').replace('-', '_'), '?')}" for f in dict.fromkeys(flags))
        err(f"{values or 'the learning-rate schedule'}: megatron-core's OptimizerParamScheduler requires {condition}")


def _check_local_context_parallel(args, err) -> None:
    """CP > 1 without transformer-engine runs :mod:`megatron.ciera.app.cp_attention` (all-gather-KV):
    what it does not cover is refused by name; another ``--cp-comm-type`` (a TE kernel choice)
    is reported on CPU and refused on GPU, where TE would honour it."""
    cp = args.context_parallel_size
    if cp == 1 or args.transformer_impl == "transformer_engine":
        return
    for dest in ("multi_latent_attention", "window_size"):
        if getattr(args, dest, None):
            err(f"{_option(dest)} with --context-parallel-size {cp} needs transformer-engine's attention "
                "(the local context-parallel attention covers standard causal attention)")
    comm = args.cp_comm_type if isinstance(args.cp_comm_type, list) else [args.cp_comm_type]
    if any(c != "all_gather" for c in comm):
        shown = f"--cp-comm-type {' '.join(map(str, comm))}"
        if args.device == "cpu":
            args.cpu_ignored.append(f"{shown} (the local context-parallel attention all-gathers K/V)")
        else:
            err(f"{shown}: --transformer-impl local's context-parallel attention all-gathers K/V; "
                "pass --cp-comm-type all_gather, or use transformer-engine for the others")


def _check_layout(args, world: int, err) -> None:
    """TP / PP (+ virtual) / CP / EP / ETP sizes against the world (Megatron-Core's rank layout)."""
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    ep = args.expert_model_parallel_size
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = tp
    etp = args.expert_tensor_parallel_size
    for name, v in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                    ("context_parallel_size", cp), ("expert_model_parallel_size", ep),
                    ("expert_tensor_parallel_size", etp)):
        if v < 1:
            err(f"{_option(name)} {v} must be >= 1")
            return
    if world % (tp * pp * cp) != 0:
        err(f"world size {world} is not divisible by tensor x pipeline x context parallel size "
            f"{tp} x {pp} x {cp} = {tp * pp * cp}")
    if world % (etp * ep * pp) != 0:
        err(f"world size {world} is not divisible by expert-tensor x expert x pipeline parallel size "
            f"{etp} x {ep} x {pp} = {etp * ep * pp}")
    args.world_size = world
    args.data_parallel_size = max(world // (tp * pp * cp), 1)
    args.expert_data_parallel_size = max(world // (etp * ep * pp), 1)
    if ep > 1 and args.num_experts is None:
        err(f"--expert-model-parallel-size {ep} needs --num-experts")
    if tp == 1 and args.sequence_parallel:
        args.sequence_parallel = False  # as upstream: nothing to split at TP 1
    if args.num_experts is not None and tp > 1 and not args.sequence_parallel:
        err(f"--num-experts with --tensor-model-parallel-size {tp} needs --sequence-parallel (as in Megatron-LM)")

    vstage, vranks = args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank
    args.virtual_pipeline_model_parallel_size = None
    if vstage is not None and vranks is not None:
        err("--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank are exclusive")
    elif vstage is not None or vranks is not None:
        if pp < 2:
            err("the interleaved schedule (virtual pipeline stages) needs --pipeline-model-parallel-size >= 2")
        elif vstage is not None:
            if args.num_layers % (pp * vstage) != 0:
                err(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp} x "
                    f"--num-layers-per-virtual-pipeline-stage {vstage} = {pp * vstage}")
            else:
                args.virtual_pipeline_model_parallel_size = args.num_layers // (pp * vstage)
        else:
            args.virtual_pipeline_model_parallel_size = vranks
            if (args.decoder_first_pipeline_num_layers is None and args.decoder_last_pipeline_num_layers is None
                    and args.pipeline_model_parallel_layout is None and args.num_layers % (pp * vranks) != 0):
                err(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp} x "
                    f"--num-virtual-stages-per-pipeline-rank {vranks} = {pp * vranks}")
    if args.virtual_pipeline_model_parallel_size is None:  # as upstream: only the interleaved schedule overlaps
        args.overlap_p2p_comm = False
        args.align_param_gather = False
    if (pp > 1 and args.decoder_first_pipeline_num_layers is None and args.pipeline_model_parallel_layout is None and args.decoder_last_pipeline_num_layers is None
            and args.num_layers % pp != 0):
        err(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")


def _check_model(args, err) -> None:
    tp = args.tensor_model_parallel_size
    if args.hidden_size % args.num_attention_heads != 0 and args.kv_channels is None:
        err(f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
            f"{args.num_attention_heads}; give --kv-channels")
    if args.num_attention_heads % tp != 0:
        err(f"--num-attention-heads {args.num_attention_heads} is not divisible by --tensor-model-parallel-size {tp}")
    if args.group_query_attention:
        if args.num_attention_heads % args.num_query_groups != 0:
            err(f"--num-attention-heads {args.num_attention_heads} is not divisible by "
                f"--num-query-groups {args.num_query_groups}")
        if args.num_query_groups % tp != 0:
            err(f"--num-query-groups {args.num_query_groups} is not divisible by --tensor-model-parallel-size {tp}")
    if args.num_experts is not None:
        ep = args.expert_model_parallel_size
        if args.num_experts % ep != 0:
            err(f"--num-experts {args.num_experts} is not divisible by --expert-model-parallel-size {ep}")
        if not 1 <= args.moe_router_topk <= args.num_experts:
            err(f"--moe-router-topk {args.moe_router_topk} must be in [1, --num-experts {args.num_experts}]")
        if isinstance(args.moe_layer_freq, list) and len(args.moe_layer_freq) != args.num_layers:
            err(f"--moe-layer-freq gives {len(args.moe_layer_freq)} layers, --num-layers is {args.num_layers}")
        if args.transformer_impl == "local" and args.add_bias_linear:
            # megatron-core's local SequentialMLP adds the expert bias in place onto the output of
            # the row-parallel reduce (a custom autograd Function): autograd refuses it at the first
            # forward. transformer-engine's expert linears return fresh tensors and train.
            err("--num-experts with biased linears under --transformer-impl local (the CPU path): "
                "megatron-core's local experts fail in their first forward with a bias; give "
                "--disable-bias-linear, or run with transformer-engine")
    if args.multi_latent_attention and args.transformer_impl == "local":
        # MLA builds its core attention with k_channels / v_channels, which only transformer-engine's
        # attention takes (megatron-core's local DotProductAttention has neither, 0.16 and 0.19)
        err("--multi-latent-attention needs transformer-engine's attention: megatron-core's local attention "
            "(--transformer-impl local, the CPU path) takes no separate key/value head sizes")
    for name in ("moe_aux_loss_coeff", "moe_router_load_balancing_type"):  # nargs='+': one value is a scalar
        value = getattr(args, name)
        if isinstance(value, list) and len(value) == 1:
            setattr(args, name, value[0])
    if args.moe_ffn_hidden_size is None and args.num_experts is not None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    if not args.add_position_embedding and args.position_embedding_type == "learned_absolute":
        args.position_embedding_type = "none"  # upstream's reading of the deprecated --no-position-embedding


def _check_batch_and_schedule(args, err) -> None:
    """Batch sizes (positive, divisible), iterations from samples, LR schedule lengths."""
    dp, mbs = args.data_parallel_size, args.micro_batch_size
    if mbs < 1:
        err(f"--micro-batch-size {mbs} must be >= 1")
        return
    if args.global_batch_size is None:
        args.global_batch_size = mbs * dp
    gbs = args.global_batch_size
    if gbs < 1:
        err(f"--global-batch-size {gbs} must be >= 1")
        return
    per_step = mbs * dp
    if gbs % per_step != 0:
        err(f"--global-batch-size {gbs} is not divisible by --micro-batch-size {mbs} x data-parallel size "
            f"{dp} = {per_step}")
    args.num_microbatches = max(gbs // per_step, 1)
    pp = args.pipeline_model_parallel_size
    if args.virtual_pipeline_model_parallel_size and args.num_microbatches % pp != 0:
        err(f"the interleaved schedule needs the number of micro batches ({args.num_microbatches}) to be a "
            f"multiple of --pipeline-model-parallel-size {pp}")

    if args.train_iters is not None and args.train_samples is not None:
        err("--train-iters and --train-samples are exclusive")
    if args.train_iters is None and args.train_samples is not None:
        if args.train_samples < 1:
            err(f"--train-samples {args.train_samples} must be >= 1")
        args.train_iters = max(args.train_samples // gbs, 1)
    if args.train_iters is not None and args.train_iters < 1:
        err(f"--train-iters {args.train_iters} must be >= 1")
    iters_mode = args.train_samples is None
    if iters_mode and (args.lr_decay_samples is not None or args.lr_warmup_samples):
        err("--lr-decay-samples / --lr-warmup-samples go with --train-samples (as in Megatron-LM)")
    if not iters_mode and (args.lr_decay_iters is not None or args.lr_warmup_iters):
        err("--lr-decay-iters / --lr-warmup-iters go with --train-iters (as in Megatron-LM)")
    batch_schedule.check_args(args, err)  # --rampup-batch-size / --step-batch-size-schedule: train_iters
    if args.lr_warmup_fraction is not None and (args.lr_warmup_iters or args.lr_warmup_samples):
        err("--lr-warmup-fraction is exclusive with --lr-warmup-iters / --lr-warmup-samples")
    # Scheduler lengths in samples (the scheduler steps by the global batch size).
    if iters_mode:
        args.lr_decay_steps = (args.lr_decay_iters or args.train_iters or 0) * gbs
        args.lr_warmup_steps = (args.lr_warmup_iters or 0) * gbs
        args.wd_incr_steps = (args.train_iters or 0) * gbs
    else:
        args.lr_decay_steps = args.lr_decay_samples or args.train_samples
        args.lr_warmup_steps = args.lr_warmup_samples or 0
        args.wd_incr_steps = args.train_samples
    if args.lr_warmup_fraction is not None:
        args.lr_warmup_steps = int(args.lr_warmup_fraction * args.lr_decay_steps)


def _weight_shards_as_upstream(args) -> None:
    """megatron-core >= 0.19: the weight-shard counts (dense and expert) resolved against the tensor
    parallel sizes by megatron-core's own function, as upstream's validate_args does."""
    try:
        from megatron.core.model_parallel_config import resolve_tensor_parallel_weight_shards as resolve
    except ImportError:  # megatron-core 0.16: no such flags
        return
    args.tensor_parallel_num_weight_shards, args.gtp_weight_remat_size = resolve(
        args.tensor_model_parallel_size, args.tensor_parallel_num_weight_shards, getattr(args, "gtp_weight_remat_size", 1))
    args.expert_tensor_parallel_num_weight_shards, args.expert_gtp_weight_remat_size = resolve(
        args.expert_tensor_parallel_size or args.tensor_model_parallel_size,
        args.expert_tensor_parallel_num_weight_shards, getattr(args, "expert_gtp_weight_remat_size", 1))


def _fill_model_defaults(args) -> None:
    import torch

    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.kv_channels is None:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.moe_ffn_hidden_size is None and args.num_experts is not None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    args.params_dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    _grad_reduce_dtype_as_upstream(args)
    _weight_shards_as_upstream(args)
    if args.start_weight_decay is None:
        args.start_weight_decay = args.weight_decay
    if args.end_weight_decay is None:
        args.end_weight_decay = args.weight_decay
    if args.device == "cpu":
        args.use_cpu_initialization = True


def _grad_reduce_dtype_as_upstream(args) -> None:
    """Megatron-LM's bf16 rule: gradients accumulate and reduce in fp32 (with fp32 main grads)
    unless ``--grad-reduce-in-bf16``; without it a bf16 run here would reduce in bf16 and train
    differently from the same command under Megatron-LM."""
    if not args.bf16:
        return
    if args.grad_reduce_in_bf16:
        args.accumulate_allreduce_grads_in_fp32 = False
    elif args.main_grads_dtype == "fp32":
        args.accumulate_allreduce_grads_in_fp32 = True


def explicit_dests(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """Dests of the flags that appear in ``argv`` (to tell a typed default from an omitted flag)."""
    by_option = {o: a.dest for a in parser._actions for o in a.option_strings}
    return {by_option[w.split("=", 1)[0]] for w in argv if w.split("=", 1)[0] in by_option}


def parse_args(argv: list[str] | None = None, **validate_kw) -> argparse.Namespace:
    """Parse and validate; on an invalid combination exit with status 2, as argparse, printing
    the error once (rank 0) with a one-line usage hint (:func:`megatron.ciera.app.failfast.usage_error`)."""
    import sys

    from .failfast import usage_error

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    parser.error = usage_error  # not argparse's usage of every flag, on every rank
    if newer := newer_release_flags(argv):
        from importlib.metadata import version

        parser.error(f"{', '.join(newer)}: Megatron-LM flags of a newer release ({', '.join(sorted(set(newer.values())))}) "
                     f"than the installed megatron-core {version('megatron-core')}; install that release's megatron-core")
    args = parser.parse_args(argv)
    args.explicit = explicit_dests(parser, argv)
    try:
        return validate_args(args, **validate_kw)
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
        "cache": args.ciera_cache,
        "cache_budget": args.ciera_cache_budget,
        "node_size": args.ciera_node_size,
        "per_rank_sizes": args.ciera_per_rank_sizes,
    }
    return CieraConfig(**{k: v for k, v in fields.items() if v is not None})
