"""Flags of the checkpoint, evaluation, data and logging features (Megatron-LM's names and defaults).

``build_parser`` adds them with one call, ``validate_args`` checks them with one call:

    add_checkpoint_eval_data_logging_args(parser)
    validate_checkpoint_eval_data_logging_args(args, err)   # err(message) collects problems

Every flag here is honoured by :mod:`megatron.ciera.app.checkpointing`, :mod:`megatron.ciera.app.evaluation`,
:mod:`megatron.ciera.app.data`, :mod:`megatron.ciera.app.timers` or :mod:`megatron.ciera.app.logging_utils`,
or rejected by name in :func:`validate_checkpoint_eval_data_logging_args`. Flags that are not
Megatron-LM's are marked "(CIERA-Megatron)" in their help.
"""

from __future__ import annotations

import argparse
import functools
from typing import Callable

__all__ = ["add_checkpoint_eval_data_logging_args", "validate_checkpoint_eval_data_logging_args",
           "HONOURED_FLAGS", "TABLE_CHECKPOINT_FLAGS",
           "feature_dests"]

STRICTNESS = ["assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
              "return_unexpected", "return_all", "ignore_all"]


def add_checkpoint_eval_data_logging_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the checkpoint, evaluation, data and logging flags to ``parser`` (returns it)."""
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="directory to save checkpoints to")
    g.add_argument("--save-interval", type=int, default=None, help="iterations between checkpoint saves")
    g.add_argument("--no-save-optim", action="store_true", default=None, help="do not save the optimizer state")
    g.add_argument("--no-save-rng", action="store_true", default=None, help="do not save the RNG state")
    g.add_argument("--load", default=None, help="directory holding the checkpoint to load")
    g.add_argument("--no-load-optim", action="store_true", default=None,
                   help="do not load the optimizer and LR scheduler state")
    g.add_argument("--no-load-rng", action="store_true", default=None, help="do not load the RNG state")
    g.add_argument("--finetune", action="store_true",
                   help="load the model only; start at iteration 0 with a fresh optimizer and RNG "
                        "(without --load: from scratch, as upstream)")
    g.add_argument("--ckpt-step", type=int, default=None, help="with --load: this iteration instead of the latest")
    g.add_argument("--ckpt-format", default="torch_dist",
                   choices=["torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"],
                   help="checkpoint format: torch_dist (default) or torch (legacy per-rank files)")
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoints in a background process (megatron-core's async dist-ckpt) while "
                        "training goes on; each becomes the latest only once every rank's write is done. With "
                        "--use-persistent-ckpt-worker the writer is one long-lived process per rank (megatron-core "
                        "0.19 needs it, as Megatron-LM 0.19: without it the save is synchronous)")
    g.add_argument("--dist-ckpt-strictness", default="assume_ok_unexpected", choices=STRICTNESS,
                   help="what a key mismatch between checkpoint and model does on load")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="exit when --load holds no checkpoint instead of starting from scratch")
    g.add_argument("--exit-interval", type=int, default=None, help="stop (after saving) at an iteration multiple of this")
    g.add_argument("--ckpt-fallback-to-previous", action="store_true",
                   help="(CIERA-Megatron) when the checkpoint to load fails its checksums, load the newest "
                        "earlier checkpoint that passes them instead of failing")
    g.add_argument("--overwrite-checkpoints", action="store_true",
                   help="(CIERA-Megatron) start without loading although --save already holds checkpoints "
                        "(default: refuse, so that a mistyped --load never overwrites them)")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false", dest="check_for_nan_in_loss_and_grad",
                   help="do not stop the run on NaN or Inf in the loss or the gradient norm")

    g = parser.add_argument_group("validation")
    g.add_argument("--eval-iters", type=int, default=100, help="iterations per evaluation (0: none)")
    g.add_argument("--eval-interval", type=int, default=None,
                   help="iterations between evaluations on the valid split (default: none, only at the end)")

    g = parser.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true", help="synthetic data (megatron-core's MockGPTDataset)")
    g.add_argument("--data-path", nargs="*", default=None, help="[weight] prefix ... of .bin/.idx datasets")
    g.add_argument("--split", default=None, help="train,valid,test proportions of --data-path (default 969,30,1)")
    g.add_argument("--train-data-path", nargs="*", default=None, help="[weight] prefix ... of the train split")
    g.add_argument("--valid-data-path", nargs="*", default=None, help="[weight] prefix ... of the valid split")
    g.add_argument("--test-data-path", nargs="*", default=None, help="[weight] prefix ... of the test split")
    g.add_argument("--data-cache-path", default=None, help="where the dataset index caches go")
    g.add_argument("--num-workers", type=int, default=2, help="DataLoader worker processes per rank")

    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--tensorboard-log-interval", type=int, default=1,
                   help="write TensorBoard scalars at log lines whose iteration is a multiple of this")
    g.add_argument("--tensorboard-queue-size", type=int, default=1000)
    g.add_argument("--no-log-learning-rate-to-tensorboard", action="store_false",
                   dest="log_learning_rate_to_tensorboard")
    g.add_argument("--no-log-loss-scale-to-tensorboard", action="store_false", dest="log_loss_scale_to_tensorboard")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--log-memory-to-tensorboard", action="store_true")
    g.add_argument("--log-params-norm", action="store_true")
    g.add_argument("--log-num-zeros-in-grad", action="store_true")
    g.add_argument("--log-throughput", action="store_true", help="TFLOP/s per GPU in the log line")
    g.add_argument("--timing-log-level", type=int, default=0, choices=[0, 1, 2],
                   help="0: iteration time only; 1: + forward-backward, optimizer, params-all-gather; 2: all")
    g.add_argument("--timing-log-option", default="minmax", choices=["max", "minmax", "all"])
    g.add_argument("--log-timers-to-tensorboard", action="store_true")
    g.add_argument("--no-barrier-with-L1-time", action="store_false", dest="barrier_with_L1_time")
    g.add_argument("--wandb-project", default=None, help="Weights & Biases project (enables wandb)")
    g.add_argument("--wandb-exp-name", default=None, help="Weights & Biases run name")
    g.add_argument("--wandb-save-dir", default=None, help="wandb files (default: <--save>/wandb); "
                                                        "WANDB_MODE=offline works without network")
    g.add_argument("--wandb-entity", default=None)
    return parser


HONOURED_FLAGS = (
    "save", "save_interval", "no_save_optim", "no_save_rng", "load", "no_load_optim", "no_load_rng", "finetune",
    "ckpt_step", "ckpt_format", "async_save", "dist_ckpt_strictness", "exit_on_missing_checkpoint", "exit_interval",
    "ckpt_fallback_to_previous", "overwrite_checkpoints", "check_for_nan_in_loss_and_grad", "eval_iters",
    "eval_interval", "mock_data", "data_path", "split", "train_data_path", "valid_data_path", "test_data_path",
    "data_cache_path", "num_workers", "log_interval", "tensorboard_dir", "tensorboard_log_interval",
    "tensorboard_queue_size", "log_learning_rate_to_tensorboard", "log_loss_scale_to_tensorboard",
    "log_validation_ppl_to_tensorboard", "log_memory_to_tensorboard", "log_params_norm", "log_num_zeros_in_grad",
    "log_throughput", "timing_log_level", "timing_log_option", "log_timers_to_tensorboard", "barrier_with_L1_time",
    "wandb_project", "wandb_exp_name", "wandb_save_dir", "wandb_entity",
)
"""Destinations of the flags above that the feature modules honour (every one of them)."""

TABLE_CHECKPOINT_FLAGS = (
    "use_persistent_ckpt_worker", "async_strategy", "async_ckpt_use_cpu_shm", "async_ckpt_cpu_priority",
    "async_ckpt_io_priority", "save_retain_interval", "auto_detect_ckpt_format", "verify_integrity",
)
"""Checkpoint flags that come from upstream's flag table (those of them the installed release has:
``--async-strategy``, ``--async-ckpt-*`` and ``--verify-integrity`` are 0.19's), honoured by
:mod:`megatron.ciera.app.checkpointing` and :mod:`megatron.ciera.app.checkpoint_async`, checked below."""


@functools.lru_cache(maxsize=None)
def feature_dests() -> frozenset:
    """Every dest :func:`add_checkpoint_eval_data_logging_args` defines (checked here, not by the
    upstream flag policy)."""
    parser = add_checkpoint_eval_data_logging_args(argparse.ArgumentParser(add_help=False))
    return frozenset(action.dest for action in parser._actions)


def validate_checkpoint_eval_data_logging_args(args: argparse.Namespace, err: Callable[[str], None]) -> None:
    """Report every invalid combination of the flags above through ``err`` (messages name the flags)."""
    megatron_fsdp = args.ckpt_format == "fsdp_dtensor" and getattr(args, "use_megatron_fsdp", False)
    if args.ckpt_format not in ("torch_dist", "torch") and not megatron_fsdp:  # (its checks: megatron_fsdp.py)
        err(f"--ckpt-format {args.ckpt_format}: this entry point writes and reads torch_dist (megatron-core "
            "dist_checkpointing) and torch (legacy per-rank files) checkpoints; convert others with "
            "Megatron-LM's tools/checkpoint")
    if args.ckpt_format == "torch" and args.async_save:
        err("--async-save needs --ckpt-format torch_dist (as upstream)")
    for name in ("save_interval", "eval_interval", "log_interval", "tensorboard_log_interval", "exit_interval"):
        value = getattr(args, name)
        if value is not None and value < 1:
            err(f"--{name.replace('_', '-')} {value} must be >= 1")
    if args.save_interval is not None and args.save is None:
        err("--save-interval needs --save")
    if args.eval_iters < 0:
        err(f"--eval-iters {args.eval_iters} must be >= 0")
    if args.num_workers < 0:
        err(f"--num-workers {args.num_workers} must be >= 0")
    _validate_table_checkpoint_args(args, err)
    if args.ckpt_step is not None and not args.load:
        err("--ckpt-step needs --load")
    if args.ckpt_step is not None and args.ckpt_step < 0:
        err(f"--ckpt-step {args.ckpt_step} must be >= 0")
    if args.split is None:  # Megatron-LM's legacy default
        args.split = "969,30,1"
    per_split = [args.train_data_path, args.valid_data_path, args.test_data_path]
    sources = sum([bool(args.mock_data), bool(args.data_path), any(p is not None for p in per_split)])
    if sources != 1:
        err("give exactly one of --mock-data, --data-path, or --train-data-path/--valid-data-path/--test-data-path")
    elif any(p is not None for p in per_split) and not args.train_data_path:
        err("--valid-data-path / --test-data-path need --train-data-path")
    if (args.wandb_project or args.wandb_save_dir) and not args.wandb_exp_name:
        err("--wandb-project needs --wandb-exp-name (the run's name)")
    if args.wandb_exp_name and not args.wandb_project:
        err("--wandb-exp-name needs --wandb-project")
    if args.wandb_project and not (args.wandb_save_dir or args.save):
        err("--wandb-project needs --wandb-save-dir (or --save, whose wandb/ folder is the default)")


def _validate_table_checkpoint_args(args: argparse.Namespace, err: Callable[[str], None]) -> None:
    """The checks of :data:`TABLE_CHECKPOINT_FLAGS` (upstream's rules; each reads the flag only
    where the installed release's table has it)."""
    from megatron.ciera.app.checkpoint_async import check_args

    check_args(args, err)
    retain = getattr(args, "save_retain_interval", None)
    if retain is not None and args.save is not None:  # (inert without --save, as upstream)
        if retain < 1:
            err(f"--save-retain-interval {retain} must be >= 1")
        elif args.save_interval and retain % args.save_interval:
            err(f"--save-retain-interval {retain} must be a multiple of --save-interval {args.save_interval} "
                "(as upstream)")
    if getattr(args, "verify_integrity", False) and (args.save or args.load) and args.ckpt_format != "torch_dist":
        err(f"--verify-integrity is megatron-core's integrity manifest of --ckpt-format torch_dist checkpoints; "
            f"--ckpt-format {args.ckpt_format} has no such manifest (every checkpoint here carries checksums.sha256, "
            "verified at every load)")
