"""Codecs: fixed-capacity, in-place-decodable encodings of one rank's parameter shard.

One folder per codec (``raw/``, ``exponent_reuse/``, ``delta/``, ``delta_ans/``), each registering
itself with its descriptor (:class:`CodecSpec`) when imported; importing this package imports every
subpackage, so every built-in codec is registered and a new folder needs no line here. A third-party
codec is a package of its own that calls :func:`register_codec` when imported (see docs/library.md,
"Adding a codec").
"""

import importlib as _importlib
import pkgutil as _pkgutil

from .base import ALIGN, FLAG_OVERFLOW, HEADER_BYTES, Codec, PayloadHeader, read_headers
from .formats import FORMATS, FloatFormat, as_bits, float_format
from .registry import CodecSpec, available_codecs, codec_spec, codec_specs, make_codec, register_codec

__all__ = [
    "ALIGN", "FLAG_OVERFLOW", "HEADER_BYTES", "FORMATS", "Codec", "CodecSpec", "FloatFormat", "PayloadHeader",
    "as_bits", "available_codecs", "codec_spec", "codec_specs", "float_format", "make_codec", "read_headers",
    "register_codec",
]

for _folder in sorted(m.name for m in _pkgutil.iter_modules(__path__) if m.ispkg):
    _importlib.import_module(f"{__name__}.{_folder}")  # a codec folder: registers its codec
