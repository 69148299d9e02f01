"""Helpers the tools share: timing a call or a collective, and writing a result table.

Device synchronisation is the library's (:func:`ciera.measure.synchronize`), so a tool's clock
and the cost model's measurements wait for the same work.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from ciera.measure import synchronize

__all__ = ["median_seconds", "synchronize", "timed", "timed_collective", "write_table"]


def timed(fn: Callable[[], object], *, device, cpu_clock: Callable[[], float] = time.process_time
          ) -> tuple[float, float]:
    """``(wall seconds, CPU seconds)`` of one call of ``fn``, with ``device``'s queued work waited
    for before and after. ``cpu_clock``: the process's CPU time over all its threads (default), or
    ``time.thread_time`` for the calling thread's alone."""
    synchronize(device)
    w0, c0 = time.perf_counter(), cpu_clock()
    fn()
    synchronize(device)
    return time.perf_counter() - w0, cpu_clock() - c0


def median_seconds(fn: Callable[[], object], *, device, repeats: int, warmup: int = 0) -> float:
    """Median wall seconds of ``repeats`` calls of ``fn`` (:func:`timed`), after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    return statistics.median(timed(fn, device=device)[0] for _ in range(repeats))


def timed_collective(fn: Callable[[], object], *, device="cpu", group=None, slowest: bool = False) -> float:
    """Wall seconds of one call of the collective ``fn``, started together on every rank of
    ``group`` (a barrier) with ``device`` idle. ``slowest``: the figure is the slowest rank's
    (MAX-reduced, on the CPU: gloo), as a gather is as slow as its slowest rank."""
    synchronize(device)
    dist.barrier(group=group)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    seconds = time.perf_counter() - t0
    if slowest:
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        seconds = float(t)
    return seconds


def write_table(lines: list[str], out_md: Path | None) -> str:
    """Print the Markdown table ``lines`` and, with ``out_md``, write it there too. Returns it."""
    table = "\n".join(lines)
    print(table)
    if out_md:
        Path(out_md).write_text(table + "\n")
    return table
