"""Triton support shared by the codecs' Triton twins (each codec's own ``kernels.py`` in its folder under
``ciera/codecs``, with the signatures of its pure-torch reference): availability and the look-back."""

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
