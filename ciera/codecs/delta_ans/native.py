"""Native ``delta_ans``: same signatures as :mod:`ciera.codecs.delta_ans`'s references."""

from __future__ import annotations

from ...native import _lib
from .codec import DeltaAnsCodec

NAME = DeltaAnsCodec.name

_c_layout, encode_native, decode_native, decode_many_native, direct = _lib.twin(codec_type=DeltaAnsCodec,
                                                                                symbol="dans")
