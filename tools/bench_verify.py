#!/usr/bin/env python
"""The cost of CIERA's verify (``CieraConfig.verify_interval``) against the gather it checks.

One verify hashes every shard of the gathered buffer (``ciera.replicas.shard_hashes``) and
all-gathers the ``world`` x ``world`` table (``verify_replicas``). Printed per buffer size: the
median time of a plain ``all_gather_into_tensor`` of the buffer (the cheapest gather: the
denominator), of a compressed CIERA gather (delta, after warmup), of one verify, and the verify
interval at which verify costs 0.5% of the plain gather time, and what the default interval costs.

    python tools/bench_verify.py                          # gloo, 2 ranks, 1M / 4M / 16M bf16 values
    python tools/bench_verify.py --world 4 --numel 67108864 --steps 10
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch
import torch.distributed as dist

from ciera import CieraAllGather, CieraConfig
from ciera.replicas import verify_replicas
from ciera.testing import run_on_ranks
from ciera.testing.trajectory import AdamTrajectory
from tools._common import timed_collective

BUDGET = 0.005  # verify's share of the gather time


def _worker(rank, world, numel, steps):
    shard = numel // world
    traj = AdamTrajectory(numel=shard, lr=1e-4, seed=rank, device=torch.device("cpu"))
    plain = torch.zeros(numel, dtype=torch.bfloat16)
    gather = CieraAllGather(torch.zeros_like(plain), config=CieraConfig(codec="delta", selection="always",
                                                                         verify_interval=0), name="bench")
    times = {"plain": [], "ciera": [], "verify": []}
    for step in range(steps + 2):
        x = traj.step()
        plain.view(world, -1)[rank].copy_(x)
        gather.buffer.view(world, -1)[rank].copy_(x)
        t_plain = timed_collective(lambda: dist.all_gather_into_tensor(plain, plain.view(world, -1)[rank]),
                                   slowest=True)
        t_ciera = timed_collective(lambda: gather.start().wait(), slowest=True)
        t_verify = timed_collective(lambda: verify_replicas(gather.buffer, salt=step), slowest=True)
        if step >= 2:  # after the raw warmup gather
            times["plain"].append(t_plain)
            times["ciera"].append(t_ciera)
            times["verify"].append(t_verify)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--numel", type=int, nargs="+", default=[1 << 20, 1 << 22, 1 << 24])
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args(argv)
    default = CieraConfig().verify_interval
    print(f"gloo, {a.world} ranks, bf16, median of {a.steps}; default verify_interval {default}")
    print(f"{'values':>10} {'plain ms':>9} {'ciera ms':>9} {'verify ms':>10} {'verify/plain':>12} "
          f"{'N for 0.5%':>10} {'cost at default':>15}")
    for numel in a.numel:
        t = run_on_ranks(_worker, world=a.world, args=(numel, a.steps))[0]
        ratio = t["verify"] / t["plain"]
        need = math.ceil(ratio / BUDGET)
        cost = f"{100 * ratio / default:.3f}%" if default else "off"
        print(f"{numel:>10} {1e3 * t['plain']:>9.2f} {1e3 * t['ciera']:>9.2f} {1e3 * t['verify']:>10.2f} "
              f"{ratio:>12.2f} {need:>10} {cost:>15}")


if __name__ == "__main__":
    main()
