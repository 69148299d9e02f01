"""The memory budget of the ZeRO-3 receiver caches (``CieraConfig.cache='auto'``).

A budget is written as a share of the memory free once the model and optimizer are built (``"50%"``)
or as bytes (``"8GiB"``, ``"512MiB"``, ``"1000000"``). Free memory is the device's (CUDA:
``torch.cuda.mem_get_info``) or, on CPU, the host's available RAM divided among the ranks on the
host (``LOCAL_WORLD_SIZE``). Every rank must take the same cache decisions, so the budget is the
smallest over the ranks (one MIN all-reduce when it is measured).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_BUDGET = "50%"
"""Half of the memory left after the model and optimizer: room for activations stays."""

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SPEC = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(%|[kmgt]i?b|b)?\s*$", re.I)


def parse_budget(spec: str) -> tuple[float | None, int | None]:
    """``(fraction, None)`` for ``"N%"`` (0 < N <= 100), ``(None, bytes)`` for a size; ``ValueError``
    naming the spec otherwise."""
    m = _SPEC.match(str(spec))
    if not m:
        raise ValueError(f"cache budget {spec!r}: expected a share of the free memory like '50%' or a size like "
                         f"'8GiB', '512MiB', '1000000'")
    value, unit = float(m.group(1)), (m.group(2) or "").lower()
    if unit == "%":
        if not 0 < value <= 100:
            raise ValueError(f"cache budget {spec!r}: a share must be in (0%, 100%]")
        return value / 100, None
    return None, int(value * _UNITS[unit])


def free_bytes(device: torch.device) -> int:
    """Memory this rank may still use: the CUDA device's free bytes, or on CPU the host's available
    RAM shared by the ranks on the host."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        import psutil

        available = int(psutil.virtual_memory().available)
    except ImportError:  # pragma: no cover - psutil comes with megatron-core
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return available // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


@dataclass(frozen=True)
class Budget:
    """A measured cache budget, equal on every rank."""

    bytes: int
    """Bytes per rank the receiver caches may keep (the smallest over the ranks)."""
    free: int
    """Free bytes it was taken from (the smallest over the ranks; 0 for a budget given in bytes)."""
    spec: str
    """As the user wrote it."""

    def describe(self) -> str:
        mib = self.bytes / 2**20
        if not self.free:
            return f"{mib:.1f} MiB per rank (--ciera-cache-budget {self.spec})"
        return f"{mib:.1f} MiB per rank ({self.spec} of the {self.free / 2**20:.1f} MiB free after the model and optimizer)"


def measure_budget(*, spec: str, device: torch.device, group=None) -> Budget:
    """The budget of ``spec`` on this rank's ``device``, MIN-reduced over ``group`` (a collective;
    none when the process group is not initialised)."""
    fraction, fixed = parse_budget(spec)
    free = 0 if fraction is None else free_bytes(device)
    mine = torch.tensor([fixed if fraction is None else int(free * fraction), free], dtype=torch.int64,
                        device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=group)
    nbytes, free = (int(v) for v in mine.cpu())
    return Budget(bytes=nbytes, free=free, spec=spec)


CACHE_PREFERENCE = ("values", "two_level", "exponents")
"""The receiver caches ``auto`` chooses between, fastest first: ``values`` (a step's later gathers
send nothing), ``two_level`` (the same across nodes, from a cache of ``1/L`` of the values; raw
within the node), ``exponents`` (one byte per value; every gather sends signs and mantissas)."""


def choose_cache(*, sizes: dict[str, int], left: int) -> str:
    """The fastest receiver cache of :data:`CACHE_PREFERENCE` offered in ``sizes`` (cache -> bytes
    per rank) that fits ``left`` bytes; ``exponents`` (the smallest) when none does."""
    return next((c for c in CACHE_PREFERENCE if c in sizes and sizes[c] <= left), "exponents")
