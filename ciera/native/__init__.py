"""Native CPU twins of the codecs: a small C library, loaded with ctypes, on tensors' data.

On CPU tensors ``Codec`` dispatches here (``backend='auto'``; ``backend='native'`` forces it) and
falls back to the pure-torch references, with one warning, when the library is missing. The
references stay the definition of the formats; every function here has the signature of its
reference (``encode_native``, ``decode_native``, ``decode_many_native`` in
:mod:`ciera.native.exponent_reuse` and :mod:`ciera.native.delta`) and is tested byte for byte
against it.

Why C11 + OpenMP behind ctypes, built by ``setup.py``:

* Both codecs are byte-granular scalar loops (a variable-width bit packer, a 17-bin-per-exponent
  histogram, exponent compares per block): what pure torch is worst at (the delta reference moves
  ~0.02 GB/s) and a C compiler is best at, auto-vectorising the exponent_reuse passes.
* No torch or Python headers: the library does not depend on the torch ABI, so one build serves
  every torch version, and pip's isolated build environment needs only setuptools and gcc (a
  ``torch.utils.cpp_extension`` build would pull a multi-GB torch into it). ``setup.py`` builds it
  during ``pip install`` / ``make setup`` as an *optional* extension: without a C compiler the
  install still succeeds and the codecs run their references.
* numba would add a large JIT dependency and first-call compile pauses on every rank;
  ``torch.compile``'s C++ backend cannot express the sequential bit packing without graph breaks.
* OpenMP threads follow ``torch.get_num_threads()``. Threads claim grains of whole blocks as they
  get to them (one CAS per claim; thread 0 from the front, writing in place, the others from the
  back into scratch that is copied into place once every claim's size is known), so no thread
  waits on a fixed share of a slower one (a VM's two vCPUs drift 20-30% apart), and the bytes
  depend neither on the thread count nor on who claimed what (``CIERA_NATIVE_STALL=k`` delays
  thread k, for the tests).
* One portable build, no ``-march=native``: the hot loops also get x86-64-v4 (AVX-512) and
  x86-64-v3 (AVX2 + BMI2) clones, the widest the CPU runs chosen at load time (GCC
  ``target_clones``; v4 ran 15-30% faster than v3 on one thread on the Ice Lake dev VM), and
  delta's two hot spots (one width per previous exponent, the exception test on the values masked
  to their widths) have explicit AVX2 paths chosen per call (``CIERA_NATIVE_AVX2=0`` forces the
  portable ones; both are tested against the reference). Which clone runs is the CPU's choice, so a
  test machine exercises only its own clone of the compiler-vectorised loops.
  Speeds, the peers and the verdict per target are in BENCHMARKS.md (``make bench-codec``).
* delta's bit packing works a word at a time: values are merged into <= 64-bit chunks (pairs and
  quads) in independent loops, and only one shift-or per chunk stays serial; decoding mirrors it.
* delta on 16-bit values (bf16, fp16) has explicit AVX-512 paths (F, BW, VL, VBMI, VBMI2 + BMI2:
  Ice Lake and later, Zen 4), chosen per call where the CPU has them (``CIERA_NATIVE_AVX512=0``
  keeps the AVX2 ones): width lookups are 64 byte permutes at a time; a group of 64 values packs
  with no serial chain (pairs and quads by variable shifts, each 64-bit output word the difference
  of running sums taken at its last quad) and unpacks by prefix-summed bit offsets and one byte
  permute per 16 values; a threaded decode sizes its blocks in registers. The three paths
  (portable, AVX2, AVX-512) are tested against the reference on every CPU that has them.
* delta's 16-bit encode on AVX-512 reads each value once per pass. The histogram pass counts,
  in registers, the values whose previous exponent lies in a window of 8 neighbouring exponents
  (chosen from a 1024-value sample; about 97% of real weights) and whose bit length is at most 7:
  each becomes one set bit of a 64-bin one-hot code, summed vertically by carry-save adders
  (ternary logic) into bit planes, about two operations per 32 values and group of 16 bins; only
  the other values are incremented one by one (a scalar increment per value, about one per cycle,
  was that pass's floor). The window changes the speed, never the counts: the counts themselves
  are compared with the reference's, every one, on skewed and adversarial shards
  (``ciera_delta_histogram``). The packing pass takes a whole run of blocks in one call: each
  group's state, z, widths, exceptions and packed words come from one load of each value, and
  where every 8 values fit in 64 bits (all but about one group in 600) the group packs from one
  register of 8-value chunks. The decode likewise runs whole blocks in one call and, in a block
  without exceptions, adds each group to the target straight from the registers it was unpacked
  into. Prefetch hints follow the direction a chunk runs (a 2-thread decode runs one backwards).
* exponent_reuse on bf16 with blocks of 8 (the default) has an AVX-512 path in both directions,
  a 64-value tile per step in registers: two byte permutes split the tile into its low and high
  bytes, a tile's 8 blocks are the 8 qwords of its exponent bytes (one test gives its bitmap byte,
  one compress its changed blocks' exponents, staged by whole-register stores and copied to their
  slots a few KB at a time -- a masked store per tile straight into the slots, each overlapping
  the last, cost two thirds of the encode; decoding loads them under a mask and expands them). The
  portable loop left gcc's vectoriser with a branch per block: 7 / 6 GB/s encode / decode at one
  thread on the EPYC dev VM, 12 / 21 GB/s with the tile path, 32 / 22 GB/s with the staging
  (library calls alone, BENCHMARKS.md).

* ``Codec.encode`` / ``Codec.decode`` on CPU tensors are one C call each (``ciera_encode`` /
  ``ciera_decode``, :class:`ciera.native._lib.Direct`): the header is written and checked in C, so no
  tensor operation runs around the codec. Those cost tens of microseconds each once the codec's
  streams have left the caches, serial time no thread count shortens (it held exponent_reuse's
  2-thread speed-up near 1.65x). Arguments it does not take, and refused headers, go through the
  checked path (``_impl``), which names the problem; the tests compare both paths.
* A threaded delta decode needs each chunk's start, and the wire format stores no block offsets:
  the first chunk starts at the data, the last one runs last block first from the header's needed
  bytes (where the data ends), so at 2 threads there is no sizing pass; middle chunks are sized
  by a pass split over all threads. A last chunk that does not meet the one before it is a corrupt
  payload (an error, never a silent decode).

``CIERA_NATIVE=0`` in the environment disables the library (the references run).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ._lib import available, library, unavailable_reason

CODECS = ("exponent_reuse", "delta")
"""Codecs with a native twin (module ``ciera.native.<name>``)."""


def codec_module(name: str, *, required: bool = False) -> ModuleType | None:
    """The native module of codec ``name``, or ``None`` when it has none or the library is missing
    (``required=True``: a clear error instead)."""
    if name not in CODECS:
        if required:
            raise RuntimeError(f"{name}: backend='native' but this codec has no native implementation "
                               f"(native codecs: {', '.join(CODECS)})")
        return None
    if library() is None:
        if required:
            raise RuntimeError(f"{name}: backend='native' but the native codec library is unavailable: "
                               f"{unavailable_reason()}")
        return None
    return importlib.import_module(f"{__name__}.{name}")


def load_build(path) -> "ctypes.CDLL":
    """Another build of the native library (e.g. an older commit's), its entry points declared
    where it has them: for timing the C calls themselves (``tools/bench_native.py``)."""
    import ctypes
    from pathlib import Path

    from . import _lib

    lib = ctypes.CDLL(str(Path(path).resolve()))
    _lib.declare(lib, missing_ok=True)
    return lib


def c_layout(codec) -> "ctypes.Structure":
    """The C struct of ``codec``'s layout, as the library's entry points take it (pass
    ``ctypes.addressof`` of it; keep the struct alive while they run)."""
    return codec_module(codec.name, required=True)._c_layout(codec.layout)


def raise_for(name: str, rc: int) -> None:
    """Raise the library's error for a negative return code ``rc`` of a call on codec ``name``."""
    from . import _lib

    _lib.raise_for(name, rc)


__all__ = ["CODECS", "available", "c_layout", "codec_module", "library", "load_build", "raise_for",
           "unavailable_reason"]
