"""How ``pretrain_gpt.py`` treats each Megatron-LM flag: the one table.

Every flag of upstream's ``megatron/training/arguments.py`` is parsed (``upstream_flags.json``, same
names, types and defaults). What happens to its value is decided here, by :func:`policy`:

``honoured``
    Training uses it. Flags whose dest is a field of megatron-core's ``TransformerConfig``,
    ``ModelParallelConfig``, ``DistributedDataParallelConfig`` or ``OptimizerConfig`` are honoured
    by construction: :mod:`megatron.ciera.app.model` builds those configs from ``vars(args)``.
``gpu``
    Only chooses a GPU kernel, fusion or backend (same model, same math up to rounding): honoured
    on GPU; on CPU the unfused/local path runs and the flags are reported once in one log line.
``feature:<name>``
    Honoured by the module of that feature (``checkpoint``, ``eval``, ``data``, ``logging``:
    :mod:`megatron.ciera.app.feature_args` lists what they honour); a flag of those families that they
    do not honour is ``rejected``.
``rejected``
    Not implemented: setting it to anything but upstream's default is a start-up error naming the
    flag and the reason. Every flag that is neither a config field nor listed below is rejected
    with :data:`DEFAULT_REASON` (leaving it at upstream's default is harmless and accepted).

Inert flags: a flag whose effect upstream depends on another flag (``Policy.needs``, e.g.
``--use-persistent-ckpt-worker`` only picks the writer of ``--async-save``) is accepted at any value
while every flag it needs is at upstream's default, and does nothing, as upstream; the run names it
at start-up. With a flag it needs set, its own kind above decides. "Not implemented" (``rejected``)
is for flags that would change what the run computes or writes.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass

__all__ = ["Policy", "policy", "HONOURED", "GPU", "REJECTED", "DEFAULT_REASON"]

HONOURED, GPU, REJECTED = "honoured", "gpu", "rejected"
DEFAULT_REASON = "not implemented by this pretrain_gpt.py"


@dataclass(frozen=True)
class Policy:
    kind: str
    """``honoured``, ``gpu``, ``feature:<name>`` or ``rejected``."""
    reason: str = ""
    """Why (rejected), what runs instead on CPU (gpu), or why a feature flag needs no code of its own."""
    needs: tuple[str, ...] = ()
    """Dests of the flags this one acts with upstream: while each is at upstream's default the flag
    is accepted at any value and inert (empty: it acts on its own)."""
    inert_reason: str = ""
    """Why the flag does nothing without ``needs`` (upstream's meaning), for the table and the log."""


def _feature(name, reason=""):
    return Policy(f"feature:{name}", reason)


_H = Policy(HONOURED)

# Honoured by our own code (not a config-dataclass field of the same name).
_HONOURED = {
    "seq_length", "max_position_embeddings", "position_embedding_type", "rotary_base", "rotary_percent",
    "rotary_interleaved", "swiglu", "untie_embeddings_and_output_weights", "deprecated_use_mcore_models",
    "add_position_embedding", "enable_gloo_process_groups", "use_gloo_process_groups", "check_weight_hash_across_dp_replicas_interval",
    "vocab_size", "make_vocab_size_divisible_by", "num_experts", "group_query_attention",
    "micro_batch_size", "global_batch_size", "train_iters", "train_samples", "lr_decay_style",
    "lr_decay_iters", "lr_decay_samples", "lr_warmup_iters", "lr_warmup_samples", "lr_warmup_fraction",
    "lr_warmup_init", "start_weight_decay", "end_weight_decay", "weight_decay_incr_style", "seed",
    "mock_data", "distributed_backend",
    "distributed_timeout_minutes", "num_layers_per_virtual_pipeline_stage", "override_opt_param_scheduler",
    "num_virtual_stages_per_pipeline_rank", "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers", "exit_interval", "exit_duration_in_mins", "use_cpu_initialization",
    "deterministic_mode", "no_persist_layer_norm", "overlap_p2p_comm", "fp8_param_gather", "bf16", "fp16",
    "attention_softmax_in_fp32", "apply_query_key_layer_scaling", "moe_layer_freq", "qk_layernorm",
    "multi_latent_attention", "mtp_num_layers", "mtp_loss_scaling_factor", "transformer_impl",
    "manual_gc", "manual_gc_interval", "manual_gc_eval", "no_check_for_nan_in_loss_and_grad",
    "expert_tensor_parallel_size", "context_parallel_size", "sequence_parallel", "cp_comm_type",
    "ddp_bucket_size", "ddp_average_in_collective", "ddp_pad_buckets_for_high_nccl_busbw",
    "ddp_reduce_scatter_with_fp32_accumulation", "num_distributed_optimizer_instances",
    "rope_type", "moe_latent_size", "local_rank", "accumulate_allreduce_grads_in_fp32", "grad_reduce_in_bf16",
    "use_torch_fsdp2", "torch_fsdp2_reshard_after_forward",  # megatron.ciera.binding.fsdp2
    "use_megatron_fsdp",  # megatron.ciera.binding.megatron_fsdp
    "profile", "profile_step_start", "profile_step_end", "profile_ranks", "use_pytorch_profiler",  # .profiling
    "pytorch_profiler_collect_shapes", "pytorch_profiler_collect_callstack",
    "rampup_batch_size", "step_batch_size_schedule",  # megatron.ciera.app.batch_schedule
    "squared_relu", "quick_geglu",  # model.transformer_config's activation, as upstream
    "recompute_activations",  # validate_args: --recompute-granularity selective, as upstream
    "enable_experimental",  # training.train sets megatron-core's experimental flag, as upstream
    "exit_signal_handler", "exit_signal",  # megatron.ciera.app.exit_signal: a checkpoint, then a clean exit
}

# Kernel / fusion / backend choices: honoured on GPU, the plain path on CPU.
_GPU = {
    "bias_gelu_fusion", "bias_swiglu_fusion", "bias_dropout_fusion", "masked_softmax_fusion",
    "apply_rope_fusion", "gradient_accumulation_fusion", "persist_layer_norm", "cross_entropy_loss_fusion",
    "cross_entropy_fusion_impl", "attention_backend", "moe_grouped_gemm", "moe_permute_fusion",
    "moe_router_fusion", "use_flash_attn", "tp_comm_overlap", "tp_comm_bulk_wgrad", "tp_comm_bulk_dgrad",
    "tp_comm_overlap_ag", "tp_comm_overlap_rs", "tp_comm_split_ag", "tp_comm_split_rs",
    "tp_comm_overlap_rs_dgrad", "tp_comm_overlap_cfg", "overlap_moe_expert_parallel_comm",
    "delay_wgrad_compute", "cuda_graph_impl", "cuda_graph_scope", "cuda_graph_scope_deprecated", "external_cuda_graph", "enable_cuda_graph",
    "cuda_graph_warmup_steps", "fp8", "fp8_recipe", "fp8_margin", "fp8_interval", "fp8_amax_history_len",
    "fp8_amax_compute_algo", "fp8_wgrad", "fp8_param", "first_last_layers_bf16", "num_layers_at_start_in_bf16",
    "num_layers_at_end_in_bf16", "te_rng_tracker", "moe_use_legacy_grouped_gemm", "use_te_activation_func",
    "async_tensor_model_parallel_allreduce", "moe_shared_expert_overlap", "disable_bf16_reduced_precision_matmul",
    "use_fused_weighted_squared_relu", "empty_unused_memory_level", "fp8_format", "moe_deepep_num_sms",
    "moe_enable_deepep", "use_te_rng_tracker", "inference_rng_tracker", "calculate_per_token_loss_kernel",
    "use_transformer_engine_op_fuser", "cuda_graph_modules",
}

# Flags whose effect upstream depends on other flags (dests): inert while those are at upstream's
# default (read from upstream's arguments.py / training config at the release of the table).
_INERT_WITHOUT = {
    "use_persistent_ckpt_worker": (("async_save",), "picks the background writer of --async-save"),
    "async_strategy": (("async_save",), "picks the implementation of --async-save (upstream sets mcore without it)"),
    "async_ckpt_use_cpu_shm": (("async_save",), "how --async-save hands tensors to its writer"),
    "async_ckpt_cpu_priority": (("async_save",), "the nice value of --async-save's writer"),
    "async_ckpt_io_priority": (("async_save",), "the I/O class of --async-save's writer"),
    "profile_step_start": (("profile",), "the first profiled iteration of --profile"),
    "profile_step_end": (("profile",), "the last profiled iteration of --profile"),
    "profile_ranks": (("profile",), "the ranks --profile profiles"),
    "use_pytorch_profiler": (("profile",), "the profiler --profile runs"),
    "nvtx_ranges": (("profile",), "NVTX ranges for --profile's nsys capture"),
    "verify_integrity": (("save", "load"), "hashes the files --save writes and checks them on --load"),
    "save_retain_interval": (("save",), "which checkpoints of --save are kept"),
    "non_persistent_save_interval": (("save",), "local checkpoints next to --save's"),
}

_REJECTED = {
    "use_legacy_models": "only Megatron-Core models are built",
    "yaml_cfg": "YAML configs are not read; give the flags",
    "heterogeneous_layers_config_path": "heterogeneous layer configs are not built",
    "is_hybrid_model": "hybrid (Mamba) models are not built",
    "fp4": "FP4 training is not supported",
    "optimizer_cpu_offload": "optimizer CPU offload is not supported",
    "use_precision_aware_optimizer": "the precision-aware optimizer is not supported",
    "pytorch_profiler_collect_chakra": "Chakra execution traces are not written (--use-pytorch-profiler's "
                                       "chrome trace is)",
    "nvtx_ranges": "NVTX ranges inside the model are not emitted (--profile's capture range is)",
}

# The feature modules' flag families (see the module docstring).
_FEATURE_PATTERNS = [
    ("checkpoint", r"save|load|save_interval|no_load_optim|no_load_rng|load_optim|load_rng|finetune|async_save|"
                   r"dist_ckpt_.*|ckpt_.*|auto_detect_ckpt_format|non_persistent_.*|pretrained_checkpoint|"
                   r"use_dist_ckpt|use_checkpoint_opt_param_scheduler|use_checkpoint_args|exit_on_missing_checkpoint|save_retain_interval|no_save_optim|no_save_rng|save_optim|save_rng|"
                   r"use_persistent_ckpt_worker|async_strategy|async_ckpt_.*|verify_integrity"),
    ("eval", r"eval_interval|eval_iters|skip_train|full_validation|multiple_validation_sets|test_mode"),
    ("data", r"split|data_path|tokenizer_.*|tiktoken_.*|special_tokens|vocab_file|merge_file|vocab_extra_ids|train_data_path|valid_data_path|test_data_path|data_cache_path|num_workers|"
             r"per_split_data_args_path|data_args_path|mmap_bin_files|no_mmap_bin_files|create_attention_mask_in_dataloader|"
             r"reset_position_ids|reset_attention_mask|eod_mask_loss|num_dataset_builder_threads|"
             r"object_storage_cache_path|mid_level_dataset_surplus|dataloader_type|no_create_attention_mask_in_dataloader"),
    ("logging", r"timing_log_level|timing_log_option|log_.*|wandb_.*|tensorboard_.*|check_for_nan_in_loss_and_grad|"
                r"barrier_with_l1_time|logging_level|record_memory_history|memory_snapshot_path|"
                r"check_for_spiky_loss|check_for_large_grads|log_interval"),
]


@functools.lru_cache(maxsize=None)
def _config_fields() -> frozenset:
    """Dests honoured by construction: fields of megatron-core's config dataclasses."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    names = set()
    for cls in (TransformerConfig, MLATransformerConfig, ModelParallelConfig, DistributedDataParallelConfig,
                OptimizerConfig):
        names.update(f.name for f in dataclasses.fields(cls) if f.init)
    return frozenset(names)


@functools.lru_cache(maxsize=None)
def _feature_honoured() -> frozenset:
    """Dests the feature modules honour (:data:`megatron.ciera.app.feature_args.HONOURED_FLAGS`, the
    dataset-config flags :data:`megatron.ciera.app.data.DATASET_FLAGS`, and the tokenizer flags :func:`megatron.ciera.app.data.build_tokenizer` reads)."""
    from .data import DATASET_FLAGS, TOKENIZER_FLAGS
    from .feature_args import HONOURED_FLAGS, TABLE_CHECKPOINT_FLAGS

    return frozenset(HONOURED_FLAGS) | set(TABLE_CHECKPOINT_FLAGS) | set(DATASET_FLAGS) | set(TOKENIZER_FLAGS) | {"logging_level"} | set(_CHECKPOINT_AS_UPSTREAM) | set(_CHECKPOINT_HONOURED)


# Checkpoint flags that only pick how megatron-core's dist_checkpointing moves bytes (reviewed
# against upstream's meaning): any value saves and loads the same tensors in the same files, so
# they are accepted at any value and the table says why.
_CHECKPOINT_AS_UPSTREAM = {
    "dist_ckpt_optim_fully_reshardable": "the distributed optimizer is saved fully reshardable at any value (upstream's "
                                         "default writes dp_reshardable; both load, with the same values)",
    "ckpt_fully_parallel_load": "a load strategy (each rank reads a share, then exchanges): the loaded values "
                                "do not depend on it",
    "ckpt_fully_parallel_save": "a save strategy (replicas split the writing): the saved tensors and files do "
                                "not depend on it; megatron-core's default strategy writes them",
    "ckpt_fully_parallel_save_deprecated": "upstream's deprecated spelling of the default save strategy",
    "ckpt_assume_constant_structure": "a save-plan cache: the saved values do not depend on it",
}

# Checkpoint-family flags honoured through megatron-core (megatron.ciera.app.checkpointing and, for the
# --async-* ones, megatron.ciera.app.checkpoint_async; checked in megatron.ciera.app.feature_args).
_CHECKPOINT_HONOURED = {
    "use_checkpoint_opt_param_scheduler": "passed to megatron-core's OptimizerParamScheduler: the checkpoint's "
                                          "schedule wins (default: the command line's must match it)",
    "use_persistent_ckpt_worker": "megatron-core's persistent checkpoint worker (AsyncCallsQueue(persistent=True)); "
                                  "megatron-core 0.19, as Megatron-LM 0.19, saves synchronously without it",
    "async_strategy": "mcore: megatron-core's writer; nvrx (nvidia-resiliency-ext's writer of the same "
                      "torch_dist files) is written by mcore, said at start-up",
    "async_ckpt_use_cpu_shm": "a staging mode of nvrx's writer (same files): written by mcore, said at start-up",
    "async_ckpt_cpu_priority": "the persistent worker's nice value (megatron-core's warm-up)",
    "async_ckpt_io_priority": "the persistent worker's I/O class (megatron-core's warm-up)",
    "save_retain_interval": "after each save the previous latest checkpoint is removed unless its iteration is a "
                            "multiple (as upstream); never the latest nor the one this run loaded",
    "auto_detect_ckpt_format": "the format of the checkpoint to load is read from it; saves keep --ckpt-format",
    "verify_integrity": "megatron-core's integrity manifest: written at save, checked at load (torch_dist)",
}


@functools.lru_cache(maxsize=None)
def policy(dest: str) -> Policy:
    """The policy of the flag with this argparse dest (with the flags it needs, if any)."""
    pol = _own_policy(dest)
    if dest in _INERT_WITHOUT:
        needs, why = _INERT_WITHOUT[dest]
        return dataclasses.replace(pol, needs=needs, inert_reason=why)
    return pol


def _own_policy(dest: str) -> Policy:
    if dest.startswith("ciera_") or dest in ("device", "log_interval"):
        return _H
    if dest in _REJECTED:
        return Policy(REJECTED, _REJECTED[dest])
    if dest in _GPU:
        return Policy(GPU, "the unfused / local path runs on CPU")
    for name, pattern in _FEATURE_PATTERNS:
        if re.fullmatch(pattern, dest):
            if dest in _feature_honoured():
                return _feature(name, _CHECKPOINT_AS_UPSTREAM.get(dest, _CHECKPOINT_HONOURED.get(dest, "")))
            return Policy(REJECTED, f"not implemented by the {name} feature of this pretrain_gpt.py")
    if dest in _HONOURED or dest in _config_fields():
        return _H
    return Policy(REJECTED, DEFAULT_REASON)


def table() -> list[tuple[str, Policy]]:
    """(first option string, policy) for every upstream flag, in upstream's order."""
    from .flag_table import upstream_flags

    return [(flag["options"][0], policy(flag["dest"])) for flag in upstream_flags()]


if __name__ == "__main__":  # python -m megatron.ciera.app.flag_policy: the whole table, then counts
    import collections

    rows = table()
    for option, pol in rows:
        inert = f" [inert without {', '.join(pol.needs)}: {pol.inert_reason}]" if pol.needs else ""
        print(f"{option:55s} {pol.kind:20s} {pol.reason}{inert}")
    print(dict(collections.Counter(pol.kind for _, pol in rows)))
