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
import math
import os
import random
import sys
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist

from . import bucket_group as ciera_binding
from . import checkpointing, cpu_compat, data, evaluation, logging_utils, timers
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


def _install_ciera(args, model, opt_config):
    """Step 4: CIERA on the DDP bucket groups (``None`` without ``--ciera-allgather``)."""
    ciera_config = ciera_config_from_args(args)
    if ciera_config is not None:
        n = ciera_binding.install([model], ciera_config, optimizer_config=opt_config, log=_print0)
        _print0(f"CIERA all-gather on {n} bucket group(s): {ciera_config}")
    return ciera_config


def _load_checkpoint(args, model, optimizer, scheduler) -> int:
    """Step 5: the checkpoint (if any); CIERA keeps no checkpoint state, its caches are dropped."""
    start_iter = checkpointing.load(args, model=model, optimizer=optimizer, scheduler=scheduler)
    if args.load:
        ciera_binding.invalidate_param_caches([model])  # the first gather after a load is raw
    return start_iter


class _Run:
    """What the loop's steps share: the model, optimizer, data, sinks and interval counters."""

    def __init__(self, args, model, optimizer, scheduler, config, datasets, timers, ciera_config, start_iter):
        from megatron.core import parallel_state

        self.args, self.model, self.optimizer, self.scheduler = args, model, optimizer, scheduler
        self.config, self.timers, self.ciera_config = config, timers, ciera_config
        self.train_ds, self.valid_ds, self.test_ds = datasets
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.ep_group = parallel_state.get_expert_model_parallel_group()
        self.iteration = start_iter
        self.writer = logging_utils.MetricWriter(args, start_iteration=start_iter, rank=dist.get_rank())
        self.loss_log = (logging_utils.LossLog(args.ciera_loss_log, start_iteration=start_iter)
                         if args.ciera_loss_log and dist.get_rank() == 0 else None)
        self.losses = logging_utils.IntervalLosses()
        self.skipped = self.nan_iters = 0
        self.logged_stats = []  # CIERA counters at the last log line
        self.flops_per_iteration = logging_utils.flops_per_iteration(args)


def _train_step(run: _Run, batches):
    """One iteration: forward-backward over the micro batches, optimizer step, LR step."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    args, timers = run.args, run.timers
    run.model.zero_grad_buffer()
    run.optimizer.zero_grad()
    reports = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=batches, model=[run.model],
        num_microbatches=args.num_microbatches, seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, forward_only=False)
    timers("optimizer", log_level=1).start(barrier=args.barrier_with_L1_time)
    update_successful, grad_norm, num_zeros = run.optimizer.step()
    timers("optimizer").stop()
    if run.ciera_config is not None and args.overlap_param_gather:
        # Encode the new shards now; the next forward's pre-hooks only launch the gathers.
        ciera_binding.prepare_param_gathers([run.model])
    if update_successful:
        run.scheduler.step(increment=args.global_batch_size)
    else:
        run.skipped += 1
    run.iteration += 1
    if reports:  # the loss stays on the device until the next log line
        summed = torch.stack([r["lm loss"] for r in reports]).sum(dim=0)
        dist.all_reduce(summed, group=run.dp_group)
        run.losses.add(run.iteration, summed)
    # The grad norm is on the host already (the optimizer's clipping synchronised for it).
    if (args.check_for_nan_in_loss_and_grad and update_successful and grad_norm is not None
            and not math.isfinite(grad_norm)):
        raise SystemExit(f"iteration {run.iteration}: the gradient norm is {grad_norm} (NaN or Inf in the "
                         "gradients); stopping before anything is saved (--no-check-for-nan-in-loss-and-grad "
                         "trains on)")
    return grad_norm, num_zeros


def _log_interval(run: _Run, grad_norm, num_zeros, interval_start: float) -> None:
    """Log line (rank 0), the timers block, CIERA's bucket table, TensorBoard / wandb scalars."""
    args, it = run.args, run.iteration
    steps = run.losses.flush()
    if run.loss_log is not None:
        run.loss_log.write(steps)
    bad = logging_utils.nonfinite(steps)
    run.nan_iters += len(bad)
    if bad and args.check_for_nan_in_loss_and_grad:
        raise SystemExit(f"iterations {bad}: the loss is NaN or Inf; stopping before anything is saved "
                         "(--no-check-for-nan-in-loss-and-grad trains on)")
    n = max(len(steps), 1)
    seconds = (time.time() - interval_start) / n
    mean = sum(v for _, v in steps) / n
    stats = ciera_binding.bucket_stats([run.model]) if run.ciera_config is not None else None
    interval_stats = interval_bytes = None
    if stats is not None:  # the iteration line and the table show this log interval
        interval_stats = logging_utils.since(stats, run.logged_stats)
        interval_bytes = logging_utils.totals(interval_stats)
        run.logged_stats = stats
    pnorm = logging_utils.params_norm(_unwrapped(run.model), expert_group=run.ep_group) if args.log_params_norm else None
    throughput = (logging_utils.throughput_tflops(args, seconds_per_iteration=seconds, world_size=dist.get_world_size())
                  if args.log_throughput else None)
    lr = run.optimizer.param_groups[0]["lr"]
    loss_scale = float(run.optimizer.get_loss_scale())
    _print0(logging_utils.iteration_line(
        iteration=it, train_iters=args.train_iters, consumed_samples=it * args.global_batch_size,
        elapsed_ms=seconds * 1000, lr=lr, global_batch_size=args.global_batch_size, losses={"lm loss": mean},
        loss_scale=loss_scale, grad_norm=grad_norm, skipped=run.skipped, nan_iters=run.nan_iters,
        ciera_totals=interval_bytes, throughput=throughput,
        num_zeros=num_zeros if args.log_num_zeros_in_grad else None, params_norm=pnorm))
    w = run.writer if it % args.tensorboard_log_interval == 0 else None
    timers.write_tensorboard(run.timers, w if w is not None and w.enabled else None, args=args, iteration=it,
                             iterations=n)
    codec_ms = timers.ciera_codec_ms(interval_stats, n) if interval_stats is not None else None
    block = timers.timers_block(run.timers, args=args, iterations=n, codec_ms=codec_ms)
    if block:
        _print0(block)
    if interval_stats:
        _print0(logging_utils.bucket_table(
            interval_stats, f"CIERA buckets, iterations {it - len(steps) + 1}-{it} (bytes rank 0 received):"))
    if w is not None and w.enabled:
        w.add_scalar("lm loss", mean, it)
        if args.log_learning_rate_to_tensorboard:
            w.add_scalar("learning-rate", lr, it)
        if args.log_loss_scale_to_tensorboard:
            w.add_scalar("loss-scale", loss_scale, it)
        w.add_scalar("batch-size", args.global_batch_size, it)
        w.add_scalar("iteration-time", seconds, it)
        if grad_norm is not None:
            w.add_scalar("grad-norm", grad_norm, it)
        if args.log_num_zeros_in_grad and num_zeros is not None:
            w.add_scalar("num-zeros", num_zeros, it)
        if pnorm is not None:
            w.add_scalar("params-norm", pnorm, it)
        if throughput is not None:
            w.add_scalar("throughput", throughput, it)
        if args.log_memory_to_tensorboard:
            for tag, value in logging_utils.memory_scalars().items():
                w.add_scalar(tag, value, it)
        if codec_ms is not None:
            w.add_scalar("ciera-encode-time", codec_ms[0], it)
            w.add_scalar("ciera-decode-time", codec_ms[1], it)
        if interval_stats:
            logging_utils.write_tensorboard(w, interval_stats, it)


def _evaluate(run: _Run, *, split: str, index: int, prefix: str) -> None:
    """Evaluate ``split`` (valid / test) slice ``index`` and report it."""
    dataset = run.valid_ds if split == "valid" else run.test_ds
    if dataset is None or not run.args.eval_iters:
        return
    batches = data.eval_iterator(dataset, run.args, dp_rank=run.dp_rank, eval_index=index)
    losses = evaluation.evaluate(forward_step_func=_forward_step, data_iterator=batches, model=run.model, args=run.args)
    name = "validation" if split == "valid" else "test"
    block = evaluation.report(losses, prefix=prefix, name=name, iteration=run.iteration,
                              writer=run.writer if run.writer.enabled else None,
                              log_ppl=run.args.log_validation_ppl_to_tensorboard)
    _print0(block)


def _save(run: _Run) -> None:
    _sync_params(run.model, run.args)
    checkpointing.save(run.args, iteration=run.iteration, model=run.model, optimizer=run.optimizer,
                       scheduler=run.scheduler, flops_so_far=run.iteration * run.flops_per_iteration)
    _print0(f"saved checkpoint {run.args.save} at iteration {run.iteration}")


def _train_loop(run: _Run) -> bool:
    """Iterate to ``--train-iters`` (or ``--exit-interval``); True when training completed."""
    args = run.args
    batches = data.train_iterator(run.train_ds, args, dp_rank=run.dp_rank, start_iteration=run.iteration)
    interval_start = time.time()
    run.model.train()
    while run.iteration < args.train_iters:
        grad_norm, num_zeros = _train_step(run, batches)
        it = run.iteration
        if it % args.log_interval == 0 or it == args.train_iters:
            _log_interval(run, grad_norm, num_zeros, interval_start)
            interval_start = time.time()
        if args.eval_interval and it % args.eval_interval == 0 and it < args.train_iters:
            _evaluate(run, split="valid", index=evaluation.eval_index(it, args.eval_interval), prefix=f"iteration {it}")
        if args.ciera_snapshot_interval and it % args.ciera_snapshot_interval == 0:
            _sync_params(run.model, args)
            _save_snapshot(run.model, args, it)
        if args.save and args.save_interval and it % args.save_interval == 0:
            _save(run)
        if args.exit_interval and it % args.exit_interval == 0:
            return it >= args.train_iters
    return True


def train(args) -> str:
    """Run the whole job; returns the final params sha256 (printed by rank 0)."""
    logging_utils.check_writer_packages(args)
    initialize(args)
    checkpointing.preflight(args)  # --save writable, no fresh start over checkpoints: before any work
    tokenizer = data.build_tokenizer(args)
    vocab = data.padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by)
    args.padded_vocab_size = vocab
    model, optimizer, scheduler, config, opt_config = build_model_and_optimizer(args, vocab)
    step_timers = timers.build(args)
    timers.attach(step_timers, model_config=config, optimizer_config=opt_config, args=args)
    ciera_config = _install_ciera(args, model, opt_config)
    start_iter = _load_checkpoint(args, model, optimizer, scheduler)
    datasets = data.build_datasets(args, tokenizer)
    run = _Run(args, model, optimizer, scheduler, config, datasets, step_timers, ciera_config, start_iter)
    completed = _train_loop(run)
    _sync_params(model, args)
    if args.save and (not args.save_interval or run.iteration % args.save_interval != 0):
        _save(run)
    if completed:  # as Megatron-LM: the valid and the test split once more at the end
        it = run.iteration
        _evaluate(run, split="valid", index=evaluation.eval_index(it + args.eval_interval, args.eval_interval),
                  prefix=f"iteration {it} on validation set")
        _evaluate(run, split="test", index=0, prefix=f"iteration {it} on test set")
    if ciera_config is not None:
        _print0(logging_utils.bucket_table(ciera_binding.bucket_stats([model]), "CIERA summary (bytes received by rank 0):"))
    if run.loss_log is not None:
        run.loss_log.close()
    run.writer.close()
    digest = params_sha256(model, run.ep_group, args.expert_model_parallel_size)
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
