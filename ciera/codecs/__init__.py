"""Codecs: fixed-capacity, in-place-decodable encodings of one rank's parameter shard.

Importing this package registers every built-in codec.
"""

from . import delta as _delta  # noqa: F401  (registers)
from . import delta_ans as _delta_ans  # noqa: F401  (registers)
from . import exponent_reuse as _exponent_reuse  # noqa: F401  (registers)
from . import raw as _raw  # noqa: F401  (registers)
from .base import ALIGN, FLAG_OVERFLOW, HEADER_BYTES, Codec, PayloadHeader, read_headers
from .formats import FORMATS, FloatFormat, as_bits, float_format
from .registry import available_codecs, make_codec, register_codec

__all__ = [
    "ALIGN", "FLAG_OVERFLOW", "HEADER_BYTES", "FORMATS", "Codec", "FloatFormat", "PayloadHeader",
    "as_bits", "available_codecs", "float_format", "make_codec", "read_headers", "register_codec",
]
