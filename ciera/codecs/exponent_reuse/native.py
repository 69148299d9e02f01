"""Native ``exponent_reuse``: same signatures as :mod:`ciera.codecs.exponent_reuse`'s references."""

from __future__ import annotations

import torch

from ...native import _lib
from .codec import ExponentReuseCodec

NAME = ExponentReuseCodec.name

# The state is one byte per value (see ExponentReuseCodec.new_state).
_c_layout, encode_native, decode_native, decode_many_native, direct = _lib.twin(
    codec_type=ExponentReuseCodec, symbol="er", state_dtype=torch.uint8)
