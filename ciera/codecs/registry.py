"""Codec registry: each codec's descriptor (:class:`CodecSpec`), names to classes, one constructor.

A codec is a plugin: a folder (``ciera/codecs/<name>/`` for the built-in ones, any importable
package for others) whose codec class carries a :class:`CodecSpec` as ``spec`` and is registered
once with :func:`register_codec` when the package is imported. Everything that used to list codec
names by hand asks this registry instead: :class:`ciera.CieraConfig`'s validation and help, the
ZeRO-3 cache rules (:attr:`CodecSpec.reads_previous`), the gather's candidates for
``codec='auto'`` (:attr:`CodecSpec.auto`), the native dispatch (:attr:`CodecSpec.native`) and the
Triton twins (:attr:`CodecSpec.kernels`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from .base import Codec

FLAG_WORDS = MappingProxyType({"corrupt": -3, "failed": -1, "raw": 0})
"""The agreement's proposal words that are no codec's id (:data:`ciera.agreement.FLAG_FAILED` and
the like), and ``raw`` (0), which means the same in both roles: the shard travels as it is
(``RawCodec``'s header, or a proposal to send raw; the gather never proposes ``RawCodec`` itself)."""

MAX_CODEC_ID = 255
"""Codec ids are the codec byte of the payload header: 1..255 (0 is ``raw``)."""

READS_PREVIOUS = ("values", "exponents", "nothing")


@dataclass(frozen=True)
class CodecSpec:
    """What the rest of the library needs to know about one codec, stated once by the codec."""

    name: str
    """Registry name: ``CieraConfig.codec``, ``--ciera-codec``, logs and stats."""
    codec_id: int
    """Wire word: the codec byte of its payload header and the word a rank proposes in the agreement
    when it encoded with this codec (1..255; 0 only for ``raw``). Changing it changes the wire: peers
    built from different commits would misread each other."""
    summary: str
    """One line for help texts (``--ciera-codec``, ``CieraConfig.codec``)."""
    reads_previous: str = "values"
    """What ``decode`` reads of a target's previous contents: ``"values"`` (it adds to them: a
    receiver cache must keep the values, ZeRO-3's ``cache='values'``), ``"exponents"`` (only the
    exponent bits: ZeRO-3's one-byte ``cache='exponents'`` is enough, and decoding the same payload
    twice gives the same values), or ``"nothing"``."""
    auto: bool = False
    """Whether ``codec='auto'`` considers this codec (measured speeds and sizes choose among them)."""
    block_size_option: str | None = None
    """The :class:`ciera.CieraConfig` field giving its ``block_size`` (``None``: its own default)."""
    native: str | None = None
    """Module of its native CPU twin (``encode_native``, ``decode_native``, ``decode_many_native``,
    ``direct``, usually made by :func:`ciera.native._lib.twin`), or ``None``: none."""
    kernels: str | None = None
    """Module of its Triton twins (``encode_triton``, ``decode_triton``, ``decode_many_triton``), or
    ``None``: CUDA tensors run the pure-torch reference."""

    def __post_init__(self):
        if not self.name.isidentifier():
            raise ValueError(f"codec name {self.name!r} must be an identifier")
        if self.name == "auto" or (self.name in FLAG_WORDS and FLAG_WORDS[self.name] != self.codec_id):
            raise ValueError(f"codec name {self.name!r} is a reserved word of the agreement or the config")
        lo = 0 if self.name == "raw" else 1
        if not lo <= self.codec_id <= MAX_CODEC_ID:
            raise ValueError(f"codec {self.name!r}: codec_id={self.codec_id} must be in [{lo}, {MAX_CODEC_ID}]"
                             " (the codec byte of the payload header; 0 is raw)")
        if self.reads_previous not in READS_PREVIOUS:
            raise ValueError(f"codec {self.name!r}: reads_previous={self.reads_previous!r}; expected one of "
                             f"{READS_PREVIOUS}")

    @property
    def needs_values_cache(self) -> bool:
        """Its decode adds to the previous values: a receiver (ZeRO-3's cache, a gather into a buffer
        that is not persistent) must keep every value between gathers."""
        return self.reads_previous == "values"

    @property
    def decodes_from_exponents(self) -> bool:
        """Its decode reads only the previous exponents: ZeRO-3's one-byte exponent cache serves it."""
        return self.reads_previous == "exponents"


class _Registry:
    """Name -> codec class. One instance lives in this module; codecs register when imported."""

    def __init__(self):
        self._by_name: dict[str, type[Codec]] = {}

    def register(self, cls: type[Codec]) -> type[Codec]:
        spec = getattr(cls, "spec", None)
        if not isinstance(spec, CodecSpec):
            raise ValueError(f"{cls.__name__}: a codec class carries its CodecSpec as `spec`")
        if self._by_name.get(spec.name) is cls:
            return cls  # the same class again (its module imported twice): nothing changes
        taken = {c.spec.codec_id: n for n, c in self._by_name.items()}
        if spec.name in self._by_name or spec.codec_id in taken:
            owner = self._by_name.get(spec.name) or self._by_name[taken[spec.codec_id]]
            raise ValueError(f"codec {spec.name!r} (id {spec.codec_id}) clashes with the registered "
                             f"{owner.spec.name!r} (id {owner.spec.codec_id})")
        self._by_name[spec.name] = cls
        return cls

    def unregister(self, name: str) -> None:
        """Forget codec ``name`` (for tests that register a codec for a while)."""
        self._by_name.pop(name, None)

    def get(self, name: str) -> type[Codec]:
        try:
            return self._by_name[name]
        except KeyError:
            raise ValueError(f"unknown codec {name!r}; registered: {sorted(self._by_name)}") from None

    def spec(self, name: str) -> CodecSpec:
        return self.get(name).spec

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def specs(self) -> list[CodecSpec]:
        """Every descriptor, by codec id."""
        return sorted((c.spec for c in self._by_name.values()), key=lambda s: s.codec_id)


REGISTRY = _Registry()


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Register codec class ``cls`` under ``cls.spec.name`` (usable as a class decorator). A codec
    package calls it once, when imported; a name or id already taken by another class is refused
    (registering the same class again changes nothing)."""
    return REGISTRY.register(cls)


def codec_spec(name: str) -> CodecSpec:
    """The descriptor of registered codec ``name`` (ValueError naming the registered ones if none)."""
    return REGISTRY.spec(name)


def available_codecs() -> list[str]:
    """Names of every registered codec."""
    return REGISTRY.names()


def codec_specs() -> list[CodecSpec]:
    """Descriptors of every registered codec, by codec id."""
    return REGISTRY.specs()


def needs_values_cache(name: str) -> bool:
    """Whether codec ``name``'s decode adds to the previous values (:attr:`CodecSpec.needs_values_cache`);
    ``False`` for ``auto``, whose candidates a cache rule narrows itself."""
    return name != "auto" and codec_spec(name).needs_values_cache


def codec_choices() -> tuple[str, ...]:
    """What ``CieraConfig.codec`` accepts: every registered codec, by id, then ``auto``."""
    return (*(s.name for s in REGISTRY.specs()), "auto")


def codec_help() -> str:
    """One line per choice of ``CieraConfig.codec`` (``name: summary``), for help texts."""
    lines = [f"{s.name}: {s.summary}" for s in REGISTRY.specs()]
    auto = ", ".join(s.name for s in REGISTRY.specs() if s.auto)
    return "; ".join([*lines, f"auto: chooses per bucket among {auto} (and raw) from measured speeds and sizes"])


class _WireWords(Mapping):
    """Name -> wire word: :data:`FLAG_WORDS` and every registered codec's id, read live."""

    def _table(self) -> dict[str, int]:
        return {**FLAG_WORDS, **{s.name: s.codec_id for s in REGISTRY.specs()}}

    def __getitem__(self, key: str) -> int:
        return self._table()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())

    def __repr__(self) -> str:
        return f"WIRE_WORDS({self._table()})"


WIRE_WORDS: Mapping[str, int] = _WireWords()
"""The table of wire words: the agreement's flags (:data:`FLAG_WORDS`) and every registered codec's
id (its :attr:`CodecSpec.codec_id`, the codec byte of its payload header). The C library's codec ids
(``CIERA_CODECS`` in ``ciera/native/csrc/ciera_codecs.h``) are the native codecs' words
(``tests/ciera/native/test_native.py`` compares them)."""


def make_codec(
    name: str, *, dtype: torch.dtype, numel: int, block_size: int | None = None, backend: str = "auto"
) -> Codec:
    """Build codec ``name`` for shards of ``numel`` values of ``dtype``.

    ``block_size`` is the codec's block parameter (values per block); ``None`` takes its default.
    """
    cls = REGISTRY.get(name)
    kwargs = {} if block_size is None else {"block_size": block_size}
    return cls(dtype=dtype, numel=numel, backend=backend, **kwargs)
