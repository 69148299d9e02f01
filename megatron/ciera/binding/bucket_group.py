"""The one dispatch point: Megatron-Core's parameter all-gather, done by CIERA.

Megatron-Core's DDP keeps parameters in flat buffers cut into buckets; a bucket group's
``start_param_sync`` all-gathers every bucket's ``param_data`` over the distributed optimizer's
data-parallel group (dense buckets) or expert data-parallel group (expert buckets), either
synchronously right after the optimizer step or, with ``overlap_param_gather``, asynchronously
from the next forward's pre-hooks, which call ``finish_param_sync`` -> ``param_gather_handle.wait()``.

:func:`install` builds one :class:`ciera.CieraAllGather` per bucket (measuring link and codec
speeds then) and hands each bucket group to :func:`megatron.ciera.binding.upstream_patch.attach`, whose
``start_param_sync`` (the one dispatch point) asks this module's scheduler for the group's gathers
and stores a handle whose ``wait()`` completes them (and their in-place decode). Everything else
(``finish_param_sync``, the prefetch chain, dispatch bookkeeping) stays upstream's. This module
never touches megatron-core's objects itself: :mod:`megatron.ciera.binding.upstream_patch` does, gated by
megatron-core version. A bucket group in a mode CIERA does not handle keeps upstream's gather,
announced by one log line.

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

Errors unwind: when a bucket's prepare, start or wait raises, the gathers already started are
waited, the others dropped back to idle (their next gather raw on every rank), and the first error
propagates; no gather is left proposed, agreed or in flight, so a checkpoint save and a clean exit
(or the same request again) work (``tests/megatron/ciera/binding/test_mc_bucket_group_errors.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable

from ciera.changes import ShardWrites

from . import upstream_patch as upstream
from .protocol import Binding

logger = logging.getLogger(__name__)

__all__ = ["install", "uninstall", "invalidate_param_caches", "prepare_param_gathers", "finish_param_gathers",
           "raise_pending_errors", "device_bytes",
           "after_optimizer_step", "bucket_stats", "summary", "DistributedOptimizerBinding"]


class _GroupHandle:
    """What ``param_gather_handle`` holds: ``wait()`` finishes every bucket's gather, once (also
    when one of them raises: :func:`_wait_all`)."""

    def __init__(self, handles):
        self._handles = handles

    def wait(self):
        handles, self._handles = self._handles, []
        _wait_all(handles)


def _wait_all(handles) -> None:
    """Wait every handle, even after one raised (each wait returns its gather to idle, and the
    collectives behind the others were launched on every rank), then raise the first error."""
    first = None
    for handle in handles:
        try:
            handle.wait()
        except BaseException as e:  # noqa: BLE001 - re-raised below, once every gather is idle
            if first is None:
                first = e
            else:
                logger.error("CIERA all-gather: a further gather failed while unwinding: %r", e)
    if first is not None:
        raise first


def _start_all(gathers) -> _GroupHandle:
    """Start every gather of a bucket group. When one ``start()`` raises, no gather is left in
    flight or agreed: those started are waited, the failing one and the rest are dropped back to
    idle (``invalidate()``: their next gather is raw on every rank), then the error propagates."""
    handles = []
    try:
        for gather in gathers:
            handles.append(gather.start())
    except BaseException:
        _unwind(gathers[len(handles):], handles)
        raise
    return _GroupHandle(handles)


def _unwind(gathers, handles) -> None:
    """After an error: ``gathers`` back to idle (``invalidate()``), ``handles`` waited; a further
    error here is logged, so the first one is what the caller sees."""
    for gather in gathers:
        gather.invalidate()
    try:
        _wait_all(handles)
    except BaseException as e:  # noqa: BLE001 - the caller re-raises the first error
        logger.error("CIERA all-gather: a gather started before the failure also failed: %r", e)


@dataclass
class _Binding:
    """State shared by the bucket groups of one :func:`install`."""

    groups: list = field(default_factory=list)
    """The :class:`_GroupState` of every installed bucket group, in install order (the same on
    every rank)."""
    tracks_writes: bool = False
    """The optimizer's steps mark the bucket groups they write (``install(optimizer=...)``);
    otherwise every ``start_param_sync`` gathers."""
    wrapped_optimizers: list = field(default_factory=list)
    """The optimizers whose steps mark writes (:func:`upstream.wrap_optimizer_steps`)."""

    def prepare(self, process_group) -> int:
        """Encode every bucket of the written, not yet prepared bucket groups of ``process_group``
        and agree all their sizes in ONE collective (:func:`ciera.agreement.agree_sizes`). Every rank
        selects the same groups in the same order (the written flags follow the same optimizer
        steps everywhere). Returns the number of buckets prepared."""
        todo = [s for s in self.groups if s.process_group is process_group and s.writes.written and not s.prepared
                and not upstream.gather_in_flight(s.bucket_group) and s.launched is None]
        gathers = [g for s in todo for g in s.gathers]
        if gathers:
            try:
                type(gathers[0]).prepare_many(gathers, group=process_group)
            except BaseException:  # no gather stays proposed or agreed; the groups stay written
                _unwind(gathers, [])
                raise
        for s in todo:
            s.prepared = True
        return len(gathers)

    def request(self, state: "_GroupState", *, ahead: bool):
        """A gather request of ``state``'s bucket group (:func:`upstream.start_param_sync`): the
        handle to wait for its gathers, or ``None`` when nothing is due (no optimizer wrote the
        group since its last gather: its buffers already hold what a gather would deliver). A
        group started ahead by an earlier synchronous request gets that handle."""
        if state.launched is not None:
            handle, state.launched = state.launched, None
            return handle
        if not state.writes.written:
            return None
        return self.launch(state, ahead=ahead)

    def launch(self, state: "_GroupState", *, ahead: bool) -> "_GroupHandle":
        """Start ``state``'s gathers (preparing its process group first if needed) and return
        their handle. With ``ahead`` (a synchronous request), also start those of every other
        prepared synchronous group of the same process group, in install order, each keeping its
        handle for its own request: a group's decode then runs while the next groups' bytes are
        on the wire, instead of each group's transfer waiting for the previous decode. Every rank
        launches the same groups in the same order (the prepared flags are rank-identical), so
        the collectives match."""
        if not state.prepared:
            self.prepare(state.process_group)
        todo = [state]
        if ahead:
            todo += [s for s in self.groups if s is not state and s.process_group is state.process_group
                     and s.prepared and s.launched is None and not s.overlap]
        for i, s in enumerate(todo):
            # One collective per bucket, each with its own handle, where upstream coalesces a
            # group's all_gather_into_tensor calls (_coalescing_manager). The sizes are no reason:
            # prepare() agreed every payload size of the process group before this launch. Two
            # are: (1) inside a coalescing block torch returns a placeholder work per call and one
            # work for the block, so a bucket's decode (in its handle's wait()) could start only
            # after the group's last bucket arrived, losing the decode/transfer overlap across
            # buckets; CieraAllGather.start() would also have to hand over that shared work. (2)
            # there is little to coalesce: without fp8 buffers megatron-core puts one bucket in
            # each bucket group (partition_buckets), several only with disable_bucketing (one per
            # parameter dtype), and the synchronous groups of a process group already go out
            # back to back here.
            try:
                s.launched = _start_all(s.gathers)
            except BaseException:
                self._unwind_launch(done=todo[:i], failed=todo[i:])
                raise
            s.prepared = False
            if self.tracks_writes:  # (else every request gathers: the group stays marked)
                s.writes.sent()
        handle, state.launched = state.launched, None
        return handle

    @staticmethod
    def _unwind_launch(*, done, failed) -> None:
        """A ``start()`` of a group in ``failed`` raised (its own started gathers are waited
        already): wait the groups launched before it in the same request and drop the prepared,
        unlaunched ones back to idle, still written, so every gather is idle and the next request
        gathers them again (raw: ``invalidate()``)."""
        for s in failed:
            _unwind(s.gathers, [])
            s.prepared = False
            s.writes.mark()
        handles = []
        for s in done:
            handles.append(s.launched)
            s.launched = None
        _unwind([], handles)

    def finish_launched(self) -> int:
        """Wait for every group started ahead whose own request has not come (none, when upstream
        asks for every group in the optimizer step, as it does). Returns how many it waited."""
        pending = [s for s in self.groups if s.launched is not None]
        handles = []
        for s in pending:
            handles.append(s.launched)
            s.launched = None
        _wait_all(handles)  # every one, even after one raised
        return len(pending)

    def owners(self, param_data) -> list:
        """The states of the bucket groups with a bucket in the parameter buffer ``param_data``."""
        ptr = param_data.untyped_storage().data_ptr()
        return [s for s in self.groups if any(p.untyped_storage().data_ptr() == ptr for p in s.param_data)]


@dataclass
class _GroupState:
    """CIERA state of one bucket group."""

    name: str
    binding: _Binding
    bucket_group: object
    """megatron-core's bucket group (read and written only through :mod:`megatron.ciera.binding.upstream_patch`)."""
    process_group: object
    param_data: list
    """Each bucket's parameter buffer."""
    gathers: list
    overlap: bool
    """``ddp_config.overlap_param_gather``: the gathers are requested by the forward's pre-hooks."""
    writes: ShardWrites = field(default_factory=ShardWrites)
    """Some shard changed since this group's last gather. With optimizer tracking it starts
    clear: like upstream (no gather before the first step in synchronous mode), the buffers built
    from identically initialised parameters already agree; a load must call
    :func:`invalidate_param_caches`, which marks it."""
    prepared: bool = False
    """Encoded and sizes agreed for the next gather."""
    launched: object = None
    """The handle of this group's gathers when an earlier group's synchronous request started
    them ahead (:meth:`_Binding.launch`); this group's own request waits it."""


def _mark_written(states) -> None:
    for state in states:
        state.writes.mark()


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

    upstream.check_upstream()  # the version gate, before any collective
    log = log or logger.warning
    binding, fallbacks, measurements = _Binding(), {}, {}
    for chunk, ddp_model in enumerate(ddp_models):
        for name, bucket_group in upstream.bucket_groups(ddp_model):
            if upstream.is_attached(bucket_group):
                raise RuntimeError(f"CIERA already installed on bucket group {name}")
            reason = upstream.fallback_reason(bucket_group, optimizer_config)
            if reason is not None:
                fallbacks.setdefault(reason, []).append(name)
                continue
            prefix = name if chunk == 0 else f"chunk{chunk}.{name}"
            group, param_data = upstream.gather_targets(bucket_group)
            m = measurements.setdefault(group, Measurements())
            gathers = [make_gather(data, group=group, config=config, name=f"{prefix}.bucket{i}", measurements=m)
                       for i, data in enumerate(param_data)]
            state = _GroupState(prefix, binding, bucket_group, group, param_data, gathers,
                                overlap=bucket_group.ddp_config.overlap_param_gather)
            upstream.attach(bucket_group, state)
            binding.groups.append(state)
    if optimizer is not None and binding.groups:
        wrapped = upstream.wrap_optimizer_steps(optimizer, binding.owners, _mark_written)
        binding.tracks_writes, binding.wrapped_optimizers = wrapped is not None, wrapped or []
        for s in binding.groups:
            s.writes = ShardWrites(written=not binding.tracks_writes)
        if not binding.tracks_writes:
            log("CIERA all-gather: the optimizer exposes no parameter buffers; every start_param_sync gathers")
    if binding.groups and hasattr(binding.groups[0].gathers[0], "device_bytes"):
        log(device_bytes_line(binding.groups))
    if fallbacks:
        parts = "; ".join(f"{reason}: {', '.join(names)}" for reason, names in fallbacks.items())
        log(f"CIERA all-gather: {sum(map(len, fallbacks.values()))} bucket group(s) keep Megatron's "
            f"uncompressed all-gather ({parts})")
    return len(binding.groups)


def _installed(ddp_models) -> list[_GroupState]:
    return [upstream.state_of(bg) for ddp_model in ddp_models for _, bg in upstream.bucket_groups(ddp_model)
            if upstream.is_attached(bg)]


def finish_param_gathers(ddp_models: Iterable) -> int:
    """Wait for every gather started ahead and not yet waited (a synchronous request starts the
    next groups' gathers too; each group's own request waits its own). Call after the optimizer
    step: afterwards every parameter is gathered even if some group's request never came.
    Returns the number of bucket groups it had to wait for (0 with upstream's optimizers)."""
    bindings = {id(s.binding): s.binding for s in _installed(ddp_models)}
    return sum(b.finish_launched() for b in bindings.values())


def after_optimizer_step(ddp_models: Iterable, *, overlap_param_gather: bool) -> None:
    """The training loop's one call after ``optimizer.step()``: every synchronous gather started
    ahead is finished (:func:`finish_param_gathers`); with overlapped gathers the new shards are
    encoded now (:func:`prepare_param_gathers`), so the next forward's pre-hooks only launch."""
    finish_param_gathers(ddp_models)
    if overlap_param_gather:
        prepare_param_gathers(ddp_models)


def uninstall(ddp_models: Iterable) -> None:
    """Restore upstream's gather and optimizer steps (waits for the gathers in flight first)."""
    ddp_models = list(ddp_models)
    finish_param_gathers(ddp_models)
    states = _installed(ddp_models)
    for binding in {id(s.binding): s.binding for s in states}.values():
        upstream.unwrap_optimizer_steps(binding.wrapped_optimizers)
        binding.wrapped_optimizers = []
    for s in states:
        upstream.detach(s.bucket_group)


def invalidate_param_caches(ddp_models: Iterable) -> None:
    """Make the next gather of every bucket raw (and due). Call on every rank after anything but
    the optimizer step wrote parameter buffers: checkpoint load, broadcast_params, offload/reload."""
    ddp_models = list(ddp_models)
    finish_param_gathers(ddp_models)
    for s in _installed(ddp_models):
        s.writes.mark()
        s.prepared = False
        for gather in s.gathers:
            gather.invalidate()


def raise_pending_errors(ddp_models: Iterable) -> None:
    """Before a checkpoint: raise a corrupt payload that a device decode of any bucket found and has
    not reported yet (waits for the decodes in flight; the step's agreements report the rest)."""
    for s in _installed(list(ddp_models)):
        for gather in s.gathers:
            gather.raise_pending_errors(wait=True)


def prepare_param_gathers(ddp_models: Iterable) -> int:
    """The once-per-step size agreement: right after the optimizer step, encode every written
    bucket's shard (side CUDA stream on GPU) and agree the sizes of all buckets of each process
    group in ONE small collective per group. The gathers the next forward dispatches then only
    launch their collectives; nothing after this reads the host until the next step. Skips bucket
    groups whose gather is already dispatched. Returns the number of buckets prepared."""
    states = [s for s in _installed(ddp_models) if not upstream.gather_dispatched(s.bucket_group)]
    n, seen = 0, []
    for s in states:
        if not any(s.process_group is p for p in seen):
            seen.append(s.process_group)
            n += s.binding.prepare(s.process_group)
    return n


def device_bytes(ddp_models: Iterable) -> dict[str, int]:
    """Device bytes per rank that CIERA adds beside the parameter buffers of its bucket groups, by
    use (:meth:`ciera.CieraAllGather.device_bytes`: send, receive, state, index, total), and the
    buffers' own bytes (``model``)."""
    return _device_bytes(_installed(ddp_models))


def _device_bytes(states) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in states:
        for gather in s.gathers:
            for k, v in gather.device_bytes().items():
                out[k] = out.get(k, 0) + v
    out["model"] = sum(d.numel() * d.element_size() for s in states for d in s.param_data)
    return out


def device_bytes_line(states) -> str:
    """The start-up line: CIERA's device bytes per rank beside the model's parameter buffers."""
    b = _device_bytes(states)
    mib = 1 << 20
    # A receive buffer holds every rank's payload, each smaller than its shard (else the plan is
    # raw), plus 1/8 slack: at most 9/8 of the bucket.
    bound = sum(d.numel() * d.element_size() * 9 // 8 for s in states for d in s.param_data)
    parts = ", ".join(f"{k} {b.get(k, 0) / mib:.2f} MiB" for k in ("send", "receive", "state", "index"))
    return (f"CIERA device memory per rank: {b.get('total', 0) / mib:.2f} MiB ({b.get('total', 0)} bytes: {parts}) "
            f"beside {b['model'] / mib:.2f} MiB of parameter buffers; receive buffers grow at agreements "
            f"only, to at most {bound / mib:.2f} MiB; sender states at the first compressed gather")


def bucket_stats(ddp_models: Iterable) -> list[tuple[str, object]]:
    """``(bucket name, gather.stats)`` for every CIERA bucket gathered so far, in a fixed order."""
    return [(f"{s.name}.bucket{i}", gather.stats) for s in _installed(ddp_models) for i, gather in enumerate(s.gathers)]


def summary(ddp_models: Iterable) -> str:
    """The closing summary of a run: every bucket's counters (:func:`bucket_stats`) as a table."""
    from .report import bucket_table

    return bucket_table(bucket_stats(ddp_models), "CIERA summary (bytes received by rank 0):")


class DistributedOptimizerBinding(Binding):
    """:class:`~megatron.ciera.binding.protocol.Binding` of megatron-core's DDP and distributed
    optimizer: CIERA on the bucket groups (this module's functions)."""

    noun = "bucket group"

    def wrap(self, chunks: list, *, config, ddp_config) -> list:
        """megatron-core's ``DistributedDataParallel`` around each chunk, parameters broadcast.
        Only the first chunk buckets its gradients (as Megatron-LM: with several virtual stages
        the others communicate as one bucket each)."""
        from megatron.core.distributed import DistributedDataParallel

        model = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0)
                 for i, chunk in enumerate(chunks)]
        for chunk in model:
            chunk.broadcast_params()
        return model

    def install(self, model: list, *, config, optimizer_config=None, optimizer=None,
                log: Callable[[str], None] | None = None) -> int:
        """See :func:`install`."""
        return install(model, config, optimizer_config=optimizer_config, log=log, optimizer=optimizer)

    def after_optimizer_step(self, model: list, *, overlap_param_gather: bool) -> None:
        """See :func:`after_optimizer_step`."""
        after_optimizer_step(model, overlap_param_gather=overlap_param_gather)

    def raise_pending_errors(self, model: list) -> None:
        """See :func:`raise_pending_errors`."""
        raise_pending_errors(model)

    def invalidate_param_caches(self, model: list) -> None:
        """See :func:`invalidate_param_caches`."""
        invalidate_param_caches(model)

    def bucket_stats(self, model: list) -> list[tuple[str, object]]:
        """See :func:`bucket_stats`."""
        return bucket_stats(model)

    def summary(self, model: list) -> str:
        """See :func:`summary`."""
        return summary(model)
