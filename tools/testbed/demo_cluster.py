#!/usr/bin/env python
"""`make demo-cluster`: two hosts joined by a 1 Gbit/s link, the same training with and without CIERA.

Builds the 2-host testbed (network namespaces, tbf-shaped veth links; needs root), runs
``pretrain_gpt.py`` on it (one torchrun node per host, one rank each, c10d rendezvous on host 0)
(8 experts of FFN 1024, 2M-parameter buckets, bf16 gradients reduced by upstream's all-to-all
reduce-scatter, synchronous param gathers) as Megatron's
baseline, with ``--ciera-allgather`` (``auto``: the cost model decides per bucket),
and with exponent_reuse forced, and prints iteration time, all-gather bytes and whether every run's
losses and params sha256 equal the baseline's. Everything is torn down at the end.

    sudo .venv/bin/python tools/testbed/demo_cluster.py [--rate 1gbit] [--iters 12] [--overlap]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from tools.testbed.bench_cluster import bench_train, train_flags
from tools.testbed.netns import LinkSpec, Testbed, TestbedConfig, TestbedUnavailable
from tools.testbed.sim_testbed import probe_link

RUNS = [("baseline", "Megatron all-gather"), ("auto", "--ciera-allgather (auto)"),
        ("exponent_reuse", "--ciera-allgather, exponent_reuse forced")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--moe-ffn", type=int, default=1024, help="--moe-ffn-hidden-size")
    p.add_argument("--bucket-size", type=int, default=2_000_000, help="--ddp-bucket-size")
    p.add_argument("--overlap", action="store_true", help="--overlap-param-gather (smaller gain, see BENCHMARKS.md)")
    a = p.parse_args(argv)
    # the testbed's communication-bound configuration (BENCHMARKS.md): large experts, 32-token
    # micro-batches, several buckets, gradients reduced in bf16 by the all-to-all reduce-scatter
    # (upstream's flags; gloo's own reduce_scatter is an all-reduce, twice the bytes NCCL moves),
    # synchronous param gathers (no --overlap-param-gather; --overlap adds it)
    flags = train_flags(hidden=a.hidden, layers=2, experts=a.experts, moe_ffn=a.moe_ffn, iters=a.iters, seq=32,
                        dp=2, bucket_size=a.bucket_size,
                        extra_flags=("--grad-reduce-in-bf16", "--ddp-reduce-scatter-with-fp32-accumulation"))
    try:
        with Testbed(TestbedConfig(hosts=2, link=LinkSpec(rate=a.rate))) as tb, tempfile.TemporaryDirectory() as tmp:
            bw = probe_link(tb)
            print(f"testbed {tb.name}: 2 hosts ({tb.addr(0)}, {tb.addr(1)}), link {a.rate} "
                  f"(one TCP stream: {bw / 1e6:.0f} MB/s); {a.iters} iterations per run, "
                  f"{'overlapped' if a.overlap else 'synchronous'} param gathers, bf16 grad reduce-scatter",
                  flush=True)
            runs = {}
            for mode, label in RUNS:
                print(f"  running {label} ...", flush=True)
                runs[mode] = bench_train(tb, nproc=1, flags=flags, mode=mode, overlap=a.overlap, timeout=900,
                                         work=Path(tmp))
    except TestbedUnavailable as e:
        print(f"demo-cluster: cannot run here: {e}", file=sys.stderr)
        return 77
    base = runs["baseline"]
    print(f"\n{'run':<44} {'ms/iter':>8} {'all-gather MB raw -> wire':>27}")
    for mode, label in RUNS:
        r = runs[mode]
        raw = r["raw_mb"] or runs["auto"]["raw_mb"]  # Megatron sends the same raw bytes
        mb = f"{r['raw_mb']:.1f} -> {r['wire_mb']:.1f}" if r["raw_mb"] else f"{raw:.1f} (uncompressed)"
        print(f"{label:<44} {r['ms']:8.1f} {mb:>27}")
    same = all(runs[m]["sha256"] == base["sha256"] and runs[m]["losses"] == base["losses"] and base["sha256"]
               for m, _ in RUNS[1:])
    auto = runs["auto"]
    if auto["raw_mb"] and auto["wire_mb"] >= auto["raw_mb"]:
        print("auto: the cost model sent every gather raw: with this machine's CPU codecs compression "
              "would be slower than the link (see the per-bucket 'codec' column in the run's log)")
    print(f"speed-up vs Megatron: " + ", ".join(f"{label} {base['ms'] / runs[m]['ms']:.2f}x" for m, label in RUNS[1:]))
    print(f"params sha256: {base['sha256']}")
    print(f"bit-identical: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
