"""Everything the Megatron-FSDP binding does to megatron-core's objects, gated by version.

The sibling of :mod:`megatron.ciera.binding.upstream_patch` (the distributed optimizer's), under the same
rule: every upstream method replaced, copied or relied on is listed in :data:`UPSTREAM_METHODS`
with what to re-check, and :data:`KNOWN_SOURCES` holds each one's source digest per checked
megatron-core version; :func:`attach` refuses any other source (:func:`check_upstream`).

* :func:`attach` shadows an ``AllGatherPipeline``'s ``async_bucket_gather`` (an instance attribute:
  ``all_gather_params`` and ``MegatronFSDP.start_param_sync`` both call ``self.async_bucket_gather``)
  with :func:`async_bucket_gather`, upstream's method with the binding's gather in place of
  ``all_gather_into_tensor``: the binding's one dispatch point.
* :func:`on_shard_written` wraps the ``ParamAndGradBuffer``'s ``copy_main_weights_to_model_weights``
  (where an optimizer step writes this rank's shards) so the binding learns every step.

The compressed gather starts where upstream's would (its collectives run at once: torch's
``_coalescing_manager``, inside which ``all_gather_params`` launches its buckets, would only record
them, so the group's recorded list is set aside meanwhile) and finishes (waits, decodes) in the
ready closure stored with the event, which ``wait_bucket_ready`` calls before the bucket is read:
``all_gather_params`` replaces the stored event with the manager's and keeps the closure.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Callable, Mapping

from megatron.ciera.binding.upstream_patch import UpstreamMethod, installed_digests, installed_version, upstream_changes

__all__ = ["UPSTREAM_METHODS", "KNOWN_SOURCES", "check_upstream", "attach", "is_attached", "async_bucket_gather",
           "on_shard_written"]

_STATE = "_ciera_megatron_fsdp"  # the attribute holding the binding's state of an attached pipeline
_PGB = "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer"
_MFSDP = "megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp"

UPSTREAM_METHODS: tuple[UpstreamMethod, ...] = (
    UpstreamMethod(_PGB, "AllGatherPipeline.async_bucket_gather",
                   "is copied by async_bucket_gather here: the same status, release and fetch_bucket steps, one "
                   "all_gather_into_tensor of wbuf.get_shard_from_local_buffer() into bucket.data, and the "
                   "(event, ready closure) pair in param_gather_event_map"),
    UpstreamMethod(_PGB, "AllGatherPipeline.all_gather_params",
                   "calls self.async_bucket_gather inside _coalescing_manager, keeps the ready closure when it "
                   "replaces the event, and waits through wait_bucket_ready"),
    UpstreamMethod(_PGB, "AllGatherPipeline.wait_bucket_ready",
                   "waits the stored event, then calls the stored ready closure, before the bucket is read"),
    UpstreamMethod(_PGB, "ParamAndGradBuffer.copy_main_weights_to_model_weights",
                   "is where an optimizer step writes this rank's shard of each model-weight buffer, and "
                   "writes nothing else of them"),
    UpstreamMethod(_MFSDP, "MegatronFSDP.start_param_sync",
                   "gathers every bucket through self.all_gather_pipeline.async_bucket_gather after the step"),
)
"""Every upstream method whose behaviour this module's patches depend on."""

KNOWN_SOURCES: Mapping[str, Mapping[str, str]] = MappingProxyType({
    "0.16.1": MappingProxyType({
        f"{_PGB}.AllGatherPipeline.async_bucket_gather": "c37b46c8735e2d18",
        f"{_PGB}.AllGatherPipeline.all_gather_params": "709437da748d1723",
        f"{_PGB}.AllGatherPipeline.wait_bucket_ready": "2afd99a980f8703d",
        f"{_PGB}.ParamAndGradBuffer.copy_main_weights_to_model_weights": "fec2599e31de2e7c",
        f"{_MFSDP}.MegatronFSDP.start_param_sync": "d1a3555f9374c14f",
    }),
    # 0.19: a fourth bucket status, PRESERVED (a persistent bucket's storage kept but not ready):
    # gathered like EMPTY (the skip is "COMMUNICATING or READY_TO_USE", as upstream's); the HSDP
    # outer gather and start_param_sync's fsdp_all_gather_in_start_param_sync do not touch the patch
    "0.19.2": MappingProxyType({
        f"{_PGB}.AllGatherPipeline.async_bucket_gather": "fb95c56b3783ae5d",
        f"{_PGB}.AllGatherPipeline.all_gather_params": "72eba46ec22e33ec",
        f"{_PGB}.AllGatherPipeline.wait_bucket_ready": "fcb181cac34800fd",
        f"{_PGB}.ParamAndGradBuffer.copy_main_weights_to_model_weights": "fec2599e31de2e7c",
        f"{_MFSDP}.MegatronFSDP.start_param_sync": "a20798802a427785",
    }),
})
"""megatron-core version -> {method name: source digest} for every version re-read against this module."""


def check_upstream(*, digests: Mapping[str, str] | None = None) -> None:
    """The version gate: raise ``RuntimeError`` naming every changed method."""
    changes = upstream_changes(methods=UPSTREAM_METHODS, known=KNOWN_SOURCES,
                               digests=installed_digests(UPSTREAM_METHODS) if digests is None else digests)
    if changes:
        raise RuntimeError(
            f"CIERA all-gather under Megatron-FSDP: megatron-core {installed_version()} changed methods the binding "
            "patches or relies on; re-check each, then record its digest in "
            "megatron.ciera.binding.upstream_patch.megatron_fsdp.KNOWN_SOURCES:\n  " + "\n  ".join(changes))


def attach(pipeline, gather: Callable) -> None:
    """Make ``pipeline``'s bucket gathers ``gather(bucket_id=, output=, input=, group=, persistent=, shard=)``'s:
    it starts a bit-exact ``all_gather_into_tensor`` and returns a handle whose ``wait()`` completes
    it (``persistent``: the bucket is the model-weight buffer itself, which keeps its values between
    gathers; ``shard()``: the bucket's shard as it is now, for encoding ahead of the gather). Runs the
    version gate first."""
    check_upstream()
    _coalesce_state()
    if is_attached(pipeline):
        raise RuntimeError("CIERA already installed on this Megatron-FSDP model")
    setattr(pipeline, _STATE, gather)
    pipeline.async_bucket_gather = async_bucket_gather.__get__(pipeline)


def is_attached(pipeline) -> bool:
    """Whether :func:`attach` made this pipeline's gathers the binding's."""
    return hasattr(pipeline, _STATE)


class _Pending:
    """The event stored with a bucket's ready closure, which waits for the gather itself."""

    def wait(self) -> None:
        """Nothing here: the ready closure waits (and decodes)."""


def _coalesce_state() -> dict:
    """torch's per-group lists of the collectives a ``_coalescing_manager`` recorded (private)."""
    from torch.distributed import distributed_c10d as c10d

    state = getattr(getattr(c10d, "_world", None), "pg_coalesce_state", None)
    if not isinstance(state, dict):
        raise RuntimeError("CIERA all-gather under Megatron-FSDP: this torch keeps no "
                           "distributed_c10d._world.pg_coalesce_state, which the binding sets aside to start its "
                           "gathers inside Megatron-FSDP's _coalescing_manager")
    return state


def _start_outside_coalescing(group, start: Callable):
    """``start()`` with ``group``'s collectives run at once even inside torch's
    ``_coalescing_manager`` (its recorded list is set aside and put back); returns what ``start``
    returned."""
    from torch.distributed import distributed_c10d as c10d

    state = _coalesce_state()
    key = group if group is not None else c10d._get_default_group()
    recorded = state.pop(key, None)
    try:
        return start()
    finally:
        if recorded is not None:
            state[key] = recorded


def async_bucket_gather(self, bucket_id, bwd) -> None:
    """Upstream ``AllGatherPipeline.async_bucket_gather`` with the binding's gather in place of
    ``all_gather_into_tensor``, finished by the bucket's ready closure (when the engine waits for it)."""
    import torch

    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import BucketStatus

    bucket_key = self.get_bucket_key(bucket_id, bwd)
    self.bucket_can_be_released[bucket_key] = False
    # (0.16 has no PRESERVED status: there this is "not EMPTY", its skip)
    if self.bucket_status[bucket_key] in (BucketStatus.COMMUNICATING, BucketStatus.READY_TO_USE):
        return
    self.bucket_status[bucket_key] = BucketStatus.COMMUNICATING
    wbuf = self.get_fsdp_buffer(bucket_id, bwd)
    self.recycle_unused_buckets()  # (upstream's lazy release)
    bucket = wbuf.fetch_bucket(set_param_data=True)
    gather = getattr(self, _STATE)
    group = wbuf.data_parallel_group

    @torch.no_grad()
    def start():
        return gather(bucket_id=bucket_id, output=bucket.data, input=wbuf.get_shard_from_local_buffer(),
                      group=group, persistent=not wbuf.is_data_distributed, shard=wbuf.get_shard_from_local_buffer)

    handle = _start_outside_coalescing(group, start)

    @torch.no_grad()
    def mark_bucket_ready_to_use():
        handle.wait()
        self.bucket_status[self.get_bucket_key(bucket_id, bwd)] = BucketStatus.READY_TO_USE

    self.param_gather_event_map[bucket_key] = (_Pending(), mark_bucket_ready_to_use)


def on_shard_written(buffer, callback: Callable[[], None]) -> None:
    """Call ``callback()`` after every ``copy_main_weights_to_model_weights`` of ``buffer`` (a
    ``ParamAndGradBuffer``): an optimizer step wrote this rank's shards."""
    original = buffer.copy_main_weights_to_model_weights

    def copy_main_weights_to_model_weights(*args, **kwargs):
        out = original(*args, **kwargs)
        callback()
        return out

    buffer.copy_main_weights_to_model_weights = copy_main_weights_to_model_weights
