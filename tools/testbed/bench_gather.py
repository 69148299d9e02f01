#!/usr/bin/env python
"""One torchrun worker of the testbed gather benchmark: plain all-gather vs CieraAllGather.

Launched on every testbed host by ``bench_cluster.py`` (torchrun, c10d rendezvous on host 0), gloo
over the hosts' shaped links. Every rank advances its shard along a bf16 AdamW trajectory
(``ciera.trajectory``, lr 1e-4); each step the same new shard is gathered by
``all_gather_into_tensor`` and by one CieraAllGather per mode (each codec forced with
``selection='always'``, and ``auto``: ``codec='auto', selection='auto'``), in an order that rotates
every step. Every mode's buffer is compared bit for bit with the plain one after every step.
Rank 0 writes per-mode median gather time (the slowest rank's, per step), bytes received,
encode/decode seconds and the codec ``auto`` ended with, as JSON.

    torchrun ... tools/testbed/bench_gather.py --numel 8388608 --out result.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ciera import CieraAllGather, CieraConfig  # noqa: E402
from ciera.codecs import as_bits  # noqa: E402
from ciera.trajectory import AdamTrajectory  # noqa: E402

FORCED = ("exponent_reuse", "delta")


def mode_config(mode: str) -> CieraConfig:
    if mode == "auto":
        return CieraConfig(codec="auto", selection="auto")
    return CieraConfig(codec=mode, selection="always")


def run(*, numel: int, modes: list[str], lr: float, warmup: int, steps: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = numel // world
    traj = AdamTrajectory(numel=shard, lr=lr, seed=rank)
    plain = torch.zeros(shard * world, dtype=torch.bfloat16)
    gathers = {m: CieraAllGather(torch.zeros_like(plain), config=mode_config(m), name=m) for m in modes}
    times = {m: [] for m in ["plain", *modes]}
    before = {}

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a gather is as slow as its slowest rank
        return float(t)

    for step in range(warmup + steps):
        if step == warmup:
            before = {m: g.stats for m, g in gathers.items()}
        x = traj.step()
        plain.view(world, -1)[rank].copy_(x)
        order = ["plain", *modes]
        k = step % len(order)
        order = order[k:] + order[:k]
        for name in order:
            if name == "plain":
                t = timed(lambda: dist.all_gather_into_tensor(plain, plain.view(world, -1)[rank]))
            else:
                g = gathers[name]
                g.buffer.view(world, -1)[rank].copy_(x)
                t = timed(lambda: g.start().wait())
            if step >= warmup:
                times[name].append(t)
        for m, g in gathers.items():
            if not torch.equal(as_bits(g.buffer), as_bits(plain)):
                raise AssertionError(f"step {step}: {m}: gathered buffer differs from all_gather_into_tensor")
    out = {"world": world, "numel": shard * world, "steps": steps, "warmup": warmup, "lr": lr,
           "bit_exact_steps": warmup + steps, "plain_ms": statistics.median(times["plain"]) * 1e3, "modes": {}}
    for m, g in gathers.items():
        s = g.stats.minus(before[m])
        out["modes"][m] = {
            "ms": statistics.median(times[m]) * 1e3,
            "raw_bytes": s.raw_bytes, "wire_bytes": s.wire_bytes,
            "gathers": s.gathers, "raw_gathers": s.raw_gathers, "overflows": s.overflows,
            "encode_ms": s.encode_s / max(1, s.gathers) * 1e3, "decode_ms": s.decode_s / max(1, s.gathers) * 1e3,
            "codec": g.stats.codec,
        }
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=1 << 23, help="bucket values (bf16)")
    p.add_argument("--modes", nargs="+", default=[*FORCED, "auto"])
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    try:
        result = run(numel=a.numel, modes=a.modes, lr=a.lr, warmup=a.warmup, steps=a.steps)
        if dist.get_rank() == 0:
            a.out.write_text(json.dumps(result, indent=1))
            print(json.dumps(result), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
