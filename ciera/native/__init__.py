"""Native CPU twins of the codecs: a small C library, loaded with ctypes, on tensors' data.

On CPU tensors ``Codec`` dispatches here (``backend='auto'``; ``backend='native'`` forces it) and
falls back to the pure-torch references, with one warning, when the library is missing. The
references stay the definition of the formats; every function here has the signature of its
reference (``encode_native``, ``decode_native``, ``decode_many_native`` in each codec's
``native.py``, e.g. :mod:`ciera.codecs.delta.native`, named by its descriptor's ``native``) and is
tested byte for byte against it.

Why C11 + OpenMP behind ctypes, built by ``setup.py``:

* Both codecs are byte-granular scalar loops (a variable-width bit packer, per-exponent
  histograms, exponent compares per block): what pure torch is worst at and a C compiler best at.
* No torch or Python headers: one build serves every torch version, and pip's isolated build
  environment needs only setuptools and gcc (a ``torch.utils.cpp_extension`` build would pull
  torch into it). The extension is optional: without a C compiler the install still succeeds and
  the codecs run their references.
* numba would add a large JIT dependency and first-call compile pauses on every rank;
  ``torch.compile``'s C++ backend cannot express the sequential bit packing without graph breaks.

How (``csrc/``; ``ciera_codecs.h`` is the interface, and its ``CIERA_CODECS`` list the codecs; the layouts, status codes and messages
:mod:`ciera.native._lib` uses are read from the library, never copied):

* Threads follow ``torch.get_num_threads()`` and claim grains of whole blocks as they get to them
  (``claims.c``), so no thread waits on a fixed share of a slower one, and the bytes depend
  neither on the thread count nor on who claimed what (``CIERA_NATIVE_STALL=k`` delays thread k,
  for the tests).
* One portable build, no ``-march=native``: the hot loops get x86-64-v4 and x86-64-v3 clones
  picked at load time (GCC ``target_clones``), and explicit AVX2 and AVX-512 paths (delta on
  16-bit values, exponent_reuse on bf16 in blocks of 8) are chosen per call where the CPU has
  them (``CIERA_NATIVE_AVX2=0`` / ``CIERA_NATIVE_AVX512=0`` narrow the choice). Every explicit
  path is tested against the reference on each CPU that has it; which clone of the
  compiler-vectorised loops runs is the CPU's choice.
* ``Codec.encode`` / ``Codec.decode`` on CPU tensors are one C call each (``ciera_encode`` /
  ``ciera_decode``, :class:`ciera.native._lib.Direct`): the header is written and checked in C, so
  no tensor operation (serial time no thread count shortens) runs around the codec. Other
  arguments, and refused headers, go through the checked path, which names the problem.
* A threaded delta decode needs each chunk's start, and the wire format stores no block offsets:
  the first chunk starts at the data, the last runs backwards from the header's needed bytes, and
  middle chunks are sized by a pass split over all threads. A last chunk that does not meet the
  one before it is a corrupt payload (an error, never a silent decode).

Speeds per path and target: BENCHMARKS.md (``make bench-codec``, ``tools/bench_native.py``).
``CIERA_NATIVE=0`` in the environment disables the library (the references run).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ._lib import available, library, unavailable_reason

def codec_module(spec, *, required: bool = False) -> ModuleType | None:
    """The native module of the codec described by ``spec`` (its
    :class:`ciera.codecs.registry.CodecSpec`: ``spec.native``), or ``None`` when it has none or the
    library is missing (``required=True``: a clear error instead)."""
    if spec.native is None:
        if required:
            raise RuntimeError(f"{spec.name}: backend='native' but this codec has no native implementation")
        return None
    if library() is None:
        if required:
            raise RuntimeError(f"{spec.name}: backend='native' but the native codec library is unavailable: "
                               f"{unavailable_reason()}")
        return None
    return importlib.import_module(spec.native)


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
    return codec_module(codec.spec, required=True)._c_layout(codec.layout)


def raise_for(name: str, rc: int) -> None:
    """Raise the library's error for a negative return code ``rc`` of a call on codec ``name``."""
    from . import _lib

    _lib.raise_for(name, rc)


__all__ = ["available", "c_layout", "codec_module", "library", "load_build", "raise_for",
           "unavailable_reason"]
