"""The one dispatch point: Megatron-Core's parameter all-gather, done by CIERA.

Megatron-Core's DDP keeps parameters in flat buffers cut into buckets; a bucket group's
``start_param_sync`` all-gathers every bucket's ``param_data`` over the distributed optimizer's
data-parallel group (dense buckets) or expert data-parallel group (expert buckets), either
synchronously right after the optimizer step or, with ``overlap_param_gather``, asynchronously
from the next forward's pre-hooks, which call ``finish_param_sync`` -> ``param_gather_handle.wait()``.

:func:`install` builds one :class:`ciera.CieraAllGather` per bucket (measuring link and codec
speeds then) and replaces ``start_param_sync`` on each bucket group of a DDP model by
:func:`_start_param_sync`, which starts the bucket group's gathers and stores a handle whose
``wait()`` completes them (and their in-place decode). Everything else (``finish_param_sync``, the
prefetch chain, dispatch bookkeeping) stays upstream's. A bucket group in a mode CIERA does not
handle keeps upstream's gather, announced by one log line.

Per step: the optimizer's step marks the bucket groups it wrote; the first gather of a process
group after that (or :func:`prepare_param_gathers`, right after the optimizer step) encodes every
written bucket of the group and agrees all their payload sizes in ONE small collective; each
written group is then gathered exactly once, and a group nobody wrote is not gathered again. A
synchronous request starts the gathers of every prepared group of its process group at once
(each later request only waits its own), so each decode overlaps the following transfers; the
training loop's :func:`after_optimizer_step` finishes any whose request did not come.

Invariant the gathers rely on: between two gathers of a bucket, only this rank's own shard of
``param_data`` changes (the optimizer writes it). Anything else that writes parameter buffers
(checkpoint load, parameter broadcast, offload/reload) must be followed by
:func:`invalidate_param_caches`, which makes the next gather of every bucket raw.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

logger = logging.getLogger(__name__)

__all__ = ["install", "uninstall", "invalidate_param_caches", "prepare_param_gathers", "finish_param_gathers",
           "after_optimizer_step", "bucket_stats", "upstream_post_sync", "fallback_reason"]

_GATHER_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def upstream_post_sync(bucket_group) -> Callable[[], None] | None:
    """Version isolation: the post-gather step upstream's ``start_param_sync`` runs itself.

    megatron-core 0.19.x ends a *forced* synchronous gather under ``overlap_param_gather`` with
    ``bucket_group._post_param_sync()`` (quantized-parameter post-processing). 0.16.x has no such
    method: its ``finish_param_sync`` and DDP do that inline, after calling ``start_param_sync``.
    Returns the callable to run in that case, or ``None`` (0.16.x). Everything else this module
    touches (``buckets``, ``param_data``, ``intra_distributed_optimizer_instance_group/_size/_rank``,
    ``param_gather_handle``, ``param_gather_dispatched``, ``ddp_config``) is the same in both.
    """
    return getattr(bucket_group, "_post_param_sync", None)


def fallback_reason(bucket_group, optimizer_config=None) -> str | None:
    """Why this bucket group must keep upstream's all-gather, or ``None`` when CIERA can do it.

    Checked with ``getattr`` defaults so that fields missing in one megatron-core version (e.g.
    ``fp4_param_gather`` before 0.19) read as off."""
    cfg = bucket_group.ddp_config
    if not getattr(cfg, "use_distributed_optimizer", False):
        return "layer-wise parameter gather (no distributed optimizer)"
    for flag in ("fp8_param_gather", "fp4_param_gather", "reuse_grad_buf_for_mxfp8_param_ag",
                 "use_megatron_fsdp", "use_custom_fsdp"):
        if getattr(cfg, flag, False):
            return f"ddp_config.{flag}"
    if optimizer_config is not None and getattr(optimizer_config, "use_precision_aware_optimizer", False):
        return "optimizer_config.use_precision_aware_optimizer"
    if bucket_group.intra_distributed_optimizer_instance_size == 1:
        return "single-rank gather group (nothing to send)"
    for bucket in bucket_group.buckets:
        data = bucket.param_data
        if data is None:
            return "bucket without a parameter buffer"
        if data.dtype not in _GATHER_DTYPES:
            return f"parameter buffer dtype {data.dtype} (fp8/fp4 storage)"
        grad = getattr(bucket, "grad_data", None)
        if grad is not None and grad.numel() and data.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr():
            return "parameter buffer shared with the gradient buffer"
    return None


class _GroupHandle:
    """What ``param_gather_handle`` holds: ``wait()`` finishes every bucket's gather, once."""

    def __init__(self, handles):
        self._handles = handles

    def wait(self):
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.wait()


@dataclass
class _Binding:
    """State shared by the bucket groups of one :func:`install`."""

    groups: list = field(default_factory=list)
    """Every installed bucket group, in install order (the same on every rank)."""
    tracks_writes: bool = False
    """The optimizer's steps mark the bucket groups they write (``install(optimizer=...)``);
    otherwise every ``start_param_sync`` gathers."""

    def prepare(self, process_group) -> int:
        """Encode every bucket of the written, not yet prepared bucket groups of ``process_group``
        and agree all their sizes in ONE collective (:func:`ciera.agreement.agree_sizes`). Every rank
        selects the same groups in the same order (the written flags follow the same optimizer
        steps everywhere). Returns the number of buckets prepared."""
        todo = [bg for bg in self.groups if bg._ciera.process_group is process_group and bg._ciera.written
                and not bg._ciera.prepared and bg.param_gather_handle is None and bg._ciera.launched is None]
        gathers = [g for bg in todo for g in bg._ciera.gathers]
        if gathers:
            type(gathers[0]).prepare_many(gathers, group=process_group)
        for bg in todo:
            bg._ciera.prepared = True
        return len(gathers)

    def launch(self, bucket_group, *, ahead: bool) -> "_GroupHandle":
        """Start ``bucket_group``'s gathers (preparing its process group first if needed) and
        return their handle. With ``ahead`` (a synchronous request), also start those of every
        other prepared synchronous group of the same process group, in install order, each
        keeping its handle for its own request: a group's decode then runs while the next groups'
        bytes are on the wire, instead of each group's transfer waiting for the previous decode.
        Every rank launches the same groups in the same order (the prepared flags are
        rank-identical), so the collectives match."""
        state = bucket_group._ciera
        if not state.prepared:
            self.prepare(state.process_group)
        todo = [bucket_group]
        if ahead:
            todo += [bg for bg in self.groups if bg is not bucket_group and bg._ciera.process_group is state.process_group
                     and bg._ciera.prepared and bg._ciera.launched is None
                     and not bg.ddp_config.overlap_param_gather]
        for bg in todo:
            s = bg._ciera
            s.launched = _GroupHandle([gather.start() for gather in s.gathers])
            s.prepared = False
            s.written = not self.tracks_writes
        handle, state.launched = state.launched, None
        return handle

    def finish_launched(self) -> int:
        """Wait for every group started ahead whose own request has not come (none, when upstream
        asks for every group in the optimizer step, as it does). Returns how many it waited."""
        pending = [bg for bg in self.groups if bg._ciera.launched is not None]
        for bg in pending:
            handle, bg._ciera.launched = bg._ciera.launched, None
            handle.wait()
        return len(pending)


@dataclass
class _GroupState:
    """CIERA state of one bucket group."""

    name: str
    binding: _Binding
    process_group: object
    gathers: list
    written: bool = True
    """Some shard changed since this group's last gather. With optimizer tracking it starts
    False: like upstream (no gather before the first step in synchronous mode), the buffers built
    from identically initialised parameters already agree; a load must call
    :func:`invalidate_param_caches`, which sets it."""
    prepared: bool = False
    """Encoded and sizes agreed for the next gather."""
    launched: object = None
    """The handle of this group's gathers when an earlier group's synchronous request started
    them ahead (:meth:`_Binding.launch`); this group's own request waits it."""


def _start_param_sync(bucket_group, force_sync: bool = False):
    """Upstream ``start_param_sync``'s distributed-optimizer branch, with CIERA gathers.

    A group no optimizer wrote since its last gather is not gathered again: its buffers already
    hold what a gather would deliver (megatron-core's chained optimizers call this for every group
    once per optimizer)."""
    state = bucket_group._ciera
    post_sync = upstream_post_sync(bucket_group)
    overlap = bucket_group.ddp_config.overlap_param_gather
    if force_sync:
        if bucket_group.param_gather_handle is not None:
            bucket_group.param_gather_handle.wait()
            bucket_group.param_gather_handle = None
            if post_sync is not None:
                post_sync()
            return
    else:
        # Prevents a second gather into the same buffers while one is in flight.
        assert bucket_group.param_gather_handle is None

    if state.launched is not None:  # started ahead by an earlier group's synchronous request
        handle, state.launched = state.launched, None
        handle.wait()
        bucket_group.param_gather_handle = None
    elif state.written:
        handle = state.binding.launch(bucket_group, ahead=not overlap)
        if overlap and not force_sync:
            bucket_group.param_gather_handle = handle
        else:
            handle.wait()
            bucket_group.param_gather_handle = None
    if force_sync and overlap and post_sync is not None:
        post_sync()
    bucket_group.param_gather_dispatched = True


def _track_optimizer_writes(optimizer, groups) -> bool:
    """Wrap each distributed optimizer's ``step_with_ready_grads`` (on the instance) so that it
    marks the bucket groups whose parameter buffers it owns as written before it steps (and, in
    synchronous mode, gathers). Returns False when ``optimizer`` exposes no buffers to map."""
    optimizers = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    by_storage = {}
    for bg in groups:
        for bucket in bg.buckets:
            by_storage.setdefault(bucket.param_data.untyped_storage().data_ptr(), []).append(bg)
    mapped = False
    for opt in optimizers:
        buffers = getattr(opt, "buffers", None)
        if buffers is None or not hasattr(opt, "step_with_ready_grads"):
            if getattr(opt, "is_stub_optimizer", False):
                continue
            return False
        owned = [bg for buf in buffers for bg in by_storage.get(buf.param_data.untyped_storage().data_ptr(), [])]
        mapped = mapped or bool(owned)
        original = opt.step_with_ready_grads

        def step_with_ready_grads(*a, _original=original, _owned=tuple(owned), **k):
            for bg in _owned:
                bg._ciera.written = True
            return _original(*a, **k)

        opt.step_with_ready_grads = step_with_ready_grads
    return mapped


def _bucket_groups(ddp_model) -> list[tuple[str, object]]:
    named = [(f"dense{i}", bg) for i, bg in enumerate(ddp_model.bucket_groups)]
    named += [(f"expert{i}", bg) for i, bg in enumerate(getattr(ddp_model, "expert_parallel_bucket_groups", []))]
    return named


def install(ddp_models: Iterable, config, optimizer_config=None, make_gather: Callable | None = None,
            log: Callable[[str], None] | None = None, optimizer=None) -> int:
    """Gather the parameters of ``ddp_models`` (Megatron-Core DDP modules) with CIERA.

    ``config`` is the :class:`ciera.CieraConfig` for every bucket; ``make_gather`` defaults to
    :class:`ciera.CieraAllGather` (tests pass a fake). ``optimizer`` (the Megatron optimizer, chained
    or not): its steps mark the bucket groups they write, so a group is gathered once per step
    even when several optimizers each ask for every group; without it every request gathers.

    Call on every rank, after the model and optimizer are built and before the first gather: the
    gathers are built here (collectively, one process group after the other in the same order on
    every rank; ``make_gather`` is a class with ``prepare_many(gathers, *, group)``, like
    :class:`ciera.CieraAllGather`), which is also when link and codec speeds are measured, at the real bucket sizes.
    Returns the number of bucket groups now on CIERA; the others keep upstream's gather and are
    reported in one line through ``log``."""
    if make_gather is None:
        from ciera import CieraAllGather as make_gather
    from ciera.selection import Measurements

    log = log or logger.warning
    binding, fallbacks, measurements = _Binding(), {}, {}
    for chunk, ddp_model in enumerate(ddp_models):
        for name, bucket_group in _bucket_groups(ddp_model):
            if hasattr(bucket_group, "_ciera"):
                raise RuntimeError(f"CIERA already installed on bucket group {name}")
            reason = fallback_reason(bucket_group, optimizer_config)
            if reason is not None:
                fallbacks.setdefault(reason, []).append(name)
                continue
            prefix = name if chunk == 0 else f"chunk{chunk}.{name}"
            group = bucket_group.intra_distributed_optimizer_instance_group
            m = measurements.setdefault(group, Measurements())
            gathers = [make_gather(bucket.param_data, group=group, config=config, name=f"{prefix}.bucket{i}",
                                   measurements=m) for i, bucket in enumerate(bucket_group.buckets)]
            bucket_group._ciera = _GroupState(prefix, binding, group, gathers)
            # An instance attribute shadows the class method: finish_param_sync, the prefetch
            # chain and DDP.start_param_sync all call self.start_param_sync and reach this.
            bucket_group.start_param_sync = _start_param_sync.__get__(bucket_group)
            binding.groups.append(bucket_group)
    if optimizer is not None and binding.groups:
        binding.tracks_writes = _track_optimizer_writes(optimizer, binding.groups)
        for bg in binding.groups:
            bg._ciera.written = not binding.tracks_writes
        if not binding.tracks_writes:
            log("CIERA all-gather: the optimizer exposes no parameter buffers; every start_param_sync gathers")
    if fallbacks:
        parts = "; ".join(f"{reason}: {', '.join(names)}" for reason, names in fallbacks.items())
        log(f"CIERA all-gather: {sum(map(len, fallbacks.values()))} bucket group(s) keep Megatron's "
            f"uncompressed all-gather ({parts})")
    return len(binding.groups)


def _installed(ddp_models):
    for ddp_model in ddp_models:
        for name, bucket_group in _bucket_groups(ddp_model):
            if hasattr(bucket_group, "_ciera"):
                yield bucket_group


def finish_param_gathers(ddp_models: Iterable) -> int:
    """Wait for every gather started ahead and not yet waited (a synchronous request starts the
    next groups' gathers too; each group's own request waits its own). Call after the optimizer
    step: afterwards every parameter is gathered even if some group's request never came.
    Returns the number of bucket groups it had to wait for (0 with upstream's optimizers)."""
    bindings = {id(bg._ciera.binding): bg._ciera.binding for bg in _installed(ddp_models)}
    return sum(b.finish_launched() for b in bindings.values())


def after_optimizer_step(ddp_models: Iterable, *, overlap_param_gather: bool) -> None:
    """The training loop's one call after ``optimizer.step()``: every synchronous gather started
    ahead is finished (:func:`finish_param_gathers`); with overlapped gathers the new shards are
    encoded now (:func:`prepare_param_gathers`), so the next forward's pre-hooks only launch."""
    finish_param_gathers(ddp_models)
    if overlap_param_gather:
        prepare_param_gathers(ddp_models)


def uninstall(ddp_models: Iterable) -> None:
    """Restore upstream's gather (waits for a gather in flight first)."""
    finish_param_gathers(ddp_models)
    for bucket_group in list(_installed(ddp_models)):
        if bucket_group.param_gather_handle is not None:
            bucket_group.param_gather_handle.wait()
            bucket_group.param_gather_handle = None
        del bucket_group.start_param_sync
        del bucket_group._ciera


def invalidate_param_caches(ddp_models: Iterable) -> None:
    """Make the next gather of every bucket raw (and due). Call on every rank after anything but
    the optimizer step wrote parameter buffers: checkpoint load, broadcast_params, offload/reload."""
    finish_param_gathers(ddp_models)
    for bucket_group in _installed(ddp_models):
        bucket_group._ciera.written = True
        bucket_group._ciera.prepared = False
        for gather in bucket_group._ciera.gathers:
            gather.invalidate()


def prepare_param_gathers(ddp_models: Iterable) -> int:
    """The once-per-step size agreement: right after the optimizer step, encode every written
    bucket's shard (side CUDA stream on GPU) and agree the sizes of all buckets of each process
    group in ONE small collective per group. The gathers the next forward dispatches then only
    launch their collectives; nothing after this reads the host until the next step. Skips bucket
    groups whose gather is already dispatched. Returns the number of buckets prepared."""
    groups = [bg for bg in _installed(ddp_models) if not bg.param_gather_dispatched]
    n, seen = 0, []
    for bg in groups:
        if not any(bg._ciera.process_group is s for s in seen):
            seen.append(bg._ciera.process_group)
            n += bg._ciera.binding.prepare(bg._ciera.process_group)
    return n


def bucket_stats(ddp_models: Iterable) -> list[tuple[str, object]]:
    """``(bucket name, gather.stats)`` for every CIERA bucket gathered so far, in a fixed order."""
    out = []
    for bucket_group in _installed(ddp_models):
        for i, gather in enumerate(bucket_group._ciera.gathers):
            out.append((f"{bucket_group._ciera.name}.bucket{i}", gather.stats))
    return out
