"""The configs and the model ``pretrain_gpt.py`` builds from its flags.

Configs are megatron-core's own dataclasses filled from ``vars(args)``: every field whose name is
a flag's dest takes the flag's value (upstream's flags are named after these fields), then the few
renamed or derived ones are set here. On CPU the GPU-only choices (fusions, TE, grouped GEMM, ...)
are turned off in one place, :func:`_cpu_overrides`; on GPU upstream's values stand.

    config = transformer_config(args)         # TransformerConfig / MLATransformerConfig
    chunks = build_model_chunks(args, config, vocab_size)   # one GPTModel per virtual stage
"""

from __future__ import annotations

import dataclasses

import torch

from megatron.ciera.binding import upstream_patch

__all__ = ["transformer_config", "ddp_config", "optimizer_config", "layer_spec", "build_model_chunks",
           "scheduler"]


def _from_args(cls, args, **overrides):
    """``cls`` with every init field that is also a flag's dest taken from ``args``, then
    ``overrides`` (those that are fields of ``cls``; ``dataclasses.MISSING`` keeps the default)."""
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    kw = {name: getattr(args, name) for name in fields if hasattr(args, name)}
    kw.update({k: v for k, v in overrides.items() if k in fields})
    return cls(**{k: v for k, v in kw.items() if v is not dataclasses.MISSING})


def _te_importable() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def _cpu_overrides(args) -> dict:
    """What runs instead of the GPU kernels on CPU (the flags were reported at start-up); on a
    GPU without transformer-engine only the fusions that need it are off."""
    if args.device != "cpu":
        return {} if _te_importable() else dict(
            apply_rope_fusion=False, moe_permute_fusion=False, moe_router_fusion=False, fp8=None, fp8_param=False,
            cuda_graph_impl="none", enable_cuda_graph=False, external_cuda_graph=False,
            use_transformer_engine_op_fuser=False)
    return dict(bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
                apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
                cross_entropy_loss_fusion=False, moe_grouped_gemm=False, moe_permute_fusion=False,
                moe_router_fusion=False, tp_comm_overlap=False, use_cpu_initialization=True,
                fp8=None, fp8_param=False, cuda_graph_impl="none", use_transformer_engine_op_fuser=False,
                overlap_moe_expert_parallel_comm=False, delay_wgrad_compute=False)


def transformer_config(args):
    """megatron-core's TransformerConfig (MLATransformerConfig with --multi-latent-attention)."""
    import torch.nn.functional as F
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    cls = MLATransformerConfig if args.multi_latent_attention else TransformerConfig
    kw = dict(
        persist_layer_norm=not args.no_persist_layer_norm,
        deallocate_pipeline_outputs=True,
        pipeline_dtype=args.params_dtype,
        params_dtype=args.params_dtype,
        batch_p2p_comm=not args.overlap_p2p_comm,
        num_moe_experts=args.num_experts,
        rotary_interleaved=args.rotary_interleaved,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        fp8_param=args.fp8_param_gather,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        bias_activation_fusion=args.bias_swiglu_fusion if args.swiglu else args.bias_gelu_fusion,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        inference_sampling_seed=args.seed,  # megatron-core >= 0.19 (absent fields are dropped)
    )
    if args.swiglu:
        kw.update(activation_func=F.silu, gated_linear_unit=True)
    if args.squared_relu:  # exclusive with --swiglu (validate_args); wins over --quick-geglu, as upstream
        from megatron.core.activations import squared_relu

        kw.update(activation_func=squared_relu)
    elif args.quick_geglu:  # exclusive with --swiglu (validate_args)
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        kw.update(activation_func=quick_gelu, gated_linear_unit=True)
    if isinstance(args.cp_comm_type, list) and len(args.cp_comm_type) == 1:
        kw["cp_comm_type"] = args.cp_comm_type[0]
    if args.rope_type is None:
        kw["rope_type"] = dataclasses.MISSING
    if args.transformer_impl == "local" and args.attention_backend == AttnBackend.auto:
        kw["attention_backend"] = AttnBackend.local
    kw.update(_cpu_overrides(args))
    return _from_args(cls, args, **kw)


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8, "auto": None}
"""Upstream's dtype flag values (``megatron/training/arguments.py``'s mapping)."""


def ddp_config(args):
    from megatron.core.distributed import DistributedDataParallelConfig

    # megatron-core 0.19's Megatron-FSDP dtype fields take torch dtypes; their flags give names
    as_dtype = {f.name: _DTYPES[getattr(args, f.name)] for f in dataclasses.fields(DistributedDataParallelConfig)
                if f.name.endswith("_dtype") and isinstance(getattr(args, f.name, None), str)}
    # Upstream's flags whose dest is not the field's name (megatron/training/training.py's mapping).
    return _from_args(DistributedDataParallelConfig, args, **as_dtype,
                      grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
                      bucket_size=args.ddp_bucket_size,
                      average_in_collective=args.ddp_average_in_collective,
                      pad_buckets_for_high_nccl_busbw=args.ddp_pad_buckets_for_high_nccl_busbw,
                      reduce_scatter_with_fp32_accumulation=args.ddp_reduce_scatter_with_fp32_accumulation)


def optimizer_config(args):
    from megatron.core.optimizer import OptimizerConfig

    names = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
    as_dtype = {n: _DTYPES[getattr(args, n)] for n in names if isinstance(getattr(args, n, None), str)}
    return _from_args(OptimizerConfig, args, params_dtype=args.params_dtype, timers=None, **as_dtype)


class _TorchNorm:
    """torch's LayerNorm / RMSNorm for the local spec, sequence-parallel capable.

    Megatron-Core's own torch fallback (``WrappedTorchNorm``, used without apex) refuses
    ``sequence_parallel``; with SP the norm weights are replicated over TP ranks that see
    different tokens, so they are marked ``sequence_parallel`` and ``finalize_model_grads``
    all-reduces their gradients over TP (what apex's FusedLayerNorm and TE do)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        if not config.sequence_parallel:
            return WrappedTorchNorm(config, hidden_size, eps, persist_layer_norm, zero_centered_gamma, normalization)
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm


def _replace_module(spec, old, new):
    """Swap the module class ``old`` for ``new`` everywhere in a (block or layer) spec, in place."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(spec, (list, tuple)):
        for item in spec:
            _replace_module(item, old, new)
        return
    if isinstance(spec, ModuleSpec):
        if spec.module is old:
            spec.module = new
        _replace_module(spec.submodules, old, new)
        return
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for f in dataclasses.fields(spec):
            value = getattr(spec, f.name)
            if value is old:
                setattr(spec, f.name, new)
            else:
                _replace_module(value, old, new)


def layer_spec(args, config, vp_stage: int | None = None):
    """The decoder block spec Megatron-LM's pretrain_gpt.py would pick for this run (TE or local;
    dense and MoE layers per ``--moe-layer-freq``). The local spec gets sequence-parallel capable
    norms and, with context parallelism, :mod:`megatron.ciera.app.cp_attention`'s core attention."""
    import copy

    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    use_te = args.transformer_impl == "transformer_engine"
    spec = specs.get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization=args.normalization,
                                            vp_stage=vp_stage)
    if not use_te:
        spec = copy.deepcopy(spec)
        _replace_module(spec, WrappedTorchNorm, _TorchNorm)
        if config.context_parallel_size > 1:  # upstream's local attention has no CP: the all-gather-KV form
            from megatron.core.transformer.dot_product_attention import DotProductAttention

            from .cp_attention import ContextParallelDotProductAttention

            _replace_module(spec, DotProductAttention, ContextParallelDotProductAttention)
    return spec


def build_model_chunks(args, config, vocab_size: int) -> list:
    """One GPTModel per (virtual) pipeline stage this rank holds, first/last stage flags set."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    upstream_patch.define_missing_te_names()
    if args.transformer_impl == "transformer_engine":
        import transformer_engine  # noqa: F401  (validated at start-up)
    vpp = args.virtual_pipeline_model_parallel_size
    chunks = []
    for stage in range(vpp or 1):
        spec = layer_spec(args, config, vp_stage=stage if vpp else None)
        chunk = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            rotary_percent=args.rotary_percent,
            rotary_base=args.rotary_base,
            vp_stage=stage if vpp else None,
        )
        chunks.append(chunk)
    if args.device == "cuda":
        for chunk in chunks:
            chunk.cuda(torch.cuda.current_device())
    return chunks


def scheduler(args, optimizer):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init if args.lr_warmup_steps else args.lr,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_steps,
        lr_decay_steps=args.lr_decay_steps,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay,
        wd_incr_steps=args.wd_incr_steps,
        wd_incr_style=args.weight_decay_incr_style,
        # On load: upstream's check that the command line's schedule matches the checkpoint's,
        # unless one of these says which one wins.
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
    )
