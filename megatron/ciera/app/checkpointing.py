"""Megatron distributed checkpoints (``--ckpt-format torch_dist``) that lose nothing.

Layout, as Megatron-LM writes it::

    <save>/latest_checkpointed_iteration.txt      the tracker: written last, atomically
    <save>/iter_0000010/                           megatron-core dist_checkpointing (torch_dist)
        metadata.json .metadata *.distcp  (+ common.pt on megatron-core 0.16; 0.19 keeps it in the .distcp)
        checksums.sha256                           (CIERA-Megatron) ``sha256sum -c`` format

The state dict has Megatron-LM's keys: ``model`` (GPTModel's own ``sharded_state_dict``, the keys
of megatron-core's models), ``optimizer`` (the distributed optimizer ``fully_reshardable``: canonical per-parameter
state, so a checkpoint reshards to any DP / TP / PP / EP layout),
``opt_param_scheduler``, ``iteration``, ``checkpoint_version`` 3.0, ``args``, ``rng_state``
(a ShardedObject over (pp, tp) with DP replicas, as Megatron-LM stores it) and
``num_floating_point_operations_so_far``, assembled by :mod:`megatron.ciera.app.checkpoint_state`.
Checkpoints move between this repo and Megatron-LM.

Nothing lost:

* a save writes ``iter_N.incomplete/``, then the checksums, then renames it to ``iter_N`` and
  only then replaces the tracker (:mod:`megatron.ciera.app.checkpoint_publish`): a crash at any point
  leaves the previous checkpoint the latest, and no half-written folder is ever read (leftovers
  are removed at the next start);
* :func:`preflight` (start-up, before any training) checks that ``--save`` is writable by every
  rank and refuses a run that would start from scratch while ``--save`` already holds
  checkpoints (a mistyped ``--load``) unless ``--overwrite-checkpoints``;
* a load verifies the checksums first (each rank hashes a share of the files; the verdict is
  agreed over all ranks): a damaged checkpoint fails on every rank naming the files, or, with
  ``--ckpt-fallback-to-previous``, the newest earlier checkpoint that passes is loaded.

``--async-save``: megatron-core writes the tensors in a background process (forked per save, or
megatron-core's persistent worker with ``--use-persistent-ckpt-worker``:
:mod:`megatron.ciera.app.checkpoint_async`) and the publication (checksums, rename, tracker) runs in
its finalisation, once every rank's write is done (:func:`finalize_async_saves`, called by the
loop every iteration): atomic as above. ``--save-retain-interval`` removes the previous latest
checkpoint after each publication, as Megatron-LM (:func:`~megatron.ciera.app.checkpoint_publish.retire`).

``--ckpt-format torch`` writes Megatron-LM's legacy per-rank files instead
(:mod:`megatron.ciera.app.torch_checkpoint`), published the same way; it loads only at its own layout.
A checkpoint from another expert-parallel size loads too: the optimizers' common part is
regrouped for this run's chained optimizers.

``--ckpt-format fsdp_dtensor`` (the one format of ``--use-megatron-fsdp``, and only of it) writes
Megatron-LM's torch.distributed.checkpoint of Megatron-FSDP's sharded DTensors
(:mod:`megatron.ciera.app.fsdp_dtensor_checkpoint`), published and verified the same way; it is not
saved asynchronously (as upstream).

megatron-core's checkpoint behaviours that would lose or refuse state (the optimizer state of
every bucket after the first misplaced in ``fully_reshardable`` checkpoints, torch Adam's ``step``
on load, a change of expert-parallel size) are worked around in
:mod:`megatron.ciera.binding.checkpoint_fixes`, each with its version gate and the upstream fix that
retires it.

CIERA keeps no state in checkpoints: the caller invalidates its caches after :func:`load`
(``bucket_group.invalidate_param_caches``), so the first gather after a load is raw.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.ciera.app import checkpoint_async, failfast, fsdp_dtensor_checkpoint, torch_checkpoint
from megatron.ciera.app.checkpoint_publish import (CHECKSUMS, TRACKER, begin, complete_iterations, iteration_dir,
                                                   latest_iteration, print0, publish, remove_interrupted, verify)
from megatron.ciera.app.checkpoint_state import (CONTENT_METADATA, common_entries, model_keys, parallel_layout,
                                                 rng_state, set_rng_state, sharded_state_dict, unwrap)
from megatron.ciera.binding.checkpoint_fixes import fit_optimizer_layout, torch_adam_step_fix

__all__ = ["TRACKER", "CHECKSUMS", "preflight", "save", "write", "async_queue", "finalize_async_saves", "load", "latest_iteration", "iteration_dir",
           "complete_iterations", "verify"]

# Arguments that fix the shapes in a checkpoint: a mismatch is reported by name before loading.
_SHAPE_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
               "kv_channels", "num_experts", "moe_ffn_hidden_size", "swiglu", "untie_embeddings_and_output_weights",
               "padded_vocab_size")


def _agree(problem: str | None) -> list[str]:
    """Every rank's problem (``None``: fine), so that all ranks take the same decision."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problem)
    return [p for p in everyone if p]


def _fail_together(problem: str | None) -> None:
    problems = _agree(problem)
    if problems:
        raise SystemExit("\n".join(dict.fromkeys(problems)))


def _holds_checkpoint(root: str | None) -> int | None:
    if not root:
        return None
    latest = latest_iteration(root)
    return latest if latest is not None else (complete_iterations(root) or [None])[-1]


# ---------------------------------------------------------------------------------------------
# start-up checks

def preflight(args: argparse.Namespace) -> None:
    """Collective, before any training: ``--save`` writable by every rank (a probe file each),
    leftovers of interrupted saves removed, and no fresh start over existing checkpoints."""
    if args.save:
        problem = None
        probe = os.path.join(args.save, f".write-probe-rank{dist.get_rank()}")
        try:
            os.makedirs(args.save, exist_ok=True)
            with open(probe, "w") as f:
                f.write("ok")
            os.remove(probe)
        except OSError as exc:
            problem = f"--save {args.save} is not writable by rank {dist.get_rank()}: {exc.strerror or exc}"
        _fail_together(problem)
        remove_interrupted(args.save)

    found = _holds_checkpoint(args.load)
    if args.load and found is None and args.exit_on_missing_checkpoint:
        _fail_together(f"--load {args.load} holds no checkpoint (--exit-on-missing-checkpoint)")
    fresh = found is None or args.finetune
    existing = _holds_checkpoint(args.save)
    if fresh and existing is not None and not args.overwrite_checkpoints:
        why = (f"--load {args.load} holds no checkpoint" if args.load and found is None else
               "--finetune starts at iteration 0" if args.finetune else "no --load given")
        _fail_together(
            f"refusing to start: {why}, but --save {args.save} already holds checkpoints (latest iteration "
            f"{existing}); this run would overwrite them. Fix --load (e.g. --load {args.save}), choose another "
            "--save, or pass --overwrite-checkpoints to start over anyway.")
    if args.load and found is None:
        print0(f"WARNING: --load {args.load} holds no checkpoint: training starts from scratch")


# ---------------------------------------------------------------------------------------------
# save

def async_queue(args: argparse.Namespace):
    """The queue of asynchronous saves under ``--async-save`` (:func:`megatron.ciera.app.checkpoint_async.async_queue`;
    ``None`` without it)."""
    return checkpoint_async.async_queue(args)


def finalize_async_saves(queue, *, blocking: bool) -> None:
    """Collective, every iteration under ``--async-save`` and ``blocking`` before the run ends:
    finish the saves whose background writes are done on every rank (each one's checksums,
    rename and tracker run only then); ``blocking`` also stops the writer."""
    if queue is not None:
        if blocking:
            queue.close()
        else:
            queue.finalize(blocking=False)


def write(state: dict, *, root: str, iteration: int, queue=None, args: argparse.Namespace | None = None,
          protect: str | None = None) -> None:
    """Collective: write the sharded ``state`` as checkpoint ``iteration`` under ``root``,
    atomically. With ``queue`` (:func:`async_queue`) the tensors are written in a background
    process and the checkpoint is published (checksums, rename, tracker) by
    :func:`finalize_async_saves` once every rank's write is done: until then the previous
    checkpoint stays the latest, and a crash leaves only an ``.incomplete`` folder. ``args``:
    ``--verify-integrity``, ``--async-strategy`` and ``--save-retain-interval`` (which never
    removes ``protect``, the checkpoint this run loaded)."""
    from megatron.core import dist_checkpointing

    partial = begin(root=root, iteration=iteration)
    kwargs = checkpoint_async.save_kwargs(args, asynchronous=queue is not None)
    needed = _bytes_to_write(state)  # named should the disk fill up (megatron.ciera.app.failfast)

    def publish_it():
        publish(root=root, iteration=iteration, retain_interval=getattr(args, "save_retain_interval", None),
                protect=protect)

    if queue is None:
        with failfast.noting_bytes_needed(needed):
            dist_checkpointing.save(state, partial, content_metadata=dict(CONTENT_METADATA), **kwargs)
        publish_it()
        return
    with failfast.noting_bytes_needed(needed):
        request = dist_checkpointing.save(state, partial, content_metadata=dict(CONTENT_METADATA), **kwargs)
    queue.schedule(request, root=root, iteration=iteration, publish=publish_it, needed=needed)


def _bytes_to_write(state: dict) -> int:
    """Collective: about how many bytes the checkpoint of ``state`` takes, all ranks together (the
    tensors each rank writes as their main replica; a small all-reduce)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory, is_main_replica

    mine = 0
    for value in nested_values(state):
        if isinstance(value, (ShardedTensor, ShardedTensorFactory)) and is_main_replica(value.replica_id):
            data = value.data
            if isinstance(data, torch.Tensor):
                mine += data.numel() * data.element_size()
    total = torch.tensor([mine], dtype=torch.int64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(total)
    return int(total.item())


def save(args: argparse.Namespace, *, iteration: int, model, optimizer, scheduler, flops_so_far: float = 0.0,
         queue=None) -> None:
    """Collective: write checkpoint ``iteration`` under ``--save`` atomically, then the tracker
    (``queue``: asynchronously, see :func:`write`).

    The model's parameter buffers must hold the gathered parameters (the caller forces a
    synchronous gather first under ``--overlap-param-gather``)."""
    if getattr(args, "ckpt_format", "torch_dist") == "torch":
        _save_torch(args, iteration=iteration, model=model, optimizer=optimizer, scheduler=scheduler,
                    flops_so_far=flops_so_far)
        return
    if args.ckpt_format == "fsdp_dtensor":  # Megatron-FSDP's DTensors through torch.distributed.checkpoint
        partial = begin(root=args.save, iteration=iteration)
        fsdp_dtensor_checkpoint.save(args, folder=partial, iteration=iteration, model=model, optimizer=optimizer,
                                     scheduler=scheduler, flops_so_far=flops_so_far)
        publish(root=args.save, iteration=iteration, retain_interval=getattr(args, "save_retain_interval", None),
                protect=loaded_folder(args))
        return
    state = sharded_state_dict(model, optimizer, metadata=CONTENT_METADATA, with_optimizer=not args.no_save_optim,
                                with_rng=not args.no_save_rng, is_loading=False)
    state.update(common_entries(args, iteration=iteration, scheduler=scheduler, flops_so_far=flops_so_far))
    write(state, root=args.save, iteration=iteration, queue=queue, args=args, protect=loaded_folder(args))


def _save_torch(args, *, iteration: int, model, optimizer, scheduler, flops_so_far: float) -> None:
    """``--ckpt-format torch``: per-rank files (:mod:`megatron.ciera.app.torch_checkpoint`) written into
    ``iter_N.incomplete`` and published as the torch_dist ones are (checksums, rename, tracker)."""
    partial = begin(root=args.save, iteration=iteration)
    state = common_entries(args, iteration=iteration, scheduler=scheduler, flops_so_far=flops_so_far)
    if not args.no_save_rng:
        state["rng_state"] = [rng_state()]  # DP rank 0's, as Megatron-LM without --data-parallel-random-init
    torch_checkpoint.save(partial, state=state, model_chunks=[(k, unwrap(c)) for k, c in model_keys(model)],
                          optimizer=optimizer, with_optimizer=not args.no_save_optim)
    publish(root=args.save, iteration=iteration, retain_interval=getattr(args, "save_retain_interval", None),
            protect=loaded_folder(args))


# ---------------------------------------------------------------------------------------------
# load

@dataclass(frozen=True)
class _LoadPlan:
    folder: str
    """The checkpoint folder that passed verification."""
    iteration: int
    """Its iteration."""


def _choose(args) -> _LoadPlan | None:
    """The checkpoint to load (verified), ``None`` when ``--load`` holds none."""
    root = args.load
    wanted = args.ckpt_step if args.ckpt_step is not None else latest_iteration(root)
    if wanted is None:
        wanted = (complete_iterations(root) or [None])[-1]
        if wanted is not None:
            print0(f"note: {root} has no {TRACKER}; loading its newest folder, iteration {wanted}")
    if wanted is None:
        return None
    candidates = [wanted]
    if args.ckpt_fallback_to_previous:
        candidates += [i for i in reversed(complete_iterations(root)) if i < wanted]
    for it in candidates:
        folder = iteration_dir(root, it)
        problems = verify(folder)
        if not problems:
            if it != wanted:
                print0(f"WARNING: loading the previous good checkpoint {folder} instead")
            return _LoadPlan(folder, it)
        report = f"checkpoint {folder} failed verification:\n  " + "\n  ".join(problems)
        if not args.ckpt_fallback_to_previous:
            raise SystemExit(report + "\n(pass --ckpt-fallback-to-previous to load the previous good checkpoint)")
        print0("WARNING: " + report)
    raise SystemExit(f"--load {root}: no checkpoint at or before iteration {wanted} passes verification")


def _check_shapes(saved, args) -> None:
    diffs = [f"--{k.replace('_', '-')}: checkpoint {getattr(saved, k)!r}, this run {getattr(args, k)!r}"
             for k in _SHAPE_ARGS if hasattr(saved, k) and hasattr(args, k) and getattr(saved, k) != getattr(args, k)]
    if diffs:
        raise SystemExit("the checkpoint's model does not match this run's:\n  " + "\n  ".join(diffs))


@torch.no_grad()
def load(args: argparse.Namespace, *, model, optimizer, scheduler) -> int:
    """Collective: restore the checkpoint ``--load`` / ``--ckpt-step`` names; returns the iteration
    to continue from (0 when nothing was loaded or with ``--finetune``)."""
    from megatron.core import dist_checkpointing

    if not args.load:
        return 0
    plan = _choose(args)
    if plan is None:
        return 0
    fmt = ("torch" if torch_checkpoint.is_torch_checkpoint(plan.folder) else
           "fsdp_dtensor" if fsdp_dtensor_checkpoint.is_fsdp_dtensor_checkpoint(plan.folder) else "torch_dist")
    if fmt != getattr(args, "ckpt_format", "torch_dist"):
        if not getattr(args, "auto_detect_ckpt_format", False):
            raise SystemExit(f"{plan.folder} is a --ckpt-format {fmt} checkpoint but this run has --ckpt-format "
                             f"{args.ckpt_format}: pass --ckpt-format {fmt} (or --auto-detect-ckpt-format) to load it")
        print0(f"note: {plan.folder} is a --ckpt-format {fmt} checkpoint (--auto-detect-ckpt-format); this run "
               f"saves --ckpt-format {args.ckpt_format}")
    if getattr(args, "use_megatron_fsdp", False) != (fmt == "fsdp_dtensor"):
        raise SystemExit(f"{plan.folder} is a --ckpt-format {fmt} checkpoint: Megatron-FSDP (--use-megatron-fsdp) "
                         "reads and writes fsdp_dtensor checkpoints, and only it does")
    if fmt == "torch":
        return _load_torch(args, plan, model=model, optimizer=optimizer, scheduler=scheduler)
    if fmt == "fsdp_dtensor":
        return _load_fsdp_dtensor(args, plan, model=model, optimizer=optimizer, scheduler=scheduler)
    common = dist_checkpointing.load_common_state_dict(plan.folder)
    saved_args = common.get("args")
    if saved_args is not None:
        _check_shapes(saved_args, args)
    metadata = dist_checkpointing.load_content_metadata(plan.folder) or {}
    with_optimizer = not (args.finetune or args.no_load_optim) and "opt_param_scheduler" in common
    with_rng = not (args.finetune or args.no_load_rng)
    if with_rng and saved_args is not None and parallel_layout(saved_args) != parallel_layout(args):
        print0(f"note: checkpoint written at (pp, tp) = {parallel_layout(saved_args)}, this run has {parallel_layout(args)}: "
                "RNG state not loaded (as Megatron-LM)")
        with_rng = False
    request = sharded_state_dict(model, optimizer, metadata=metadata, with_optimizer=with_optimizer,
                                  with_rng=with_rng, is_loading=True)
    integrity = {"verify_integrity": True} if getattr(args, "verify_integrity", False) else {}
    state = dist_checkpointing.load(request, plan.folder, strict=args.dist_ckpt_strictness, **integrity)
    if isinstance(state, tuple):  # the 'return_*' strictness modes also return the mismatching keys
        state, missing, unexpected = state
        print0(f"checkpoint key mismatch: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    def load_optimizer():
        optimizer.load_state_dict(fit_optimizer_layout(state["optimizer"], optimizer))

    return _restore(args, plan, state, model=model, optimizer=optimizer, scheduler=scheduler,
                    load_optimizer=load_optimizer if with_optimizer else None, with_rng=with_rng)


def _restore(args, plan: _LoadPlan, state: dict, *, model, optimizer, scheduler, load_optimizer, with_rng: bool,
             note: str = "") -> int:
    """What both formats do with a loaded ``state``: the model; then the optimizer
    (``load_optimizer()``) and scheduler, or without them the main parameters from the model; the
    RNG (``with_rng``); the log line. Returns the iteration to continue from."""
    for key, chunk in model_keys(model):
        unwrap(chunk).load_state_dict(state[key], strict=args.dist_ckpt_strictness != "ignore_all")
    if load_optimizer is not None:
        with torch_adam_step_fix(optimizer):
            load_optimizer()
        scheduler.load_state_dict(state["opt_param_scheduler"])
    else:
        optimizer.reload_model_params()  # main (fp32) parameters from the loaded model
    if with_rng:
        set_rng_state(state["rng_state"][0])
    iteration = 0 if args.finetune else int(state.get("iteration", plan.iteration))
    args.ckpt_loaded_folder = plan.folder  # kept by --save-retain-interval (loaded_folder)
    print0(f"loaded checkpoint {plan.folder} (iteration {plan.iteration}{note})"
            + ("; --finetune: starting at iteration 0" if args.finetune else ""))
    return iteration


def loaded_folder(args: argparse.Namespace) -> str | None:
    """The checkpoint folder :func:`load` restored in this run (``None``: none), which
    ``--save-retain-interval`` never removes."""
    return getattr(args, "ckpt_loaded_folder", None)


def _load_torch(args, plan: _LoadPlan, *, model, optimizer, scheduler) -> int:
    """``--ckpt-format torch``: this rank's files, at the layout that wrote them (checked first)."""
    state = torch_checkpoint.load(plan.folder)
    saved_args = state.get("args")
    if saved_args is not None:
        _check_shapes(saved_args, args)
        torch_checkpoint.check_layout(saved_args, args)
    def load_optimizer():
        optimizer.load_state_dict(state["optimizer"])
        optimizer.load_parameter_state(torch_checkpoint.optimizer_file(plan.folder))

    with_optimizer = not (args.finetune or args.no_load_optim) and "optimizer" in state
    return _restore(args, plan, state, model=model, optimizer=optimizer, scheduler=scheduler,
                    load_optimizer=load_optimizer if with_optimizer else None,
                    with_rng=not (args.finetune or args.no_load_rng) and "rng_state" in state,
                    note=", --ckpt-format torch")


def _load_fsdp_dtensor(args, plan: _LoadPlan, *, model, optimizer, scheduler) -> int:
    """``--ckpt-format fsdp_dtensor``: the model's shapes checked first, then everything read in place
    (:mod:`megatron.ciera.app.fsdp_dtensor_checkpoint`)."""
    saved_args = fsdp_dtensor_checkpoint.saved_args_of(plan.folder)
    if saved_args is not None:
        _check_shapes(saved_args, args)
    keys = fsdp_dtensor_checkpoint.saved_keys(plan.folder)
    with_optimizer = not (args.finetune or args.no_load_optim) and "optimizer" in keys
    with_rng = not (args.finetune or args.no_load_rng)
    if with_rng and saved_args is not None and parallel_layout(saved_args) != parallel_layout(args):
        print0(f"note: checkpoint written at (pp, tp) = {parallel_layout(saved_args)}, this run has "
               f"{parallel_layout(args)}: RNG state not loaded (as Megatron-LM)")
        with_rng = False
    entries = fsdp_dtensor_checkpoint.load(args, folder=plan.folder, model=model, optimizer=optimizer,
                                           scheduler=scheduler, with_optimizer=with_optimizer, with_rng=with_rng)
    iteration = 0 if args.finetune else int(entries["iteration"])
    args.ckpt_loaded_folder = plan.folder  # kept by --save-retain-interval (loaded_folder)
    print0(f"loaded checkpoint {plan.folder} (iteration {plan.iteration}, --ckpt-format fsdp_dtensor)"
           + ("; --finetune: starting at iteration 0" if args.finetune else ""))
    return iteration
