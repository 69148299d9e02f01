"""Codec registry: names to classes, and one constructor for all of them."""

from __future__ import annotations

from types import MappingProxyType

import torch

from .base import Codec

WIRE_WORDS = MappingProxyType({
    "corrupt": -3, "replay": -2, "failed": -1,
    "raw": 0, "exponent_reuse": 1, "delta": 2, "delta_ans": 3,
})
"""The one table of wire words. A codec's id (>= 0) is the codec byte of its payload header and the
word a rank proposes in the agreement when it encoded with that codec; the negative words are the
agreement's other proposals (:data:`ciera.agreement.FLAG_FAILED` and the like). ``raw`` is 0 in
both roles and means the same there: the shard travels as it is (``RawCodec``'s header, or a
proposal to send raw; the gather never proposes ``RawCodec`` itself). The C library's
``CIERA_CODEC_*`` ids are the positive words (``tests/codecs/test_native.py`` compares them).
Changing a word changes the wire: peers built from different commits would misread each other."""


class _Registry:
    """Name -> codec class. One instance lives in this module; codecs register at import."""

    def __init__(self):
        self._by_name: dict[str, type[Codec]] = {}

    def register(self, cls: type[Codec]) -> type[Codec]:
        if WIRE_WORDS.get(cls.name, -1) < 0 or cls.codec_id != WIRE_WORDS[cls.name]:
            raise ValueError(f"codec {cls.name!r} has id {cls.codec_id}, but the wire table WIRE_WORDS gives "
                             f"{WIRE_WORDS.get(cls.name, 'none')}: a codec's id is its entry there")
        other = {c.codec_id: n for n, c in self._by_name.items()}
        if cls.name in self._by_name or cls.codec_id in other:
            raise ValueError(f"codec {cls.name!r} (id {cls.codec_id}) is already registered")
        self._by_name[cls.name] = cls
        return cls

    def get(self, name: str) -> type[Codec]:
        try:
            return self._by_name[name]
        except KeyError:
            raise ValueError(f"unknown codec {name!r}; registered: {sorted(self._by_name)}") from None

    def names(self) -> list[str]:
        return sorted(self._by_name)


REGISTRY = _Registry()
register_codec = REGISTRY.register


def available_codecs() -> list[str]:
    """Names of every registered codec."""
    return REGISTRY.names()


def make_codec(
    name: str, *, dtype: torch.dtype, numel: int, block_size: int | None = None, backend: str = "auto"
) -> Codec:
    """Build codec ``name`` for shards of ``numel`` values of ``dtype``.

    ``block_size`` is the codec's block parameter (values per block); ``None`` takes its default.
    """
    cls = REGISTRY.get(name)
    kwargs = {} if block_size is None else {"block_size": block_size}
    return cls(dtype=dtype, numel=numel, backend=backend, **kwargs)
