#!/usr/bin/env python
"""One torchrun worker of the testbed gather benchmark: plain all-gather vs CieraAllGather.

Launched on every testbed host by ``bench_cluster.py`` (torchrun, c10d rendezvous on host 0), gloo
over the hosts' shaped links. Every rank advances its shard along a bf16 AdamW trajectory
(``ciera.testing.trajectory``, lr 1e-4); each step the same new shard is gathered by
``all_gather_into_tensor`` and by one CieraAllGather per mode (each codec forced with
``selection='always'``, and ``auto``: ``codec='auto', selection='auto'``), in an order that rotates
every step. Every mode's buffer is compared bit for bit with the plain one after every step.
Rank 0 writes per-mode median gather time (the slowest rank's, per step), bytes received,
encode/decode seconds and the codec ``auto`` ended with, as JSON.

``--buckets K`` (K > 1) splits the values into K equal buckets gathered as one step's parameters
are: plain launches K async ``all_gather_into_tensor`` and waits for all; CIERA encodes every
bucket and agrees their sizes in one collective (``prepare_many``, as the Megatron binding does
right after the optimizer step), launches all K, then waits for each in order, so decoding bucket
i overlaps the later ones on the wire (gloo runs collectives on its own threads). Agreeing bucket
by bucket instead would queue each agreement behind the transfers already in gloo's queue.

    torchrun ... tools/testbed/bench_gather.py --numel 8388608 --out result.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ciera import CieraAllGather, CieraConfig
from ciera.codecs import as_bits
from ciera.measure import measure_link
from ciera.testing.trajectory import AdamTrajectory
from tools._common import timed_collective

FORCED = ("exponent_reuse", "delta")
LINK_FIT_SIZES = (1 << 16, 1 << 18, 1 << 20)
"""Bytes per rank of the all-gathers gloo's link is fitted from, with the benchmark's shard bytes:
on a shaped link a long gloo transfer runs slower per byte than a short one (TCP against the
shaper's queue), so a fit from small sizes alone under-predicts the real ones by ~30%."""


def mode_config(mode: str) -> CieraConfig:
    """A codec forced on every gather, or ``auto``: the cost model picks raw or a codec per bucket."""
    if mode == "auto":
        return CieraConfig(codec="auto", selection="auto")
    return CieraConfig(codec=mode, selection="always")


class _Buckets:
    """K equal buckets of one flat tensor, each rank's shard of each bucket a slice of its shard."""

    def __init__(self, flat: torch.Tensor, *, world: int, rank: int, k: int):
        self.flat, self.world, self.rank = flat, world, rank
        self.views = list(flat.view(k, -1))  # bucket b: values [b*n, (b+1)*n) of the flat tensor

    def set_shard(self, x: torch.Tensor) -> None:
        """Rank r's shard of bucket b is x's b-th chunk."""
        for v, part in zip(self.views, x.view(len(self.views), -1)):
            v.view(self.world, -1)[self.rank].copy_(part)


def _sum_stats(parts):
    """The buckets' counters added up (the codec is the first bucket's)."""
    out = dataclasses.replace(parts[0])
    for f in dataclasses.fields(out):
        if f.name != "codec":
            setattr(out, f.name, sum(getattr(q, f.name) for q in parts))
    return out


def _plain_gather(views, world: int, rank: int) -> None:
    works = [dist.all_gather_into_tensor(v, v.view(world, -1)[rank], async_op=True) for v in views]
    for w in works:
        w.wait()


def _ciera_gather(gathers) -> float:
    """One step; returns this rank's seconds in ``prepare_many`` (encode + the size agreement)."""
    t0 = time.perf_counter()
    CieraAllGather.prepare_many(gathers)  # every bucket encoded, ONE size agreement
    prep = time.perf_counter() - t0
    handles = [g.start() for g in gathers]
    for h in handles:
        h.wait()
    return prep


def run(*, numel: int, modes: list[str], lr: float, warmup: int, steps: int, buckets: int = 1) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = numel // world // buckets * buckets
    # gloo's own link, fitted as the cost model measures it at run time (measure_link, up to the
    # real shard size): the simulator's link input, timed apart from the gathers it predicts
    sizes = (*LINK_FIT_SIZES, shard * 2)
    fit = measure_link(sizes=sizes, repeats=3)
    traj = AdamTrajectory(numel=shard, lr=lr, seed=rank)
    plain = torch.zeros(shard * world, dtype=torch.bfloat16)
    plain_b = _Buckets(plain, world=world, rank=rank, k=buckets)
    bufs = {m: _Buckets(torch.zeros_like(plain), world=world, rank=rank, k=buckets) for m in modes}
    multi = {m: [CieraAllGather(v, config=mode_config(m), name=f"{m}.b{i}") for i, v in enumerate(b.views)]
             for m, b in bufs.items()}
    times = {m: [] for m in ["plain", *modes]}
    prepare = {m: [] for m in modes}  # the slowest rank's encode + agreement seconds per step
    before = {}

    for step in range(warmup + steps):
        if step == warmup:
            before = {m: [g.stats for g in gs] for m, gs in multi.items()}
        x = traj.step()
        plain_b.set_shard(x)
        order = ["plain", *modes]
        k = step % len(order)
        order = order[k:] + order[:k]
        for name in order:
            if name == "plain":
                t = timed_collective(lambda: _plain_gather(plain_b.views, world, rank), slowest=True)
            else:
                bufs[name].set_shard(x)
                prep = []
                t = timed_collective(lambda: prep.append(_ciera_gather(multi[name])), slowest=True)
                p = torch.tensor(prep, dtype=torch.float64)
                dist.all_reduce(p, op=dist.ReduceOp.MAX)
                if step >= warmup:
                    prepare[name].append(float(p[0]))
            if step >= warmup:
                times[name].append(t)
        for m, b in bufs.items():
            if not torch.equal(as_bits(b.flat), as_bits(plain)):
                raise AssertionError(f"step {step}: {m}: gathered buffer differs from all_gather_into_tensor")
    out = {"gloo_link": {"bandwidth_bytes_per_s": fit.bandwidth_bytes_per_s, "latency_s": fit.latency_s,
                         "sizes": list(sizes)},
           "world": world, "numel": shard * world, "buckets": buckets, "steps": steps, "warmup": warmup, "lr": lr,
           "bit_exact_steps": warmup + steps, "plain_ms": statistics.median(times["plain"]) * 1e3, "modes": {}}
    for m, gs in multi.items():
        g = gs[0]
        parts = [x.stats.minus(b0) for x, b0 in zip(gs, before[m])]
        s = _sum_stats(parts)
        # the slowest rank's codec seconds (a collective waits for it): where ranks share cores,
        # rank 0's own timers can miss what the others were scheduled later for
        slowest = torch.tensor([s.encode_s, s.decode_s], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        out["modes"][m] = {
            "ms": statistics.median(times[m]) * 1e3,
            "raw_bytes": s.raw_bytes, "wire_bytes": s.wire_bytes,
            "gathers": s.gathers, "raw_gathers": s.raw_gathers, "overflows": s.overflows,
            # per step (all buckets): the time one gather of the whole values spent in the codec
            "encode_ms": s.encode_s / max(1, s.gathers // buckets) * 1e3,
            "decode_ms": s.decode_s / max(1, s.gathers // buckets) * 1e3,
            "prepare_ms": statistics.median(prepare[m]) * 1e3,
            "encode_ms_max": float(slowest[0]) / max(1, s.gathers // buckets) * 1e3,
            "decode_ms_max": float(slowest[1]) / max(1, s.gathers // buckets) * 1e3,
            "codec": g.stats.codec,
        }
        d = g.selector.decision if g.selector is not None else None
        if d is not None:  # what the cost model predicted and why (auto's log line)
            out["modes"][m]["decision"] = {"choice": d.choice, "reason": d.reason,
                                           "predicted_ms": {k: v * 1e3 for k, v in d.times.items()}}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=1 << 23, help="bucket values (bf16)")
    p.add_argument("--modes", nargs="+", default=[*FORCED, "auto"])
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--buckets", type=int, default=1, help="equal buckets per step, gathered pipelined")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    try:
        result = run(numel=a.numel, modes=a.modes, lr=a.lr, warmup=a.warmup, steps=a.steps, buckets=a.buckets)
        if dist.get_rank() == 0:
            a.out.write_text(json.dumps(result, indent=1))
            print(json.dumps(result), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
