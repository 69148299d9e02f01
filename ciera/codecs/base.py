"""The codec interface: self-describing payloads, in-place decoding, batched decode.

A codec turns one rank's shard into a payload written into a buffer of a capacity the caller
chooses. Layout of every payload::

    header   32 bytes: int64 words [magic|codec id, flags, needed bytes, capacity]
    sections codec specific, each 16-byte aligned; a fixed part, then a variable part

``capacity`` is the size of the buffer the payload was encoded into, not the size it travels in:
the gather encodes into a buffer of ``max_bytes`` (never overflows) and sends exactly the agreed
size, so a received payload may be any length ``>= needed``. Decoders take every length from the
header and the layout.

Invariants every codec keeps:

* ``encode`` writes only inside ``out`` (``capacity`` bytes). When the shard needs more than that it
  sets ``FLAG_OVERFLOW`` and the true size in the header; such a payload must never be decoded.
* ``decode`` is in place: ``target`` holds the previous values of the same shard (what every
  receiver already has after the last gather) and receives the new values. No other receiver state.
* ``state`` is the sender's own memory of its previous shard, updated by every ``encode`` and by
  :meth:`Codec.reset_state` after a gather that did not go through the codec. Receivers and sender
  agree as long as every gather ends with every rank holding the new shard (the gather's contract).
"""

from __future__ import annotations

import abc
import ctypes
import importlib
import os
import struct
from typing import ClassVar

import torch

from .deferred import DeferredErrors, DeviceError
from .formats import FloatFormat, as_bits, float_format

HEADER_BYTES = 32
ALIGN = 16
MAGIC = 0xC1E7A
FLAG_OVERFLOW = 1

_H_MAGIC, _H_FLAGS, _H_NEEDED, _H_CAPACITY = range(4)
_HEADER = struct.Struct("<4q")
"""The header's four little-endian int64 words, for host reads and writes of CPU payloads."""


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def write_header(out: torch.Tensor, *, codec_id: int, needed: torch.Tensor | int, capacity: int) -> None:
    """Fill the 32-byte header of ``out``. ``needed`` may be a device tensor (no host sync)."""
    if isinstance(needed, int) and out.is_cpu and out.is_contiguous() and out.numel() >= HEADER_BYTES:
        # A host int into a CPU buffer: one 32-byte copy instead of a handful of tensor ops (each
        # of which costs tens of microseconds after the codec's own streams have left the caches).
        words = _HEADER.pack((MAGIC << 8) | codec_id, FLAG_OVERFLOW if needed > capacity else 0, needed, capacity)
        ctypes.memmove(out.data_ptr(), words, HEADER_BYTES)
        return
    header = out[:HEADER_BYTES].view(torch.int64)
    needed = torch.as_tensor(needed, dtype=torch.int64, device=out.device)
    header[_H_MAGIC] = (MAGIC << 8) | codec_id
    header[_H_FLAGS] = (needed > capacity).to(torch.int64) * FLAG_OVERFLOW
    header[_H_NEEDED] = needed
    header[_H_CAPACITY] = capacity


def read_headers(payloads: torch.Tensor) -> torch.Tensor:
    """Headers of ``[world, capacity]`` uint8 payloads as a ``[world, 4]`` int64 CPU tensor."""
    return payloads[:, :HEADER_BYTES].contiguous().view(torch.int64).reshape(-1, 4).cpu()


def payload_needed(payloads: torch.Tensor, offset: int) -> int:
    """Bytes the payload starting at byte ``offset`` of flat ``payloads`` needs (host read: for
    reference implementations and tests)."""
    return int(payloads[offset + 8 * _H_NEEDED : offset + 8 * _H_NEEDED + 8].view(torch.int64)[0])


def decode_many_of(decode):
    """The batched reference decoder of a codec whose one-payload reference is
    ``decode(*, layout, payload, target_bits)``: ``decode_many_reference(*, layout, payloads, rows,
    offsets, targets_bits)`` (:meth:`Codec.decode_many`'s signature) decodes the payload of flat
    ``payloads`` starting at ``offsets[i]`` into row ``rows[i]`` of ``targets_bits``, one ``decode``
    call each (it reads ``rows``/``offsets`` and the headers on the host)."""

    def decode_many_reference(*, layout, payloads: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor,
                              targets_bits: torch.Tensor) -> None:
        for row, off in zip(rows.tolist(), offsets.tolist()):
            payload = payloads[off : off + payload_needed(payloads, off)]
            decode(layout=layout, payload=payload, target_bits=targets_bits[row])

    decode_many_reference.__doc__ = f"Pure-torch batched decoder: {decode.__module__}.{decode.__name__} per payload."
    return decode_many_reference


class PayloadHeader:
    """Decoded view of one payload header (host side)."""

    def __init__(self, words: torch.Tensor | tuple[int, ...]):
        w = [int(x) for x in (words.tolist() if isinstance(words, torch.Tensor) else words)]
        self.magic, self.codec_id = w[_H_MAGIC] >> 8, w[_H_MAGIC] & 0xFF
        self.flags, self.needed, self.capacity = w[_H_FLAGS], w[_H_NEEDED], w[_H_CAPACITY]

    @property
    def overflow(self) -> bool:
        return bool(self.flags & FLAG_OVERFLOW)


class Codec(abc.ABC):
    """One codec bound to one shard shape: ``numel`` values of ``dtype``.

    Subclasses define the section layout and a pure-torch reference; a Triton twin with the same
    signature is used automatically for CUDA tensors when ``backend='auto'`` and Triton imports.
    """

    spec: ClassVar  # a ciera.codecs.registry.CodecSpec (not imported here: the registry imports this module)
    """The codec's descriptor (:class:`ciera.codecs.registry.CodecSpec`): every property the rest of
    the library asks about. ``name``, ``codec_id``, ``reads_previous`` and ``kernels`` are copied
    from it onto the class."""
    name: ClassVar[str]
    codec_id: ClassVar[int]
    reads_previous: ClassVar[str] = "values"
    """What ``decode`` reads of a target's previous contents: ``"values"`` (it adds to them),
    ``"exponents"`` (only the exponent bits; decoding the same payload twice gives the same
    values), or ``"nothing"``. A receiver cache must keep at least this."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        spec = cls.__dict__.get("spec")
        if spec is not None:
            cls.name, cls.codec_id, cls.reads_previous, cls.kernels = (
                spec.name, spec.codec_id, spec.reads_previous, spec.kernels)

    def __init__(self, *, dtype: torch.dtype, numel: int, backend: str = "auto"):
        if numel < 0:
            raise ValueError(f"numel={numel} must be >= 0")
        if backend not in ("auto", "torch", "triton", "native"):
            raise ValueError(f"backend={backend!r}; expected 'auto', 'torch', 'triton' or 'native'")
        self.fmt: FloatFormat = float_format(dtype)
        self.dtype = dtype
        self.numel = numel
        self.backend = backend

    # -- sizes ---------------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def fixed_bytes(self) -> int:
        """Smallest valid capacity: header plus every fixed section."""

    @property
    @abc.abstractmethod
    def max_bytes(self) -> int:
        """Capacity that can never overflow (every value changed in the worst way)."""

    @property
    def raw_bytes(self) -> int:
        """Bytes of the shard itself."""
        return self.numel * self.fmt.itemsize

    def clamp_capacity(self, capacity: int) -> int:
        """``capacity`` rounded up to the alignment and clamped to [fixed_bytes, max_bytes]."""
        return min(max(align_up(int(capacity)), self.fixed_bytes), align_up(self.max_bytes))

    # -- state ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def new_state(self, *, shard: torch.Tensor) -> torch.Tensor | None:
        """Sender state describing ``shard`` as the previous values receivers hold."""

    @abc.abstractmethod
    def reset_state(self, *, state: torch.Tensor | None, shard: torch.Tensor) -> None:
        """Make ``state`` describe ``shard`` (after a gather that bypassed the codec)."""

    # -- coding --------------------------------------------------------------------------------
    # A codec's hot loops: module-level ``encode_reference(*, layout, shard_bits, state, out) ->
    # needed`` and ``decode_reference(*, layout, payload, target_bits)`` in pure torch, and their
    # Triton twins ``encode_triton`` / ``decode_triton`` with the same signatures in ``kernels``.
    encode_reference: ClassVar
    decode_reference: ClassVar
    decode_many_reference: ClassVar
    kernels: ClassVar[str | None] = None
    layout: object

    def encode(self, *, shard: torch.Tensor, state: torch.Tensor | None, out: torch.Tensor) -> None:
        """Encode ``shard`` against ``state`` into ``out`` (uint8, its whole length is the
        capacity) and update ``state`` to ``shard``. Never writes past ``out``; reports overflow
        in the header."""
        direct = self._direct(shard)
        if direct is not None and direct.encode(shard=shard, state=state, out=out):
            return
        self._check_shard(shard)
        cap = self._check_out(out)
        self._check_state(state)
        needed = self._impl("encode", shard)(layout=self.layout, shard_bits=as_bits(shard), state=state, out=out)
        write_header(out, codec_id=self.codec_id, needed=needed, capacity=cap)

    def decode(self, *, payload: torch.Tensor, target: torch.Tensor, header: PayloadHeader | None = None) -> None:
        """Rebuild the new shard in place: ``target`` holds the previous values on entry.

        ``header``: the payload's header already read on the host (saves a device sync);
        read from ``payload`` when omitted."""
        if header is None:
            direct = self._direct(target)
            if direct is not None and direct.decode(payload=payload, target=target):
                return
        self._check_shard(target, "target")
        self._check_payload(payload, header)
        self.raise_pending_errors()
        self._defer(self._impl("decode", target)(layout=self.layout, payload=payload, target_bits=as_bits(target)))

    def decode_many(self, *, payloads: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor,
                    targets: torch.Tensor) -> None:
        """Decode several payloads in place, in one call: row ``rows[i]`` of ``targets``
        (``[world, numel]``, the gathered bucket) becomes the shard whose payload starts at byte
        ``offsets[i]`` of the flat uint8 ``payloads``. ``rows`` and ``offsets`` are int64 tensors on
        the payloads' device and are never read on the host here; payload lengths come from their
        headers. Bit-identical to :meth:`decode` on each payload.

        Implementations (``decode_many_<impl>``): the Triton twin issues a fixed
        number of launches independent of ``len(rows)``; the reference loops over rows."""
        if targets.dim() != 2 or targets.shape[1] != self.numel or targets.dtype != self.dtype \
                or not targets.is_contiguous():
            raise ValueError(f"{self.name}: targets must be a contiguous [world, {self.numel}] {self.dtype} tensor")
        if payloads.dtype != torch.uint8 or payloads.dim() != 1 or not payloads.is_contiguous():
            raise ValueError(f"{self.name}: payloads must be a flat contiguous uint8 tensor")
        if rows.dtype != torch.int64 or offsets.dtype != torch.int64 or rows.shape != offsets.shape:
            raise ValueError(f"{self.name}: rows and offsets must be int64 tensors of one shape")
        self.raise_pending_errors()
        self._defer(self._decode_many_impl(targets)(layout=self.layout, payloads=payloads, rows=rows,
                                                    offsets=offsets, targets_bits=as_bits(targets)))

    def raise_pending_errors(self, *, wait: bool = False) -> None:
        """Raise the ``ValueError`` of a corrupt payload that a device decode of this codec found and
        has not reported yet: a decoder that checks payloads on a CUDA device returns its verdict
        without a host read (see :mod:`ciera.codecs.deferred`), and it is raised here, at the next
        decode, or at a caller's sync point. ``wait``: wait for every decode in flight first;
        otherwise only verdicts already copied to the host are read. Cheap when nothing is pending."""
        errors = self.__dict__.get("_deferred_errors")
        if errors is not None and errors.in_flight:
            errors.check(wait=wait)

    def _defer(self, found: DeviceError | None) -> None:
        """Keep a decoder's unread verdict (``None``: it raised or returned nothing to check)."""
        if found is not None:
            self.__dict__.setdefault("_deferred_errors", DeferredErrors()).push(found)

    def _decode_many_impl(self, t: torch.Tensor):
        """``decode_many_<impl>`` for tensors like ``t``, chosen as :meth:`_impl` chooses."""
        return self._impl("decode_many", t)

    def implementation(self, which: str, *, like: torch.Tensor) -> str:
        """The module whose ``<which>_<impl>`` runs ``which`` (``encode``, ``decode`` or
        ``decode_many``) for tensors like ``like``: a ``ciera.codecs`` reference, a ``ciera.native``
        or a ``ciera.kernels`` twin. For benchmarks and logs."""
        if which not in ("encode", "decode", "decode_many"):
            raise ValueError(f"{self.name}: implementation({which!r}): expected encode, decode or decode_many")
        return self._impl(which, like).__module__

    def _check_state(self, state) -> None:
        """Raise when ``state`` is not what :meth:`new_state` returns for this codec."""

    def _direct(self, t: torch.Tensor):
        """The native codec's one-call encode/decode (header included) for tensors like ``t``
        (:class:`ciera.native._lib.Direct`), or ``None``: not a CPU tensor, no native twin, or the
        backend is not ``auto``/``native``. Made once per codec; same bytes as :meth:`_impl`'s."""
        if not t.is_cpu:
            return None
        cache = self.__dict__
        if "_direct_calls" not in cache:
            native = self._native(t)
            cache["_direct_calls"] = native.direct(self) if native is not None and hasattr(native, "direct") else None
        return cache["_direct_calls"]

    def _impl(self, which: str, t: torch.Tensor):
        """The reference or, on CUDA (see :meth:`_use_triton`), the Triton twin of ``which``; on CPU
        the native twin when built (see :meth:`_native`)."""
        # The choice depends only on the backend and the tensor's device: made once per device kind
        # (the function itself is looked up on every call, so a patched module is honoured).
        key = (t.is_cpu, t.is_cuda)
        cache = self.__dict__.setdefault("_impl_sources", {})
        source = cache.get(key)
        if source is None:
            native = self._native(t)
            if native is not None:
                source = (native, "_native")
            elif self._use_triton(t):
                source = (importlib.import_module(self.kernels), "_triton")
            else:
                source = (type(self), "_reference")
            cache[key] = source
        return getattr(source[0], which + source[1])

    # -- helpers for subclasses ----------------------------------------------------------------
    def _check_shard(self, shard: torch.Tensor, what: str = "shard") -> None:
        if shard.dtype != self.dtype or shard.numel() != self.numel or not shard.is_contiguous():
            raise ValueError(
                f"{self.name}: {what} must be a contiguous {self.dtype} tensor of {self.numel} values; "
                f"got {shard.dtype} with {shard.numel()} values (contiguous={shard.is_contiguous()})"
            )

    def _check_out(self, out: torch.Tensor) -> int:
        cap = out.numel()
        if out.dtype != torch.uint8 or not out.is_contiguous():
            raise ValueError(f"{self.name}: payload must be a contiguous uint8 tensor")
        if cap < self.fixed_bytes or cap % ALIGN:
            raise ValueError(
                f"{self.name}: capacity {cap} B must be a multiple of {ALIGN} and >= the fixed part "
                f"{self.fixed_bytes} B (use clamp_capacity)"
            )
        return cap

    def _check_payload(self, payload: torch.Tensor, header: PayloadHeader | None = None) -> PayloadHeader:
        if payload.dtype != torch.uint8 or payload.numel() < HEADER_BYTES:
            raise ValueError(f"{self.name}: payload must be uint8 with at least a header")
        if header is not None:
            h = header
        elif payload.is_cpu and payload.is_contiguous():  # host bytes: no tensor ops
            h = PayloadHeader(_HEADER.unpack(ctypes.string_at(payload.data_ptr(), HEADER_BYTES)))
        else:
            h = PayloadHeader(payload[:HEADER_BYTES].contiguous().view(torch.int64).cpu())
        if h.magic != MAGIC or h.codec_id != self.codec_id:
            raise ValueError(
                f"{self.name}: payload header is not a {self.name} payload "
                f"(magic {h.magic:#x}, codec id {h.codec_id}, expected {MAGIC:#x}/{self.codec_id})"
            )
        if h.overflow:
            raise ValueError(
                f"{self.name}: refusing to decode an overflowed payload (needs {h.needed} B, "
                f"capacity {h.capacity} B); the sender must resend"
            )
        if h.needed > payload.numel():
            raise ValueError(f"{self.name}: payload of {payload.numel()} B is shorter than the {h.needed} B "
                             f"its header needs")
        return h

    def _native(self, t: torch.Tensor):
        """``ciera.native``'s module for this codec: CPU tensors under ``auto`` when the library is
        built (else ``None``: the reference), always under ``native`` (else a clear error)."""
        if self.backend not in ("auto", "native"):
            return None
        if t.device.type != "cpu":
            if self.backend == "native":
                raise RuntimeError(f"{self.name}: backend='native' runs on CPU tensors; got {t.device}")
            return None
        from ciera import native

        return native.codec_module(self.spec, required=self.backend == "native")

    def _use_triton(self, t: torch.Tensor) -> bool:
        if self.backend == "torch" or (self.backend == "auto" and not t.is_cuda):
            return False
        if self.kernels is None:
            if self.backend == "triton":
                raise RuntimeError(f"{self.name}: backend='triton' but this codec has no Triton twin")
            return False
        from ciera.kernels import triton_available

        if not triton_available():
            if self.backend == "triton":
                raise RuntimeError(f"{self.name}: backend='triton' but Triton is not importable")
            return False
        if not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(f"{self.name}: backend='triton' on a {t.device} tensor needs TRITON_INTERPRET=1 "
                               "set before Triton is imported")
        return True
