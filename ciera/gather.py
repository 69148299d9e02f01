"""CieraAllGather: a lossless, compressed drop-in for ``all_gather_into_tensor`` on a bucket.

Layout, as in Megatron's distributed optimizer: rank ``r`` owns ``buffer[r*n:(r+1)*n]`` with
``n = numel // world``. Before each gather, the owner has overwritten its shard with new values
and every other shard of ``buffer`` still holds the previous gather's values: that is the
receivers' cache, so receivers keep no state at all. The sender keeps only what its codec needs
of its own previous shard.

Protocol of one gather (see :mod:`ciera.agreement` for step 2):

1. **Encode** (``prepare``): every rank encodes its shard into its own send buffer of the codec's
   worst-case size (never overflows); the payload's size stays on the device.
2. **Agree**: one small all-gather per process group, covering every bucket prepared together,
   carries each rank's payload size and flags; the host reads that table once. From it every rank
   derives the same plan for each bucket: compressed at ``size = max`` over ranks of the payload
   sizes, or a plain all-gather when any rank asks for raw (warmup, invalidated, a local failure)
   or when the largest payload would not be smaller than the shard itself.
3. **Gather** (``start``): one collective of exactly ``size`` bytes per rank (or the plain one).
4. **Decode** (``wait``): one :meth:`ciera.codecs.Codec.decode_many` call decodes the ``world - 1``
   received payloads in place; their rows and offsets were written on the device at step 2.

From step 2 to the end of ``wait()`` the compressed path reads nothing on the host and allocates
nothing (``tests/distributed/test_host_reads.py`` fails if that changes). On CUDA the encodes run on
one side stream per device; the buffers they use are marked with ``record_stream``.

Invariant kept by every path: when ``wait()`` returns, ``buffer`` equals what
``all_gather_into_tensor`` would have produced, bit for bit, and the sender's codec state
describes its shard. Failures cannot make ranks take different paths: a rank that failed locally
says so in the next agreement and every rank then sends that bucket raw (see :mod:`ciera.agreement`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import torch
import torch.distributed as dist

from .agreement import FLAG_FAILED, FLAG_RAW, Plan, agree_sizes
from .codecs import HEADER_BYTES, Codec, PayloadHeader, make_codec
from .codecs.base import align_up
from .codecs.formats import FORMATS, as_bits, float_format
from .comm import all_gather_into
from .config import CieraConfig
from .selection import Measurements, Selector
from .stats import GatherStats, SectionTimer

logger = logging.getLogger(__name__)

_DTYPE_CODES = {dtype: i + 1 for i, dtype in enumerate(FORMATS)}
_CONCRETE_CODECS = ("exponent_reuse", "delta")
_RAW_PLAN = Plan(raw=True)


class CieraVerifyError(RuntimeError):
    """The gathered buffers of two ranks disagree: a cache was stale or a codec is broken."""


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

    Construction is collective over ``group``: it checks that every rank passed the same config,
    dtype and size, and fails with a clear error otherwise.

    Per step, either call :meth:`prepare` then :meth:`start` (one small size agreement per bucket),
    or prepare every bucket of a group at once with :meth:`prepare_many` (one agreement for all of
    them), then :meth:`start` each.
    """

    def __init__(self, buffer: torch.Tensor, *, group=None, config: CieraConfig | None = None,
                 name: str = "bucket", measurements: Measurements | None = None):
        config = CieraConfig() if config is None else config
        if not isinstance(config, CieraConfig):
            raise TypeError(f"{name}: config must be a CieraConfig, got {type(config).__name__}")
        if not isinstance(buffer, torch.Tensor) or buffer.dim() != 1 or not buffer.is_contiguous():
            raise ValueError(f"{name}: buffer must be a flat contiguous tensor")
        float_format(buffer.dtype)  # clear error for unsupported dtypes
        self.buffer, self.group, self.config, self.name = buffer, group, config, name
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if buffer.numel() % self.world:
            raise ValueError(
                f"{name}: buffer of {buffer.numel()} values is not divisible by the group size "
                f"{self.world} ({buffer.numel()} % {self.world} = {buffer.numel() % self.world})"
            )
        self.shard_numel = buffer.numel() // self.world
        self._raw_bytes = buffer.numel() * buffer.element_size()
        self._shards = buffer.view(self.world, self.shard_numel)
        self._shard = self._shards[self.rank]
        self._check_agreement()

        self._codecs: dict[str, Codec] = {c: self._make_codec(c) for c in self._candidate_codecs()}
        self._codec_name: str | None = next(iter(self._codecs), None)
        self._state = None  # sender state of self._codec_name, valid iff self._raw_left == 0
        self._raw_left = config.warmup_gathers
        self._failed = False  # a local failure since the last agreement: the next gather is raw everywhere
        self._stats = GatherStats(codec="raw")
        self._encode_timer = SectionTimer(buffer.device)
        self._decode_timer = SectionTimer(buffer.device)
        self._started = 0
        self._encoded: tuple[str, object] | None = None  # (mode, cuda event) of the encode in flight
        self._plan: Plan | None = None  # agreed plan of the next start()
        self._pending: GatherHandle | None = None
        dev = buffer.device
        # Persistent buffers: the send payload at the codec's worst case (so it never overflows);
        # the receive buffer grows only at an agreement; rows/offsets of the other ranks' payloads.
        worst = max((c.clamp_capacity(c.max_bytes) for c in self._codecs.values()), default=0)
        self._send = torch.empty(worst, dtype=torch.uint8, device=dev)
        self._recv = torch.empty(0, dtype=torch.uint8, device=dev)
        self._rows = torch.tensor([r for r in range(self.world) if r != self.rank], dtype=torch.int64, device=dev)
        self._offsets = torch.empty_like(self._rows)
        self._needed = torch.zeros((), dtype=torch.int64, device=dev)  # this rank's payload size
        decides = config.selection == "auto" or len(self._codecs) > 1
        self.selector = None
        if self._codecs and decides:
            m = measurements or Measurements()
            self.selector = Selector(
                codecs=self._codecs, config=config, world=self.world, group=group, device=dev,
                link=m.link_for(group=group, device=dev, shard_bytes=self._raw_bucket_bytes() // self.world),
                speeds={n: m.codec_for(codec=c, group=group, device=dev) for n, c in self._codecs.items()},
                name=self.name, measurements=m)

    # -- public API ------------------------------------------------------------------------------
    @staticmethod
    def prepare_many(gathers, *, group=None) -> list[Plan]:
        """:meth:`prepare` for many gathers of ``group`` with ONE size agreement
        (:func:`ciera.agreement.agree_sizes`)."""
        return agree_sizes(gathers, group=group)

    def prepare(self) -> None:
        """Encode this rank's shard now and agree the sizes of this bucket alone (one small
        collective; the host reads it). Call once the shard holds its new values (right after the
        optimizer step). To prepare many buckets with ONE agreement use
        :func:`ciera.agreement.agree_sizes`. Optional: ``start()`` prepares when this was not called."""
        if self._plan is None:
            agree_sizes([self], group=self.group)

    def start(self) -> GatherHandle | _DoneHandle:
        """Launch the agreed collective (preparing first if needed). Returns a handle; call
        ``wait()`` on it before reading the other shards or starting the next gather."""
        self._check_idle("start()")
        self.prepare()
        plan, self._plan = self._plan, None
        if self.world == 1:
            self._account(plan, wire=self._raw_bucket_bytes())
            return _DoneHandle()
        try:
            launched = time.perf_counter()
            if plan.raw:
                work = all_gather_into(self.buffer, self._shard, group=self.group, async_op=True)
            else:
                work = all_gather_into(self._recv[: self.world * plan.size], self._send[: plan.size],
                                       group=self.group, async_op=True)
        except BaseException:
            self._fail()
            raise
        self._pending = GatherHandle(self, work, plan, launched)
        return self._pending

    def invalidate(self) -> None:
        """Forget all cached state: the next ``config.warmup_gathers`` gathers are sent raw.

        Call after ANY write to ``buffer`` outside the gather (checkpoint load, parameter
        broadcast, offload/reload): receivers' caches would otherwise be stale. A rank that
        invalidates makes the next gather raw on every rank of the group (it says so in the
        agreement). Buffers an encode in flight still uses stay alive (``record_stream``)."""
        self._raw_left = max(self._raw_left, self.config.warmup_gathers)
        self._state = None
        self._encoded = None  # a payload encoded before the write would be stale
        self._plan = None

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

    # -- protocol steps used by ciera.agreement --------------------------------------------------
    def _encode_local(self) -> tuple[int, torch.Tensor]:
        """Step 1: choose this rank's proposal and encode. Returns ``(flags, needed)``: ``needed``
        is a 0-d int64 device tensor (not read here). Never raises: a failure is reported as
        ``FLAG_FAILED`` so that every rank learns it in the agreement."""
        self._check_idle("prepare()")
        try:
            mode = self._choose_mode()  # also after a failure: the selector's schedule stays rank-identical
            self._started += 1
            if self._failed:
                return FLAG_FAILED, self._needed
            if mode == "raw":
                self._encoded = ("raw", None)
                return FLAG_RAW, self._needed
            self._encoded = (mode, self._encode(mode))
            return self._codecs[mode].codec_id, self._needed
        except Exception:
            logger.exception("%s: encoding failed on rank %d; this gather is sent raw on every rank",
                             self.name, self.rank)
            self._fail()
            return FLAG_FAILED, self._needed

    def _quiet_raw(self) -> bool:
        """Selection has chosen raw and its schedule has nothing due at this gather (no snapshot,
        no decision): preparing it is bookkeeping only, no encode and no agreement (the fast path of
        :func:`ciera.agreement.agree_sizes`). Rank-identical, like :meth:`_raw_by_selection`."""
        return (self._plan is None and self._raw_by_selection() and not self.selector.due(self._started)
                and self._idle())

    def _take_quiet_raw(self) -> Plan:
        """For a :meth:`_quiet_raw` gather, what ``_encode_local`` then ``_apply_plan`` of a raw plan
        would do, without their calls (a local failure stays pending, as on that path)."""
        self._started += 1
        self._encoded = None
        self._plan = _RAW_PLAN
        return _RAW_PLAN

    def _raw_by_selection(self) -> bool:
        """Selection has chosen raw for this bucket (rank-identical: the selector's inputs are
        agreed). A local failure meanwhile stays pending and is reported at the next agreement."""
        return bool(self._codecs) and self.selector is not None and self._codec_name is None

    def _apply_plan(self, plan: Plan) -> None:
        """Step 2's result: remember the plan; on a compressed plan write the payload offsets on
        the device and make sure the receive buffer holds ``world x size`` bytes."""
        mode, _ = self._encoded or ("raw", None)
        self._encoded = None
        if plan.failed_ranks:
            if not self._failed:
                logger.warning("%s: rank(s) %s failed in a previous step; gathering raw on every rank",
                               self.name, list(plan.failed_ranks))
            self._stats.failures += 1
            self._failed = False
            self.invalidate()
        if plan.raw:
            self._refresh_state_for_raw()
        else:
            if mode != plan.codec_name:  # cannot happen: the plan is compressed only if every rank encoded
                raise RuntimeError(f"{self.name}: agreed codec {plan.codec} but rank {self.rank} encoded {mode}")
            need = self.world * plan.size
            if self._recv.numel() < need:  # grows at agreements only, with 1/8 slack against regrowth
                self._recv = torch.empty(align_up(need + need // 8), dtype=torch.uint8, device=self.buffer.device)
            torch.mul(self._rows, plan.size, out=self._offsets)
        self._plan = plan

    # -- construction helpers --------------------------------------------------------------------
    def _candidate_codecs(self) -> list[str]:
        cfg = self.config
        if cfg.codec == "raw" or cfg.selection == "never" or self.world == 1:
            return []
        if cfg.codec == "auto":
            from .codecs.registry import available_codecs

            return [c for c in _CONCRETE_CODECS if c in available_codecs()]
        return [cfg.codec]

    def _make_codec(self, name: str) -> Codec:
        block = self.config.delta_block_size if name == "delta" else self.config.block_size
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
    def _idle(self) -> bool:
        """No gather of this bucket is in flight (the previous one was waited on)."""
        return self._pending is None or self._pending._done

    def _check_idle(self, what: str) -> None:
        if not self._idle():
            raise RuntimeError(f"{self.name}: {what} called while the previous gather is not waited on")

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
        if not self.buffer.is_cuda:
            token = self._encode_timer.start()
            codec.encode(shard=self._shard, state=self._state, out=send)
            self._needed.copy_(send[: HEADER_BYTES].view(torch.int64)[2])
            self._encode_timer.stop(token)
            return None
        stream = side_stream(self.buffer.device)
        stream.wait_stream(torch.cuda.current_stream(self.buffer.device))  # the optimizer wrote the shard
        with torch.cuda.stream(stream):
            token = self._encode_timer.start()
            codec.encode(shard=self._shard, state=self._state, out=send)
            self._needed.copy_(send[: HEADER_BYTES].view(torch.int64)[2])
            self._encode_timer.stop(token)
            event = torch.cuda.Event()
            event.record(stream)
        for t in (self._send, self._needed, self._state, self.buffer):  # alive until the stream is done
            if t is not None:
                t.record_stream(stream)
        return event

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

    def _fail(self) -> None:
        """A local failure: caches are undefined here, so the next agreement makes the bucket raw on
        every rank."""
        self._failed = True
        self.invalidate()

    # -- completion ----------------------------------------------------------------------------------
    def _finish(self, work, plan: Plan, launched: float) -> None:
        try:
            work.wait()
            self._stats.comm_s += time.perf_counter() - launched
            if plan.raw:
                self._raw_left = max(0, self._raw_left - 1)
                wire = self._raw_bucket_bytes()
            else:
                codec = self._codecs[plan.codec_name]
                token = self._decode_timer.start()
                codec.decode_many(payloads=self._recv[: self.world * plan.size], rows=self._rows,
                                  offsets=self._offsets, targets=self._shards)
                self._decode_timer.stop(token)
                wire = self.world * plan.size
            self._account(plan, wire=wire)
            self._maybe_verify()
        except BaseException:
            self._fail()
            raise

    def _raw_bucket_bytes(self) -> int:
        return self._raw_bytes

    def _account(self, plan: Plan, *, wire: int) -> None:
        s = self._stats
        s.gathers += 1
        s.raw_bytes += self._raw_bucket_bytes()
        s.wire_bytes += wire
        if plan.raw:
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


_MIX = (-0x40A7B892E31B1A47, -0x6B2FB644ECCEEE15)  # splitmix64 finalizer constants (as int64)
_CHUNK = 1 << 20


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 (wrapping; logical shifts by masking): a bijection whose
    every output bit depends on every input bit."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _MIX[0]
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _MIX[1]
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def shard_hashes(buffer: torch.Tensor, world: int, *, salt: int = 0) -> torch.Tensor:
    """A 64-bit hash of each of ``world`` shards' bit patterns: ``[world]`` int64.

    ``sum_i mix(bits_i * a + i * b + c)`` with odd multipliers ``a, b`` and offset ``c`` drawn from
    ``salt``: any change to a shard changes its hash except with probability ~2^-64 per check
    (unlike a linear checksum, where +1, -2, +1 on neighbouring values cancels). Equal on every
    device for equal buffers and salts; the work is elementwise plus one sum per chunk."""
    gen = torch.Generator().manual_seed(0xC1E7A + salt)
    a, b, c = (int(v) | 1 for v in torch.randint(-(1 << 62), 1 << 62, (3,), generator=gen))
    shards = as_bits(buffer).view(world, -1)
    n = shards.shape[1]
    out = torch.zeros(world, dtype=torch.int64, device=buffer.device)
    for lo in range(0, n, _CHUNK):
        v = shards[:, lo : lo + _CHUNK].to(torch.int64)
        pos = torch.arange(lo, lo + v.shape[1], dtype=torch.int64, device=buffer.device)
        out += _mix64(v * a + pos * b + c).sum(1)
    return out


def verify_replicas(buffer: torch.Tensor, *, group=None, name: str = "bucket", salt: int = 0) -> None:
    """Check that every rank of ``group`` holds the same ``buffer``; raise :class:`CieraVerifyError`
    naming the bucket, the shard (its owner rank) and the ranks that disagree. Every rank reads the
    same gathered table, so every rank raises together."""
    world = dist.get_world_size(group)
    mine = shard_hashes(buffer, world, salt=salt)
    everyone = torch.empty(world * world, dtype=torch.int64, device=buffer.device)
    all_gather_into(everyone, mine, group=group)
    table = everyone.view(world, world).cpu()
    for shard in range(world):
        bad = [r for r in range(world) if table[r, shard] != table[shard, shard]]
        if bad:
            raise CieraVerifyError(
                f"{name}: shard {shard} (owned by rank {shard}) differs from its owner's values on "
                f"ranks {bad}: a receiver's cache was stale (a write to the buffer outside the gather "
                f"without invalidate()?) or a codec is broken"
            )
