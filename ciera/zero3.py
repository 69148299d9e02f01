"""CIERA where the gathered buffer does not persist: ZeRO-3 (FSDP2, Megatron-FSDP's ZeRO-3).

Under ZeRO-3 only the shard persists. Each gather gets a buffer from the engine, the engine copies
the unsharded parameters out of it and frees it; the same shard is gathered again in the backward
(and once more per micro-batch). :class:`Zero3Gather` keeps what CIERA needs across those freed
buffers and encodes each shard **once per optimizer step**:

* **Receiver cache** (``CieraConfig.cache``): ``exponents`` keeps one byte per value of every
  rank's shard (the paper's design); the payloads are ``exponent_reuse``'s, whose decode reads
  nothing of a target but its exponents, so each gather's fresh buffer is seeded with the cached
  exponents and decoded in place. ``values`` keeps the gathered values (the engine is handed the
  same persistent buffer every time, :meth:`Zero3Gather.allocate`): any codec, ``delta``
  included. ``two_level`` keeps ``values`` of the shards of this rank's local index on every node
  (``1/L`` of them) and gathers the rest raw within the node (:mod:`ciera.two_level`). ``none``
  keeps nothing: every gather is plain.
* **Once per step**: after :meth:`Zero3Gather.step` (the optimizer changed the shard) the next
  gather is *fresh*: encoded and agreed as in :class:`ciera.CieraAllGather`. Every later gather of
  the step is a *replay*: nothing is encoded; every rank says its shard is unchanged, with the
  count of values that changed after all computed on the device against a copy of what it sent
  (expected 0). When all ranks replay, ``exponents`` sends the same payloads again (decoding them a
  second time gives the same values) and ``values`` sends nothing: the cache already holds the
  step's values. A rank whose shard did change is treated as failed: the gather is raw
  everywhere, never stale.

Without :meth:`Zero3Gather.step` calls (``stepped=False``) every gather is fresh: still exact,
encoded at every gather.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Callable

import torch
import torch.distributed as dist

from .changes import ShardWrites
from .codecs.formats import FORMATS, as_bits, float_format
from .codecs.registry import needs_values_cache
from .comm import all_gather_into
from .config import CieraConfig
from .cost_model import StepShape
from .errors import CieraVerifyError
from .gather import CieraAllGather, Phase, _DoneHandle
from .memory import Budget, choose_cache, measure_budget
from .selection import Measurements
from .stats import GatherStats
from .two_level import NodeGroups, NodeLayout, TwoLevel, group_layout, node_size, split_group

logger = logging.getLogger(__name__)


class Zero3Gather:
    """Compressed, bit-exact ZeRO-3 all-gather of one parameter group (one FSDP unit).

    Args:
        group: the process group the engine gathers over (checked at every call).
        config: a :class:`CieraConfig`, equal on every rank; ``config.cache`` picks the receiver
            cache. ``cache='exponents'`` needs ``codec`` ``exponent_reuse`` or ``auto`` (which then
            chooses between raw and ``exponent_reuse`` only).
        name: for logs and errors.
        stepped: ``True`` when the caller calls :meth:`step` after every optimizer step (on every
            rank): later gathers of a step replay. ``False``: every gather encodes.
        measurements: shared link and codec measurements of the group (see :class:`CieraAllGather`).
        source: ``source(out)`` writes this rank's current shard into ``out`` (the values the next
            gather's input will hold: for FSDP2 its copy-in, for Megatron-FSDP the persistent shard).
            With it, a :class:`Zero3Units` prepares the unit right after the optimizer step, together
            with every other unit of its group (one agreement); without it the step's first gather
            prepares (one agreement per unit and step).
        units: the :class:`Zero3Units` this unit belongs to (it registers at its first gather).

    Call :meth:`gather` with the engine's output buffer (``world x n`` values, from
    :meth:`allocate`) and this rank's shard, its own slot of the output or a separate tensor. The
    first call builds the inner gather, a collective over ``group``.
    """

    def __init__(self, *, group=None, config: CieraConfig | None = None, name: str = "zero3",
                 stepped: bool = True, measurements: Measurements | None = None,
                 source: Callable[[torch.Tensor], None] | None = None, units: "Zero3Units | None" = None):
        self.config = CieraConfig() if config is None else config
        if self.config.cache == "exponents" and needs_values_cache(self.config.codec):
            raise ValueError(f"{name}: codec={self.config.codec!r} adds to the previous values, so it needs cache='values'; "
                             f"cache='exponents' keeps one byte per value, which only exponent_reuse decodes against")
        self.cache: str | None = None if self.config.cache == "auto" else self.config.cache
        """The receiver cache in use (``config.cache``; with ``auto`` chosen at the first gather)."""
        self.group, self.name, self.stepped = group, name, stepped
        self._measurements, self._source, self._units = measurements, source, units
        self._inner: CieraAllGather | None = None
        self._two: TwoLevel | None = None  # cache='two_level': the gather across nodes and within
        self._handle: Zero3Handle | None = None
        self._values: torch.Tensor | None = None  # cache='values': the persistent gathered buffer
        self._exps: torch.Tensor | None = None  # cache='exponents': [world, n] uint8
        self._sent: torch.Tensor | None = None  # this rank's shard as last sent fresh (or staged to be)
        self._exps_valid = False  # the exponent cache holds the last gathered buffer's exponents
        self.writes = ShardWrites()
        """Marked by :meth:`step` and :meth:`invalidate`: the next gather encodes (or was prepared
        ahead: the inner is AGREED)."""
        self._plain = GatherStats(codec="raw")  # gathers that never reach the inner gather
        self.gathers_this_step = 0
        """Gathers since the last :meth:`step` (the count a step needs: 1, or 2 x micro-batches)."""
        self._fresh_gathers = 0  # this unit's own gather's counters (two_level: stage 1's instead)
        self._gather_prepares = 0

    @property
    def fresh_gathers(self) -> int:
        """Gathers that encoded (at most one per step when ``stepped``; ``two_level``: its stage
        across nodes, the one that encodes)."""
        return self._two.stage1.fresh_gathers if self._two is not None else self._fresh_gathers

    @property
    def gather_prepares(self) -> int:
        """Gathers that prepared (encoded and agreed) themselves: a unit's first gather, the first after
        :meth:`invalidate`, every fresh one of a unit without ``source`` (the others were prepared by
        :meth:`Zero3Units.step`, or replay); ``two_level``: its stage across nodes'."""
        return self._two.stage1.gather_prepares if self._two is not None else self._gather_prepares

    # -- the engine's side -----------------------------------------------------------------------
    def allocate(self, *, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The output buffer of the next gather: with ``cache='values'`` the same persistent buffer
        every time (it is the cache); otherwise a new one the engine may free."""
        if self.cache != "values" or dtype not in FORMATS:  # (two_level: its cache is 1/L of this buffer)
            return torch.empty(numel, dtype=dtype, device=device)
        return self._persistent(numel=numel, dtype=dtype, device=device)

    def gather(self, *, output: torch.Tensor, input: torch.Tensor, group=None) -> None:
        """``output`` becomes ``all_gather_into_tensor(output, input)``, bit for bit:
        :meth:`start` then ``wait()``."""
        self.start(output=output, input=input, group=group).wait()

    def start(self, *, output: torch.Tensor, input: torch.Tensor, group=None) -> "Zero3Handle":
        """Launch the gather into ``output``; the returned handle's ``wait()`` completes it (decode,
        caches). Between the two the caller may compute: the collective runs meanwhile. One gather
        of this unit at a time.

        Which agreement it needs (every choice below is rank-identical): none when the unit was
        prepared with its group after the optimizer step (:meth:`Zero3Units.step`) or when it
        replays the step's plan; one of its own only for a fresh gather not prepared ahead (the
        first gathers, after :meth:`invalidate`, units without a ``source``). No host read either
        way except in that agreement. What this rank sends without an agreement is checked on the
        device against what it gathers now; a difference raises at the next agreement."""
        if self._handle is not None and not self._handle.done:
            raise RuntimeError(f"{self.name}: start() called while the previous gather is not waited on")
        group = self.group if group is None else group
        if self._inner is not None and group is not self._inner.group and group != self._inner.group:
            raise ValueError(f"{self.name}: gathered over a different process group than at its first gather")
        self.group = group
        world = dist.get_world_size(group)
        if output.dim() != 1 or output.numel() != world * input.numel():
            raise ValueError(f"{self.name}: output of {tuple(output.shape)} values for a shard of "
                             f"{input.numel()} at world {world}")
        self.gathers_this_step += 1
        if world == 1 or output.dtype not in FORMATS or not self._compresses():
            work = all_gather_into(output, input, group=group, async_op=True)
            self._count_plain(output)
            self._handle = Zero3Handle(work=work)
            return self._handle
        rank = dist.get_rank(group)
        n = input.numel()
        if self.cache is None:
            self._choose_cache(numel=output.numel(), world=world, dtype=output.dtype, device=output.device)
        if self.cache == "two_level":
            return self._start_two_level(output=output, input=input)
        buffer = output if self.cache != "values" else self._persistent(
            numel=output.numel(), dtype=output.dtype, device=output.device)
        own = buffer.view(world, n)[rank]
        inner = self._inner
        if inner is None:
            mode = "fresh"
        elif inner.phase is Phase.AGREED:
            mode = "ahead"  # prepared with its group after the step, from the staged copy in _sent
        elif self.writes.written or not self.stepped or inner.last_plan is None:
            mode = "fresh"  # this gather's own agreement
        else:
            mode = "replay"  # a later gather of the step: the step's plan again, no agreement
        # (a replay into the values cache: its own slot holds the step's shard already)
        if own.data_ptr() != input.data_ptr() and not (mode == "replay" and buffer is self._values):
            own.copy_(input)
        if inner is None:
            inner = self._build(buffer)
        else:
            inner.rebind(buffer)
        if mode == "ahead":  # what was encoded must be what the engine hands in now
            inner.add_changed(_count_changed(input, self._sent))
        elif mode == "fresh":
            inner.prepare()
            self._gather_prepares += 1
        else:
            inner.replay(changed=_count_changed(input, self._sent))
        fresh = mode != "replay"
        plan = inner.plan
        if self.cache == "exponents" and not plan.raw:
            if not self._exps_valid:  # _finish keeps the cache whenever the next plan may compress
                raise RuntimeError(f"{self.name}: a compressed plan without the exponent cache (a bug)")
            self._seed(buffer)
        if fresh:
            self._fresh_gathers += 1
            self.writes.sent()
        work = inner.start()
        self._handle = Zero3Handle(work=work, ready=isinstance(work, _DoneHandle), finish=lambda: self._finish(
            buffer=buffer, output=output, own=own, replayed=plan.replay, staged=mode == "ahead"))
        return self._handle

    def _start_two_level(self, *, output: torch.Tensor, input: torch.Tensor):
        """``cache='two_level'``: the unit's gather is :class:`ciera.two_level.TwoLevel`'s, whose
        stage across nodes is a ``values`` :class:`Zero3Gather` over the inter group (registered with
        this unit's :class:`Zero3Units`: prepared after the step with its group's other units)."""
        if self._two is None:
            units = self._units if self._units is not None else Zero3Units()
            groups = units.node_groups(self.group, self._layout)
            stage1 = Zero3Gather(group=groups.inter, config=dataclasses.replace(self.config, cache="values"),
                                 name=f"{self.name}.nodes", stepped=self.stepped, source=self._source,
                                 measurements=units.measurements(groups.inter), units=self._units)
            self._two = TwoLevel(stage1=stage1, groups=groups)
        self._handle = self._two.start(output=output, input=input)
        return self._handle

    def _compresses(self) -> bool:
        """Whether this configuration ever compresses (else every gather is plain)."""
        c = self.config
        return c.cache != "none" and c.codec != "raw" and c.selection != "never"

    def _finish(self, *, buffer: torch.Tensor, output: torch.Tensor, own: torch.Tensor, replayed: bool,
                staged: bool) -> None:
        """After the inner gather's ``wait()``: the caches follow what receivers now hold."""
        if not replayed:  # receivers now hold this shard exactly
            if not staged:  # (staged: _sent holds it already, checked equal to the input)
                self._sent.copy_(own)
            if self.cache == "exponents":
                # The cache is read only by compressed gathers: kept while the next one may be.
                self._exps_valid = self._inner.may_compress()
                if self._exps_valid:
                    store_exponents(buffer.view(self._exps.shape), self._exps)
        if buffer is not output:
            output.copy_(buffer)
        if self.cache == "exponents":
            self._inner.release()  # the engine frees the gathered buffer: keep no reference to it

    def step(self) -> None:
        """The shard changed (call after every optimizer step, on every rank): the next gather
        encodes. The step's gather count tells the cost model how often a fresh payload serves.
        (:meth:`Zero3Units.step` calls this for every unit, then prepares them together.)"""
        if self._two is not None:
            self._two.stage1.step()
        if self._inner is not None and self._inner.selector is not None and self.gathers_this_step:
            exps = self.cache == "exponents"
            self._inner.selector.shape = StepShape(gathers=self.gathers_this_step, replays_send=exps,
                                                   cache_passes=2 if exps else 0)
        self.writes.mark()
        self.gathers_this_step = 0

    def prepares_ahead(self) -> bool:
        """Whether :meth:`Zero3Units.step` prepares this unit's next gather (it has a ``source``,
        has gathered before, and is stepped)."""
        return self._source is not None and self._inner is not None and self.stepped

    def stage(self) -> CieraAllGather:
        """Before :meth:`Zero3Units.step`'s agreement: this rank's current shard, from ``source``,
        becomes what the inner gather encodes. Returns the inner gather to prepare. A plan prepared
        ahead and never gathered (the engine skipped the unit for a whole step: rank-identical) is
        dropped, its caches with it: the unit's next gather is raw."""
        inner = self._inner
        if inner.phase is Phase.AGREED:
            inner.invalidate()
            self._exps_valid = False
        self._source(self._sent)
        inner.stage(self._sent)
        return inner

    def raise_pending_errors(self, *, wait: bool = True) -> None:
        """See :meth:`ciera.CieraAllGather.raise_pending_errors`."""
        if self._two is not None:
            self._two.stage1.raise_pending_errors(wait=wait)
        if self._inner is not None:
            self._inner.raise_pending_errors(wait=wait)

    def invalidate(self) -> None:
        """After any write to the shard outside the optimizer step (checkpoint load): the next
        gather is raw on every rank and refills the caches."""
        self.writes.mark()
        if self._two is not None:
            self._two.stage1.invalidate()
        if self._inner is not None:
            self._inner.invalidate()

    # -- what it costs and did ---------------------------------------------------------------------
    @property
    def cache_bytes(self) -> int:
        """Bytes this rank keeps between gathers: the receiver cache plus its copy of its own last
        sent shard (0 before the first gather)."""
        if self._two is not None:
            return self._two.stage1.cache_bytes
        return sum(t.numel() * t.element_size() for t in (self._values, self._exps, self._sent) if t is not None)

    @property
    def stats(self) -> GatherStats:
        """Cumulative counters (the inner gather's plus the plain gathers'; ``two_level``: its
        gather across nodes, what crosses them)."""
        if self._two is not None:
            return self._two.stage1.stats
        if self._inner is None:
            return dataclasses.replace(self._plain)
        s = self._inner.stats
        for f in ("raw_bytes", "wire_bytes", "gathers", "raw_gathers"):
            setattr(s, f, getattr(s, f) + getattr(self._plain, f))
        return s

    # -- internals --------------------------------------------------------------------------------------
    def _persistent(self, *, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The persistent buffer of ``cache='values'``: made on first use, the same one after (when
        the engine's output did not come from :meth:`allocate`, the gather copies into it)."""
        if self._values is None:
            self._values = torch.empty(numel, dtype=dtype, device=device)
        elif self._values.numel() != numel or self._values.dtype != dtype:
            raise ValueError(f"{self.name}: {numel} {dtype} values after {self._values.numel()} "
                             f"{self._values.dtype}: one Zero3Gather serves one parameter group")
        return self._values

    @functools.cached_property
    def _layout(self) -> NodeLayout | None:
        """The group's node layout when two levels are possible (several nodes of several ranks)."""
        layout = group_layout(self.group, ranks_per_node=node_size(self.config.node_size))
        return layout if layout is not None and layout.useful else None

    def _choose_cache(self, *, numel: int, world: int, dtype: torch.dtype, device: torch.device) -> None:
        """``cache='auto'``: ``values`` when this unit's values cache fits what is left of the budget
        (its :class:`Zero3Units`', else one measured now over the unit's group), else ``exponents``.
        Rank-identical: the budget is the smallest over the ranks, units choose in gather order."""
        sizes = _auto_sizes(numel=numel, world=world, dtype=dtype, nodes=self._layout.nodes if self._layout else 1)
        units = self._units if self._units is not None else Zero3Units()
        if units.budget is None:
            units.budget = measure_budget(spec=self.config.cache_budget, device=device, group=self.group)
        self.cache = units.take(sizes)
        if self.cache == "exponents" and needs_values_cache(self.config.codec):
            raise ValueError(f"{self.name}: codec={self.config.codec!r} needs cache='values' ({sizes['values']} bytes per "
                             f"rank) or 'two_level' ({sizes.get('two_level', 'not possible:')} bytes per rank"
                             f"{'' if 'two_level' in sizes else ' one node, or one rank per node'}), over what is "
                             f"left of the cache budget {units.budget.describe()}: raise --ciera-cache-budget or "
                             f"choose codec 'exponent_reuse' or 'auto'")

    def _build(self, buffer: torch.Tensor) -> CieraAllGather:
        config = dataclasses.replace(self.config, cache=self.cache)
        persistent = config.cache == "values"
        if not persistent and config.codec == "auto":  # the exponent cache decodes exponent_reuse only
            config = dataclasses.replace(config, codec="exponent_reuse")
        self._inner = CieraAllGather(buffer, group=self.group, config=config, name=self.name,
                                     measurements=self._measurements, persistent=persistent)
        world, n = self._inner.world, self._inner.shard_numel
        self._sent = torch.empty(n, dtype=buffer.dtype, device=buffer.device)
        if not persistent:
            self._exps = torch.empty(world, n, dtype=torch.uint8, device=buffer.device)
        if self._units is not None:
            self._units.register(self)
        if self._inner.rank == 0:
            logger.debug("%s: ZeRO-3 gather of %d x %d %s values, cache=%s: %.1f MiB per rank kept between gathers",
                         self.name, world, n, buffer.dtype, config.cache,
                         cache_bytes_per_rank(numel=world * n, world=world, dtype=buffer.dtype, cache=config.cache) / 2**20)
        return self._inner

    def _seed(self, buffer: torch.Tensor) -> None:
        """The other ranks' slots of a fresh buffer get their cached exponents: all
        ``exponent_reuse``'s decode reads of a target."""
        world, n = self._exps.shape
        rank = self._inner.rank
        rows = buffer.view(world, n)
        for lo, hi in ((0, rank), (rank + 1, world)):  # the other ranks: two ranges of rows
            if hi > lo:
                seed_exponents(rows[lo:hi], self._exps[lo:hi])

    def _count_plain(self, output: torch.Tensor) -> None:
        s = self._plain
        s.gathers += 1
        s.raw_gathers += 1
        b = output.numel() * output.element_size()
        s.raw_bytes += b
        s.wire_bytes += b


class Zero3Units:
    """Every ZeRO-3 unit of one model: after each optimizer step, one encode per unit and ONE
    agreement per process group for all of them (:meth:`step`), so that every gather of the step,
    forward and backward, every micro-batch, launches its data collective with no host read and no
    other collective. Units register at their first gather (a collective, in the engine's gather
    order: the same on every rank); those with a ``source`` are prepared ahead. With
    ``cache='auto'`` the units share ``budget`` (:func:`ciera.memory.measure_budget`; measured at
    the first unit's first gather when not given)."""

    def __init__(self, *, budget: Budget | None = None):
        self.units: list[Zero3Gather] = []
        """Registered units, in first-gather order."""
        self.agreements = 0
        """Agreements :meth:`step` ran (one per process group and step)."""
        self.budget = budget
        """The receiver caches' budget (``cache='auto'``)."""
        self.chosen: dict[str, int] = {}
        """``cache='auto'``: units per cache chosen so far."""
        self._spent = 0
        self._node_groups: dict[int, tuple[object, NodeGroups]] = {}  # id(group) -> (group, its inter and intra)
        self._measurements: dict[int, Measurements] = {}  # id(inter group) -> its link's measurements

    def node_groups(self, group, layout: NodeLayout | None) -> NodeGroups:
        """This rank's inter and intra groups of ``group`` (created at the first call for the group: a
        collective among their members, at the same point on every rank of ``group``)."""
        if layout is None:
            raise ValueError("cache='two_level' needs a process group of several nodes of several ranks each, numbered "
                             "node by node (set LOCAL_WORLD_SIZE or CieraConfig.node_size / --ciera-node-size)")
        if id(group) not in self._node_groups:
            self._node_groups[id(group)] = (group, split_group(group, layout=layout))
        return self._node_groups[id(group)][1]

    def measurements(self, group) -> Measurements:
        """The shared link and codec measurements of a group the units create (an inter group)."""
        return self._measurements.setdefault(id(group), Measurements())

    def take(self, sizes: dict[str, int]) -> str:
        """A unit's cache under the budget: the fastest of ``sizes`` that fits what is left
        (:func:`ciera.memory.choose_cache`), else ``exponents``; its bytes are spent either way."""
        cache = choose_cache(sizes=sizes, left=self.budget.bytes - self._spent)
        self._spent += sizes[cache]
        self.chosen[cache] = self.chosen.get(cache, 0) + 1
        return cache

    def register(self, unit: Zero3Gather) -> None:
        """Called by a unit at its first gather."""
        self.units.append(unit)

    def step(self) -> None:
        """Every unit's shard changed (call after every optimizer step, on every rank): each unit
        that can is staged from its source and encoded, and each process group agrees once."""
        for u in self.units:
            u.step()
        groups: dict[int, tuple[object, list[CieraAllGather]]] = {}
        for u in self.units:
            if u.prepares_ahead():
                groups.setdefault(id(u.group), (u.group, []))[1].append(u.stage())
        failed: BaseException | None = None
        for group, inners in groups.values():
            try:
                CieraAllGather.prepare_many(inners, group=group)
            except BaseException as exc:  # raised on every rank of this group
                if not self._node_groups:
                    raise
                failed = failed or exc
            self.agreements += 1
        if self._node_groups:
            self._spread(failed)

    def _spread(self, failed: BaseException | None) -> None:
        """Two-level units agree within their node groups: an error raised in one (a stale replay, a
        corrupt payload) reaches every rank of the whole group, here after the step, instead of
        leaving the others to wait on it in the next gather. One small MAX all-reduce per group."""
        for group, groups in self._node_groups.values():
            flag = torch.tensor([0 if failed is None else 1], dtype=torch.int32)
            if dist.get_backend(group) == "nccl":
                flag = flag.cuda()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            if failed is None and int(flag.item()):
                raise CieraVerifyError(f"CIERA ZeRO-3: another node group of this process group failed its agreement "
                                       f"after the optimizer step (its ranks raised the cause); stopping every rank")
        if failed is not None:
            raise failed


class Zero3Handle:
    """Returned by :meth:`Zero3Gather.start`; :meth:`wait` completes the gather. Idempotent."""

    def __init__(self, *, work, finish=None, ready: bool = False):
        self._work, self._finish = work, finish
        self.ready = ready
        """No collective was posted (a replay into the values cache): ``wait()`` only finishes."""
        self.done = False

    def wait(self) -> None:
        """Wait for the collective, decode the other ranks' payloads, update the caches."""
        if self.done:
            return
        self.done = True
        self._work.wait()
        if self._finish is not None:
            self._finish()


def _count_changed(shard: torch.Tensor, sent: torch.Tensor) -> torch.Tensor:
    """0-d tensor on the shard's device, 0 iff ``shard`` equals ``sent`` bit for bit: on a device,
    how many words differ (8 bytes at a time where the size allows; no host read); on CPU 0 or 1
    from one memory comparison (no temporaries: the host is where CPU tensors live)."""
    nbytes, start = shard.numel() * shard.element_size(), shard.storage_offset() * shard.element_size()
    wide = next(w for w, size in ((torch.int64, 8), (torch.int32, 4), (as_bits(shard).dtype, 1))
                if nbytes % size == 0 and start % size == 0)
    a, b = shard.view(as_bits(shard).dtype).view(wide), sent.view(as_bits(sent).dtype).view(wide)
    if shard.device.type == "cpu":
        return torch.tensor(0 if torch.equal(a, b) else 1, dtype=torch.int64)
    return (a != b).sum()


def _exponent_bytes(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the two little-endian bytes of every value that hold its exponent field: ``(high,
    low)``. bf16 and fp32: ``high`` = sign | exponent bits 7..1, bit 7 of ``low`` = exponent bit 0;
    fp16: bits 6..2 of ``high`` (``low`` unused)."""
    item = values.element_size()
    b = values.view(torch.uint8).view(*values.shape, item)
    return b[..., item - 1], b[..., item - 2]


def seed_exponents(values: torch.Tensor, exps: torch.Tensor) -> None:
    """Write exponent fields ``exps`` (uint8, the shape of ``values``) into ``values``' exponent
    bits; the other bits are left as they are (a decode that reads only exponents ignores them).
    In place, no temporaries: elementwise ops into strided byte views."""
    fmt = float_format(values.dtype)
    high, low = _exponent_bytes(values)
    if fmt.exp_bits == 5:  # fp16: sign 0, exponent in bits 6..2, mantissa's top 2 bits 0
        torch.bitwise_left_shift(exps, 2, out=high)
        return
    torch.bitwise_right_shift(exps, 1, out=high)  # sign 0, exponent bits 7..1
    torch.bitwise_and(exps, 1, out=low)
    low.bitwise_left_shift_(7)  # exponent bit 0, the mantissa's top bits 0


def store_exponents(values: torch.Tensor, exps: torch.Tensor) -> None:
    """``exps`` (uint8, the shape of ``values``) = the exponent fields of ``values``. In place, no
    temporaries: ``(low >> 7) + 2 x high`` wraps the sign out in uint8 arithmetic."""
    fmt = float_format(values.dtype)
    high, low = _exponent_bytes(values)
    if fmt.exp_bits == 5:
        torch.bitwise_right_shift(high, 2, out=exps)
        exps.bitwise_and_(0x1F)
        return
    torch.bitwise_right_shift(low, 7, out=exps)
    exps.add_(high, alpha=2)


def cache_bytes_per_rank(*, numel: int, world: int, dtype: torch.dtype, cache: str, nodes: int = 1) -> int:
    """What :class:`Zero3Gather` keeps per rank for a parameter group of ``numel`` gathered values
    (padded to ``world``): the receiver cache plus the sender's copy of its shard. ``nodes``: the
    nodes the group spans (``two_level`` keeps the values of one shard per node)."""
    shard = math.ceil(numel / world)
    item = float_format(dtype).itemsize
    if cache == "two_level":
        return nodes * shard * item + shard * item
    per_value = {"values": item, "exponents": 1, "none": 0}[cache]  # (a concrete cache: see plan_caches for auto)
    return 0 if cache == "none" else world * shard * per_value + shard * item


def plan_caches(units: list[tuple], *, cache: str, budget: Budget | None) -> list[str]:
    """The cache each unit ``(numel, world, dtype[, nodes])`` would get, in order: ``cache`` itself,
    or for ``auto`` what :class:`Zero3Units` chooses under ``budget`` when the units gather in this
    order (what a binding logs at start-up). ``nodes``: the nodes the unit's group spans when two
    levels are possible (several of several ranks each), else 1."""
    if cache != "auto":
        return [cache] * len(units)
    plan = Zero3Units(budget=budget)
    return [plan.take(_auto_sizes(numel=u[0], world=u[1], dtype=u[2], nodes=u[3] if len(u) > 3 else 1)) for u in units]


def _auto_sizes(*, numel: int, world: int, dtype: torch.dtype, nodes: int = 1) -> dict[str, int]:
    """The bytes per rank of each cache ``auto`` chooses between, for one unit (``two_level`` only
    when ``nodes > 1``: the caller found two levels possible)."""
    caches = ("values", "two_level", "exponents") if nodes > 1 else ("values", "exponents")
    return {c: cache_bytes_per_rank(numel=numel, world=world, dtype=dtype, cache=c, nodes=nodes) for c in caches}
