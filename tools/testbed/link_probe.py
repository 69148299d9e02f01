#!/usr/bin/env python
"""One torchrun worker of the simulator's link probe: gloo's all-gather timed at the sizes and in
the patterns a run uses, as medians (the simulator's link input: ``sim_testbed.MeasuredLink``).

Each ``--case NAME:PATTERN:B1,B2,...`` is one step of K gathers of ``Bi`` bytes per rank:

* ``sync``: the K gathers blocking, one after the other (Megatron's synchronous param gather:
  ``start_param_sync(force_sync=True)`` per bucket group in turn; K = 1: a single gather);
* ``async``: all K launched, then waited in order (CIERA's payloads after ``prepare_many``, and
  overlapped buckets);
* ``idle``: ``sync`` after ``--idle`` seconds with no traffic (between two optimizer steps: TCP's
  slow start after idle, the shaper's refilled burst).

Cases are rotated every repetition (drift hits all alike); time = the slowest rank's seconds, barrier
first. Rank 0 writes JSON: per case its bytes, pattern, median, samples, and per rank the TCP
retransmission counters of its network namespace over the whole probe.

    torchrun ... tools/testbed/link_probe.py --case plain:sync:2097152,2097152 --reps 15 --out p.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

WATCH = ("RetransSegs", "TCPTimeouts", "TCPLossProbes", "TCPFastRetrans", "TCPSlowStartRetrans")
PATTERNS = ("sync", "async", "idle")


def tcp_counters() -> dict[str, int]:
    """This network namespace's TCP retransmission counters (``/proc/net/snmp``, ``netstat``)."""
    out = {}
    for f in ("/proc/net/snmp", "/proc/net/netstat"):
        lines = Path(f).read_text().splitlines()
        for head, vals in zip(lines[::2], lines[1::2]):
            if head.startswith(("Tcp:", "TcpExt:")):
                out |= {k: int(v) for k, v in zip(head.split()[1:], vals.split()[1:]) if k in WATCH}
    return out


def parse_case(text: str) -> tuple[str, str, list[int]]:
    """``NAME:PATTERN:B1,B2,...`` -> (name, pattern, bytes per rank of each gather)."""
    name, pattern, sizes = text.split(":")
    if pattern not in PATTERNS:
        raise ValueError(f"--case {text!r}: pattern must be one of {PATTERNS}")
    return name, pattern, [int(b) for b in sizes.split(",")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", action="append", required=True, type=parse_case)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--idle", type=float, default=0.3)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cases = []
    for name, pattern, sizes in a.case:
        bufs = []
        for b in sizes:
            out = torch.zeros(max(1, b // 2) * world, dtype=torch.bfloat16)
            bufs.append((out, out.view(world, -1)[rank]))
        cases.append((name, pattern, sizes, bufs))
    samples: dict[str, list[float]] = {c[0]: [] for c in cases}
    c0 = tcp_counters()
    for rep in range(a.warmup + a.reps):
        k = rep % len(cases)
        for name, pattern, _, bufs in cases[k:] + cases[:k]:
            dist.barrier()
            if pattern == "idle":
                time.sleep(a.idle)
            t0 = time.perf_counter()
            if pattern == "async":
                for w in [dist.all_gather_into_tensor(o, i, async_op=True) for o, i in bufs]:
                    w.wait()
            else:
                for o, i in bufs:
                    dist.all_gather_into_tensor(o, i)
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if rep >= a.warmup:
                samples[name].append(float(t))
    c1 = tcp_counters()
    counters = [None] * world
    dist.all_gather_object(counters, {k: c1[k] - c0.get(k, 0) for k in c1})
    if rank == 0:
        res = {"world": world, "reps": a.reps, "tcp_counters": counters, "cases": {
            name: {"pattern": pattern, "bytes_per_rank": sizes, "median_s": statistics.median(samples[name]),
                   "samples_s": samples[name]} for name, pattern, sizes, _ in cases}}
        a.out.write_text(json.dumps(res, indent=1))
        for name, c in res["cases"].items():
            print(f"{name:<16} {c['pattern']:<5} {sum(c['bytes_per_rank']) / 1e6:7.3f} MB/rank "
                  f"median {c['median_s'] * 1e3:7.2f} ms  (" + " ".join(f"{x * 1e3:.0f}" for x in c["samples_s"]) + ")",
                  flush=True)
        print("tcp counters per rank:", counters, flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
