"""GPT / MoE pretraining on Megatron-Core: the loop behind ``pretrain_gpt.py``.

Set-up, in this order (each step needs the previous one):

1-2. :func:`megatron.ciera.parallel.initialize`: process group from torchrun's ``env://`` (gloo on
   CPU, nccl on GPU; ``--distributed-timeout-minutes``), the CPU shims, every rank's arguments
   compared, Megatron-Core's TP / PP (+ virtual) / CP / EP / ETP groups, seeds;
3. one GPTModel per (virtual) pipeline stage (:mod:`megatron.ciera.model`: configs derived from
   megatron-core's dataclasses; TE spec on GPU when installed, local spec on CPU) in bf16/fp16 via
   Float16Module, each wrapped in DDP, then the distributed optimizer and LR scheduler;
4. CIERA on the DDP bucket groups (``--ciera-allgather``): from here on every parameter all-gather
   goes through :mod:`megatron.ciera.bucket_group`;
5. checkpoint load (which invalidates CIERA's caches), then the loop: Megatron-Core's
   ``get_forward_backward_func()`` schedule (no pipelining, 1F1B or interleaved), optimizer step.

Everything is deterministic for a given seed and parallel layout: two runs give the same loss at
every iteration and the same ``params sha256`` at the end, with or without CIERA.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

from . import bucket_group as ciera_binding
from . import checkpointing, data, logging_utils, parallel
from . import model as model_lib
from .arguments import ciera_config_from_args, parse_args


def _print0(*a, **k):
    if dist.get_rank() == 0:
        print(*a, **k, flush=True)


def build_model_and_optimizer(args, vocab_size: int):
    """Step 3: model chunks -> Float16Module -> DDP, distributed optimizer, scheduler."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    config = model_lib.transformer_config(args)
    chunks = model_lib.build_model_chunks(args, config, vocab_size)
    if args.bf16 or args.fp16:
        chunks = [Float16Module(config, chunk) for chunk in chunks]
    ddp_config = model_lib.ddp_config(args)
    # Only the first chunk buckets its gradients (as Megatron-LM: with several virtual stages the
    # others communicate as one bucket each).
    model = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0)
             for i, chunk in enumerate(chunks)]
    for chunk in model:
        chunk.broadcast_params()

    opt_config = model_lib.optimizer_config(args)
    optimizer = get_megatron_optimizer(opt_config, model)
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


def _forward_step(data_iterator, model):
    from functools import partial

    from megatron.core import parallel_state

    batch = next(data_iterator)
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    batch = {k: v.to(device) for k, v in batch.items()}
    if parallel_state.get_context_parallel_world_size() > 1:  # this rank's sequence chunks
        from megatron.core.utils import get_batch_on_this_cp_rank

        batch = get_batch_on_this_cp_rank(batch)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
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


def params_sha256(model) -> str:
    """Digest of every parameter's bytes over all ranks, identical on all ranks.

    Each rank hashes its dense and its expert parameters separately (``named_parameters`` order of
    each unwrapped chunk; Megatron-Core marks expert parameters ``allreduce=False``). The digests are
    all-gathered; replicas (equal :func:`_replica_keys`) must agree, a free consistency check, and
    the result is sha256 over the distinct shards' digests in key order."""
    digests = {}
    for kind in ("dense", "expert"):
        h = hashlib.sha256()
        for i, chunk in enumerate(model):
            for name, p in _unwrapped(chunk).named_parameters():
                if (getattr(p, "allreduce", True)) == (kind == "dense"):
                    h.update(f"{i}.{name}".encode())
                    h.update(p.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
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
    optimizer step already gathered synchronously)."""
    if args.overlap_param_gather:
        for chunk in model:
            chunk.start_param_sync(force_sync=True)


def _save_snapshot(model, args, iteration):
    if dist.get_rank() == 0:
        os.makedirs(args.ciera_snapshot_dir, exist_ok=True)
        snap = {(n if len(model) == 1 else f"chunk{i}.{n}"): p.detach().clone().cpu()
                for i, chunk in enumerate(model) for n, p in _unwrapped(chunk).named_parameters()}
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


def _checkpoint_module(model):
    """What the checkpoint module saves: the chunk, or all chunks of a virtual pipeline."""
    return model[0] if len(model) == 1 else torch.nn.ModuleList(model)


def _report_cpu_ignored(args) -> None:
    if args.cpu_ignored:
        _print0(f"CPU run: GPU-only choices not applied (the local/unfused path runs): {', '.join(args.cpu_ignored)}")


def _iteration_loss(reports, args) -> float:
    """The iteration's mean LM loss, on every rank: the last pipeline stage holds the reports;
    sum (loss, tokens) over data- and context-parallel ranks, then over the pipeline."""
    from megatron.core import parallel_state as ps

    summed = (torch.stack([r["lm loss"] for r in reports]).sum(dim=0) if reports
              else torch.zeros(2, dtype=torch.float32))
    dist.all_reduce(summed, group=ps.get_data_parallel_group(with_context_parallel=True))
    if args.pipeline_model_parallel_size > 1:
        dist.all_reduce(summed, group=ps.get_pipeline_model_parallel_group())
    return (summed[0] / summed[1]).item()


def train(args) -> str:
    """Run the whole job; returns the final params sha256 (printed by rank 0)."""
    writer_class = _tensorboard_writer_class(args)
    parallel.initialize(args)
    _report_cpu_ignored(args)
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tokenizer = data.build_tokenizer(args)
    vocab = data.padded_vocab_size(tokenizer.vocab_size,
                                   args.make_vocab_size_divisible_by * args.tensor_model_parallel_size)
    model, optimizer, scheduler, config, opt_config = build_model_and_optimizer(args, vocab)

    ciera_config = ciera_config_from_args(args)
    if ciera_config is not None:
        n = ciera_binding.install(model, ciera_config, optimizer_config=opt_config, log=_print0,
                                  optimizer=optimizer)
        _print0(f"CIERA all-gather on {n} bucket group(s): {ciera_config}")

    layout = {"world": dist.get_world_size(), "tp": args.tensor_model_parallel_size,
              "pp": args.pipeline_model_parallel_size, "vpp": args.virtual_pipeline_model_parallel_size,
              "cp": args.context_parallel_size, "ep": args.expert_model_parallel_size,
              "etp": args.expert_tensor_parallel_size, "dp": args.data_parallel_size,
              "params_dtype": str(args.params_dtype)}
    start_iter = 0
    if args.load:
        start_iter = checkpointing.load(args.load, _checkpoint_module(model), optimizer, scheduler, layout, args.ckpt_step)
        if start_iter:
            ciera_binding.invalidate_param_caches(model)
            _print0(f"loaded checkpoint {args.load} at iteration {start_iter}")

    dataset = data.build_train_dataset(args, tokenizer)
    dp_rank = parallel_state.get_data_parallel_rank()
    batches = data.BatchOrder(dataset, args.micro_batch_size, args.data_parallel_size, dp_rank, args.num_microbatches)
    forward_backward = get_forward_backward_func()
    writer = writer_class(log_dir=args.tensorboard_dir) if writer_class and dist.get_rank() == 0 else None
    loss_log = open(args.ciera_loss_log, "a" if start_iter else "w") if args.ciera_loss_log and dist.get_rank() == 0 else None

    skipped = nan_iters = 0
    interval_start = time.time()
    interval_losses = []
    logged_stats = []  # CIERA counters at the last log line
    iteration = start_iter
    for chunk in model:
        chunk.train()
    while iteration < args.train_iters:
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        # Every (virtual) stage reads the same micro batches: the first embeds the tokens, the last
        # takes labels and loss mask, the others only position ids.
        iterators = [batches.iterator(iteration) for _ in model]
        reports = forward_backward(
            forward_step_func=_forward_step,
            data_iterator=iterators if len(model) > 1 else iterators[0],
            model=model,
            num_microbatches=args.num_microbatches,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            forward_only=False,
        )
        update_successful, grad_norm, _ = optimizer.step()
        if ciera_config is not None and args.overlap_param_gather:
            # Encode the new shards now; the next forward's pre-hooks only launch the gathers.
            ciera_binding.prepare_param_gathers(model)
        if update_successful:
            scheduler.step(increment=args.global_batch_size)
        else:
            skipped += 1
        iteration += 1

        loss = _iteration_loss(reports, args)
        if loss != loss:
            nan_iters += 1
        interval_losses.append(loss)
        if loss_log is not None:
            loss_log.write(f"{iteration} {float(loss).hex()}\n")
            loss_log.flush()

        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            elapsed_ms = (time.time() - interval_start) * 1000 / len(interval_losses)
            stats = ciera_binding.bucket_stats(model) if ciera_config is not None else None
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
            checkpointing.save(args.save, iteration, _checkpoint_module(model), optimizer, scheduler, layout)
            _print0(f"saved checkpoint {args.save} at iteration {iteration}")
        if args.exit_interval and iteration % args.exit_interval == 0:
            break

    _sync_params(model, args)
    if args.save and (not args.save_interval or iteration % args.save_interval != 0):
        checkpointing.save(args.save, iteration, _checkpoint_module(model), optimizer, scheduler, layout)
        _print0(f"saved checkpoint {args.save} at iteration {iteration}")
    if ciera_config is not None:
        stats = ciera_binding.bucket_stats(model)
        _print0(logging_utils.bucket_table(stats, "CIERA summary (bytes received by rank 0):"))
    if loss_log is not None:
        loss_log.close()
    if writer is not None:
        writer.close()
    digest = params_sha256(model)
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
