"""CieraAllGather: a lossless, compressed drop-in for ``all_gather_into_tensor`` on a bucket.

Layout, as in Megatron's distributed optimizer: rank ``r`` owns ``buffer[r*n:(r+1)*n]`` with
``n = numel // world``. Before each gather, the owner has overwritten its shard with new values
and every other shard of ``buffer`` still holds the previous gather's values: that is the
receivers' cache, so receivers keep no state at all. The sender keeps only what its codec needs
of its own previous shard. (A buffer that does not persist between gathers, as in ZeRO-3, is
handed in with :meth:`CieraAllGather.rebind`; its caller fills the other shards with what the
codec's decode reads of the previous values: see :mod:`ciera.zero3`.)

One gather walks four phases (:class:`Phase`), each step a public method:

1. **Propose** (:meth:`CieraAllGather.propose`): every rank encodes its shard into its own send
   buffer of the codec's worst-case size (never overflows), or says it sends raw, or that its shard
   is unchanged since its last gather (a replay); the payload's size stays on the device.
2. **Agree** (:mod:`ciera.agreement`): one small all-gather per process group, covering every
   bucket prepared together, carries every rank's proposal; the host reads that table once and
   every rank derives the same :class:`~ciera.agreement.Plan` (:meth:`CieraAllGather.apply`).
3. **Launch** (:meth:`CieraAllGather.start`): one collective of the payloads at their agreed sizes
   (each rank's own, or all at the largest; see :mod:`ciera.agreement`), or the plain one; none
   for a replay of a persistent buffer.
4. **Decode** (``handle.wait()``): one :meth:`ciera.codecs.Codec.decode_many` call decodes the
   ``world - 1`` received payloads in place; their rows and offsets were written on the device at
   step 2.

:meth:`CieraAllGather.prepare` and :meth:`CieraAllGather.prepare_many` run steps 1-2 for one bucket or
for many with one agreement. From step 2 to the end of ``wait()`` the compressed path reads nothing
on the host and allocates nothing (``tests/ciera/test_host_reads.py`` fails if that changes).

Streams (CUDA; ``tests/ciera/test_stream_policy.py`` checks it on CPU with a recording fake of
``torch.cuda``): the **encode** runs on the device's one side stream (:func:`side_stream`), after
it waited for the stream current at the proposal (the optimizer wrote the shard there) and that
stream waited for the previous gather's decode; the agreement's stream waits for the encode's
event before reading the size. The plan's offsets (and a grown receive buffer) are written on the
stream current at the agreement. The **send** runs on the stream current at ``start()``, which
first waits for the agreement's stream and for the previous decode. The **decode** (and any
cache the codec writes with it) runs on the stream current at ``wait()``, which the collective's
work makes wait for the transfer. Every buffer used on a stream other than the one it was
allocated on is marked with ``record_stream`` there (send, size, sender state and bucket on the
side stream; send, receive and bucket on the launch stream; receive, offsets, rows and bucket on
the decode stream), so a receive buffer replaced when it grows is not reused while a decode reads it.
The caller orders the stream current at ``start()`` after the writes of the shard, as for a plain
all-gather (FSDP2's copy-in does).

Invariant kept by every path: when ``wait()`` returns, ``buffer`` equals what
``all_gather_into_tensor`` would have produced, bit for bit, and the sender's codec state
describes its shard. Failures cannot make ranks take different paths: a rank that failed locally
says so in the next agreement and every rank then sends that bucket raw.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import logging
import time
from typing import Sequence

import torch
import torch.distributed as dist

from .agreement import (FLAG_CORRUPT, FLAG_FAILED, FLAG_RAW, RAW_PLAN, REPLAY_PLAN, Plan, Proposal,
                        exchange, plan_from_table, stale_ranks)
from .errors import CieraVerifyError, StaleReplayError
from .codecs import HEADER_BYTES, Codec, PayloadHeader, codec_spec, codec_specs, make_codec
from .codecs.base import align_up
from .codecs.formats import FORMATS, float_format
from .comm import all_gather_into, all_gather_uneven
from .config import CieraConfig
from .replicas import verify_replicas
from .selection import Measurements, Selector
from .stats import GatherStats, SectionTimer

logger = logging.getLogger(__name__)

_DTYPE_CODES = {dtype: i + 1 for i, dtype in enumerate(FORMATS)}


class Phase(enum.Enum):
    """Where one gather stands. ``IDLE -> PROPOSED -> AGREED -> IN_FLIGHT -> IDLE``; a proposal or a
    plan not yet launched goes back to ``IDLE`` on ``invalidate()``; a gather that completes inside
    ``start()`` (one rank, a replay of a persistent buffer) goes from ``AGREED`` to ``IDLE``."""

    IDLE = "idle"
    """Nothing prepared; ``start()`` would prepare first."""
    PROPOSED = "proposed"
    """This rank's proposal is made (encoded, raw or replay); the agreement comes next."""
    AGREED = "agreed"
    """The plan is known on every rank; ``start()`` launches it."""
    IN_FLIGHT = "in flight"
    """The collective is launched; ``wait()`` completes and decodes it."""


_TRANSITIONS = {
    Phase.IDLE: {Phase.PROPOSED},
    Phase.PROPOSED: {Phase.AGREED, Phase.IDLE},
    Phase.AGREED: {Phase.IN_FLIGHT, Phase.IDLE},
    Phase.IN_FLIGHT: {Phase.IDLE},
}
"""The legal moves of :class:`Phase` (``tests/ciera/test_gather_phases.py`` walks all of them)."""


def _uses_streams(device: torch.device) -> bool:
    """Whether gathers on ``device`` follow the stream policy (CUDA; the stream-policy tests make
    it true on CPU under a recording fake of ``torch.cuda``)."""
    return device.type == "cuda"


def _keep_for(t: torch.Tensor, stream) -> None:
    """``record_stream``: ``t``'s memory is not handed out again before ``stream``'s work queued so
    far is done (nothing to keep for an empty tensor)."""
    if t.numel():
        t.record_stream(stream)


@functools.cache
def side_stream(device: torch.device):
    """The one encode stream of a CUDA device, shared by every gather on it."""
    return torch.cuda.Stream(device=device)


class _DoneHandle:
    """Handle of a gather that finished inside ``start()``."""

    def wait(self) -> None:
        return None


class GatherHandle:
    """Returned by :meth:`CieraAllGather.start`; :meth:`wait` completes the gather in place."""

    def __init__(self, owner: "CieraAllGather", work, plan: Plan, launched: float):
        self._owner, self._work, self._plan, self._launched = owner, work, plan, launched
        self._done = False

    def wait(self) -> None:
        """Wait for the collective (on CUDA: make the current stream wait), then decode the other
        ranks' payloads in place. Idempotent."""
        if self._done:
            return
        self._done = True
        self._owner._finish(self._work, self._plan, self._launched)


class CieraAllGather:
    """Compressed, bit-exact all-gather of one flat parameter bucket.

    Args:
        buffer: flat contiguous bf16/fp16/fp32 tensor whose size is divisible by the group size.
        group: process group (default: the world).
        config: a :class:`CieraConfig`; must be equal on every rank of ``group``.
        name: used in logs and error messages (e.g. ``"expert.bucket3"``).
        measurements: a :class:`ciera.selection.Measurements` shared by the gathers of ``group``,
            so that the link and the codec speeds the cost model needs are measured once per group,
            at construction (``selection='auto'`` or ``codec='auto'``); a private one when omitted.
        persistent: ``True`` (default) when ``buffer`` keeps its values between gathers (the
            distributed optimizer's buffer): a replay then needs no collective. ``False`` when the
            caller hands a new buffer to every gather (:meth:`rebind`): a replay sends the previous
            payloads again.

    Construction is collective over ``group``: it checks that every rank passed the same config,
    dtype and size, and fails with a clear error otherwise.

    Per step, either call :meth:`prepare` then :meth:`start` (one small size agreement per bucket),
    or prepare every bucket of a group at once with :meth:`prepare_many` (one agreement for all of
    them), then :meth:`start` each.
    """

    def __init__(self, buffer: torch.Tensor, *, group=None, config: CieraConfig | None = None,
                 name: str = "bucket", measurements: Measurements | None = None, persistent: bool = True):
        config = CieraConfig() if config is None else config
        if not isinstance(config, CieraConfig):
            raise TypeError(f"{name}: config must be a CieraConfig, got {type(config).__name__}")
        self._check_buffer(buffer, name)
        self.buffer, self.group, self.config, self.name = buffer, group, config, name
        self.persistent = persistent
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if buffer.numel() % self.world:
            raise ValueError(
                f"{name}: buffer of {buffer.numel()} values is not divisible by the group size "
                f"{self.world} ({buffer.numel()} % {self.world} = {buffer.numel() % self.world})"
            )
        self.shard_numel = buffer.numel() // self.world
        self._dtype, self._numel = buffer.dtype, buffer.numel()
        self._staged = False  # self._shard is a stage()d tensor, not the buffer's own slot
        empty = buffer.new_empty(0)
        self._no_buffer = (empty, empty.view(self.world, 0))  # what release() leaves in place of the buffer
        self._raw_bytes = buffer.numel() * buffer.element_size()
        self._shards = buffer.view(self.world, self.shard_numel)
        self._shard = self._shards[self.rank]
        self._check_agreement()

        self._codecs: dict[str, Codec] = {c: self._make_codec(c) for c in self._candidate_codecs()}
        bad = [n for n, c in self._codecs.items() if c.reads_previous == "values"]
        if not persistent and bad:
            raise ValueError(f"{name}: codec(s) {bad} decode by adding to the previous values, so they need a "
                             f"persistent buffer (with persistent=False choose codec='exponent_reuse')")
        self._codec_name: str | None = next(iter(self._codecs), None)
        self._state = None  # sender state of self._codec_name, valid iff self._raw_left == 0
        self._raw_left = config.warmup_gathers
        self._failed = False  # a local failure since the last agreement: the next gather is raw everywhere
        self._corrupt: str | None = None  # a device decode found a corrupt payload: every rank stops
        self._stats = GatherStats(codec="raw")
        self._encode_timer = SectionTimer(buffer.device)
        self._decode_timer = SectionTimer(buffer.device)
        self._started = 0  # fresh (non-replay) gathers proposed: the selector's schedule counts these
        self._phase = Phase.IDLE
        self._proposed: tuple[str, object] | None = None  # PROPOSED: (mode, cuda event of the encode)
        self._plan: Plan | None = None  # AGREED / IN_FLIGHT: the plan being carried out
        self._last_plan: Plan | None = None  # the last fresh plan: what a replay repeats
        self._pending: GatherHandle | None = None  # IN_FLIGHT
        self._proposing = None  # CUDA: the stream current at the last encode (the plan is written there)
        self._released = None  # CUDA: an event after the last decode (the next encode and launch wait it)
        dev = buffer.device
        # Persistent buffers: the send payload at the codec's worst case (so it never overflows);
        # the receive buffer grows only at an agreement; rows/offsets of the other ranks' payloads.
        worst = max((c.clamp_capacity(c.max_bytes) for c in self._codecs.values()), default=0)
        self._send = torch.empty(worst, dtype=torch.uint8, device=dev)
        self._recv = torch.empty(0, dtype=torch.uint8, device=dev)
        self._rows = torch.tensor([r for r in range(self.world) if r != self.rank], dtype=torch.int64, device=dev)
        self._offsets = torch.empty_like(self._rows)
        self._offsets_host = torch.empty(self._rows.numel(), dtype=torch.int64)  # per-rank offsets, staged
        self._needed = torch.zeros((), dtype=torch.int64, device=dev)  # this rank's payload size
        # Values found changed by replay() since the last agreement (device; carried by the next one)
        self._stale = torch.zeros((), dtype=torch.int64, device=dev)
        self._stale_unreported = False  # replay() ran since the last agreement
        decides = config.selection == "auto" or len(self._codecs) > 1
        self.selector = None
        if self._codecs and decides:
            m = measurements or Measurements()
            self.selector = Selector(
                codecs=self._codecs, config=config, world=self.world, group=group, device=dev,
                link=m.link_for(group=group, device=dev, shard_bytes=self._raw_bucket_bytes() // self.world),
                speeds={n: m.codec_for(codec=c, group=group, device=dev) for n, c in self._codecs.items()},
                name=self.name, measurements=m, rank=self.rank)

    # -- public API ------------------------------------------------------------------------------
    @staticmethod
    def prepare_many(gathers: Sequence["CieraAllGather"], *, group=None) -> list[Plan]:
        """Steps 1-2 for many gathers of ``group`` with ONE agreement: every gather proposes
        (encodes), one collective carries all the proposals, every gather applies its plan.
        Collective over ``group``: every rank passes its gathers of that group in the same order.
        Returns the plans (for tests and logs)."""
        return _prepare(list(gathers), group=group)

    def prepare(self) -> None:
        """Steps 1-2 for this bucket alone (one small collective; the host reads it). Call once the
        shard holds its new values (right after the optimizer step). Optional: ``start()`` prepares
        when this was not called."""
        if self._phase is Phase.IDLE:
            _prepare([self], group=self.group)

    def replay(self, *, changed: torch.Tensor) -> None:
        """Steps 1-2 with no agreement: the last fresh plan again (``IDLE -> AGREED``), on the
        caller's word that this rank's shard is unchanged since that plan's gather (ZeRO-3's later
        gathers of a step). Every rank of the group must call it for the same gather (a rank-identical
        decision: nothing is exchanged). ``changed``, a 0-d device tensor counting the values that
        differ after all (expected 0), is added to a device counter, not read here; the next
        agreement carries it and any non-zero count raises :class:`~ciera.errors.StaleReplayError`
        on every rank (those gathers delivered the earlier values). After ``invalidate()`` there is
        no plan to repeat: the caller prepares a fresh gather instead."""
        if self._last_plan is None:
            raise RuntimeError(f"{self.name}: replay() with no fresh plan to repeat (after invalidate() or "
                               f"before the first gather); prepare a fresh gather")
        self._move(Phase.PROPOSED, "replay()")
        self.add_changed(changed)
        self._proposed = ("replay", None)
        self.apply(REPLAY_PLAN)

    def add_changed(self, changed: torch.Tensor) -> None:
        """Count ``changed`` (a 0-d device tensor, not read here) as values of this rank's shard that
        differ from what a gather without its own agreement sent (a :meth:`replay`, or a gather
        prepared ahead from a :meth:`stage`d copy): the next agreement raises
        :class:`~ciera.errors.StaleReplayError` on every rank when any rank's count is not 0."""
        self._stale.add_(changed.reshape(()).to(torch.int64))
        self._stale_unreported = True

    def propose(self) -> Proposal:
        """Step 1: this rank's proposal. Encodes the shard (on CUDA on the side stream) unless it
        sends raw. Never raises for a codec failure: it is reported as ``FLAG_FAILED`` so that
        every rank learns it in the agreement."""
        self._move(Phase.PROPOSED, "propose()")
        try:
            mode = self._choose_mode()  # also after a failure: the selector's schedule stays rank-identical
            self._started += 1
            if self._corrupt is None:
                self._corrupt = self._pending_decode_error()
            if self._corrupt is not None:
                self._proposed = ("raw", None)
                return Proposal(FLAG_CORRUPT, self._needed)
            if self._failed:
                self._proposed = ("raw", None)
                return Proposal(FLAG_FAILED, self._needed)
            if mode == "raw":
                self._proposed = ("raw", None)
                return Proposal(FLAG_RAW, self._needed)
            self._proposed = (mode, self._encode(mode))
            return Proposal(self._codecs[mode].codec_id, self._needed)
        except Exception:
            logger.exception("%s: encoding failed on rank %d; this gather is sent raw on every rank",
                             self.name, self.rank)
            self._fail()
            self._proposed = ("raw", None)
            return Proposal(FLAG_FAILED, self._needed)

    def quiet_raw(self) -> bool:
        """Selection has chosen raw and its schedule has nothing due at this gather (no snapshot, no
        decision): preparing it is bookkeeping only, no encode and no agreement (the fast path of
        :meth:`prepare_many`). Rank-identical, like :meth:`raw_by_selection`."""
        return (self._phase is Phase.IDLE and self.raw_by_selection()
                and not self.selector.due(self._started))

    def may_compress(self) -> bool:
        """Whether the next fresh gather can be compressed. ``False`` guarantees a raw plan: no
        codec, warmup or a failure pending on this rank, or selection has chosen raw and decides
        nothing at that gather (then it cannot switch there)."""
        if not self._codecs or self._raw_left > 0 or self._failed:
            return False
        return not (self.raw_by_selection() and not self.selector.due(self._started))

    @property
    def last_plan(self) -> Plan | None:
        """The last fresh plan (what a replay repeats); ``None`` after ``invalidate()``."""
        return self._last_plan

    def raw_by_selection(self) -> bool:
        """Selection has chosen raw for this bucket (rank-identical: the selector's inputs are
        agreed). A local failure meanwhile stays pending and is reported at the next agreement."""
        return bool(self._codecs) and self.selector is not None and self._codec_name is None

    def apply(self, plan: Plan) -> None:
        """Step 2's result: take the agreed plan (a replay becomes the last plan again); on a
        compressed plan write the payload offsets on the device and make sure the receive buffer
        holds ``world x size`` bytes."""
        self._move(Phase.AGREED, "apply()")
        mode, _ = self._proposed or ("raw", None)
        self._proposed = None
        if _uses_streams(self._send.device):  # a raw plan refreshes the sender state from the shard here
            self._proposing = torch.cuda.current_stream(self._send.device)  # the launch waits for this stream
        if plan.corrupt_ranks:
            mine = f" (here: {self._corrupt})" if self._corrupt else ""
            self._move(Phase.IDLE, "apply()")
            raise CieraVerifyError(
                f"{self.name}: rank(s) {list(plan.corrupt_ranks)} decoded a corrupt payload in an earlier gather"
                f"{mine}; the parameters they trained on were not the ones sent, so training cannot go on "
                f"bit-exact: resume from the last checkpoint")
        if plan.failed_ranks:
            if not self._failed:
                logger.warning("%s: rank(s) %s failed or changed a shard claimed unchanged; gathering raw on "
                               "every rank", self.name, list(plan.failed_ranks))
            self._stats.failures += 1
            self._failed = False
            self.invalidate(keep_phase=True)
        if plan.replay:
            plan = dataclasses.replace(self._last_plan or RAW_PLAN, replay=True)
        elif plan.raw:  # receivers will hold this shard exactly
            self._refresh_state_for_raw()
        elif mode != plan.codec_name:  # cannot happen: the plan is compressed only if every rank encoded it
            raise RuntimeError(f"{self.name}: agreed codec {plan.codec_name} but rank {self.rank} proposed {mode}")
        if not plan.raw and not plan.replay:  # (a replay's receive buffer and offsets are its plan's, set then)
            need = self._recv_bytes(plan)
            if self._recv.numel() < need:  # grows at agreements only, with 1/8 slack against regrowth
                self._recv = torch.empty(align_up(need + need // 8), dtype=torch.uint8, device=self.buffer.device)
            if plan.sizes:  # the other ranks' payloads at their exclusive prefix sums
                starts = list(itertools.accumulate(plan.sizes[:-1], initial=0))
                self._offsets_host.numpy()[:] = [starts[r] for r in range(self.world) if r != self.rank]
                self._offsets.copy_(self._offsets_host)  # at the agreement, whose table read synced already
            else:
                torch.mul(self._rows, plan.size, out=self._offsets)
        if not plan.replay:
            self._last_plan = plan
        self._plan = plan

    def start(self) -> GatherHandle | _DoneHandle:
        """Step 3: launch the agreed collective (preparing first if needed). Returns a handle; call
        ``wait()`` on it before reading the other shards or starting the next gather."""
        if self._phase is Phase.IN_FLIGHT:
            raise RuntimeError(f"{self.name}: start() called while the previous gather is not waited on")
        self.prepare()
        plan = self._plan
        if self.world == 1 or (plan.replay and self.persistent):  # the buffer already holds everything
            self._plan = None
            self._move(Phase.IDLE, "start()")
            self._account(plan, wire=self._wire_bytes(plan))
            return _DoneHandle()
        try:
            launched = time.perf_counter()
            self._order_launch()
            if plan.raw:
                work = all_gather_into(self.buffer, self._shard, group=self.group, async_op=True)
            elif plan.sizes:
                work = all_gather_uneven(self._recv[: self._recv_bytes(plan)], self._send[: plan.sizes[self.rank]],
                                         sizes=plan.sizes, group=self.group)
            else:
                work = all_gather_into(self._recv[: self.world * plan.size], self._send[: plan.size],
                                       group=self.group, async_op=True)
        except BaseException:
            self._plan = None
            self._move(Phase.IDLE, "start()")
            self._fail()
            raise
        self._move(Phase.IN_FLIGHT, "start()")
        self._pending = GatherHandle(self, work, plan, launched)
        return self._pending

    def stage(self, shard: torch.Tensor) -> None:
        """Encode and send ``shard`` (``shard_numel`` values of the buffer's dtype: what this rank's
        slot will hold at the next gather) from the next :meth:`prepare` on, before any buffer is
        handed in: a ZeRO-3 unit prepared right after the optimizer step. Only while idle; the next
        :meth:`rebind` without ``shard`` goes back to the buffer's own slot."""
        if shard.dtype != self._dtype or shard.numel() != self.shard_numel:
            raise ValueError(f"{self.name}: stage() needs {self.shard_numel} {self._dtype} values, "
                             f"got {shard.numel()} {shard.dtype}")
        if self._phase is not Phase.IDLE:
            raise RuntimeError(f"{self.name}: stage() called while a gather is {self._phase.value}")
        self._shard, self._staged = shard.view(-1), True

    def release(self) -> None:
        """Drop the reference to the buffer (only while idle): a caller whose engine frees the gathered
        buffer after use (``persistent=False``) lets it go; nothing reads it before the next
        :meth:`rebind`. A :meth:`stage`d shard stays."""
        if self._phase is not Phase.IDLE:
            raise RuntimeError(f"{self.name}: release() called while a gather is {self._phase.value}")
        self.buffer, self._shards = self._no_buffer  # (made once: no allocation in a gather's wait())
        if not self._staged:
            self._shard = self._shards[self.rank]

    def rebind(self, buffer: torch.Tensor) -> None:
        """Gather into ``buffer`` from now on (same dtype and size; while idle, or agreed and not yet
        launched: the plan does not depend on the buffer). For callers whose buffers do not persist
        between gathers (``persistent=False``): before each gather the caller writes this rank's shard
        and, in the other shards, what the codec's decode reads of their previous values (for
        ``exponent_reuse``: the exponents). The shard sent is the buffer's own slot again (a
        :meth:`stage`d one is dropped: its values are the slot's)."""
        self._check_buffer(buffer, self.name)
        if buffer.dtype != self._dtype or buffer.numel() != self._numel:
            raise ValueError(f"{self.name}: rebind() needs {self._numel} {self._dtype} values, "
                             f"got {buffer.numel()} {buffer.dtype}")
        if self._phase not in (Phase.IDLE, Phase.AGREED):
            raise RuntimeError(f"{self.name}: rebind() called while a gather is {self._phase.value}")
        self.buffer = buffer
        self._shards = buffer.view(self.world, self.shard_numel)
        self._shard, self._staged = self._shards[self.rank], False

    def invalidate(self, *, keep_phase: bool = False) -> None:
        """Forget all cached state: the next ``config.warmup_gathers`` gathers are sent raw.

        Call after ANY write to ``buffer`` outside the gather (checkpoint load, parameter
        broadcast, offload/reload): receivers' caches would otherwise be stale. A rank that
        invalidates makes the next gather raw on every rank of the group (it says so in the
        agreement). A proposal or plan not yet launched is dropped. Buffers an encode in flight
        still uses stay alive (``record_stream``)."""
        self._raw_left = max(self._raw_left, self.config.warmup_gathers)
        self._state = None
        self._last_plan = None  # nothing to replay: the next fresh gather is raw
        if not keep_phase and self._phase in (Phase.PROPOSED, Phase.AGREED):
            self._proposed = self._plan = None  # a payload encoded before the write would be stale
            self._move(Phase.IDLE, "invalidate()")

    @property
    def phase(self) -> Phase:
        """Where the gather stands (:class:`Phase`)."""
        return self._phase

    @property
    def plan(self) -> Plan | None:
        """The agreed plan of the next ``start()`` (``AGREED``) or of the gather in flight."""
        return self._plan

    @property
    def stats(self) -> GatherStats:
        """A snapshot of the cumulative counters."""
        self._stats.encode_s = self._encode_timer.total()
        self._stats.decode_s = self._decode_timer.total()
        return dataclasses.replace(self._stats)

    @property
    def codec(self) -> Codec | None:
        """The codec compressed gathers use now (``None`` when this gather never compresses)."""
        return self._codecs.get(self._codec_name) if self._codec_name else None

    @property
    def codecs(self) -> dict[str, Codec]:
        """The codecs this gather may use (empty when it never compresses)."""
        return dict(self._codecs)

    def device_bytes(self) -> dict[str, int]:
        """Bytes this gather holds on its device beside the bucket, by use: ``send`` (the worst
        case, allocated once), ``receive`` (grows only at an agreement), ``state`` (the sender's
        codec state), ``index`` (rows, offsets, sizes); ``total``. Codec-owned scratch is not counted."""
        def size(t) -> int:
            return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

        out = {"send": size(self._send), "receive": size(self._recv), "state": size(self._state),
               "index": size(self._rows) + size(self._offsets) + size(self._needed)}
        out["total"] = sum(out.values())
        return out

    # -- phase bookkeeping -------------------------------------------------------------------------
    def _move(self, to: Phase, what: str) -> None:
        if to not in _TRANSITIONS[self._phase]:
            raise RuntimeError(f"{self.name}: {what} is not allowed while the gather is {self._phase.value} "
                               f"(legal next phases: {sorted(p.value for p in _TRANSITIONS[self._phase])})")
        self._phase = to

    @staticmethod
    def _check_buffer(buffer, name: str) -> None:
        if not isinstance(buffer, torch.Tensor) or buffer.dim() != 1 or not buffer.is_contiguous():
            raise ValueError(f"{name}: buffer must be a flat contiguous tensor")
        float_format(buffer.dtype)  # clear error for unsupported dtypes


    # -- construction helpers --------------------------------------------------------------------
    def _candidate_codecs(self) -> list[str]:
        cfg = self.config
        if cfg.codec == "raw" or cfg.selection == "never" or self.world == 1:
            return []
        if cfg.codec == "auto":  # the codecs whose descriptors offer them to auto, by id
            return [spec.name for spec in codec_specs() if spec.auto]
        return [cfg.codec]

    def _make_codec(self, name: str) -> Codec:
        # The config field the codec's descriptor names sets its block; None: the codec's own default
        # (delta_ans: 32 streams of 1024 values; no config field yet).
        option = codec_spec(name).block_size_option
        block = None if option is None else getattr(self.config, option)
        return make_codec(name, dtype=self.buffer.dtype, numel=self.shard_numel, block_size=block)

    def _check_agreement(self) -> None:
        mine = torch.tensor(
            [*self.config.field_digests(), _DTYPE_CODES[self.buffer.dtype], self.buffer.numel(), self.world],
            dtype=torch.int64, device=self.buffer.device,
        )
        everyone = torch.empty(self.world * mine.numel(), dtype=torch.int64, device=self.buffer.device)
        all_gather_into(everyone, mine, group=self.group)
        rows = everyone.view(self.world, -1).cpu().tolist()
        fields = (*type(self.config).field_names(), "dtype", "numel", "group size")
        for r, row in enumerate(rows):
            for f, a, b in zip(fields, rows[self.rank], row):
                if a != b:
                    if f.startswith("config."):  # digests compared; show this rank's value
                        a, b = repr(getattr(self.config, f[len("config."):])), "a different value"
                    raise ValueError(
                        f"{self.name}: ranks disagree on {f}: rank {self.rank} has {a}, rank {r} has {b} "
                        f"(every rank of the group must build CieraAllGather with the same config, "
                        f"dtype and buffer size)"
                    )

    # -- per-gather decisions ----------------------------------------------------------------------
    def _choose_mode(self) -> str:
        """'raw' or the codec this rank proposes. Every input is rank-identical except a local
        ``invalidate()``, and the agreement turns any rank's 'raw' into raw everywhere."""
        if not self._codecs:
            return "raw"
        if self.selector is not None:
            switch = self.selector.before_gather(
                self._started, warmup_left=self._raw_left, shard=self._shard, current=self._codec_name,
                probe=self._encode_probe, stats=lambda: self.stats)
            if switch is not None:
                self._switch(switch.codec, previous_shard=switch.previous_shard)
        if self._codec_name is None or self._raw_left > 0:
            return "raw"
        return self._codec_name

    def _switch(self, name: str | None, *, previous_shard: torch.Tensor | None) -> None:
        """Use codec ``name`` (``None``: raw) from this gather on. Receivers hold
        ``previous_shard``, so the new codec's state is built from it: no raw round is needed."""
        self._codec_name = name
        self._state = None if name is None else self._codecs[name].new_state(shard=previous_shard)

    def _encode_probe(self, name: str, previous_shard: torch.Tensor) -> int:
        """Bytes codec ``name`` needs for this shard against ``previous_shard`` (local, no
        collective; runs before the agreement, where host reads are allowed)."""
        codec = self._codecs[name]
        # The send buffer is free here (the previous gather was waited on; this one's encode comes
        # after, in stream order on CUDA) and holds every codec's worst case.
        scratch = self._send[: codec.clamp_capacity(codec.max_bytes)]
        codec.encode(shard=self._shard, state=codec.new_state(shard=previous_shard), out=scratch)
        return PayloadHeader(scratch[:HEADER_BYTES].view(torch.int64).cpu()).needed

    def _encode(self, mode: str):
        """Encode the shard into the send buffer, its size into ``self._needed``; on CUDA on the
        device's side stream, returning its done event."""
        codec = self._codecs[mode]
        send = self._send[: codec.clamp_capacity(codec.max_bytes)]
        if not _uses_streams(self._send.device):
            token = self._encode_timer.start()
            codec.encode(shard=self._shard, state=self._state, out=send)
            self._needed.copy_(send[: HEADER_BYTES].view(torch.int64)[2])
            self._encode_timer.stop(token)
            return None
        current = torch.cuda.current_stream(self._send.device)
        if self._released is not None:  # the previous decode read the offsets and receive buffer
            current.wait_event(self._released)
        self._proposing = current
        for t in (self._needed, self._offsets, self._rows, self._recv):  # the agreement reads and writes them
            _keep_for(t, current)
        stream = side_stream(self._send.device)
        stream.wait_stream(current)  # the optimizer wrote the shard; the previous gather is done
        with torch.cuda.stream(stream):
            token = self._encode_timer.start()
            codec.encode(shard=self._shard, state=self._state, out=send)
            self._needed.copy_(send[: HEADER_BYTES].view(torch.int64)[2])
            self._encode_timer.stop(token)
            event = torch.cuda.Event()
            event.record(stream)
        for t in (self._send, self._needed, self._state, self._shard):  # alive until the stream is done
            if t is not None:
                t.record_stream(stream)
        return event

    def _order_launch(self) -> None:
        """Stream policy, send: the launch stream waits for the agreement's stream (the encode's
        event, the plan's offsets) and for the previous decode; what the collective reads or
        writes stays alive for it."""
        if not _uses_streams(self._send.device):
            return
        current = torch.cuda.current_stream(self._send.device)
        if self._released is not None:
            current.wait_event(self._released)
        if self._proposing is not None:
            current.wait_stream(self._proposing)
            self._proposing = None
        for t in (self._send, self._recv, self.buffer):
            _keep_for(t, current)

    def _order_release(self) -> None:
        """Stream policy, decode: what the wait's stream read or wrote stays alive for it, and an
        event after it orders the next encode and launch (no allocation: one event, re-recorded)."""
        if not _uses_streams(self._send.device):
            return
        current = torch.cuda.current_stream(self._send.device)
        for t in (self._recv, self._offsets, self._rows, self.buffer):
            _keep_for(t, current)
        if self._released is None:
            self._released = torch.cuda.Event()
        self._released.record(current)

    def _refresh_state_for_raw(self) -> None:
        """A raw gather is agreed: afterwards receivers hold this shard exactly, so the codec
        state is refreshed from it now (the shard does not change until the gather)."""
        codec = self.codec
        if codec is None:
            return
        if self._state is None:
            self._state = codec.new_state(shard=self._shard)
        else:
            codec.reset_state(state=self._state, shard=self._shard)

    def raise_pending_errors(self, *, wait: bool = True) -> None:
        """Raise the ``ValueError`` of a corrupt payload that a device decode of this bucket found and
        has not reported yet. ``wait`` waits for the decodes in flight (a host sync: for checkpoints,
        not the step; each agreement reports the verdicts already landed, on every rank)."""
        for codec in self._codecs.values():
            codec.raise_pending_errors(wait=wait)
        if wait and self._stale_unreported and int(self._stale):  # (a host read: not on the step's path)
            raise StaleReplayError(f"{self.name}: rank {self.rank}: {int(self._stale)} value(s) of its shard changed "
                                   f"between gathers that reused one plan (a write to the parameters outside the "
                                   f"optimizer step without invalidate()); those gathers delivered the earlier values")

    def _pending_decode_error(self) -> str | None:
        """The message of a corrupt payload that a device decode found and has not reported yet
        (landed verdicts only: no host wait), or ``None``."""
        try:
            self.raise_pending_errors(wait=False)
        except ValueError as e:
            logger.error("%s: rank %d: %s", self.name, self.rank, e)
            return str(e)
        return None

    def _fail(self) -> None:
        """A local failure: caches are undefined here, so the next agreement makes the bucket raw on
        every rank."""
        self._failed = True
        self.invalidate(keep_phase=True)

    # -- completion ----------------------------------------------------------------------------------
    def _finish(self, work, plan: Plan, launched: float) -> None:
        """Step 4: wait for the collective, decode, count; back to ``IDLE`` whatever happens."""
        try:
            work.wait()
            self._stats.comm_s += time.perf_counter() - launched
            if plan.raw:
                if not plan.replay:
                    self._raw_left = max(0, self._raw_left - 1)
            else:
                codec = self._codecs[plan.codec_name]
                token = self._decode_timer.start()
                codec.decode_many(payloads=self._recv[: self._recv_bytes(plan)], rows=self._rows,
                                  offsets=self._offsets, targets=self._shards)
                self._decode_timer.stop(token)
            self._order_release()
            self._account(plan, wire=self._wire_bytes(plan))
            self._maybe_verify()
        except BaseException:
            self._fail()
            raise
        finally:
            self._plan = self._pending = None
            self._move(Phase.IDLE, "wait()")

    def _wire_bytes(self, plan: Plan) -> int:
        """Bytes the plan delivers to this rank (a replay of a persistent buffer: none)."""
        if self.world == 1 or (plan.replay and self.persistent):
            return 0 if plan.replay else self._raw_bucket_bytes()
        return self._raw_bucket_bytes() if plan.raw else self._recv_bytes(plan)

    def _recv_bytes(self, plan: Plan) -> int:
        """Bytes a compressed plan's collective delivers: every rank's payload, own included."""
        return sum(plan.sizes) if plan.sizes else self.world * plan.size

    def _raw_bucket_bytes(self) -> int:
        return self._raw_bytes

    def _account(self, plan: Plan, *, wire: int) -> None:
        s = self._stats
        s.gathers += 1
        s.raw_bytes += self._raw_bucket_bytes()
        s.wire_bytes += wire
        if plan.replay:  # counted apart: the fresh gather it repeats was counted already
            s.replays += 1
        elif plan.raw:
            s.raw_gathers += 1
        else:
            s.compressed_gathers += 1
            s.codec = plan.codec_name
            codec = self._codecs[plan.codec_name]
            s.payload_bytes += plan.payload_bytes
            s.variable_bytes += plan.payload_bytes - self.world * codec.fixed_bytes
            s.variable_bytes_max += self.world * (codec.max_bytes - codec.fixed_bytes)

    # -- verification ----------------------------------------------------------------------------
    def _maybe_verify(self) -> None:
        every = self.config.verify_interval
        if every and self._stats.gathers % every == 0:
            verify_replicas(self.buffer, group=self.group, name=self.name, salt=self._stats.gathers)


def _prepare(gathers: list[CieraAllGather], *, group) -> list[Plan]:
    """Propose, agree in one collective, apply: the protocol's steps 1-2 for ``gathers``."""
    if not gathers:
        return []
    if any(g.group is not group and g.group != group for g in gathers):
        raise ValueError("prepare_many: every gather must belong to the given group")
    again = [g.name for g in gathers if g.phase is not Phase.IDLE]
    if again:  # encoding twice would advance the sender state past what receivers hold
        raise RuntimeError(f"prepare_many: {again} are already prepared or in flight; start() and wait() them first")
    try:
        return _propose_agree_apply(gathers, group=group)
    except BaseException:  # nothing of these gathers launched: every one back to idle (raw next), then raise
        for g in gathers:
            if g.phase in (Phase.PROPOSED, Phase.AGREED):
                g.invalidate()
        raise


def _propose_agree_apply(gathers: list[CieraAllGather], *, group) -> list[Plan]:
    unreported = any(g._stale_unreported for g in gathers)  # replays' checks ride on the next table
    if not unreported and all(g.quiet_raw() for g in gathers):  # selection's raw, nothing due: a plain gather
        for g in gathers:  # follows and needs no table (a local failure stays pending, reported later)
            g._started += 1
            g._move(Phase.PROPOSED, "prepare()")
            g.apply(RAW_PLAN)
        return [RAW_PLAN] * len(gathers)
    world = gathers[0].world
    if world == 1:
        for g in gathers:
            g.propose()
            g.apply(RAW_PLAN)
        return [RAW_PLAN] * len(gathers)
    chose_raw = [g.raw_by_selection() for g in gathers]
    proposals = [g.propose() for g in gathers]  # encodes queue on the side stream
    if not unreported and all(chose_raw) and all(g.raw_by_selection() for g in gathers):
        # Selection chose raw for every bucket, before and after this gather's decision point. That
        # choice is agreed across ranks (the selector agrees its inputs), so every rank takes this
        # branch together: the plain gather needs no size table. (A rank's local failure, FLAG_FAILED,
        # stays pending in that gather and reaches the others at the next agreement.)
        for g in gathers:
            g.apply(RAW_PLAN)
        return [RAW_PLAN] * len(gathers)
    device = gathers[0].buffer.device
    for g in gathers:  # the sizes are written on the side stream
        event = g._proposed[1] if g._proposed else None
        if event is not None:
            torch.cuda.current_stream(device).wait_event(event)
    proposals = [dataclasses.replace(p, stale=g._stale) if g._stale_unreported else p
                 for g, p in zip(gathers, proposals)]
    table = exchange(proposals, group=group, world=world, device=device)
    for g in gathers:
        if g._stale_unreported:
            g._stale.zero_()  # in stream order after the table's copy of it
            g._stale_unreported = False
    globally = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    stale = [(g.name, [globally(r) for r in ranks]) for g, column in zip(gathers, table) if (ranks := stale_ranks(column))]
    if stale:  # (every gather goes back to idle in _prepare, caches dropped: every rank raises)
        raise StaleReplayError(
            "; ".join(f"{name}: rank(s) {ranks}" for name, ranks in stale)  # (global ranks)
            + ": a shard changed between gathers of one optimizer step that reused its plan (a write to the "
              "parameters outside the optimizer step without invalidate()); those gathers delivered the earlier "
              "values, so training cannot go on bit-exact: resume from the last checkpoint")
    plans = []
    for g, column in zip(gathers, table):
        plan = plan_from_table([word[:2] for word in column], codec_names={c.codec_id: n for n, c in g._codecs.items()},
                               shard_bytes=g._raw_bucket_bytes() // world, name=g.name,
                               per_rank_sizes=g.config.per_rank_sizes)
        g.apply(plan)
        plans.append(g.plan)
    return plans
