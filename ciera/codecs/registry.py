"""Codec registry: names to classes, and one constructor for all of them."""

from __future__ import annotations

import torch

from .base import Codec


class _Registry:
    """Name -> codec class. One instance lives in this module; codecs register at import."""

    def __init__(self):
        self._by_name: dict[str, type[Codec]] = {}

    def register(self, cls: type[Codec]) -> type[Codec]:
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
