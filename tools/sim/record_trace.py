"""Record a trace from real gloo runs of CieraAllGather here, and validate the simulator against them.

    PYTHONPATH=. python tools/sim/record_trace.py --world 2 4 --out-dir /tmp/ciera_sim_rec

For each world size, ``world`` CPU processes (torch.multiprocessing, gloo on loopback) each own
one shard of every bucket (``--buckets``, values per bucket, bf16). One iteration is:

1. "optimizer step" (untimed): every rank writes the next :class:`ciera.testing.trajectory.AdamTrajectory`
   step (lr 1e-4) into its shards;
2. timed forward, once per mode, each mode on its own buffers (a buffer is its gather's cache): Megatron's prefetch chain -- ``start()`` bucket 0; for each bucket ``k``:
   ``start()`` bucket ``k+1``, ``wait()`` bucket ``k`` (decodes in place), then the bucket's
   synthetic compute: a 128x128 fp32 matmul repeated to last ``--compute-ms`` (calibrated).

Modes: ``raw`` (``CieraConfig(codec='raw')``) and each ``--codecs`` entry with
``selection='always'``. Within each iteration the passes (each mode's forward, every bucket's raw
gather alone, the compute alone) are interleaved in a rotating order, so a background load on this
shared machine hits them alike. Per mode the recorded figures are the median iteration time, and per bucket
the wire/raw ratio (``GatherStats.wire_bytes / raw_bytes``: capacity as sent), encode and decode
throughput (``GatherStats.encode_s / decode_s``). The link is fitted
(``ciera.cost_model.fit_latency_bandwidth``) to the median time of each bucket's raw gather run
alone (``measure_link``'s best-case microbenchmark is recorded beside it); per-bucket compute by
running the loop without gathers. All
figures are MAX-agreed across ranks. The recorded trace + a one-node cluster go through
``tools/sim/timeline.simulate_iteration`` and the predicted iteration time is compared with the
measured one for every mode.

Caveat: the ranks share this machine's cores, so "communication" (gloo memcpy on loopback), codec
work and the synthetic compute all compete for the same CPUs, where a GPU runs NCCL beside its
kernels. Both predictions are printed: the GPU timeline (overlapped streams) and the same timeline
with ``overlap_comm=False`` (one serial stream), which is the one that describes a CPU box.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path


import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ciera.cost_model import fit_latency_bandwidth
from ciera.measure import agree, measure_link
from ciera.testing.trajectory import AdamTrajectory
from tools.sim.timeline import simulate_iteration
from tools.sim.trace import (
    CLUSTER_SCHEMA, TRACE_SCHEMA, cluster_from_dict, save_json, trace_from_dict,
)
from ciera.testing import free_port


def _calibrate(a: torch.Tensor, c: torch.Tensor, reps: int = 50) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        torch.mm(a, a, out=c)
    return (time.perf_counter() - t0) / reps


def _worker(rank: int, world: int, port: int, cfg: dict, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        q.put((rank, _record(rank, world, cfg)))
    except BaseException as e:  # report, then let the parent fail loudly
        q.put((rank, {"error": repr(e)}))
        raise
    finally:
        dist.destroy_process_group()


def _record(rank: int, world: int, cfg: dict) -> dict:
    """One rank's side. Every pass of every iteration runs on every rank in the same order, and the
    passes are interleaved (rotated per iteration), so all modes see the same background load."""
    from ciera import CieraAllGather, CieraConfig

    link = measure_link(sizes=cfg["link_sizes"], repeats=3)
    a = torch.randn(128, 128)
    c = torch.empty_like(a)
    _calibrate(a, c)  # warm up
    one = agree(values=[statistics.median(_calibrate(a, c) for _ in range(5))])[0]
    reps = [max(1, round(ms * 1e-3 / one)) for ms in cfg["compute_ms"]]

    def compute(k: int) -> None:
        for _ in range(reps[k]):
            torch.mm(a, a, out=c)

    numels = cfg["buckets"]
    nb = len(numels)
    trajs = [AdamTrajectory(numel=n // world, lr=cfg["lr"], seed=1000 * k + rank) for k, n in enumerate(numels)]
    for _ in range(cfg["pre_steps"]):  # past the first, atypical AdamW steps
        for t in trajs:
            t.step()

    # one set of buffers per pass: a buffer is its gather's receiver cache and must see only it
    modes = ["raw", *cfg["codecs"]]
    passes = ["alone", *modes]
    bufs = {p: [torch.zeros(n, dtype=torch.bfloat16) for n in numels] for p in passes}
    gathers = {}
    for p in passes:
        conf = CieraConfig(codec="raw", selection="never") if p in ("alone", "raw") else \
            CieraConfig(codec=p, selection="always")
        gathers[p] = [CieraAllGather(b, config=conf, name=f"{p}.b{k}") for k, b in enumerate(bufs[p])]

    def forward(gs) -> float:
        """Megatron's prefetch chain; returns its wall time."""
        t0 = time.perf_counter()
        handles = [None] * nb
        handles[0] = gs[0].start()
        for k in range(nb):
            if k + 1 < nb:
                handles[k + 1] = gs[k + 1].start()
            handles[k].wait()
            compute(k)
        return time.perf_counter() - t0

    compute_t = [[] for _ in numels]
    alone_t = [[] for _ in numels]
    iter_t = {m: [] for m in modes}
    before = None
    for it in range(cfg["warmup"] + cfg["iters"]):
        if it == cfg["warmup"]:
            before = {m: [g.stats for g in gathers[m]] for m in modes}
        for k, t in enumerate(trajs):  # the "optimizer step": new shard values in every pass's buffer
            new = t.step()
            for p in passes:
                bufs[p][k].view(world, -1)[rank].copy_(new)
        rotation = passes[it % len(passes):] + passes[: it % len(passes)] + ["compute"]
        for p in rotation:
            dist.barrier()
            if p == "compute":
                for k in range(nb):
                    t0 = time.perf_counter()
                    compute(k)
                    compute_t[k].append(time.perf_counter() - t0)
            elif p == "alone":
                for k, g in enumerate(gathers[p]):
                    dist.barrier()
                    t0 = time.perf_counter()
                    g.start().wait()
                    alone_t[k].append(time.perf_counter() - t0)
            else:
                iter_t[p].append(forward(gathers[p]))

    w = cfg["warmup"]
    compute_s = agree(values=[statistics.median(v[w:]) for v in compute_t])
    alone_s = agree(values=[statistics.median(v[w:]) for v in alone_t])
    # the link as the gathers see it: each bucket's raw gather alone, median time, fitted
    fitted = fit_latency_bandwidth(sizes=[n // world * 2 for n in numels], times=alone_s, world=world)
    out = {"link": [fitted.bandwidth_bytes_per_s, fitted.latency_s],
           "link_microbench": [link.bandwidth_bytes_per_s, link.latency_s],
           "compute_s": compute_s, "gather_alone_s": alone_s, "modes": {}}
    for mode in modes:
        deltas = [g.stats.minus(b0) for g, b0 in zip(gathers[mode], before[mode])]
        figures = []
        for n, d in zip(numels, deltas):
            shard_bytes = n // world * 2
            enc = d.compressed_gathers * shard_bytes / d.encode_s if d.encode_s > 0 else 0.0
            dec = d.compressed_gathers * (world - 1) * shard_bytes / d.decode_s if d.decode_s > 0 else 0.0
            figures += [d.wire_bytes / d.raw_bytes, 1.0 / enc if enc else 0.0, 1.0 / dec if dec else 0.0,
                        float(d.overflows), float(d.compressed_gathers)]
        # the slowest rank paces everything; MAX-agree (seconds per byte, so MAX = slowest)
        agreed = agree(values=[statistics.median(iter_t[mode][w:]), *figures])
        rows = [agreed[1 + 5 * k: 6 + 5 * k] for k in range(nb)]
        out["modes"][mode] = {
            "iteration_s": agreed[0],
            "buckets": [{"wire_ratio": r[0], "encode_bytes_per_s": 1 / r[1] if r[1] else None,
                         "decode_bytes_per_s": 1 / r[2] if r[2] else None, "overflows": int(r[3]),
                         "compressed_gathers": int(r[4])} for r in rows],
        }
    return out


def run_world(world: int, cfg: dict) -> dict:
    """Spawn ``world`` gloo ranks, record, return rank 0's (agreed) figures."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, cfg, q)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=cfg["timeout_s"]) for _ in range(world))
    for p in procs:
        p.join(timeout=60)
    for r, res in results.items():
        if "error" in res:
            raise RuntimeError(f"rank {r} failed: {res['error']}")
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"a rank exited with {[p.exitcode for p in procs]}")
    return results[0]


def to_trace_and_cluster(*, rec: dict, world: int, cfg: dict) -> tuple[dict, dict]:
    """The recorded figures as simulator inputs: a trace and a one-node cluster of ``world`` ranks."""
    buckets = []
    for k, n in enumerate(cfg["buckets"]):
        codecs = {}
        for mode in cfg["codecs"]:
            b = rec["modes"][mode]["buckets"][k]
            if b["encode_bytes_per_s"] and b["decode_bytes_per_s"]:
                codecs[mode] = {key: b[key] for key in ("wire_ratio", "encode_bytes_per_s", "decode_bytes_per_s")}
        buckets.append(dict(name=f"b{k}", numel=n, dtype="bfloat16", kind="dense", compute_s=rec["compute_s"][k],
                            codecs=codecs))
    trace = dict(schema=TRACE_SCHEMA, name=f"gloo x{world} recorded", iteration_compute_s=sum(rec["compute_s"]),
                 meta=dict(recorded_by="tools/sim/record_trace.py", config=cfg, measured=rec), buckets=buckets)
    bw, lat = rec["link"]
    cluster = dict(schema=CLUSTER_SCHEMA, name=f"this machine, gloo loopback x{world}", gpus_per_node=world,
                   intra_bandwidth_bytes_per_s=bw, intra_latency_s=lat, inter_bandwidth_bytes_per_s=bw,
                   inter_latency_s=lat, algorithm="ring", meta={"fitted by": "ciera.measure.measure_link"})
    return trace, cluster


def validate(*, trace: dict, cluster: dict, rec: dict, world: int) -> list[dict]:
    t, c = trace_from_dict(trace), cluster_from_dict(cluster)
    rows = []
    for mode, m in rec["modes"].items():
        row = dict(world=world, mode=mode, measured_s=m["iteration_s"])
        for key, overlap in (("overlapped", True), ("serial", False)):
            pred = simulate_iteration(trace=t, world=world, link=c.link(), mode=mode, overlap_comm=overlap).iteration_s
            row[f"predicted_{key}_s"] = pred
            row[f"error_{key}"] = (pred - m["iteration_s"]) / m["iteration_s"]
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--buckets", nargs="+", type=int, default=[1 << 20, 1 << 22, 1 << 21, 1 << 22],
                    help="values per bucket (bf16), divisible by every world size")
    ap.add_argument("--compute-ms", nargs="+", type=float, default=None,
                    help="synthetic forward compute per bucket (default 10 ms each)")
    ap.add_argument("--codecs", nargs="*", default=["exponent_reuse"],
                    help="codecs to run with selection='always' (the delta reference encoder is slow on CPU)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--pre-steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--out-dir", default=None, help="write trace_w<N>.json, cluster_w<N>.json, validation.json")
    ap.add_argument("--timeout-s", type=float, default=600)
    args = ap.parse_args(argv)
    compute_ms = args.compute_ms or [10.0] * len(args.buckets)
    if len(compute_ms) != len(args.buckets):
        ap.error(f"--compute-ms has {len(compute_ms)} values for {len(args.buckets)} buckets")
    cfg = dict(buckets=args.buckets, compute_ms=compute_ms, codecs=args.codecs, iters=args.iters,
               warmup=args.warmup, pre_steps=args.pre_steps, lr=args.lr, timeout_s=args.timeout_s,
               link_sizes=[1 << 14, 1 << 17, 1 << 19, 1 << 21])
    all_rows = []
    for world in args.world:
        bad = [n for n in args.buckets if n % world]
        if bad:
            ap.error(f"bucket sizes {bad} are not divisible by world {world}")
        rec = run_world(world, cfg)
        trace, cluster = to_trace_and_cluster(rec=rec, world=world, cfg=cfg)
        rows = validate(trace=trace, cluster=cluster, rec=rec, world=world)
        all_rows += rows
        if args.out_dir:
            save_json(trace, Path(args.out_dir) / f"trace_w{world}.json")
            save_json(cluster, Path(args.out_dir) / f"cluster_w{world}.json")
        bw, lat = rec["link"]
        print(f"world {world}: link {bw / 1e9:.2f} GB/s, {lat * 1e6:.0f} us/step; compute "
              f"{sum(rec['compute_s']) * 1e3:.1f} ms; " + "; ".join(
                  f"{m}: ratio {statistics.mean(b['wire_ratio'] for b in v['buckets']):.3f}"
                  for m, v in rec["modes"].items()), flush=True)
    print("\n| ranks | mode | measured ms | simulated, overlapped streams | error | simulated, serial | error |\n"
          "|---|---|---|---|---|---|---|")
    for r in all_rows:
        print(f"| {r['world']} | {r['mode']} | {r['measured_s'] * 1e3:.1f} | {r['predicted_overlapped_s'] * 1e3:.1f} | "
              f"{r['error_overlapped'] * 100:+.1f}% | {r['predicted_serial_s'] * 1e3:.1f} | "
              f"{r['error_serial'] * 100:+.1f}% |")
    if args.out_dir:
        save_json({"rows": all_rows}, Path(args.out_dir) / "validation.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
