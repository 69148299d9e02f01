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

__all__ = ["transformer_config", "ddp_config", "optimizer_config", "layer_spec", "build_model_chunks",
           "scheduler"]


def _from_args(cls, args, **overrides):
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.init and hasattr(args, f.name)}
    kw.update(overrides)
    return cls(**kw)


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
            cuda_graph_impl="none", enable_cuda_graph=False, external_cuda_graph=False)
    return dict(bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
                apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
                cross_entropy_loss_fusion=False, moe_grouped_gemm=False, moe_permute_fusion=False,
                moe_router_fusion=False, tp_comm_overlap=False, use_cpu_initialization=True,
                fp8=None, fp8_param=False, cuda_graph_impl="none")


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
    )
    if args.swiglu:
        kw.update(activation_func=F.silu, gated_linear_unit=True)
    if isinstance(args.cp_comm_type, list) and len(args.cp_comm_type) == 1:
        kw["cp_comm_type"] = args.cp_comm_type[0]
    if args.rope_type is None:
        kw["rope_type"] = dataclasses.MISSING
    if args.transformer_impl == "local" and args.attention_backend == AttnBackend.auto:
        kw["attention_backend"] = AttnBackend.local
    kw.update(_cpu_overrides(args))
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    kw = {k: v for k, v in kw.items() if k in fields and v is not dataclasses.MISSING}
    base = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
            if f.init and hasattr(args, f.name) and f.name not in kw}
    if args.rope_type is None:
        base.pop("rope_type", None)
    return cls(**base, **kw)


def ddp_config(args):
    from megatron.core.distributed import DistributedDataParallelConfig

    return _from_args(DistributedDataParallelConfig, args,
                      grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
                      bucket_size=args.ddp_bucket_size,
                      average_in_collective=args.ddp_average_in_collective)


def optimizer_config(args):
    from megatron.core.optimizer import OptimizerConfig

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8}
    names = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
    as_dtype = {n: dtypes[getattr(args, n)] for n in names if isinstance(getattr(args, n, None), str)}
    return _from_args(OptimizerConfig, args, params_dtype=args.params_dtype, timers=None, **as_dtype)


def layer_spec(args, config):
    """The layer spec Megatron-LM's pretrain_gpt.py would pick for this run."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    use_te = args.transformer_impl == "transformer_engine"
    if args.num_experts is not None:
        return specs.get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                                normalization=args.normalization, qk_l2_norm=False)
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=args.qk_layernorm, multi_latent_attention=args.multi_latent_attention)
    return specs.get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm, normalization=args.normalization,
                                          multi_latent_attention=args.multi_latent_attention)


def build_model_chunks(args, config, vocab_size: int) -> list:
    """One GPTModel per (virtual) pipeline stage this rank holds, first/last stage flags set."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    if args.transformer_impl == "transformer_engine":
        import transformer_engine  # noqa: F401  (validated at start-up)
    vpp = args.virtual_pipeline_model_parallel_size
    chunks = []
    for stage in range(vpp or 1):
        spec = layer_spec(args, config)
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
        chunk.model_type = getattr(chunk, "model_type", None)
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
    )
