"""CieraAllGather: a lossless, compressed drop-in for ``all_gather_into_tensor`` on a bucket.

Layout, as in Megatron's distributed optimizer: rank ``r`` owns ``buffer[r*n:(r+1)*n]`` with
``n = numel // world``. Before each gather, the owner has overwritten its shard with new values
and every other shard of ``buffer`` still holds the previous gather's values: that is the
receivers' cache, so receivers keep no state at all. The sender keeps only what its codec needs
of its own previous shard.

One gather in steady state is ONE collective: every rank encodes its shard into a payload of the
same fixed capacity, the payloads are all-gathered, and each rank decodes the others' payloads in
place. Every rank reads the same gathered headers, so all ranks take the same decisions without
further communication:

* if any payload overflowed, every rank follows with a plain all-gather of the buffer (the
  overflowing rank's payload is never decoded), and
* the next capacity is ``headroom x`` the largest payload needed over a recent window.

Invariant kept by every path: when ``wait()`` returns, ``buffer`` equals what
``all_gather_into_tensor`` would have produced, bit for bit, and the sender's codec state
describes its shard. Any exception inside a gather invalidates the caches, so the next gather is
raw.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time

import torch
import torch.distributed as dist

from .codecs import HEADER_BYTES, Codec, PayloadHeader, make_codec, read_headers
from .codecs.formats import FORMATS, as_bits, float_format
from .comm import all_gather_into
from .config import CieraConfig
from .selection import Measurements, Selector
from .stats import GatherStats, SectionTimer

logger = logging.getLogger(__name__)

_DTYPE_CODES = {dtype: i + 1 for i, dtype in enumerate(FORMATS)}
_CONCRETE_CODECS = ("exponent_reuse", "delta")


class CieraVerifyError(RuntimeError):
    """The gathered buffers of two ranks disagree: a cache was stale or a codec is broken."""


class _DoneHandle:
    """Handle of a gather that finished inside ``start()``."""

    def wait(self) -> None:
        return None


class GatherHandle:
    """Returned by :meth:`CieraAllGather.start`; :meth:`wait` completes the gather in place."""

    def __init__(self, owner: "CieraAllGather", work, mode: str, capacity: int, launched: float):
        self._owner, self._work, self._mode = owner, work, mode
        self._capacity, self._launched = capacity, launched
        self._done = False

    def wait(self) -> None:
        """Block until the collective is done, then decode the other ranks' payloads in place.
        Idempotent."""
        if self._done:
            return
        self._done = True
        self._owner._finish(self._work, self._mode, self._capacity, self._launched)


class CieraAllGather:
    """Compressed, bit-exact all-gather of one flat parameter bucket.

    Args:
        buffer: flat contiguous bf16/fp16/fp32 tensor whose size is divisible by the group size.
        group: process group (default: the world).
        config: a :class:`CieraConfig`; must be equal on every rank of ``group``.
        name: used in logs and error messages (e.g. ``"expert.bucket3"``).

        measurements: a :class:`ciera.selection.Measurements` shared by the gathers of ``group``,
            so that the link and the codec speeds the cost model needs are measured once per group
            (``selection='auto'`` or ``codec='auto'``); a private one when omitted.

    Construction is collective over ``group``: it checks that every rank passed the same config,
    dtype and size, and fails with a clear error otherwise.
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
        self._shards = buffer.view(self.world, self.shard_numel)
        self._shard = self._shards[self.rank]
        self._check_agreement()

        self._codecs: dict[str, Codec] = {c: self._make_codec(c) for c in self._candidate_codecs()}
        self._codec_name: str | None = next(iter(self._codecs), None)
        self._state = None  # sender state of self._codec_name, valid iff self._raw_left == 0
        self._raw_left = config.warmup_gathers
        self._needed: collections.deque[int] = collections.deque(maxlen=config.capacity_window)
        self._capacity = self._initial_capacity()
        self._send = self._recv = None
        self._pending: GatherHandle | None = None
        self._stats = GatherStats(codec="raw", capacity_bytes=self._capacity)
        self._encode_timer = SectionTimer(buffer.device)
        self._decode_timer = SectionTimer(buffer.device)
        self._started = 0
        self._prepared: tuple[str, int, object] | None = None  # (mode, capacity, cuda event)
        self._side_stream = None
        decides = config.selection == "auto" or len(self._codecs) > 1
        self.selector = (Selector(self, measurements=measurements or Measurements())
                         if self._codecs and decides else None)

    # -- public API ------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Encode this rank's shard now, ahead of :meth:`start`.

        Call once the shard holds its new values (right after the optimizer step). On CUDA the
        encode runs on a side stream, overlapping whatever the caller queues next; ``start()``
        then only launches the collective. Optional: ``start()`` prepares when this was not called.
        """
        if self._prepared is not None:
            return
        if self._pending is not None and not self._pending._done:
            raise RuntimeError(f"{self.name}: a new gather was prepared while the previous one is not waited on")
        if self.world == 1:
            self._prepared = ("raw", 0, None)
            return
        try:
            mode = self._choose_mode()
            self._started += 1
            event = None
            if mode == "raw":
                self._prepare_state_after_raw()
            else:
                send, _ = self._payload_buffers(self._capacity)
                event = self._encode(mode, send)
            self._prepared = (mode, self._capacity if mode != "raw" else 0, event)
        except BaseException:
            self.invalidate()
            raise

    def start(self) -> GatherHandle | _DoneHandle:
        """Encode this rank's shard (unless :meth:`prepare` did) and launch the collective.
        Returns a handle; call ``wait()`` on it before reading the other shards or starting the
        next gather."""
        if self._pending is not None and not self._pending._done:
            raise RuntimeError(f"{self.name}: start() called while the previous gather is not waited on")
        self.prepare()
        mode, capacity, event = self._prepared
        self._prepared = None
        if self.world == 1:
            self._account(raw=True, wire=self._raw_bucket_bytes())
            return _DoneHandle()
        try:
            launched = time.perf_counter()
            if event is not None:
                torch.cuda.current_stream(self.buffer.device).wait_event(event)
            if mode == "raw":
                work = all_gather_into(self.buffer, self._shard, group=self.group, async_op=True)
            else:
                send, recv = self._payload_buffers(capacity)
                work = all_gather_into(recv, send, group=self.group, async_op=True)
        except BaseException:
            self.invalidate()
            raise
        self._pending = GatherHandle(self, work, mode, capacity, launched)
        return self._pending

    def _encode(self, mode: str, send: torch.Tensor):
        """Encode the shard into ``send``; on CUDA on the side stream, returning its done event."""
        codec = self._codecs[mode]
        if not self.buffer.is_cuda:
            token = self._encode_timer.start()
            codec.encode(shard=self._shard, state=self._state, out=send)
            self._encode_timer.stop(token)
            return None
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=self.buffer.device)
        self._side_stream.wait_stream(torch.cuda.current_stream(self.buffer.device))
        with torch.cuda.stream(self._side_stream):
            token = self._encode_timer.start()
            codec.encode(shard=self._shard, state=self._state, out=send)
            self._encode_timer.stop(token)
            event = torch.cuda.Event()
            event.record(self._side_stream)
        return event

    def invalidate(self) -> None:
        """Forget all cached state: the next ``config.warmup_gathers`` gathers are sent raw.

        Call after ANY write to ``buffer`` outside the gather (checkpoint load, parameter
        broadcast, offload/reload): receivers' caches would otherwise be stale. Must be called on
        every rank of the group (all ranks must take the same path)."""
        self._raw_left = max(self._raw_left, self.config.warmup_gathers)
        self._state = None
        self._prepared = None  # a payload encoded before the write would be stale

    @property
    def stats(self) -> GatherStats:
        """A snapshot of the cumulative counters."""
        self._stats.encode_s = self._encode_timer.total()
        self._stats.decode_s = self._decode_timer.total()
        self._stats.capacity_bytes = self._capacity
        return dataclasses.replace(self._stats)

    @property
    def codec(self) -> Codec | None:
        """The codec compressed gathers use now (``None`` when this gather never compresses)."""
        return self._codecs.get(self._codec_name) if self._codec_name else None

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

    def _initial_capacity(self) -> int:
        codec = self.codec
        if codec is None:
            return 0
        span = codec.max_bytes - codec.fixed_bytes
        return codec.clamp_capacity(codec.fixed_bytes + math.ceil(self.config.initial_capacity * span))

    # -- per-gather decisions ----------------------------------------------------------------------
    def _choose_mode(self) -> str:
        """'raw' or the codec to use for this gather. Identical on every rank by construction: it
        depends only on config and on figures every rank derived from the same gathered headers."""
        if not self._codecs:
            return "raw"
        if self.selector is not None:
            self.selector.before_gather(self._started, warmup_left=self._raw_left)
        if self._codec_name is None or self._raw_left > 0:
            return "raw"
        return self._codec_name

    def _switch(self, name: str | None, *, previous_shard: torch.Tensor | None, needed: int | None) -> None:
        """Use codec ``name`` (``None``: raw) from this gather on. Receivers hold
        ``previous_shard``, so the new codec's state is built from it: no raw round is needed."""
        self._codec_name = name
        self._state = None
        if name is None:
            return
        self._state = self._codecs[name].new_state(shard=previous_shard)
        self._needed.clear()
        if needed is not None:
            self._update_capacity(self._codecs[name], needed)

    def _encode_probe(self, name: str, previous_shard: torch.Tensor) -> int:
        """Bytes codec ``name`` needs for this shard against ``previous_shard`` (local, no collective)."""
        codec = self._codecs[name]
        scratch = torch.empty(codec.clamp_capacity(codec.max_bytes), dtype=torch.uint8, device=self.buffer.device)
        codec.encode(shard=self._shard, state=codec.new_state(shard=previous_shard), out=scratch)
        return PayloadHeader(scratch[:HEADER_BYTES].view(torch.int64).cpu()).needed

    def _prepare_state_after_raw(self) -> None:
        """A raw gather is launching: afterwards receivers hold this shard exactly, so the codec
        state is refreshed from it now (the shard does not change until the next start())."""
        codec = self.codec
        if codec is None:
            return
        if self._state is None:
            self._state = codec.new_state(shard=self._shard)
        else:
            codec.reset_state(state=self._state, shard=self._shard)

    def _payload_buffers(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._send is None or self._send.numel() < capacity:
            dev = self.buffer.device
            self._send = torch.empty(capacity, dtype=torch.uint8, device=dev)
            self._recv = torch.empty(self.world * capacity, dtype=torch.uint8, device=dev)
        return self._send[:capacity], self._recv[: self.world * capacity]

    # -- completion ----------------------------------------------------------------------------------
    def _finish(self, work, mode: str, capacity: int, launched: float) -> None:
        try:
            work.wait()
            if mode == "raw":
                self._raw_left = max(0, self._raw_left - 1)
                self._stats.comm_s += time.perf_counter() - launched
                self._account(raw=True, wire=self._raw_bucket_bytes())
            else:
                self._finish_compressed(mode, capacity, launched)
            self._maybe_verify()
        except BaseException:
            self.invalidate()
            raise

    def _finish_compressed(self, mode: str, capacity: int, launched: float) -> None:
        codec = self._codecs[mode]
        payloads = self._recv[: self.world * capacity].view(self.world, capacity)
        headers = [PayloadHeader(words) for words in read_headers(payloads)]
        self._stats.comm_s += time.perf_counter() - launched
        needed = [h.needed for h in headers]
        overflowed = [r for r, h in enumerate(headers) if h.overflow]
        wire = self.world * capacity
        if overflowed:
            # Every rank sees the same headers, so every rank takes this branch together.
            logger.debug("%s: payload overflow on ranks %s (needed %s B, capacity %s B): raw round",
                         self.name, overflowed, max(needed), capacity)
            all_gather_into(self.buffer, self._shard, group=self.group)
            wire += self._raw_bucket_bytes()
            self._stats.overflows += 1
        else:
            token = self._decode_timer.start()
            for r in range(self.world):
                if r != self.rank:
                    codec.decode(payload=payloads[r], target=self._shards[r], header=headers[r])
            self._decode_timer.stop(token)
        self._stats.payload_bytes += sum(min(n, capacity) for n in needed)
        self._stats.variable_bytes += sum(n - codec.fixed_bytes for n in needed)
        self._stats.variable_bytes_max += self.world * (codec.max_bytes - codec.fixed_bytes)
        self._stats.codec = mode
        self._account(raw=False, wire=wire)
        self._update_capacity(codec, max(needed))

    def _update_capacity(self, codec: Codec, needed_max: int) -> None:
        self._needed.append(needed_max)
        self._capacity = codec.clamp_capacity(math.ceil(self.config.capacity_headroom * max(self._needed)))

    def _raw_bucket_bytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def _account(self, *, raw: bool, wire: int) -> None:
        s = self._stats
        s.gathers += 1
        s.raw_bytes += self._raw_bucket_bytes()
        s.wire_bytes += wire
        if raw:
            s.raw_gathers += 1
        else:
            s.compressed_gathers += 1

    # -- verification ----------------------------------------------------------------------------
    def _maybe_verify(self) -> None:
        every = self.config.verify_interval
        if every and self._stats.gathers % every == 0:
            verify_replicas(self.buffer, group=self.group, name=self.name)


def shard_checksums(buffer: torch.Tensor, world: int) -> torch.Tensor:
    """Two position-weighted sums of the bit patterns of each of ``world`` shards: ``[world, 2]``
    int64 (wrapping arithmetic; equal buffers give equal sums on every device)."""
    shards = as_bits(buffer).view(world, -1)
    out = torch.empty(world, 2, dtype=torch.int64, device=buffer.device)
    weights = torch.arange(1, shards.shape[1] + 1, dtype=torch.int64, device=buffer.device)
    for r in range(world):
        v = shards[r].to(torch.int64)
        out[r, 0] = v.sum()
        out[r, 1] = (v * weights).sum()
    return out


def verify_replicas(buffer: torch.Tensor, *, group=None, name: str = "bucket") -> None:
    """Check that every rank of ``group`` holds the same ``buffer``; raise :class:`CieraVerifyError`
    naming the bucket, the shard (its owner rank) and the ranks that disagree."""
    world = dist.get_world_size(group)
    mine = shard_checksums(buffer, world)
    everyone = torch.empty(world * mine.numel(), dtype=torch.int64, device=buffer.device)
    all_gather_into(everyone, mine.reshape(-1), group=group)
    table = everyone.view(world, world, 2).cpu()
    for shard in range(world):
        owner_view = table[shard, shard]
        bad = [r for r in range(world) if not torch.equal(table[r, shard], owner_view)]
        if bad:
            raise CieraVerifyError(
                f"{name}: shard {shard} (owned by rank {shard}) differs from its owner's values on "
                f"ranks {bad}: a receiver's cache was stale (a write to the buffer outside the gather "
                f"without invalidate()?) or a codec is broken"
            )
