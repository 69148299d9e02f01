"""Everything the gather bindings do to megatron-core's objects, in one place, gated by version.

This module patches the distributed optimizer's bucket groups; :mod:`.megatron_fsdp` patches
Megatron-FSDP's gather pipeline, with its own list of upstream methods checked by the same gate
(:func:`upstream_changes`). (The CPU-only shims are :mod:`megatron.ciera.binding.cpu_compat`'s; the checkpoint
workarounds carry their own gates.) :mod:`megatron.ciera.binding.bucket_group` schedules the gathers on its
own state and reaches megatron-core only through the functions here:

* :func:`attach` shadows a bucket group's ``start_param_sync`` with :func:`start_param_sync` (an
  instance attribute, so ``finish_param_sync``, the prefetch chain and
  ``DistributedDataParallel.start_param_sync`` all reach it: the binding's one dispatch point) and
  keeps CIERA's state of the group on it (:func:`state_of`); :func:`detach` undoes both.
* :func:`start_param_sync` is upstream's distributed-optimizer branch of
  ``_ParamAndGradBucketGroup.start_param_sync`` (its ``force_sync`` logic copied) with the
  binding's gathers in place of ``all_gather_into_tensor``.
* :func:`wrap_optimizer_steps` wraps each distributed optimizer's ``step_with_ready_grads`` so the
  binding learns which bucket groups a step wrote; :func:`unwrap_optimizer_steps` undoes it.
* :func:`fallback_reason` and :func:`upstream_post_sync` isolate the version differences (0.16.x
  vs 0.19.x) of the fields and methods read; :func:`define_missing_te_names` binds a name that
  0.16.1's MoE router reads but defines only with transformer-engine.

Version gate: every upstream method the above replaces, copies or relies on is listed in
:data:`UPSTREAM_METHODS` with what to re-check when it changes; :data:`KNOWN_SOURCES` holds the
digest of each one's code (:func:`source_digest`: docstrings and comments do not count) in every
megatron-core version it was checked against.
:func:`check_upstream` (run by :func:`attach`) refuses an installed megatron-core whose sources
match none of them, naming each changed method; ``tests/megatron/ciera/binding/test_mc_upstream_patch.py`` fails
on such a version with the same names and the digests to record once the re-check is done.
"""

from __future__ import annotations

import functools
import ast
import hashlib
import importlib
import inspect
import textwrap
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Iterable, Mapping

import torch

__all__ = ["UpstreamMethod", "UPSTREAM_METHODS", "KNOWN_SOURCES", "installed_version", "source_digest",
           "installed_digests", "upstream_changes", "check_upstream", "attach", "detach", "state_of",
           "is_attached", "start_param_sync", "gather_in_flight", "finish_in_flight", "gather_dispatched",
           "wrap_optimizer_steps", "unwrap_optimizer_steps", "fallback_reason", "upstream_post_sync",
           "bucket_groups", "define_missing_te_names"]

_GATHER_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_STATE = "_ciera"  # the attribute holding CIERA's state of an attached bucket group


# ---------------------------------------------------------------------------------------------
# The version gate
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class UpstreamMethod:
    """One megatron-core method this module replaces, copies or relies on."""

    module: str
    """The module that defines it, e.g. ``megatron.core.distributed.param_and_grad_buffer``."""

    qualname: str
    """Its qualified name in ``module``, e.g. ``_ParamAndGradBucketGroup.start_param_sync``."""

    recheck: str
    """What to re-read in the new source before recording its digest in :data:`KNOWN_SOURCES`."""

    @property
    def name(self) -> str:
        """``module.qualname``: the key of :data:`KNOWN_SOURCES`' tables."""
        return f"{self.module}.{self.qualname}"


_BUFFER = "megatron.core.distributed.param_and_grad_buffer"
_OPTIMIZER = "megatron.core.optimizer.optimizer"
_DISTOPT = "megatron.core.optimizer.distrib_optimizer"
_DDP = "megatron.core.distributed.distributed_data_parallel"
_MOE = "megatron.core.transformer.moe.moe_utils"

UPSTREAM_METHODS: tuple[UpstreamMethod, ...] = (
    UpstreamMethod(_BUFFER, "_ParamAndGradBucketGroup.start_param_sync",
                   "replaced by start_param_sync here, whose force_sync branch is a copy: the same asserts, "
                   "handle and param_gather_dispatched bookkeeping, and post-gather step (upstream_post_sync)"),
    UpstreamMethod(_BUFFER, "_ParamAndGradBucketGroup.finish_param_sync",
                   "still dispatches through self.start_param_sync (so the instance attribute is reached), "
                   "needs only .wait() of param_gather_handle, and prefetches next_param_gather_bucket_group"),
    UpstreamMethod(_DDP, "DistributedDataParallel.start_param_sync",
                   "calls start_param_sync(force_sync=...) of every dense and expert bucket group"),
    UpstreamMethod(_DDP, "DistributedDataParallel._start_bucket_group_param_sync",
                   "(0.19.x; missing before) calls the bucket group's start_param_sync, then _post_param_sync "
                   "only without overlap_param_gather"),
    UpstreamMethod(_OPTIMIZER, "MixedPrecisionOptimizer.step_with_ready_grads",
                   "is where the parameter shards are written (_copy_main_params_to_model_params)"),
    UpstreamMethod(_DISTOPT, "DistributedOptimizer.step_with_ready_grads",
                   "writes the shards (super().step_with_ready_grads()) before it asks for the synchronous "
                   "gathers, and asks through model_chunk.start_param_sync"),
    UpstreamMethod(_DISTOPT, "DistributedOptimizer._copy_main_params_to_model_params",
                   "writes only this rank's shard of each bucket's param_data (the gathers' invariant)"),
    UpstreamMethod(_DISTOPT, "DistributedOptimizer.start_param_sync_for_bucket_group_subset",
                   "(0.19.x; missing before) asks every bucket group the optimizer owns for its gather "
                   "(through DistributedDataParallel._start_bucket_group_param_sync)"),
    UpstreamMethod(_OPTIMIZER, "ChainedOptimizer.step_with_ready_grads",
                   "steps every chained optimizer through its own step_with_ready_grads (the wrapped one)"),
    UpstreamMethod(_OPTIMIZER, "ChainedOptimizer._step",
                   "(0.19.x; missing before) steps every chained optimizer through its own "
                   "step_with_ready_grads (the wrapped one)"),
    UpstreamMethod(_MOE, "RouterGatingLinearFunction.forward",
                   "still tests the module name te_general_gemm for None (define_missing_te_names binds it)"),
)
"""Every upstream method whose behaviour this module's patches depend on."""

KNOWN_SOURCES: Mapping[str, Mapping[str, str]] = MappingProxyType({
    "0.16.1": MappingProxyType({
        f"{_BUFFER}._ParamAndGradBucketGroup.start_param_sync": "92200a286ec25995",
        f"{_BUFFER}._ParamAndGradBucketGroup.finish_param_sync": "2aa5601608f34109",
        f"{_DDP}.DistributedDataParallel.start_param_sync": "77f94a168d08aba7",
        f"{_DDP}.DistributedDataParallel._start_bucket_group_param_sync": "missing",
        f"{_OPTIMIZER}.MixedPrecisionOptimizer.step_with_ready_grads": "2939ab43b58a7913",
        f"{_DISTOPT}.DistributedOptimizer.step_with_ready_grads": "a44c80bb2db58a74",
        f"{_DISTOPT}.DistributedOptimizer._copy_main_params_to_model_params": "282e6030b3ef40d0",
        f"{_DISTOPT}.DistributedOptimizer.start_param_sync_for_bucket_group_subset": "missing",
        f"{_OPTIMIZER}.ChainedOptimizer.step_with_ready_grads": "2d4ed42493dbf54b",
        f"{_OPTIMIZER}.ChainedOptimizer._step": "missing",
        f"{_MOE}.RouterGatingLinearFunction.forward": "9223b03b8e94f8a4",
    }),
    "0.19.2": MappingProxyType({
        f"{_BUFFER}._ParamAndGradBucketGroup.start_param_sync": "b3aeb0e50f5cb991",
        f"{_BUFFER}._ParamAndGradBucketGroup.finish_param_sync": "5d23e54265b4572e",
        f"{_DDP}.DistributedDataParallel.start_param_sync": "6b543cd826c784ad",
        f"{_DDP}.DistributedDataParallel._start_bucket_group_param_sync": "a927a4fa0e72a3d2",
        f"{_OPTIMIZER}.MixedPrecisionOptimizer.step_with_ready_grads": "ecbe8414ce738d32",
        f"{_DISTOPT}.DistributedOptimizer.step_with_ready_grads": "dd03993b3968d754",
        f"{_DISTOPT}.DistributedOptimizer._copy_main_params_to_model_params": "ed5522a255264f86",
        f"{_DISTOPT}.DistributedOptimizer.start_param_sync_for_bucket_group_subset": "e6774860e361adba",
        f"{_OPTIMIZER}.ChainedOptimizer.step_with_ready_grads": "a9c86c50235fb5d7",
        f"{_OPTIMIZER}.ChainedOptimizer._step": "df9cfcd4e00a8764",
        f"{_MOE}.RouterGatingLinearFunction.forward": "9223b03b8e94f8a4",
    }),
})
"""megatron-core version -> {:attr:`UpstreamMethod.name`: :func:`source_digest`, or ``missing``
where that version has no such method}, for every version whose listed methods were re-read
against this module. Add a version only after that re-reading; the test prints its digests."""


def installed_version() -> str:
    """The installed megatron-core's version string."""
    from importlib.metadata import version

    return version("megatron-core")


def source_digest(source: str) -> str:
    """First 16 hex digits of the SHA-256 of ``source``'s code (a method's source, dedented): its
    syntax tree without docstrings, written back as source, so comments, docstrings and formatting
    do not count (a patch release that edits only those passes the gate) while any change to the
    code does."""
    tree = ast.parse(textwrap.dedent(source))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.unparse(tree).encode()).hexdigest()[:16]  # (unparse: the same on every Python)


def _installed_source(method: UpstreamMethod) -> str:
    obj = importlib.import_module(method.module)
    for part in method.qualname.split("."):
        obj = getattr(obj, part)
    return inspect.getsource(obj)


@functools.cache
def installed_digests(methods: tuple[UpstreamMethod, ...] = UPSTREAM_METHODS) -> Mapping[str, str]:
    """:func:`source_digest` of each of ``methods`` as installed (a method the installed
    megatron-core lacks reads as ``missing``)."""
    out = {}
    for method in methods:
        try:
            out[method.name] = source_digest(_installed_source(method))
        except (ImportError, AttributeError, OSError, TypeError):
            out[method.name] = "missing"
    return MappingProxyType(out)


def upstream_changes(*, methods: tuple[UpstreamMethod, ...] = UPSTREAM_METHODS,
                     known: Mapping[str, Mapping[str, str]] = KNOWN_SOURCES,
                     digests: Mapping[str, str] | None = None) -> list[str]:
    """One line per method of ``methods`` whose source (``digests``, default: the installed one)
    matches that method in none of the ``known`` versions, saying what to re-check. Empty: every
    method is one that was checked. Any other patch of megatron-core passes its own ``methods``
    and ``known`` table."""
    digests = installed_digests(methods) if digests is None else digests
    lines = []
    for method in methods:
        seen = [v for v, table in known.items() if table.get(method.name) == digests.get(method.name)]
        if not seen:
            lines.append(f"{method.name} (digest {digests.get(method.name)}) matches no checked version "
                         f"({', '.join(known)}): re-check that it {method.recheck}")
    return lines


def check_upstream(*, digests: Mapping[str, str] | None = None,
                   known: Mapping[str, Mapping[str, str]] = KNOWN_SOURCES) -> None:
    """The version gate: raise ``RuntimeError`` naming every changed method (:func:`upstream_changes`)."""
    changes = upstream_changes(known=known, digests=digests)
    if changes:
        raise RuntimeError(
            f"CIERA all-gather: megatron-core {installed_version()} changed methods the binding patches or "
            "relies on; re-check each, then record its digest in megatron.ciera.binding.upstream_patch.KNOWN_SOURCES "
            "(tests/megatron/ciera/binding/test_mc_upstream_patch.py prints them):\n  " + "\n  ".join(changes))


# ---------------------------------------------------------------------------------------------
# The dispatch point
# ---------------------------------------------------------------------------------------------
def attach(bucket_group, state) -> None:
    """Make ``bucket_group``'s gathers CIERA's: store ``state`` (an object with ``binding``, whose
    ``request(state, ahead=...)`` returns the handle of the group's gathers or ``None`` when
    nothing is due) and shadow ``start_param_sync`` with :func:`start_param_sync`. Runs the
    version gate (:func:`check_upstream`) first."""
    check_upstream()
    if is_attached(bucket_group):
        raise RuntimeError(f"CIERA already installed on bucket group {state.name}")
    setattr(bucket_group, _STATE, state)
    # An instance attribute shadows the class method: finish_param_sync, the prefetch chain and
    # DistributedDataParallel.start_param_sync all call self.start_param_sync and reach this.
    bucket_group.start_param_sync = start_param_sync.__get__(bucket_group)


def detach(bucket_group) -> None:
    """Restore upstream's ``start_param_sync`` (waits for a gather in flight first) and drop the state."""
    finish_in_flight(bucket_group)
    del bucket_group.start_param_sync
    delattr(bucket_group, _STATE)


def is_attached(bucket_group) -> bool:
    """Whether :func:`attach` made this bucket group's gathers CIERA's."""
    return hasattr(bucket_group, _STATE)


def state_of(bucket_group):
    """The state :func:`attach` stored on ``bucket_group``."""
    return getattr(bucket_group, _STATE)


def start_param_sync(bucket_group, force_sync: bool = False):
    """Upstream ``start_param_sync``'s distributed-optimizer branch, with CIERA gathers.

    A group no optimizer wrote since its last gather is not gathered again: its buffers already
    hold what a gather would deliver (megatron-core's chained optimizers call this for every group
    once per optimizer); the binding decides that (``request`` returns ``None``)."""
    state = state_of(bucket_group)
    post_sync = upstream_post_sync(bucket_group)
    overlap = bucket_group.ddp_config.overlap_param_gather
    # Copied from upstream: a forced sync finishes the gather in flight, if any, and stops there.
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

    handle = state.binding.request(state, ahead=not overlap)
    if handle is not None and overlap and not force_sync:
        bucket_group.param_gather_handle = handle
    else:
        if handle is not None:
            handle.wait()
        bucket_group.param_gather_handle = None
    if force_sync and overlap and post_sync is not None:
        post_sync()
    bucket_group.param_gather_dispatched = True


def gather_in_flight(bucket_group) -> bool:
    """Whether an asynchronous gather of ``bucket_group`` is started and not yet waited."""
    return bucket_group.param_gather_handle is not None


def finish_in_flight(bucket_group) -> None:
    """Wait for ``bucket_group``'s asynchronous gather in flight, if any."""
    if bucket_group.param_gather_handle is not None:
        bucket_group.param_gather_handle.wait()
        bucket_group.param_gather_handle = None


def gather_dispatched(bucket_group) -> bool:
    """Whether this iteration's gather of ``bucket_group`` was dispatched (upstream resets the flag
    in ``finish_grad_sync``)."""
    return bucket_group.param_gather_dispatched


def bucket_groups(ddp_model) -> list[tuple[str, object]]:
    """``(name, bucket group)`` of a DDP module: ``dense<i>`` then ``expert<i>``, in upstream's order."""
    named = [(f"dense{i}", bg) for i, bg in enumerate(ddp_model.bucket_groups)]
    named += [(f"expert{i}", bg) for i, bg in enumerate(getattr(ddp_model, "expert_parallel_bucket_groups", []))]
    return named


def gather_targets(bucket_group) -> tuple[object, list[torch.Tensor]]:
    """``(process group, [param_data of each bucket])``: what upstream's gather of the group moves."""
    return bucket_group.intra_distributed_optimizer_instance_group, [b.param_data for b in bucket_group.buckets]


# ---------------------------------------------------------------------------------------------
# The optimizer step
# ---------------------------------------------------------------------------------------------
def wrap_optimizer_steps(optimizer, owners: Callable[[torch.Tensor], list], on_step: Callable[[list], None]):
    """Wrap each distributed optimizer's ``step_with_ready_grads`` (on the instance) so that it
    calls ``on_step(owned)`` before it steps (and, in synchronous mode, gathers): ``owned`` is the
    concatenation of ``owners(param_data)`` over the optimizer's parameter buffers. Returns the
    wrapped optimizers (for :func:`unwrap_optimizer_steps`), or ``None`` when ``optimizer``
    exposes no parameter buffers to map (nothing is wrapped then)."""
    optimizers = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    todo = []
    for opt in optimizers:
        buffers = getattr(opt, "buffers", None)
        if buffers is None or not hasattr(opt, "step_with_ready_grads"):
            if getattr(opt, "is_stub_optimizer", False):
                continue
            return None
        todo.append((opt, [o for buf in buffers for o in owners(buf.param_data)]))
    if not any(owned for _, owned in todo):
        return None
    for opt, owned in todo:
        original = opt.step_with_ready_grads

        def step_with_ready_grads(*a, _original=original, _owned=tuple(owned), **k):
            on_step(_owned)
            return _original(*a, **k)

        step_with_ready_grads.ciera_wrapped = original
        opt.step_with_ready_grads = step_with_ready_grads
    return [opt for opt, _ in todo]


def unwrap_optimizer_steps(optimizers: Iterable) -> None:
    """Undo :func:`wrap_optimizer_steps` on the optimizers it returned."""
    for opt in optimizers:
        original = getattr(opt.step_with_ready_grads, "ciera_wrapped", None)
        if original is None:
            continue
        from_class = getattr(type(opt), "step_with_ready_grads", None)
        if getattr(original, "__self__", None) is opt and getattr(original, "__func__", None) is from_class:
            del opt.step_with_ready_grads  # the class method shows through again
        else:
            opt.step_with_ready_grads = original


# ---------------------------------------------------------------------------------------------
# Version differences
# ---------------------------------------------------------------------------------------------
def upstream_post_sync(bucket_group) -> Callable[[], None] | None:
    """The post-gather step upstream's ``start_param_sync`` runs itself.

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


def define_missing_te_names() -> None:
    """megatron-core 0.16.1 without transformer-engine: the MoE router tests ``te_general_gemm is
    not None`` but the name is only bound when TE imports (NameError). Bind it to None, which is
    what the check means. No-op with TE installed or on versions that define the name."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
