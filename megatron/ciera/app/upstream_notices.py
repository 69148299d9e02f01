"""megatron-core's notices about missing Apex / transformer-engine, said once per run.

Without Apex and transformer-engine, six megatron-core modules each warn at import, on every rank,
that they fall back to torch (norm, optimizers, multi-tensor helpers): a dozen lines on 2 ranks
before the first iteration. :func:`silence_fallback_warnings` filters exactly those (call it before
megatron-core is imported); :func:`fallback_note` is the one line that says what is missing and
what it costs, printed once by rank 0.
"""

from __future__ import annotations

import importlib.util
import warnings

FALLBACK_WARNING = r"(Transformer Engine and Apex are|Apex is) not installed"
"""The start of every fallback notice megatron-core 0.16 - 0.19 emits at import."""


def silence_fallback_warnings() -> None:
    """Filter megatron-core's Apex / transformer-engine fallback warnings (and no other)."""
    warnings.filterwarnings("ignore", message=FALLBACK_WARNING, category=UserWarning)


def fallback_note(*, device: str) -> str | None:
    """One line naming the missing packages and their cost on ``device``; ``None`` if none is missing."""
    missing = [name for name, module in (("Apex", "apex"), ("transformer-engine", "transformer_engine"))
               if importlib.util.find_spec(module) is None]
    if not missing:
        return None
    cost = ("no cost on CPU: their kernels are CUDA-only" if device == "cpu" else
            "on GPU the unfused torch kernels are slower (pip install transformer-engine for the fused ones)")
    return (f"{' and '.join(missing)} not installed: megatron-core uses torch's norm, optimizers and "
            f"multi-tensor helpers instead; {cost}")
