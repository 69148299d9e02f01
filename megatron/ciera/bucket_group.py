"""The one dispatch point: Megatron-Core's parameter all-gather, done by CIERA.

Megatron-Core's DDP keeps parameters in flat buffers cut into buckets; a bucket group's
``start_param_sync`` all-gathers every bucket's ``param_data`` over the distributed optimizer's
data-parallel group (dense buckets) or expert data-parallel group (expert buckets), either
synchronously right after the optimizer step or, with ``overlap_param_gather``, asynchronously
from the next forward's pre-hooks, which call ``finish_param_sync`` -> ``param_gather_handle.wait()``.

:func:`install` replaces ``start_param_sync`` on each bucket group of a DDP model by
:func:`_start_param_sync`, which starts one :class:`ciera.CieraAllGather` per bucket and stores a
handle whose ``wait()`` completes the gathers (and their in-place decode). Everything else
(``finish_param_sync``, the prefetch chain, dispatch bookkeeping) stays upstream's. A bucket group
in a mode CIERA does not handle keeps upstream's gather, announced by one log line.

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

__all__ = ["install", "uninstall", "invalidate_param_caches", "prepare_param_gathers", "bucket_stats",
           "upstream_post_sync", "fallback_reason"]

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
class _GroupState:
    """CIERA state of one bucket group; gathers are built at its first gather (collectively)."""

    name: str
    config: object
    make_gather: Callable
    measurements: dict
    """Process group -> ``ciera.selection.Measurements``, shared by every bucket group of one
    :func:`install`, so link and codec speeds are measured once per group."""
    gathers: list = field(default_factory=list)


def _start_param_sync(bucket_group, force_sync: bool = False):
    """Upstream ``start_param_sync``'s distributed-optimizer branch, with CIERA gathers."""
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

    if not state.gathers:
        group = bucket_group.intra_distributed_optimizer_instance_group
        if group not in state.measurements:
            from ciera.selection import Measurements

            state.measurements[group] = Measurements()
        state.gathers = [
            state.make_gather(bucket.param_data, group=group, config=state.config, name=f"{state.name}.bucket{i}",
                              measurements=state.measurements[group])
            for i, bucket in enumerate(bucket_group.buckets)
        ]
    handle = _GroupHandle([gather.start() for gather in state.gathers])
    if overlap and not force_sync:
        bucket_group.param_gather_handle = handle
    else:
        handle.wait()
        bucket_group.param_gather_handle = None
    if force_sync and overlap and post_sync is not None:
        post_sync()
    bucket_group.param_gather_dispatched = True


def _bucket_groups(ddp_model) -> list[tuple[str, object]]:
    named = [(f"dense{i}", bg) for i, bg in enumerate(ddp_model.bucket_groups)]
    named += [(f"expert{i}", bg) for i, bg in enumerate(getattr(ddp_model, "expert_parallel_bucket_groups", []))]
    return named


def install(ddp_models: Iterable, config, optimizer_config=None, make_gather: Callable | None = None,
            log: Callable[[str], None] | None = None) -> int:
    """Gather the parameters of ``ddp_models`` (Megatron-Core DDP modules) with CIERA.

    ``config`` is the :class:`ciera.CieraConfig` for every bucket; ``make_gather`` defaults to
    :class:`ciera.CieraAllGather` (tests pass a fake). Call on every rank, after the model and
    optimizer are built and before the first gather. Returns the number of bucket groups now on
    CIERA; the others keep upstream's gather and are reported in one line through ``log``."""
    if make_gather is None:
        from ciera import CieraAllGather as make_gather
    log = log or logger.warning
    installed, fallbacks, measurements = 0, {}, {}
    for chunk, ddp_model in enumerate(ddp_models):
        for name, bucket_group in _bucket_groups(ddp_model):
            if hasattr(bucket_group, "_ciera"):
                raise RuntimeError(f"CIERA already installed on bucket group {name}")
            reason = fallback_reason(bucket_group, optimizer_config)
            if reason is not None:
                fallbacks.setdefault(reason, []).append(name)
                continue
            prefix = name if chunk == 0 else f"chunk{chunk}.{name}"
            bucket_group._ciera = _GroupState(prefix, config, make_gather, measurements)
            # An instance attribute shadows the class method: finish_param_sync, the prefetch
            # chain and DDP.start_param_sync all call self.start_param_sync and reach this.
            bucket_group.start_param_sync = _start_param_sync.__get__(bucket_group)
            installed += 1
    if fallbacks:
        parts = "; ".join(f"{reason}: {', '.join(names)}" for reason, names in fallbacks.items())
        log(f"CIERA all-gather: {sum(map(len, fallbacks.values()))} bucket group(s) keep Megatron's "
            f"uncompressed all-gather ({parts})")
    return installed


def _installed(ddp_models):
    for ddp_model in ddp_models:
        for name, bucket_group in _bucket_groups(ddp_model):
            if hasattr(bucket_group, "_ciera"):
                yield bucket_group


def uninstall(ddp_models: Iterable) -> None:
    """Restore upstream's gather (waits for a gather in flight first)."""
    for bucket_group in list(_installed(ddp_models)):
        if bucket_group.param_gather_handle is not None:
            bucket_group.param_gather_handle.wait()
            bucket_group.param_gather_handle = None
        del bucket_group.start_param_sync
        del bucket_group._ciera


def invalidate_param_caches(ddp_models: Iterable) -> None:
    """Make the next gather of every bucket raw. Call on every rank after anything but the
    optimizer step wrote parameter buffers: checkpoint load, broadcast_params, offload/reload."""
    for bucket_group in _installed(ddp_models):
        for gather in bucket_group._ciera.gathers:
            gather.invalidate()


def prepare_param_gathers(ddp_models: Iterable) -> int:
    """Encode every bucket's shard now, right after the optimizer wrote it (side CUDA stream on
    GPU), so that the gathers the next forward dispatches only launch their collectives and only
    decoding stays on the critical path. Skips bucket groups whose gather is already dispatched
    and groups not gathered yet (their gathers are built at their first dispatch). Returns the
    number of buckets prepared."""
    n = 0
    for bucket_group in _installed(ddp_models):
        if bucket_group.param_gather_dispatched or bucket_group.param_gather_handle is not None:
            continue
        for gather in bucket_group._ciera.gathers:
            gather.prepare()
            n += 1
    return n


def bucket_stats(ddp_models: Iterable) -> list[tuple[str, object]]:
    """``(bucket name, gather.stats)`` for every CIERA bucket gathered so far, in a fixed order."""
    out = []
    for bucket_group in _installed(ddp_models):
        for i, gather in enumerate(bucket_group._ciera.gathers):
            out.append((f"{bucket_group._ciera.name}.bucket{i}", gather.stats))
    return out
