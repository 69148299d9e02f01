"""Native ``delta_ans``: same signatures as :mod:`ciera.codecs.delta`'s references."""

from __future__ import annotations

import ctypes
import functools

import torch

from ..codecs.delta_ans import DeltaAnsCodec, DeltaAnsLayout
from . import _lib

NAME = DeltaAnsCodec.name


@functools.lru_cache(maxsize=256)
def _c_layout(layout: DeltaAnsLayout):
    """``layout`` as the library's ``ciera_dans_layout`` (its fields read from the library)."""
    return _lib.c_layout(codec_id=DeltaAnsCodec.codec_id, name=NAME, layout=layout)


def encode_native(*, layout: DeltaAnsLayout, shard_bits: torch.Tensor, state: torch.Tensor, out: torch.Tensor) -> int:
    """Writes the payload's sections (not the header; nothing when it does not fit) as
    ``encode_reference`` does, updates ``state`` and returns the bytes needed."""
    n, bits = layout.numel, layout.fmt.bits_dtype
    _lib.check(NAME, "shard_bits", shard_bits, bits, n)
    _lib.check(NAME, "state", state, bits, n)
    _lib.check(NAME, "out", out, torch.uint8)
    needed = _lib.library().ciera_dans_encode(ctypes.addressof(_c_layout(layout)), shard_bits.data_ptr(),
                                               state.data_ptr(), out.data_ptr(), out.numel(), _lib.threads())
    _lib.raise_for(NAME, needed)
    return int(needed)


def decode_native(*, layout: DeltaAnsLayout, payload: torch.Tensor, target_bits: torch.Tensor) -> None:
    """``target_bits`` (previous values) becomes the encoded shard, as with ``decode_reference``."""
    _lib.check(NAME, "payload", payload, torch.uint8)
    _lib.check(NAME, "target_bits", target_bits, layout.fmt.bits_dtype, layout.numel)
    rc = _lib.library().ciera_dans_decode(ctypes.addressof(_c_layout(layout)), payload.data_ptr(),
                                           payload.numel(), target_bits.data_ptr(), _lib.threads())
    _lib.raise_for(NAME, rc)


def decode_many_native(*, layout: DeltaAnsLayout, payloads: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor,
                       targets_bits: torch.Tensor) -> None:
    """Decode the payload at ``offsets[i]`` into row ``rows[i]`` of ``targets_bits`` for every i; each
    payload's length is the needed bytes in its header (checked, with the codec id and overflow flag)."""
    _lib.decode_many(name=NAME, codec_id=DeltaAnsCodec.codec_id, clayout=_c_layout(layout),
                     bits_dtype=layout.fmt.bits_dtype, numel=layout.numel, payloads=payloads, rows=rows,
                     offsets=offsets, targets_bits=targets_bits)


def direct(codec: DeltaAnsCodec) -> _lib.Direct:
    """``codec``'s encode and decode in one C call each (see :class:`ciera.native._lib.Direct`)."""
    layout = codec.layout
    return _lib.Direct(codec_id=DeltaAnsCodec.codec_id, clayout=_c_layout(layout), numel=layout.numel, dtype=codec.dtype,
                       state_dtype=layout.fmt.bits_dtype, fixed_bytes=codec.fixed_bytes, name=NAME)
