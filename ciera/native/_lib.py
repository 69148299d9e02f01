"""Loading the C library (``_ciera_codecs``, built by setup.py) and calling it on tensors."""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import logging
import os
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

logger = logging.getLogger(__name__)

ABI = 6
"""Must equal ``CIERA_ABI`` in csrc/ciera_codecs.h: a stale build is refused, not trusted. Layouts,
status codes and messages are not copied here: they are read from the library."""

_HERE = Path(__file__).resolve().parent
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_STR = ctypes.c_char_p


def _candidates() -> list[Path]:
    return [_HERE / f"_ciera_codecs{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES]


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str]:
    path = next((p for p in _candidates() if p.exists()), None)
    if os.environ.get("CIERA_NATIVE", "1") == "0":
        reason = "disabled by CIERA_NATIVE=0"
    elif path is None:
        reason = (f"not built (no _ciera_codecs library in {_HERE}; reinstall with a C compiler: "
                  "`pip install -e .` or `make setup`)")
    else:
        try:
            lib = ctypes.CDLL(str(path))
            abi = lib.ciera_abi()
            if abi != ABI:
                reason = f"{path.name} is a stale build (ABI {abi}, expected {ABI}); rebuild with `make native`"
            else:
                declare(lib)
                return lib, ""
        except OSError as e:
            reason = f"cannot load {path}: {e}"
    logger.warning("ciera.native: C codecs unavailable, CPU tensors use the pure-torch references: %s", reason)
    return None, reason


_ENCODE = (_I64, [_PTR, _PTR, _PTR, _PTR, _I64, ctypes.c_int])
_DECODE = (ctypes.c_int, [_PTR, _PTR, _I64, _PTR, ctypes.c_int])
SIGNATURES = {
    "ciera_openmp": (ctypes.c_int, []),
    "ciera_strerror": (_STR, [ctypes.c_int]),
    "ciera_status_name": (_STR, [ctypes.c_int]),
    "ciera_codec_name": (_STR, [ctypes.c_int]),
    "ciera_codec_symbol": (_STR, [ctypes.c_int]),
    "ciera_layout_fields": (_STR, [ctypes.c_int]),
    "ciera_layout_bytes": (_I64, [ctypes.c_int]),
    "ciera_encode": (_I64, [ctypes.c_int, _PTR, _PTR, _PTR, _PTR, _I64, ctypes.c_int]),
    "ciera_decode": (ctypes.c_int, [ctypes.c_int, _PTR, _PTR, _I64, _PTR, ctypes.c_int]),
    "ciera_delta_histogram": (ctypes.c_int, [_PTR, _PTR, _PTR, _I64, _I64, _PTR]),
    "ciera_decode_many": (ctypes.c_int, [ctypes.c_int, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _I64, _I64,
                                         ctypes.c_int, ctypes.POINTER(_I64)]),
}
"""(restype, argtypes) of each entry point the library exports besides the codecs' own (see
:func:`codec_signatures`)."""

MAX_CODEC_ID = 255
"""The codec byte of the payload header: codec ids the library is asked about are below this."""


def codec_signatures(lib: ctypes.CDLL) -> dict[str, tuple]:
    """(restype, argtypes) of every codec's ``ciera_<symbol>_encode`` / ``ciera_<symbol>_decode``,
    for the codecs the library lists (``CIERA_CODECS`` in csrc/ciera_codecs.h, read back through
    ``ciera_codec_symbol``); empty for a build without that entry point (an older build)."""
    symbol_of = getattr(lib, "ciera_codec_symbol", None)
    if symbol_of is None:
        return {}
    symbol_of.restype, symbol_of.argtypes = _STR, [ctypes.c_int]
    out = {}
    for codec_id in range(1, MAX_CODEC_ID + 1):
        symbol = symbol_of(codec_id)
        if symbol is not None:
            out[f"ciera_{symbol.decode()}_encode"] = _ENCODE
            out[f"ciera_{symbol.decode()}_decode"] = _DECODE
    return out


def declare(lib: ctypes.CDLL, *, missing_ok: bool = False) -> None:
    """Sets :data:`SIGNATURES` and :func:`codec_signatures` on ``lib``. ``missing_ok``: skip the entry
    points a build lacks (an older build, timed by tools/bench_native.py); otherwise a missing one
    raises AttributeError."""
    for name, (restype, argtypes) in {**SIGNATURES, **codec_signatures(lib)}.items():
        fn = getattr(lib, name, None) if missing_ok else getattr(lib, name)
        if fn is not None:
            fn.restype, fn.argtypes = restype, argtypes


def library() -> ctypes.CDLL | None:
    """The loaded library, or ``None`` (logged once) when it is missing, stale or disabled."""
    return _load()[0]


def available() -> bool:
    """True when the native codecs can run."""
    return library() is not None


def unavailable_reason() -> str:
    """Why :func:`library` is ``None`` (empty when it is available)."""
    return _load()[1]


def threads() -> int:
    """Threads a native call uses: torch's intra-op setting (``torch.set_num_threads``)."""
    return max(1, torch.get_num_threads())


def fits(t: torch.Tensor, dtype: torch.dtype, numel: int | None = None) -> bool:
    """Whether ``t`` is a contiguous CPU tensor of ``dtype`` (and ``numel`` values)."""
    return t.is_cpu and t.dtype == dtype and t.is_contiguous() and (numel is None or t.numel() == numel)


def check(name: str, what: str, t: torch.Tensor, dtype: torch.dtype, numel: int | None = None) -> None:
    """Raise unless ``t`` :func:`fits` (``dtype``, ``numel``)."""
    if not fits(t, dtype, numel):
        raise ValueError(f"{name} (native): {what} must be a contiguous CPU {dtype} tensor"
                         + (f" of {numel} values" if numel is not None else "")
                         + f"; got {t.device} {t.dtype} of {t.numel()} values (contiguous={t.is_contiguous()})")


def message(rc: int) -> str:
    """The library's message for status ``rc`` (``ciera_strerror``)."""
    lib = library()
    text = lib.ciera_strerror(int(rc)) if lib is not None else None
    return text.decode() if text else f"native error {rc}"


@functools.cache
def statuses() -> dict[str, int]:
    """The library's status codes by enumerator name (``{"CIERA_OK": 0, "CIERA_E_TRUNCATED": -2, ...}``),
    read from it: codes 0, -1, -2, ... up to the first without a name."""
    lib, codes, rc = library(), {}, 0
    while (name := lib.ciera_status_name(rc)) is not None:
        codes[name.decode()] = rc
        rc -= 1
    return codes


def raise_for(name: str, rc: int, *, codec_id: int | None = None) -> None:
    """Turn a negative return code of the library into a ValueError with its message (naming
    ``codec_id`` when the library refused it as unknown: ``CIERA_E_CODEC``)."""
    if rc < 0:
        raise ValueError(f"{name}: {message(rc)}{_codec_note(rc, codec_id)}")


def _codec_note(rc: int, codec_id: int | None) -> str:
    if codec_id is not None and rc == statuses().get("CIERA_E_CODEC"):
        return f": codec id {codec_id}"
    return ""


@functools.cache
def layout_type(codec_id: int, name: str) -> type[ctypes.Structure]:
    """The ctypes twin of codec ``codec_id``'s C layout struct, built from the fields the library
    names (``ciera_layout_fields``: int64 each, in order) and checked against its size and its name
    for the id."""
    lib = library()
    known = lib.ciera_codec_name(codec_id)
    if known is None or known.decode() != name:
        raise RuntimeError(f"{name}: the native library knows codec id {codec_id} as "
                           f"{known.decode() if known else 'nothing'}; rebuild it with `make native`")
    fields = lib.ciera_layout_fields(codec_id).decode().split()
    cls = type(f"{name}_c_layout", (ctypes.Structure,), {"_fields_": [(f, _I64) for f in fields]})
    if ctypes.sizeof(cls) != lib.ciera_layout_bytes(codec_id):
        raise RuntimeError(f"{name}: the library's layout is {lib.ciera_layout_bytes(codec_id)} bytes, "
                           f"its {len(fields)} fields {ctypes.sizeof(cls)}")
    return cls


def c_layout(*, codec_id: int, name: str, layout) -> ctypes.Structure:
    """``layout`` (a codec's layout dataclass) as the library's struct: each field the library names
    is the layout's attribute of that name, or its ``fmt``'s (the float format's bits)."""
    cls = layout_type(codec_id, name)
    values = {}
    for field, _ in cls._fields_:
        owner = layout if hasattr(layout, field) else layout.fmt
        if not hasattr(owner, field):
            raise RuntimeError(f"{name}: the native layout's field {field!r} is neither an attribute of "
                               f"{type(layout).__name__} nor of its fmt")
        values[field] = int(getattr(owner, field))
    return cls(**values)


def decode_many(*, name: str, codec_id: int, clayout, bits_dtype: torch.dtype, numel: int, payloads: torch.Tensor,
                rows: torch.Tensor, offsets: torch.Tensor, targets_bits: torch.Tensor) -> None:
    """Shared body of the codecs' ``decode_many_native`` (see Codec.decode_many: rows, offsets, headers)."""
    check(name, "payloads", payloads, torch.uint8)
    check(name, "rows", rows, torch.int64)
    check(name, "offsets", offsets, torch.int64, rows.numel())
    if targets_bits.dim() != 2 or targets_bits.shape[1] != numel:
        raise ValueError(f"{name} (native): targets_bits must be [world, {numel}]; got {list(targets_bits.shape)}")
    check(name, "targets_bits", targets_bits, bits_dtype)
    bad = _I64(-1)
    rc = library().ciera_decode_many(codec_id, ctypes.addressof(clayout), payloads.data_ptr(), payloads.numel(),
                                     rows.data_ptr(), offsets.data_ptr(), rows.numel(), targets_bits.data_ptr(),
                                     targets_bits.shape[0], targets_bits.stride(0) * targets_bits.element_size(),
                                     threads(), ctypes.byref(bad))
    if rc < 0:
        i = int(bad.value)
        where = (f"entry {i} (row {int(rows[i])}, offset {int(offsets[i])})" if 0 <= i < rows.numel() else "")
        raise ValueError(f"{name}: decode_many {where}: {message(rc)}{_codec_note(rc, codec_id)}")


class Direct:
    """``Codec.encode`` / ``Codec.decode`` of one codec instance on CPU tensors, each one C call that
    also writes / checks the payload header: no tensor operation around the codec.

    Those operations (a header written through an int64 view, a header read back, a bits view)
    cost tens of microseconds each once the codec's own streams have left the caches, which is
    serial time that no thread count shortens. Both methods return ``False``, having done nothing, when an argument is not
    exactly what the call needs (the caller then takes the checked path, which names the problem)
    and when the header is refused (idem); bytes, state and bits are those of the checked path
    (tests/ciera/native/test_native.py compares them)."""

    def __init__(self, *, codec_id: int, clayout, numel: int, dtype: torch.dtype, state_dtype: torch.dtype,
                 fixed_bytes: int, name: str):
        self._lib = library()
        self._clayout = clayout  # kept alive: the C side reads it through its address
        self._addr = ctypes.addressof(clayout)
        self._id, self._n, self._dtype, self._sdtype, self._fixed, self._name = (
            codec_id, numel, dtype, state_dtype, fixed_bytes, name)
        self._refused = statuses()["CIERA_E_HEADER"]

    def encode(self, *, shard: torch.Tensor, state: torch.Tensor, out: torch.Tensor) -> bool:
        cap = out.numel()
        if not (fits(shard, self._dtype, self._n) and fits(state, self._sdtype, self._n)
                and fits(out, torch.uint8) and cap >= self._fixed and cap % 16 == 0):
            return False
        rc = self._lib.ciera_encode(self._id, self._addr, shard.data_ptr(), state.data_ptr(), out.data_ptr(), cap,
                                    threads())
        raise_for(self._name, rc, codec_id=self._id)
        return True

    def decode(self, *, payload: torch.Tensor, target: torch.Tensor) -> bool:
        if not (fits(target, self._dtype, self._n) and fits(payload, torch.uint8) and payload.dim() == 1):
            return False
        rc = self._lib.ciera_decode(self._id, self._addr, payload.data_ptr(), payload.numel(), target.data_ptr(),
                                    threads())
        if rc == self._refused:  # the checked path says why
            return False
        raise_for(self._name, rc, codec_id=self._id)
        return True


class Twin(NamedTuple):
    """One codec's native wrappers, each with the signature of its reference (see :func:`twin`)."""

    c_layout: Callable[[Any], ctypes.Structure]
    """``layout`` -> the library's struct for it (cached; see :func:`c_layout`)."""
    encode_native: Callable[..., int]
    """``encode_native(*, layout, shard_bits, state, out)``: bytes needed."""
    decode_native: Callable[..., None]
    """``decode_native(*, layout, payload, target_bits)``."""
    decode_many_native: Callable[..., None]
    """``decode_many_native(*, layout, payloads, rows, offsets, targets_bits)``."""
    direct: Callable[[Any], Direct]
    """``direct(codec)``: the codec's one-call encode and decode (:class:`Direct`)."""


def twin(*, codec_type: type, symbol: str, state_dtype: torch.dtype | None = None) -> Twin:
    """The native wrappers of codec class ``codec_type`` (its ``name`` and ``codec_id``), calling the
    library's ``ciera_<symbol>_encode`` / ``ciera_<symbol>_decode``. ``state_dtype``: the dtype of the
    sender state (one per value); ``None`` when the state is the previous bit patterns."""
    name, codec_id = codec_type.name, codec_type.codec_id
    encode_symbol, decode_symbol = f"ciera_{symbol}_encode", f"ciera_{symbol}_decode"

    @functools.lru_cache(maxsize=256)
    def c_layout_of(layout) -> ctypes.Structure:
        return c_layout(codec_id=codec_id, name=name, layout=layout)

    def encode_native(*, layout, shard_bits: torch.Tensor, state: torch.Tensor, out: torch.Tensor) -> int:
        """Writes the payload's sections (not the header; what a payload past the capacity holds is as
        with ``encode_reference``), updates ``state`` and returns the bytes needed."""
        n, bits = layout.numel, layout.fmt.bits_dtype
        check(name, "shard_bits", shard_bits, bits, n)
        check(name, "state", state, bits if state_dtype is None else state_dtype, n)
        check(name, "out", out, torch.uint8)
        needed = getattr(library(), encode_symbol)(ctypes.addressof(c_layout_of(layout)), shard_bits.data_ptr(),
                                                   state.data_ptr(), out.data_ptr(), out.numel(), threads())
        raise_for(name, needed)
        return int(needed)

    def decode_native(*, layout, payload: torch.Tensor, target_bits: torch.Tensor) -> None:
        """``target_bits`` (previous values) becomes the encoded shard, as with ``decode_reference``."""
        check(name, "payload", payload, torch.uint8)
        check(name, "target_bits", target_bits, layout.fmt.bits_dtype, layout.numel)
        rc = getattr(library(), decode_symbol)(ctypes.addressof(c_layout_of(layout)), payload.data_ptr(),
                                               payload.numel(), target_bits.data_ptr(), threads())
        raise_for(name, rc)

    def decode_many_native(*, layout, payloads: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor,
                           targets_bits: torch.Tensor) -> None:
        """Decode the payload at ``offsets[i]`` into row ``rows[i]`` of ``targets_bits`` for every i; each
        payload's length is the needed bytes in its header (checked, with the codec id and overflow flag)."""
        decode_many(name=name, codec_id=codec_id, clayout=c_layout_of(layout), bits_dtype=layout.fmt.bits_dtype,
                    numel=layout.numel, payloads=payloads, rows=rows, offsets=offsets, targets_bits=targets_bits)

    def direct(codec) -> Direct:
        """``codec``'s encode and decode in one C call each (see :class:`Direct`)."""
        layout = codec.layout
        return Direct(codec_id=codec_id, clayout=c_layout_of(layout), numel=layout.numel, dtype=codec.dtype,
                      state_dtype=layout.fmt.bits_dtype if state_dtype is None else state_dtype,
                      fixed_bytes=codec.fixed_bytes, name=name)

    return Twin(c_layout_of, encode_native, decode_native, decode_many_native, direct)
