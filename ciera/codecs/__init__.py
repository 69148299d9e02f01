"""Codecs: fixed-capacity, in-place-decodable encodings of one rank's parameter shard.

One folder per codec (``raw/``, ``exponent_reuse/``, ``delta/``, ``delta_ans/``), each registering
itself with its descriptor (:class:`CodecSpec`) when imported; importing this package registers every
built-in codec. A third-party codec is a package of its own that calls :func:`register_codec` when
imported (see docs/library.md, "Adding a codec").
"""

from . import delta as _delta  # noqa: F401  (registers)
from . import delta_ans as _delta_ans  # noqa: F401  (registers)
from . import exponent_reuse as _exponent_reuse  # noqa: F401  (registers)
from . import raw as _raw  # noqa: F401  (registers)
from .base import ALIGN, FLAG_OVERFLOW, HEADER_BYTES, Codec, PayloadHeader, read_headers
from .formats import FORMATS, FloatFormat, as_bits, float_format
from .registry import CodecSpec, available_codecs, codec_spec, codec_specs, make_codec, register_codec

__all__ = [
    "ALIGN", "FLAG_OVERFLOW", "HEADER_BYTES", "FORMATS", "Codec", "CodecSpec", "FloatFormat", "PayloadHeader",
    "as_bits", "available_codecs", "codec_spec", "codec_specs", "float_format", "make_codec", "read_headers",
    "register_codec",
]
