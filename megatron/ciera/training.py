"""GPT / MoE pretraining on Megatron-Core: the loop behind ``pretrain_gpt.py``.

Set-up, in this order (each step needs the previous one):

1. process group from torchrun's ``env://`` (gloo on CPU, nccl on GPU); on CPU the
   :mod:`megatron.ciera.cpu_compat` shims, before Megatron-Core touches a device;
2. Megatron-Core's parallel state (TP = PP = 1, expert parallel from the flags), seeds;
3. GPTModel (local layer spec) in bf16/fp16 via Float16Module, wrapped in DDP (param/grad
   buffers and bucket groups), then the distributed optimizer and LR scheduler;
4. CIERA on the DDP bucket groups (``--ciera-allgather``): from here on every parameter all-gather
   goes through :mod:`megatron.ciera.bucket_group`;
5. checkpoint load (which invalidates CIERA's caches), then the loop.

Everything is deterministic for a given seed and parallel layout: two runs give the same loss at
every iteration and the same ``params sha256`` at the end, with or without CIERA.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist

from . import bucket_group as ciera_binding
from . import checkpointing, cpu_compat, data, logging_utils
from .arguments import ciera_config_from_args, parse_args


def _print0(*a, **k):
    if dist.get_rank() == 0:
        print(*a, **k, flush=True)


def _resolve_device(args) -> str:
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available here (use --device cpu)")
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if args.device == "cuda" else "gloo"
    return args.device


def initialize(args) -> None:
    """Steps 1-2: process group, CPU shims, Megatron parallel state, seeds."""
    device = _resolve_device(args)
    if device == "cpu":
        cpu_compat.enable()
    else:
        if args.deterministic_mode:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before the first cuBLAS call
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if args.deterministic_mode:
        torch.use_deterministic_algorithms(True)
    if not dist.is_initialized():
        dist.init_process_group(backend=args.distributed_backend, init_method="env://")
    if dist.get_world_size() != args.world_size:
        raise SystemExit(f"WORLD_SIZE {args.world_size} at parse time != process group size {dist.get_world_size()}")

    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=args.expert_model_parallel_size,
    )
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)


def _define_missing_te_names() -> None:
    """megatron-core 0.16.1 without transformer-engine: the MoE router tests ``te_general_gemm is
    not None`` but the name is only bound when TE imports (NameError). Bind it to None, which is
    what the check means. No-op with TE installed or on versions that define the name."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def transformer_config(args, vocab_size: int):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    moe = {}
    if args.num_experts is not None:
        moe = dict(
            num_moe_experts=args.num_experts,
            moe_router_topk=args.moe_router_topk,
            moe_router_pre_softmax=args.moe_router_pre_softmax,
            moe_ffn_hidden_size=args.moe_ffn_hidden_size or args.ffn_hidden_size,
            moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
            moe_router_load_balancing_type=args.moe_router_load_balancing_type,
            moe_aux_loss_coeff=args.moe_aux_loss_coeff,
            moe_token_dispatcher_type=args.moe_token_dispatcher_type,
            moe_layer_freq=args.moe_layer_freq,
            moe_grouped_gemm=False,
        )
    return TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.kv_channels,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        add_bias_linear=not args.disable_bias_linear,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=args.expert_model_parallel_size,
        sequence_parallel=False,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        # Fused kernels need CUDA extensions; the unfused paths compute the same model.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        use_cpu_initialization=args.device == "cpu",
        deterministic_mode=args.deterministic_mode,
        **moe,
    )


def build_model(args, config, vocab_size: int):
    """GPTModel (local spec; TE only with --transformer-impl transformer_engine)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if args.transformer_impl == "transformer_engine":
        try:
            import transformer_engine  # noqa: F401
        except ImportError:
            raise SystemExit("--transformer-impl transformer_engine: transformer-engine is not installed") from None
    use_te = args.transformer_impl == "transformer_engine"
    if args.num_experts is not None:
        spec = specs.get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization=args.normalization)
    elif use_te:
        spec = specs.get_gpt_layer_with_transformer_engine_spec()
    else:
        spec = specs.get_gpt_layer_local_spec(normalization=args.normalization)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
    )


def build_model_and_optimizer(args, vocab_size: int):
    """Step 3: model -> Float16Module -> DDP, distributed optimizer, scheduler."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.module import Float16Module

    _define_missing_te_names()
    config = transformer_config(args, vocab_size)
    model = build_model(args, config, vocab_size)
    if args.device == "cuda":
        model.cuda(torch.cuda.current_device())
    if args.bf16 or args.fp16:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32 or args.bf16,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        bucket_size=args.ddp_bucket_size,
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    model.broadcast_params()

    opt_config = OptimizerConfig(
        optimizer=args.optimizer,
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=config.params_dtype,
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
        clip_grad=args.clip_grad,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_config, [model])
    gbs = args.global_batch_size
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if args.lr_warmup_iters else args.lr,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs,
        lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * gbs,
        wd_incr_style="constant",
    )
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    if args.fp16:
        config.grad_scale_func = optimizer.scale_loss
    return model, optimizer, scheduler, config, opt_config


def _loss_func(loss_mask, output_tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.float().view(1)])
    return loss, num_tokens, {"lm loss": report}


def _forward_step(data_iterator, model):
    from functools import partial

    batch = next(data_iterator)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    batch = {k: v.to(device) for k, v in batch.items()}
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])


def _unwrapped(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def params_sha256(model, ep_group, ep_size: int) -> str:
    """Digest of every parameter's bytes, identical on all ranks.

    Each rank hashes its parameters (``named_parameters`` order of the unwrapped GPTModel; with
    expert parallelism a rank holds the dense parameters and its EP rank's experts). The digests
    are all-gathered over the world; ranks with the same EP rank must agree (a free consistency
    check across data-parallel replicas), and the result is sha256 over the EP ranks' digests in
    EP-rank order. EP = 1 hashes the single digest the same way."""
    h = hashlib.sha256()
    for name, p in _unwrapped(model).named_parameters():
        h.update(name.encode())
        h.update(p.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    mine = (dist.get_rank(group=ep_group) if ep_size > 1 else 0, h.hexdigest())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    by_ep = {}
    for ep_rank, digest in everyone:
        if by_ep.setdefault(ep_rank, digest) != digest:
            raise RuntimeError(f"parameters differ between data-parallel replicas of EP rank {ep_rank}")
    return hashlib.sha256("".join(by_ep[e] for e in sorted(by_ep)).encode()).hexdigest()


def _sync_params(model, args):
    """Make every parameter buffer hold the gathered parameters (a no-op without overlap: the
    optimizer step already gathered synchronously)."""
    if args.overlap_param_gather:
        model.start_param_sync(force_sync=True)


def _save_snapshot(model, args, iteration):
    if dist.get_rank() == 0:
        os.makedirs(args.ciera_snapshot_dir, exist_ok=True)
        snap = {n: p.detach().clone().cpu() for n, p in _unwrapped(model).named_parameters()}
        torch.save(snap, os.path.join(args.ciera_snapshot_dir, f"iter_{iteration:07d}.pt"))


def _tensorboard_writer_class(args):
    """Checked on every rank before anything starts, so that a missing package fails everywhere."""
    if args.tensorboard_dir is None:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise SystemExit("--tensorboard-dir needs the 'tensorboard' package (pip install tensorboard)") from None
    return SummaryWriter


def train(args) -> str:
    """Run the whole job; returns the final params sha256 (printed by rank 0)."""
    writer_class = _tensorboard_writer_class(args)
    initialize(args)
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tokenizer = data.build_tokenizer(args)
    vocab = data.padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by)
    model, optimizer, scheduler, config, opt_config = build_model_and_optimizer(args, vocab)

    ciera_config = ciera_config_from_args(args)
    if ciera_config is not None:
        n = ciera_binding.install([model], ciera_config, optimizer_config=opt_config, log=_print0,
                                  optimizer=optimizer)
        _print0(f"CIERA all-gather on {n} bucket group(s): {ciera_config}")

    layout = {"world": dist.get_world_size(), "ep": args.expert_model_parallel_size,
              "dp": args.data_parallel_size, "params_dtype": args.params_dtype}
    start_iter = 0
    if args.load:
        start_iter = checkpointing.load(args.load, model, optimizer, scheduler, layout, args.ckpt_step)
        if start_iter:
            ciera_binding.invalidate_param_caches([model])
            _print0(f"loaded checkpoint {args.load} at iteration {start_iter}")

    dataset = data.build_train_dataset(args, tokenizer)
    dp_rank = parallel_state.get_data_parallel_rank()
    batches = data.BatchOrder(dataset, args.micro_batch_size, args.data_parallel_size, dp_rank, args.num_microbatches)
    forward_backward = get_forward_backward_func()
    dp_group = parallel_state.get_data_parallel_group()
    ep_group = parallel_state.get_expert_model_parallel_group()
    writer = writer_class(log_dir=args.tensorboard_dir) if writer_class and dist.get_rank() == 0 else None
    loss_log = open(args.ciera_loss_log, "a" if start_iter else "w") if args.ciera_loss_log and dist.get_rank() == 0 else None

    skipped = nan_iters = 0
    interval_start = time.time()
    interval_losses = []
    logged_stats = []  # CIERA counters at the last log line
    iteration = start_iter
    model.train()
    while iteration < args.train_iters:
        model.zero_grad_buffer()
        optimizer.zero_grad()
        reports = forward_backward(
            forward_step_func=_forward_step,
            data_iterator=batches.iterator(iteration),
            model=[model],
            num_microbatches=args.num_microbatches,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            forward_only=False,
        )
        update_successful, grad_norm, _ = optimizer.step()
        if ciera_config is not None and args.overlap_param_gather:
            # Encode the new shards now; the next forward's pre-hooks only launch the gathers.
            ciera_binding.prepare_param_gathers([model])
        if update_successful:
            scheduler.step(increment=args.global_batch_size)
        else:
            skipped += 1
        iteration += 1

        summed = torch.stack([r["lm loss"] for r in reports]).sum(dim=0)
        dist.all_reduce(summed, group=dp_group)
        loss = (summed[0] / summed[1]).item()
        if loss != loss:
            nan_iters += 1
        interval_losses.append(loss)
        if loss_log is not None:
            loss_log.write(f"{iteration} {float(loss).hex()}\n")
            loss_log.flush()

        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            elapsed_ms = (time.time() - interval_start) * 1000 / len(interval_losses)
            stats = ciera_binding.bucket_stats([model]) if ciera_config is not None else None
            interval_bytes = interval_stats = None
            if stats is not None:  # the iteration line and the table show this log interval
                interval_stats = logging_utils.since(stats, logged_stats)
                interval_bytes = logging_utils.totals(interval_stats)
                logged_stats = stats
            line = logging_utils.iteration_line(
                iteration=iteration, train_iters=args.train_iters,
                consumed_samples=iteration * args.global_batch_size, elapsed_ms=elapsed_ms,
                lr=optimizer.param_groups[0]["lr"], global_batch_size=args.global_batch_size,
                losses={"lm loss": sum(interval_losses) / len(interval_losses)},
                loss_scale=float(optimizer.get_loss_scale()), grad_norm=grad_norm,
                skipped=skipped, nan_iters=nan_iters,
                ciera_totals=interval_bytes)
            _print0(line)
            if interval_stats:
                _print0(logging_utils.bucket_table(
                    interval_stats, f"CIERA buckets, iterations {iteration - len(interval_losses) + 1}-{iteration} "
                                    f"(bytes rank 0 received):"))
            if writer is not None:
                writer.add_scalar("lm loss", interval_losses[-1], iteration)
                writer.add_scalar("learning rate", optimizer.param_groups[0]["lr"], iteration)
                if interval_stats:
                    logging_utils.write_tensorboard(writer, interval_stats, iteration)
            interval_start, interval_losses = time.time(), []

        if args.ciera_snapshot_interval and iteration % args.ciera_snapshot_interval == 0:
            _sync_params(model, args)
            _save_snapshot(model, args, iteration)
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            _sync_params(model, args)
            checkpointing.save(args.save, iteration, model, optimizer, scheduler, layout)
            _print0(f"saved checkpoint {args.save} at iteration {iteration}")
        if args.exit_interval and iteration % args.exit_interval == 0:
            break

    _sync_params(model, args)
    if args.save and (not args.save_interval or iteration % args.save_interval != 0):
        checkpointing.save(args.save, iteration, model, optimizer, scheduler, layout)
        _print0(f"saved checkpoint {args.save} at iteration {iteration}")
    if ciera_config is not None:
        stats = ciera_binding.bucket_stats([model])
        _print0(logging_utils.bucket_table(stats, "CIERA summary (bytes received by rank 0):"))
    if loss_log is not None:
        loss_log.close()
    if writer is not None:
        writer.close()
    digest = params_sha256(model, ep_group, args.expert_model_parallel_size)
    _print0(f"params sha256: {digest}")
    return digest


def main(argv: list[str] | None = None) -> None:
    # torch.distributed's deprecation notices for the collectives Megatron-Core calls, once per call.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    args = parse_args(argv)
    try:
        train(args)
    finally:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
