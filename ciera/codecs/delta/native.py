"""Native ``delta`` (csrc/delta.c): same signatures as :mod:`ciera.codecs.delta`'s references."""

from __future__ import annotations

import ctypes

import torch

from ...native import _lib
from .codec import DeltaCodec, DeltaLayout

NAME = DeltaCodec.name

_c_layout, encode_native, decode_native, decode_many_native, direct = _lib.twin(codec_type=DeltaCodec, symbol="delta")


def histogram_native(*, layout: DeltaLayout, shard_bits: torch.Tensor, state: torch.Tensor, lo: int = 0,
                     hi: int | None = None) -> torch.Tensor:
    """``histogram_reference`` of values ``[lo, hi)``, counted by the path an encode on this CPU takes."""
    n, bits = layout.numel, layout.fmt.bits_dtype
    _lib.check(NAME, "shard_bits", shard_bits, bits, n)
    _lib.check(NAME, "state", state, bits, n)
    hist = torch.empty(layout.n_classes * (layout.width + 1), dtype=torch.int64)
    rc = _lib.library().ciera_delta_histogram(ctypes.addressof(_c_layout(layout)), shard_bits.data_ptr(),
                                              state.data_ptr(), lo, n if hi is None else hi, hist.data_ptr())
    _lib.raise_for(NAME, rc)
    return hist
