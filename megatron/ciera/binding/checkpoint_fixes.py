"""megatron-core's checkpoint behaviours this repository works around, one workaround each.

Each one changes only what the upstream behaviour gets wrong, so checkpoints keep upstream's keys
and shapes and move between this repository and Megatron-LM. Each names the megatron-core
versions it was checked on, its gate (it acts only where the behaviour is present) and the
upstream change that retires it; :data:`UPSTREAM_METHODS` holds the upstream methods they replace
or rely on, with their source digests per checked version in :data:`KNOWN_SOURCES`, checked by
:mod:`megatron.ciera.binding.upstream_patch`'s gate (``upstream_changes(methods=UPSTREAM_METHODS,
known=KNOWN_SOURCES)``: ``tests/megatron/ciera/app/test_mc_checkpointing.py`` fails on a release that
changes one, naming it and what to re-check).

* :func:`bucket_padding_fix` (saving ``fully_reshardable`` optimizer state). Upstream packs the
  gathered world tensors bucket by bucket without each bucket's end padding, then slices every
  parameter out of them at its offset in the *padded* buffer: with more than one bucket per
  buffer every parameter past the first bucket is saved with another's weights and moments.
  Checked: 0.16.1, 0.19.2 (both affected). Gate: :func:`upstream_misplaces_padded_buckets` (the
  zero padding of a short slice that the affected versions have). Retired by NVIDIA/Megatron-LM#5077
  (merged 2026-05-31: offsets rebased on the unpadded tensors, a bound check in place of the
  padding): delete it once the oldest supported megatron-core contains that change.
* :func:`torch_adam_step_fix` (loading, with torch's Adam: megatron-core's fall-back without Apex
  or transformer-engine). ``DistributedOptimizer._set_main_param_and_optimizer_states`` copies
  every tensor of the per-parameter state from the checkpoint's tensors, ``step`` included, which
  those tensors lack (KeyError); and ``DistributedOptimizer.load_state_dict`` then gives every
  parameter one shared ``step`` tensor, which the foreach step increments once per parameter.
  Checked: 0.16.1, 0.19.2 (both affected). Gate: acts only on a state that holds ``step`` where
  the checkpoint's tensors do not (fused Adam keeps ``step`` per group). No upstream fix yet:
  retired when upstream copies only the keys a checkpoint provides and restores one ``step`` per
  parameter.
* :func:`fit_optimizer_layout` (loading at another expert-parallel size). megatron-core keeps the
  expert parameters in an optimizer of their own only at EP > 1, and
  ``ChainedOptimizer.load_state_dict`` wants one entry per chained optimizer (``KeyError:
  'optimizer'`` from EP 2 to EP 1, a count error from EP 1 to EP 2). Checked: 0.16.1, 0.19.2 (both
  affected). Gate: acts only when the checkpoint's structure differs from this run's. No upstream
  fix yet: retired when ``ChainedOptimizer.load_state_dict`` (or Megatron-LM's loader) regroups a
  fully reshardable optimizer state across expert-parallel sizes.
* :func:`fsdp_dtensor_every_param_state` (saving and loading ``--ckpt-format fsdp_dtensor``).
  Megatron-FSDP shards the flat buffer, so a parameter can lie wholly on other ranks; torch's
  optimizer then keeps no state for it on this rank (and megatron-core's dummy step before a load
  skips it too), so the ranks' ``fsdp_dtensor`` optimizer states hold different parameter names.
  Megatron-LM's state-dict rewriting (``handle_swiglu_in_state_dict``,
  ``preprocess_state_dict_for_uneven_dtensor``) runs collectives per entry, in the dict's order:
  with different names the ranks' collectives pair up wrongly (an invalid-chunk AssertionError, or
  a hang). Checked: 0.16.1. Gate: acts only on names missing from a rank's state. No upstream fix
  yet: retired when the fsdp_dtensor optimizer state lists every parameter on every rank.
"""

from __future__ import annotations

import contextlib
import inspect
from types import MappingProxyType
from typing import Mapping

import torch

from megatron.ciera.binding.upstream_patch import UpstreamMethod

__all__ = ["UPSTREAM_METHODS", "KNOWN_SOURCES", "sub_optimizers",
           "upstream_misplaces_padded_buckets", "in_buffer_layout", "bucket_padding_fix", "torch_adam_step_fix",
           "fit_optimizer_layout", "fsdp_dtensor_every_param_state"]

_DISTOPT = "megatron.core.optimizer.distrib_optimizer"
_OPTIMIZER = "megatron.core.optimizer.optimizer"

UPSTREAM_METHODS: tuple[UpstreamMethod, ...] = (
    UpstreamMethod(_DISTOPT, "DistributedOptimizer.get_parameter_state_dp_zero",
                   "returns, per buffer, world tensors param / exp_avg / exp_avg_sq packed bucket by bucket "
                   "without the end padding (bucket_padding_fix re-pads them in the buffer's layout)"),
    UpstreamMethod(_DISTOPT, "DistributedOptimizer.sharded_param_state_fully_reshardable",
                   "slices each parameter out of those world tensors at its padded-buffer offset and zero-pads "
                   "a short slice (missing_elems_num); once NVIDIA/Megatron-LM#5077 is in, delete bucket_padding_fix"),
    UpstreamMethod(_DISTOPT, "DistributedOptimizer._set_main_param_and_optimizer_states",
                   "copies every tensor of optimizer.state[main_param] (torch Adam's step too) from the "
                   "checkpoint's tensors, finding main_param by model_param_group_index_map (torch_adam_step_fix)"),
    UpstreamMethod(_DISTOPT, "DistributedOptimizer.load_state_dict",
                   "gives every parameter state one shared step tensor without Apex / TE (torch_adam_step_fix "
                   "clones it per parameter)"),
    UpstreamMethod(_OPTIMIZER, "ChainedOptimizer.load_state_dict",
                   "wants exactly one entry per chained optimizer (fit_optimizer_layout regroups a checkpoint "
                   "from another expert-parallel size)"),
)
"""Every upstream method the workarounds replace or rely on."""

KNOWN_SOURCES: Mapping[str, Mapping[str, str]] = MappingProxyType({
    "0.16.1": MappingProxyType({
        f"{_DISTOPT}.DistributedOptimizer.get_parameter_state_dp_zero": "3b4f7f3b98e8ff42",
        f"{_DISTOPT}.DistributedOptimizer.sharded_param_state_fully_reshardable": "66c64e0ab2334f0c",
        f"{_DISTOPT}.DistributedOptimizer._set_main_param_and_optimizer_states": "633ed69b862ba3fb",
        f"{_DISTOPT}.DistributedOptimizer.load_state_dict": "cb1b0f07d84262d9",
        f"{_OPTIMIZER}.ChainedOptimizer.load_state_dict": "f52de277fa3b75a4",
    }),
    "0.19.2": MappingProxyType({
        f"{_DISTOPT}.DistributedOptimizer.get_parameter_state_dp_zero": "7e9d3d5e79201f95",
        f"{_DISTOPT}.DistributedOptimizer.sharded_param_state_fully_reshardable": "66c64e0ab2334f0c",
        f"{_DISTOPT}.DistributedOptimizer._set_main_param_and_optimizer_states": "642ca7aea8e30770",
        f"{_DISTOPT}.DistributedOptimizer.load_state_dict": "571842f535bba334",
        f"{_OPTIMIZER}.ChainedOptimizer.load_state_dict": "f52de277fa3b75a4",
    }),
})
"""megatron-core version -> {:attr:`UpstreamMethod.name`: ``upstream_patch.source_digest``}, for
every version whose listed methods were re-read against these workarounds."""


def sub_optimizers(optimizer) -> list:
    """The distributed optimizers behind ``optimizer``: a ChainedOptimizer's (dense, then expert
    parameters), or the optimizer itself."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


@contextlib.contextmanager
def _instance_override(name: str, overrides: list):
    """Give each object of the ``(object, function)`` pairs its own attribute ``name`` for the
    duration of the block; afterwards the class's method shows through again, even on error."""
    for obj, fn in overrides:
        setattr(obj, name, fn)
    try:
        yield
    finally:
        for obj, _ in overrides:
            delattr(obj, name)


def upstream_misplaces_padded_buckets() -> bool:
    """The gate of :func:`bucket_padding_fix`: whether this megatron-core's ``fully_reshardable``
    optimizer state has the bucket-padding bug (0.16.1 and 0.19.2 have it; NVIDIA/Megatron-LM#5077
    fixes it): the gathered "world"
    tensors drop the padding at the end of each bucket, but each parameter is then sliced out of
    them at its index in the *padded* buffer. With more than one bucket per buffer (``--ddp-bucket-size``
    below the model size, as under ``--overlap-grad-reduce``) every parameter after the first
    bucket is saved with another parameter's main weights and moments, so a resume diverges. The
    buggy versions are recognised by their zero-padding workaround for a slice that runs short."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return "missing_elems_num" in inspect.getsource(DistributedOptimizer.sharded_param_state_fully_reshardable)


def in_buffer_layout(world: torch.Tensor, buffer) -> torch.Tensor:
    """``world`` (the buckets' unpadded elements back to back) laid out as ``buffer`` is: each
    bucket at its offset, the padding after it zero."""
    out = torch.zeros(buffer.numel, dtype=world.dtype, device=world.device)
    start = 0
    for bucket in buffer.buckets:
        out[bucket.offset:bucket.offset + bucket.numel_unpadded] = world[start:start + bucket.numel_unpadded]
        start += bucket.numel_unpadded
    return out


@contextlib.contextmanager
def bucket_padding_fix(optimizer):
    """While the optimizer's
    sharded state dict is built, its gathered world tensors come back in the buffer's own
    (padded) layout, so each parameter's slice is its own. The checkpoint holds the same keys and
    shapes as upstream's; only the values of the parameters past the first bucket change (they
    become right). Loading needs no change: its world tensors are empty placeholders. Acts only
    where :func:`upstream_misplaces_padded_buckets`."""
    overrides = []
    if upstream_misplaces_padded_buckets():
        for opt in sub_optimizers(optimizer):
            original = getattr(opt, "get_parameter_state_dp_zero", None)
            if original is None or not hasattr(opt, "buffers"):
                continue

            def dp_zero(*a, _opt=opt, _original=original, **k):
                state = _original(*a, **k)
                if state is None:
                    return None
                for gbuf_idx, buffer in enumerate(_opt.buffers):
                    for world in state[gbuf_idx].values():
                        for key in ("param", "exp_avg", "exp_avg_sq"):
                            if key in world:
                                world[key] = in_buffer_layout(world[key], buffer)
                return state

            overrides.append((opt, dp_zero))
    with _instance_override("get_parameter_state_dp_zero", overrides):
        yield


@contextlib.contextmanager
def torch_adam_step_fix(optimizer):
    """For a load with torch's Adam (megatron-core without Apex / TE): loading a ``fully_reshardable``
    state copies every key of torch Adam's per-parameter state from the checkpoint's tensors, but
    those tensors leave out ``step`` (restored separately, from the common part): KeyError. For the
    duration of the load, copy only the keys the checkpoint provides; anything else missing than
    ``step`` still fails. Afterwards every parameter gets its own ``step`` tensor: the load gives
    them all one shared tensor, which torch Adam's foreach path would then increment once per
    parameter per step (a wrong bias correction from the first step after the resume on)."""
    overrides = []
    for opt in sub_optimizers(optimizer):
        original = getattr(opt, "_set_main_param_and_optimizer_states", None)
        if original is None:
            continue

        def setter(model_param, tensors, _opt=opt, _original=original):
            group_index, group_order = _opt.model_param_group_index_map[model_param]
            main_param = _opt.optimizer.param_groups[group_index]["params"][group_order]
            state = _opt.optimizer.state.get(main_param, {})
            if "step" in state and "step" not in tensors:
                missing = set(state) - set(tensors) - {"step"}
                if missing:
                    raise KeyError(f"optimizer state {sorted(missing)} missing from the checkpoint")
                main_param.detach().copy_(tensors["param"])
                for key, value in state.items():
                    if key != "step":
                        value.copy_(tensors[key])
                return
            _original(model_param, tensors)

        overrides.append((opt, setter))
    with _instance_override("_set_main_param_and_optimizer_states", overrides):
        yield
    for opt in sub_optimizers(optimizer):
        for state in opt.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def _saved_optimizers(loaded: dict) -> list[dict]:
    """The per-optimizer common parts of a loaded optimizer state: one (a plain distributed
    optimizer) or one per chained optimizer (keys 0, 1, ...: dense, then expert parameters)."""
    if "optimizer" in loaded:
        return [loaded]
    return [loaded[k] for k in sorted(k for k in loaded if isinstance(k, int) and "optimizer" in loaded[k])]


def _matching_group(group: dict, saved_groups: list[dict]) -> dict:
    """The checkpoint's parameter group for this run's ``group``: the same identifier keys
    (weight-decay and LR multipliers, decoupled LR), and ``is_expert_parallel`` too where the
    checkpoint has such a group (at EP 1 the experts join the dense groups)."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys as keys

    def ident(g, with_ep):
        return tuple(g.get(k, g.get(f"pre_{k}")) for k in keys if with_ep or k != "is_expert_parallel")

    for with_ep in (True, False):
        found = [g for g in saved_groups if ident(g, with_ep) == ident(group, with_ep)]
        if found:
            return {**found[0], "is_expert_parallel": group.get("is_expert_parallel", False)}
    raise SystemExit(f"the checkpoint has no optimizer parameter group like this run's {ident(group, True)} "
                     f"({keys}); pass --no-load-optim to start with a fresh optimizer")


def fit_optimizer_layout(loaded: dict, optimizer) -> dict:
    """The loaded optimizer state in the structure of this run's optimizer.

    megatron-core keeps the expert parameters in an optimizer of their own only at EP > 1 (at EP 1
    they are ordinary data-parallel parameters): a checkpoint written at another EP size holds
    the optimizers' common part (parameter groups, step) for another number of chained
    optimizers, while the ``fully_reshardable`` tensors, keyed by model parameter, already land
    where this run's request put them. Megatron-LM's loader passes that mismatch on to
    ``ChainedOptimizer.load_state_dict`` (``KeyError: 'optimizer'`` from EP 2 to EP 1, a count
    error from EP 1 to EP 2); here each of this run's optimizers gets the checkpoint's groups
    that match its own. A structure that already matches is returned as is."""
    subs = sub_optimizers(optimizer)
    saved = _saved_optimizers(loaded)
    single = len(subs) == 1
    if (single and "optimizer" in loaded) or (not single and len(saved) == len(subs) and "optimizer" not in loaded):
        return loaded
    kinds = {s.get("param_state_sharding_type") for s in saved}
    if not kinds <= {"fully_reshardable", "fully_sharded_model_space"}:
        raise SystemExit(f"the checkpoint's optimizer ({len(saved)} chained, sharding {sorted(map(str, kinds))}) "
                         f"cannot load into this run's {len(subs)} optimizers: only a fully reshardable optimizer "
                         "state changes its expert-parallel size (save it with this repo, or pass --no-load-optim)")
    saved_groups = [g for s in saved for g in s["optimizer"]["param_groups"]]
    out = {}
    for i, sub in enumerate(subs):
        part = {k: v for k, v in saved[0].items() if isinstance(k, str) and k not in ("optimizer", "param_state")}
        part["optimizer"] = {k: v for k, v in saved[0]["optimizer"].items() if k != "param_groups"}
        part["optimizer"]["param_groups"] = [_matching_group(g, saved_groups) for g in sub.optimizer.param_groups]
        tensors = loaded if single else loaded.get(i, {})
        if "param_state" in tensors:
            part["param_state"] = tensors["param_state"]
        out[i] = part
    return out[0] if single else out


def fsdp_dtensor_every_param_state(optimizer, state: dict) -> dict:
    """``state`` (the optimizer's ``fsdp_dtensor`` sharded state dict: one optimizer's, or a
    chained optimizer's ``{index: ...}``) with every sub-optimizer's ``state`` listing every
    parameter, in parameter-group order (the same on every rank). A parameter this rank keeps no
    state for (its shard is empty here) gets a placeholder: the entry of another parameter with
    each DTensor replaced by an empty one shaped as this parameter (its local shard, empty), other
    values (``step``: the same for every parameter) as they are. Placeholders write nothing and read
    nothing; the live optimizer is not changed (a shallow copy)."""
    from torch.distributed.tensor import DTensor

    subs = sub_optimizers(optimizer)
    parts = [state] if len(subs) == 1 else [state[i] for i in range(len(subs))]
    fixed = []
    for opt, part in zip(subs, parts):
        own = part["state"]
        template = next((v for v in own.values() if isinstance(v, dict)), None)
        params = [p for g in opt.optimizer.param_groups for p in g["params"]]
        names = [opt._param_name(p) for p in params]
        if template is None:  # (no state at all: nothing to copy the shape of an entry from)
            fixed.append(part)
            continue
        entries = {}
        for param, name in zip(params, names):
            entries[name] = own.get(name) or {
                k: (torch.zeros_like(param) if isinstance(v, DTensor) else v) for k, v in template.items()}
        entries.update((k, v) for k, v in own.items() if k not in entries)
        fixed.append({**part, "state": entries})
    return fixed[0] if len(subs) == 1 else {**state, **dict(enumerate(fixed))}
