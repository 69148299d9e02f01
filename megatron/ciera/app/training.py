"""GPT / MoE pretraining on Megatron-Core: the loop behind ``pretrain_gpt.py``.

Set-up, in this order (each step needs the previous one):

1-2. :func:`megatron.ciera.app.parallel.initialize`: process group from torchrun's ``env://`` (gloo on
   CPU, nccl on GPU; ``--distributed-timeout-minutes``), the CPU shims, every rank's arguments
   compared, Megatron-Core's TP / PP (+ virtual) / CP / EP / ETP groups, seeds;
3. one GPTModel per (virtual) pipeline stage (:mod:`megatron.ciera.app.model`: configs derived from
   megatron-core's dataclasses; TE spec on GPU when installed, local spec on CPU) in bf16/fp16 via
   Float16Module, each wrapped in DDP (``--use-torch-fsdp2``: megatron-core's FSDP2 wrapper), then
   the (distributed) optimizer and LR scheduler;
4. CIERA on the DDP bucket groups (``--ciera-allgather``): from here on every parameter all-gather
   goes through the run's :class:`~megatron.ciera.binding.protocol.Binding` (the distributed
   optimizer's bucket groups; FSDP2's or Megatron-FSDP's every unit);
5. checkpoint load (which invalidates CIERA's caches), then the loop: Megatron-Core's
   ``get_forward_backward_func()`` schedule (no pipelining, 1F1B or interleaved), optimizer step.

Everything is deterministic for a given seed and parallel layout: two runs give the same loss at
every iteration and the same ``params sha256`` at the end, with or without CIERA.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import signal
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ciera.shutdown import end_process
from megatron.ciera.binding.report import bucket_table, totals
from megatron.ciera.binding.engines import binding_for
from megatron.ciera.binding.protocol import Binding

from . import batch_schedule, checkpointing, data, evaluation, exit_signal, failfast, logging_utils, parallel, profiling, timers, upstream_notices
from . import model as model_lib
from . import watchdog as watchdog_lib
from .arguments import ciera_config_from_args, parse_args


def _print0(*a, **k):
    if dist.get_rank() == 0:
        print(*a, **k, flush=True)


def _log_selection_decisions(args) -> logging_utils.SelectionLog | None:
    """Rank 0 reports CIERA's selection decisions (``ciera.selection`` INFO: raw or which codec)
    even without ``--logging-level``: one line per log interval, or each decision with its
    predicted times under ``--ciera-log-buckets``. The choices are rank-identical, so one rank
    says them for all."""
    lg = logging.getLogger("ciera.selection")
    if args.logging_level is not None or dist.get_rank() != 0:
        return None  # --logging-level given: the user's choice stands
    for h in lg.handlers:
        if isinstance(h, logging_utils.SelectionLog):
            lg.removeHandler(h)  # a second train() in this process replaces the first one's
    handler = logging_utils.SelectionLog(each=args.ciera_log_buckets, out=_print0)
    lg.addHandler(handler)
    lg.setLevel(logging.INFO)
    lg.propagate = False
    return handler


def _binding(args) -> Binding:
    """The one dispatch point between the ways parameters are gathered: FSDP2's units
    (``--use-torch-fsdp2``), Megatron-FSDP's buckets (``--use-megatron-fsdp``) or the distributed
    optimizer's bucket groups (:func:`megatron.ciera.binding.engines.binding_for`). The loop calls
    the :class:`~megatron.ciera.binding.protocol.Binding` it returns, whichever it is."""
    return binding_for(use_torch_fsdp2=args.use_torch_fsdp2, use_megatron_fsdp=args.use_megatron_fsdp,
                       reshard_after_forward=args.torch_fsdp2_reshard_after_forward, device=args.device)


def build_model_and_optimizer(args, vocab_size: int):
    """Step 3: model chunks -> Float16Module -> DDP (or FSDP2, Megatron-FSDP), the optimizer, scheduler."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    config = model_lib.transformer_config(args)
    chunks = model_lib.build_model_chunks(args, config, vocab_size)
    if args.bf16 or args.fp16:
        chunks = [Float16Module(config, chunk) for chunk in chunks]
    model = _binding(args).wrap(chunks, config=config, ddp_config=model_lib.ddp_config(args))

    opt_config = model_lib.optimizer_config(args)
    # --disable-gloo-process-groups: the optimizer then uses no gloo groups either (as upstream passes it)
    gloo = getattr(args, "enable_gloo_process_groups", getattr(args, "use_gloo_process_groups", True))
    optimizer = get_megatron_optimizer(opt_config, model, use_gloo_process_groups=gloo)
    scheduler = model_lib.scheduler(args, optimizer)
    config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    if args.overlap_grad_reduce and args.align_grad_reduce:
        config.grad_sync_func = [m.start_grad_sync for m in model] if len(model) > 1 else model[0].start_grad_sync
    if args.overlap_param_gather and args.align_param_gather:
        config.param_sync_func = [m.start_param_sync for m in model] if len(model) > 1 else model[0].start_param_sync
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


def _forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """One micro batch's forward; with ``return_schedule_plan`` (megatron-core's combined 1F1B schedule
    of --overlap-moe-expert-parallel-comm, on GPU) the model's schedule plan instead, as upstream."""
    from functools import partial

    from megatron.core import parallel_state

    batch = next(data_iterator)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    batch = {k: v.to(device) for k, v in batch.items()}
    if parallel_state.get_context_parallel_world_size() > 1:  # this rank's sequence chunks
        from .cp_attention import batch_on_this_cp_rank

        batch = batch_on_this_cp_rank(batch)
    # The attention mask only where the dataset made one (--create-attention-mask-in-dataloader, upstream's
    # default); without it the attention builds its causal mask itself.
    if return_schedule_plan:
        plan = model.build_schedule_plan(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                                         labels=batch["labels"], loss_mask=batch["loss_mask"])
        return plan, partial(_loss_func, batch["loss_mask"])
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])


def _unwrapped(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def _replica_keys() -> tuple[tuple, tuple]:
    """Which copy of the dense / expert parameters this rank holds: ranks with equal keys hold
    replicas (data- and context-parallel peers; expert-data-parallel peers for experts)."""
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_rank()
    dense = (pp, ps.get_tensor_model_parallel_rank())
    expert = (pp, ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank())
    return dense, expert


def params_sha256(model, *, binding: Binding) -> str:
    """Digest of every parameter's bytes over all ranks, identical on all ranks.

    Each rank hashes its dense and its expert parameters separately (``named_parameters`` order of
    each unwrapped chunk; Megatron-Core marks expert parameters ``allreduce=False``). The digests are
    all-gathered; replicas (equal :func:`_replica_keys`) must agree, a free consistency check, and
    the result is sha256 over the distinct shards' digests in key order. ``binding``: the engine's
    (:meth:`~megatron.ciera.binding.protocol.Binding.full_tensor` reads a sharded parameter whole)."""
    digests = {}
    for kind in ("dense", "expert"):
        h = hashlib.sha256()
        for i, chunk in enumerate(model):
            for name, p in _unwrapped(chunk).named_parameters():
                if (getattr(p, "allreduce", True)) == (kind == "dense"):
                    h.update(f"{i}.{name}".encode())
                    full = binding.full_tensor(p)  # FSDP2's and Megatron-FSDP's DTensors: a collective
                    h.update(full.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
        digests[kind] = h.hexdigest()
    dense_key, expert_key = _replica_keys()
    mine = [(("dense",) + dense_key, digests["dense"]), (("expert",) + expert_key, digests["expert"])]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    shards = {}
    for rank, pairs in enumerate(everyone):
        for key, digest in pairs:
            if shards.setdefault(key, digest) != digest:
                raise RuntimeError(f"parameters differ between replicas of shard {key} (rank {rank})")
    return hashlib.sha256("".join(shards[k] for k in sorted(shards)).encode()).hexdigest()


def _sync_params(model, args):
    """Make every parameter buffer hold the gathered parameters (a no-op without overlap: the
    optimizer step already gathered synchronously), then wait for the verdicts of the gathers'
    device decodes: a corrupt payload raises here, before anything is saved or evaluated."""
    binding = _binding(args)
    binding.sync_params(model, overlap_param_gather=args.overlap_param_gather)
    binding.raise_pending_errors(model)


def _save_snapshot(model, args, iteration):
    if dist.get_rank() == 0:
        os.makedirs(args.ciera_snapshot_dir, exist_ok=True)
        snap = {(n if len(model) == 1 else f"chunk{i}.{n}"): p.detach().clone().cpu()
                for i, chunk in enumerate(model) for n, p in _unwrapped(chunk).named_parameters()}
        torch.save(snap, os.path.join(args.ciera_snapshot_dir, f"iter_{iteration:07d}.pt"))


def _report_cpu_ignored(args) -> None:
    if args.cpu_ignored:
        _print0(f"CPU run: GPU-only choices not applied (the local/unfused path runs): {', '.join(args.cpu_ignored)}")
    if getattr(args, "upstream_inert", None):
        _print0(f"note: {', '.join(args.upstream_inert)}: no effect here, as in Megatron-LM (the flag it acts with is off)")
    if getattr(args, "ciera_inert", None):
        _print0(f"note: {', '.join(args.ciera_inert)}: no effect without --ciera-allgather (Megatron's own "
                "parameter all-gather runs)")


def _device(args) -> str:
    return "cuda" if args.device == "cuda" else "cpu"


def _install_ciera(args, model, optimizer, opt_config):
    """Step 4: CIERA on the DDP bucket groups (``None`` without ``--ciera-allgather``)."""
    ciera_config = ciera_config_from_args(args)
    if ciera_config is not None:
        binding = _binding(args)
        n = binding.install(model, config=ciera_config, optimizer_config=opt_config, optimizer=optimizer, log=_print0)
        _print0(f"CIERA all-gather on {n} {binding.noun}(s): {ciera_config}")
    return ciera_config


def _load_checkpoint(args, model, optimizer, scheduler) -> int:
    """Step 5: the checkpoint (if any); CIERA keeps no checkpoint state, its caches are dropped."""
    try:
        start_iter = checkpointing.load(args, model=model, optimizer=optimizer, scheduler=scheduler)
    except AssertionError as exc:  # upstream's scheduler: this run's schedule differs from the checkpoint's
        if "OptimizerParamScheduler" not in str(exc):
            raise
        raise SystemExit(f"--load {args.load}: {exc} (this run's learning-rate / weight-decay schedule differs from "
                         "the checkpoint's, e.g. a larger --train-iters): pass --override-opt_param-scheduler to "
                         "use this run's schedule, or --use-checkpoint-opt_param-scheduler to keep the "
                         "checkpoint's") from exc
    if args.load:
        _binding(args).invalidate_param_caches(model)  # the first gather after a load is raw
    return start_iter


class _Run:
    """What the loop's steps share: the model, optimizer, data, sinks and interval counters."""

    def __init__(self, args, model, optimizer, scheduler, config, datasets, timers, ciera_config, start_iter,
                 watchdog=None):
        from megatron.core import parallel_state

        self.args, self.model, self.optimizer, self.scheduler = args, model, optimizer, scheduler
        self.config, self.timers, self.ciera_config = config, timers, ciera_config
        self.train_ds, self.valid_ds, self.test_ds = datasets
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        self.ep_group = parallel_state.get_expert_model_parallel_group()
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.iteration = start_iter
        self.writer = logging_utils.MetricWriter(args, start_iteration=start_iter, rank=dist.get_rank())
        self.loss_log = (logging_utils.LossLog(args.ciera_loss_log, start_iteration=start_iter)
                         if args.ciera_loss_log and dist.get_rank() == 0 else None)
        self.losses = logging_utils.IntervalLosses()
        self.skipped = self.nan_iters = 0
        self.logged_stats = []  # CIERA counters at the last log line
        self.flops_per_iteration = logging_utils.flops_per_iteration(args)
        # --exit-signal-handler: installed before the persistent checkpoint worker starts (it blocks the signal)
        self.exit_signal = (exit_signal.ExitSignal.install(signum=args.exit_signal)
                            if getattr(args, "exit_signal_handler", False) else None)
        self.async_saves = checkpointing.async_queue(args)  # --async-save (None without)
        self.faults = failfast.FaultPlan.from_env()  # CIERA_FAULT_INJECT (tests); None normally
        if self.faults is not None:
            self.faults.warn_if_unreachable(rank=dist.get_rank(), world_size=dist.get_world_size(), args=args)
        self.watchdog = watchdog  # told what the loop is doing (its report of a dead child says it)
        self.saved_at = None  # the iteration of the last checkpoint saved (or started) by this run
        self.profiler = profiling.StepProfiler.from_args(args, rank=dist.get_rank())  # --profile (None without)
        self.batches = batch_schedule.BatchSchedule.from_args(args)  # the global batch of each iteration
        self.selection_log: logging_utils.SelectionLog | None = None  # rank 0's selection lines


def _train_step(run: _Run, batches):
    """One iteration: forward-backward over the micro batches, optimizer step, LR step."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    args, timers = run.args, run.timers
    global_batch_size, num_microbatches = run.batches.at_iteration(run.iteration)
    for chunk in run.model:
        chunk.zero_grad_buffer()
    run.optimizer.zero_grad()
    reports = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=batches if len(run.model) > 1 else batches[0], model=run.model,
        num_microbatches=num_microbatches, seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, forward_only=False)
    timers("optimizer", log_level=1).start(barrier=args.barrier_with_L1_time)
    update_successful, grad_norm, num_zeros = run.optimizer.step()
    timers("optimizer").stop()
    if run.ciera_config is not None:  # gathers started ahead finished; overlapped ones encoded now
        _binding(args).after_optimizer_step(run.model, overlap_param_gather=args.overlap_param_gather)
    if update_successful:
        run.scheduler.step(increment=global_batch_size)
    else:
        run.skipped += 1
    run.iteration += 1
    # (loss, tokens) summed over data- and context-parallel ranks, then over the pipeline (only the
    # last stage holds reports); it stays on the device until the next log line.
    summed = (torch.stack([r["lm loss"] for r in reports]).sum(dim=0) if reports
              else torch.zeros(2, dtype=torch.float32, device=_device(args)))
    dist.all_reduce(summed, group=run.dp_group)
    if args.pipeline_model_parallel_size > 1:
        dist.all_reduce(summed, group=run.pp_group)
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
    stats = _binding(args).bucket_stats(run.model) if run.ciera_config is not None else None
    interval_stats = interval_bytes = None
    if stats is not None:  # the iteration line and the table show this log interval
        interval_stats = logging_utils.since(stats, run.logged_stats)
        interval_bytes = totals(interval_stats)
        run.logged_stats = stats
    pnorm = logging_utils.params_norm(torch.nn.ModuleList([_unwrapped(c) for c in run.model]), expert_group=run.ep_group) if args.log_params_norm else None
    throughput = (logging_utils.throughput_tflops(args, seconds_per_iteration=seconds, world_size=dist.get_world_size())
                  if args.log_throughput else None)
    lr = run.optimizer.param_groups[0]["lr"]
    global_batch_size = run.batches.at_iteration(it - 1)[0]  # the batch of the step just done
    loss_scale = float(run.optimizer.get_loss_scale())
    _print0(logging_utils.iteration_line(
        iteration=it, train_iters=args.train_iters, consumed_samples=run.batches.consumed_samples(it),
        elapsed_ms=seconds * 1000, lr=lr, global_batch_size=global_batch_size, losses={"lm loss": mean},
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
    if interval_stats and args.ciera_log_buckets:
        _print0(bucket_table(
            interval_stats, f"CIERA buckets, iterations {it - len(steps) + 1}-{it} (bytes rank 0 received):"))
    if run.selection_log is not None and (line := run.selection_log.interval_line()):
        _print0(line)
    if w is not None and w.enabled:
        w.add_scalar("lm loss", mean, it)
        if args.log_learning_rate_to_tensorboard:
            w.add_scalar("learning-rate", lr, it)
        if args.log_loss_scale_to_tensorboard:
            w.add_scalar("loss-scale", loss_scale, it)
        w.add_scalar("batch-size", global_batch_size, it)
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
    batches = [data.eval_iterator(dataset, run.args, dp_rank=run.dp_rank, eval_index=index) for _ in run.model]
    losses = evaluation.evaluate(forward_step_func=_forward_step, data_iterator=batches, model=run.model, args=run.args)
    name = "validation" if split == "valid" else "test"
    block = evaluation.report(losses, prefix=prefix, name=name, iteration=run.iteration,
                              writer=run.writer if run.writer.enabled else None,
                              log_ppl=run.args.log_validation_ppl_to_tensorboard)
    _print0(block)


def _phase(run: _Run, what: str) -> None:
    """Tell the watchdog where the loop is (its report of a dead child names it)."""
    if run.watchdog is not None:
        run.watchdog.phase = what


def _save(run: _Run) -> None:
    _sync_params(run.model, run.args)
    _phase(run, f"iteration {run.iteration}'s checkpoint save")
    run.saved_at = run.iteration
    doomed = run.faults is not None and run.faults.fires("kill-writer", rank=dist.get_rank(), iteration=run.iteration)
    spawned = run.async_saves is not None and run.async_saves.persistent  # killed below, not forked
    with failfast.kill_forked_children(doomed, plan=run.faults, spawned=spawned), \
            failfast.explain_save_errors(run.args.save):
        checkpointing.save(run.args, iteration=run.iteration, model=run.model, optimizer=run.optimizer,
                           scheduler=run.scheduler, flops_so_far=run.iteration * run.flops_per_iteration,
                           queue=run.async_saves)
        worker = run.async_saves.worker() if doomed and run.async_saves is not None else None
        if worker is not None:  # the persistent worker is spawned (no fork hook): the fault kills it here
            os.kill(worker.pid, signal.SIGKILL)
    _print0(f"{'started saving' if run.async_saves else 'saved'} checkpoint {run.args.save} at iteration {run.iteration}")


def _train_loop(run: _Run) -> bool:
    """Iterate to ``--train-iters`` (or ``--exit-interval``); True when training completed."""
    args = run.args
    # Every (virtual) stage reads the same micro batches: the first embeds the tokens, the last takes
    # labels and loss mask, the others only position ids.
    batches = [data.train_iterator(run.train_ds, args, dp_rank=run.dp_rank, start_iteration=run.iteration)
               for _ in run.model]
    interval_start = time.time()
    for chunk in run.model:
        chunk.train()
    while run.iteration < args.train_iters:
        if run.profiler is not None:
            run.profiler.before_step(run.iteration)
        _phase(run, f"iteration {run.iteration + 1}'s forward-backward and optimizer step")
        grad_norm, num_zeros = _train_step(run, batches)
        if run.profiler is not None:
            run.profiler.after_step(run.iteration)
        failfast.inject_after_step(run.faults, rank=dist.get_rank(), iteration=run.iteration)
        _phase(run, f"iteration {run.iteration}'s check of the checkpoint writes")
        with failfast.explain_save_errors(args.save):  # a save whose writes are done is published now
            checkpointing.finalize_async_saves(run.async_saves, blocking=False)
        _phase(run, f"iteration {run.iteration}'s logging, evaluation and saving")
        it = run.iteration
        exiting = bool(args.exit_interval) and it % args.exit_interval == 0
        if it % args.log_interval == 0 or it == args.train_iters or exiting:  # no iteration left unlogged
            _log_interval(run, grad_norm, num_zeros, interval_start)
            interval_start = time.time()
        if args.eval_interval and it % args.eval_interval == 0 and it < args.train_iters:
            _evaluate(run, split="valid", index=evaluation.eval_index(it, args.eval_interval), prefix=f"iteration {it}")
        if args.ciera_snapshot_interval and it % args.ciera_snapshot_interval == 0:
            _sync_params(run.model, args)
            _save_snapshot(run.model, args, it)
        if args.save and args.save_interval and it % args.save_interval == 0:
            _save(run)
        if run.exit_signal is not None and run.exit_signal.received():  # --exit-signal-handler
            _print0(f"received {run.exit_signal.name}: saving a checkpoint at iteration {it} and exiting "
                    "(--exit-signal-handler)")
            if args.save and run.saved_at != it:
                _save(run)
            with failfast.explain_save_errors(args.save):
                checkpointing.finalize_async_saves(run.async_saves, blocking=True)
            _print0(f"exiting after {run.exit_signal.name} at iteration {it}")
            return False
        if exiting:
            return it >= args.train_iters
    return True


def train(args, *, watchdogs: list | None = None) -> str:
    """Run the whole job; returns the final params sha256 (printed by rank 0). ``watchdogs``:
    receives the rank's :class:`~megatron.ciera.app.watchdog.Watchdog` once the process group is up
    (the caller's error path reports stalls with it)."""
    if args.logging_level is not None:
        logging.getLogger().setLevel(args.logging_level)
    logging_utils.check_writer_packages(args)
    parallel.initialize(args)
    if args.enable_experimental:  # as upstream: megatron-core's features marked experimental may run
        from megatron.core.config import set_experimental_flag

        set_experimental_flag(True)
    if watchdogs is not None:
        watchdogs.append(watchdog_lib.Watchdog(timeout_s=60.0 * args.distributed_timeout_minutes).start())
    selection_log = _log_selection_decisions(args)
    _report_cpu_ignored(args)
    if note := upstream_notices.fallback_note(device=_device(args)):
        _print0(note)
    checkpointing.preflight(args)  # --save writable, no fresh start over checkpoints: before any work
    tokenizer = data.build_tokenizer(args)
    vocab = data.padded_vocab_size(tokenizer.vocab_size,
                                   args.make_vocab_size_divisible_by * args.tensor_model_parallel_size)
    args.padded_vocab_size = vocab
    model, optimizer, scheduler, config, opt_config = build_model_and_optimizer(args, vocab)
    step_timers = timers.build(args)
    timers.attach(step_timers, model_config=config, optimizer_config=opt_config, args=args)
    ciera_config = _install_ciera(args, model, optimizer, opt_config)
    start_iter = _load_checkpoint(args, model, optimizer, scheduler)
    datasets = data.build_datasets(args, tokenizer)
    run = _Run(args, model, optimizer, scheduler, config, datasets, step_timers, ciera_config, start_iter,
               watchdog=watchdogs[0] if watchdogs else None)
    run.selection_log = selection_log
    completed = _train_loop(run)
    if run.profiler is not None:  # a window the run ended inside is written now
        run.profiler.close()
    _sync_params(model, args)
    if args.save and run.saved_at != run.iteration and (not args.save_interval or run.iteration % args.save_interval):
        _save(run)
    with failfast.explain_save_errors(args.save):
        checkpointing.finalize_async_saves(run.async_saves, blocking=True)
    if completed:  # as Megatron-LM: the valid and the test split once more at the end
        it = run.iteration
        _evaluate(run, split="valid", index=evaluation.eval_index(it + (args.eval_interval or 0), args.eval_interval),
                  prefix=f"iteration {it} on validation set")
        _evaluate(run, split="test", index=0, prefix=f"iteration {it} on test set")
        _sync_params(model, args)  # the gathers evaluation left in flight finish before the parameters are read
    if run.selection_log is not None and (line := run.selection_log.interval_line()):
        _print0(line)  # decisions after the last log line
    if ciera_config is not None:
        _print0(_binding(args).summary(model))
    if run.loss_log is not None:
        run.loss_log.close()
    run.writer.close()
    digest = params_sha256(model, binding=_binding(args))
    _print0(f"params sha256: {digest}")
    return digest


@record  # an error that escapes (none should: exit_on_error) still reaches the launcher's summary
def main(argv: list[str] | None = None) -> None:
    """Entry point of one rank. An error anywhere ends this rank at once, printed once and with a
    non-zero status, without a collective or a wait on the other ranks (the launcher ends them):
    :func:`megatron.ciera.app.failfast.exit_on_error`. Every process the rank forks dies with it."""
    # torch.distributed's deprecation notices for the collectives Megatron-Core calls, once per call.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    failfast.guard_children()
    args = parse_args(argv)
    watchdogs: list = []  # the rank's watchdog, once the process group exists
    try:
        train(args, watchdogs=watchdogs)
    except BaseException as exc:  # noqa: BLE001 - every error takes the same way out
        if not (isinstance(exc, SystemExit) and exc.code in (0, None)):
            failfast.exit_on_error(exc, watchdog=watchdogs[0] if watchdogs else None)
    for watchdog in watchdogs:
        watchdog.stop()
    if dist.is_initialized():  # only after success: every rank reaches this barrier
        dist.barrier()
        dist.destroy_process_group()
    end_process(0)  # not a plain return: see end_process (gloo's workers outlive the group)


if __name__ == "__main__":
    main(sys.argv[1:])
