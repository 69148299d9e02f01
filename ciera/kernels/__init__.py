"""Triton twins of the codecs' hot loops. Each has the signature of its pure-torch reference."""

from __future__ import annotations

import functools


@functools.cache
def triton_available() -> bool:
    """True when Triton imports (kernels run on CUDA, or on CPU under ``TRITON_INTERPRET=1``)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True
