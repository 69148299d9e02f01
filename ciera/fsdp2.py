"""CIERA for PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``): one call, plain PyTorch.

::

    from torch.distributed.fsdp import fully_shard
    import ciera.fsdp2

    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ciera_gathers = ciera.fsdp2.enable(model, optimizer=optimizer)   # before the first forward
    ...                                                                # train as before
    print(ciera_gathers.stats())                                       # bytes saved

Every FSDP unit of ``model`` gets its own :class:`ciera.zero3.Zero3Gather` through FSDP2's documented
hook ``FSDPModule.set_custom_all_gather``. With ``optimizer`` given, right after each optimizer step
every unit's shard is encoded and ONE agreement covers all units (:class:`ciera.zero3.Zero3Units`):
the step's gathers, forward and backward, every micro-batch, then launch with no host read and no
other collective (the later ones replay). Without it, every gather encodes and agrees. Training is
bit-identical to FSDP2's own gather.

To encode before FSDP2 hands a buffer, a unit's shard is assembled as FSDP2's copy-in will assemble
it (its parameters' all-gather inputs, concatenated: FSDP2's own ``_get_param_all_gather_inputs``);
each gather checks on the device that its input equals that copy (a difference raises at the next
step's agreement, on every rank).

Needs torch with ``FSDPModule.set_custom_all_gather`` (2.7 or later).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .config import CieraConfig
from .selection import Measurements
from .stats import GatherStats
from .memory import Budget, measure_budget
from .zero3 import Zero3Gather, Zero3Units

try:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather
except ImportError:  # pragma: no cover - torch without FSDP2's custom comm hook
    FSDPModule = AllGather = None


class CieraFsdpAllGather(AllGather if AllGather is not None else object):
    """FSDP2's ``AllGather`` comm interface over one :class:`Zero3Gather`."""

    def __init__(self, gather: Zero3Gather):
        self.gather = gather

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The buffer FSDP2 gathers into (``cache='values'``: the persistent cache itself)."""
        return self.gather.allocate(numel=math.prod(int(s) for s in size), dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, async_op: bool = False):
        """Launch the gather; with ``async_op`` return a work whose ``wait()`` (called by FSDP2 before
        it copies the parameters out) completes it, so the transfer overlaps FSDP2's compute."""
        handle = self.gather.start(output=output_tensor, input=input_tensor, group=group)
        if not async_op:
            handle.wait()
            return None
        return _HandleWork(handle)


class _HandleWork(dist.Work):
    """A :class:`torch.distributed.Work` over a :class:`ciera.zero3.Zero3Handle` (FSDP2 waits only
    on ``Work`` instances)."""

    def __init__(self, handle):
        super().__init__()
        self._handle = handle

    def wait(self, timeout=None) -> bool:
        self._handle.wait()
        return True

    def is_completed(self) -> bool:
        return self._handle.done


@dataclass
class Fsdp2Gathers:
    """What :func:`enable` installed: one :class:`Zero3Gather` per FSDP unit, by module name."""

    gathers: dict[str, Zero3Gather]
    """Unit name (``""`` for the root) -> its gather."""
    units: Zero3Units = field(default_factory=Zero3Units)
    """The units prepared together after each step (one agreement per step)."""
    _hooks: list = field(default_factory=list)

    def step(self) -> None:
        """Every unit's shard changed (the optimizer hook calls this; call it yourself after any
        other rank-wide update of the parameters when no optimizer was given to :func:`enable`):
        every unit that gathered before is encoded now, with one agreement for all of them."""
        self.units.step()

    def raise_pending_errors(self, *, wait: bool = True) -> None:
        """See :meth:`ciera.CieraAllGather.raise_pending_errors`, for every unit."""
        for g in self.gathers.values():
            g.raise_pending_errors(wait=wait)

    def invalidate(self) -> None:
        """After loading a checkpoint or any other write to the sharded parameters: the next gather
        of every unit is raw and refills the caches."""
        for g in self.gathers.values():
            g.invalidate()

    def stats(self) -> GatherStats:
        """The units' counters summed (``codec``: the last unit's)."""
        total = GatherStats(codec="raw")
        for g in self.gathers.values():
            s = g.stats
            for f in vars(total):
                if f != "codec":
                    setattr(total, f, getattr(total, f) + getattr(s, f))
            if s.compressed_gathers:
                total.codec = s.codec
        return total

    @property
    def cache_bytes(self) -> int:
        """Bytes this rank keeps between gathers, all units (known after the first forward)."""
        return sum(g.cache_bytes for g in self.gathers.values())

    def remove(self) -> None:
        """Detach the optimizer hook (the units keep CIERA's comm until re-sharded)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def enable(model: torch.nn.Module, *, config: CieraConfig | None = None, optimizer=None,
           group=None, budget: Budget | None = None, stepped: bool | None = None) -> Fsdp2Gathers:
    """Install CIERA's gather on every FSDP2 unit of ``model`` (after ``fully_shard``, before the
    first forward). ``optimizer``: a ``torch.optim.Optimizer`` whose ``step()`` updates the units'
    parameters on every rank; each unit then encodes once per step. ``group``: the process group
    FSDP2 shards over (default: taken from each call). ``budget``: with ``config.cache='auto'``, the
    caches' budget (default: ``config.cache_budget`` measured now, a collective over ``group``).
    ``stepped=True`` without ``optimizer``: the caller calls :meth:`Fsdp2Gathers.step` after every
    optimizer step itself, once the parameters hold the step's values (a wrapper that copies them
    in after the torch optimizer's ``step``, as Megatron's mixed-precision optimizer does). Returns
    the installed gathers."""
    if FSDPModule is None:
        raise RuntimeError("ciera.fsdp2 needs torch's FSDP2 custom all-gather hook "
                           "(torch.distributed.fsdp.FSDPModule.set_custom_all_gather, torch >= 2.7)")
    config = CieraConfig() if config is None else config
    measurements = Measurements()  # one link / codec measurement for every unit of the group
    if budget is None and config.cache == "auto":  # measured here, where every rank calls: the units share it
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        budget = measure_budget(spec=config.cache_budget, device=device, group=group)
    units = Zero3Units(budget=budget)
    gathers: dict[str, Zero3Gather] = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            gather = Zero3Gather(group=group, config=config, name=f"fsdp2:{name or 'root'}",
                                 stepped=optimizer is not None if stepped is None else stepped,
                                 measurements=measurements,
                                 source=_copy_in_source(module), units=units)
            module.set_custom_all_gather(CieraFsdpAllGather(gather))
            gathers[name] = gather
    if not gathers:
        raise ValueError("ciera.fsdp2.enable: no FSDP2 unit in the model: call fully_shard() on it first")
    out = Fsdp2Gathers(gathers, units)
    if optimizer is not None:
        out._hooks.append(optimizer.register_step_post_hook(lambda *_: out.step()))
    return out


def _copy_in_source(module):
    """``source(out)``: ``out`` becomes this rank's all-gather input of ``module`` as FSDP2's next
    copy-in will build it (its parameters' all-gather inputs, mixed-precision casts included,
    concatenated in order). ``None`` where this torch's FSDP2 does not expose them."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_param_all_gather_inputs
    except ImportError:  # pragma: no cover - a torch whose FSDP2 internals moved: every gather agrees
        return None

    def source(out: torch.Tensor) -> None:
        groups = module._get_fsdp_state()._fsdp_param_groups
        if len(groups) != 1:
            raise RuntimeError(f"ciera.fsdp2: a unit with {len(groups)} FSDP parameter groups (one expected)")
        inputs = [t.view(-1) for ts in _get_param_all_gather_inputs(groups[0].fsdp_params) for t in ts]
        torch.cat(inputs, out=out)

    return source
