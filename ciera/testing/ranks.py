"""Run a function on N local gloo ranks: the harness of the multi-process tests and benchmarks."""

from __future__ import annotations

import datetime
import gc
import os
import socket
import tempfile

import torch.distributed as dist
import torch.multiprocessing as mp

from ..shutdown import end_process


def free_port() -> int:
    """A TCP port on loopback that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args, result_dir: str, timeout_s: float | None) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    timeout = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, **timeout)
    try:
        out = fn(rank, world, *args)
        torch.save(out, os.path.join(result_dir, f"rank{rank}.pt"))
    finally:
        gc.collect()  # objects in reference cycles still holding c10d work go before their group
        dist.destroy_process_group()
    end_process(0)  # success: no interpreter finalization for gloo's workers to race (ciera.shutdown)


def run_on_ranks(fn, *, world: int, args: tuple = (), timeout_s: float | None = None) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned processes joined by a gloo group and
    return each rank's return value (saved with ``torch.save``). ``fn`` must be importable
    (module-level). Any rank's exception fails the call. ``timeout_s``: the group's collective
    timeout (gloo's default is 30 minutes), so that a test of a hang fails instead of hanging."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_entry, args=(world, free_port(), fn, args, tmp, timeout_s), nprocs=world, join=True)
        import torch

        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world)]
