#!/usr/bin/env python
"""ZeRO-3 training on the testbed: FSDP2's own all-gather against CIERA's, on real shaped links.

Builds a 2-host testbed (network namespaces, tbf-shaped veth links; needs root) and runs
``examples/fsdp2/train_fsdp2.py`` (one torchrun node per host, one rank each) with FSDP2's gather
and with ``--ciera`` in each cache mode, then prints the median iteration time, the gathers' bytes
and whether every run's losses and ``params sha256`` equal the baseline's. Torn down at the end.

    sudo .venv/bin/python tools/testbed/bench_zero3.py [--rate 1gbit] [--steps 12] [--out-md F]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import statistics
import sys
import tempfile
from pathlib import Path

from tools.testbed.bench_cluster import ROOT, _torchrun_all
from tools.testbed.netns import LinkSpec, Testbed, TestbedConfig, TestbedUnavailable
from tools.testbed.sim_testbed import probe_link

RUNS = {"baseline": ("FSDP2 all-gather", []),
        "exponents": ("--ciera (auto, cache exponents)", ["--ciera", "--cache", "exponents"]),
        "values": ("--ciera (auto, cache values)", ["--ciera", "--cache", "values"]),
        "values-always": ("--ciera (always, cache values)", ["--ciera", "--cache", "values", "--selection", "always"])}
ITER_MS = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
SHA = re.compile(r"params sha256: ([0-9a-f]{64})")
BYTES = re.compile(r"CIERA: ([0-9.]+) MiB raw -> ([0-9.]+) MiB on the wire")


def run(tb: Testbed, *, flags: list[str], extra: list[str], work: Path, timeout: float) -> dict:
    """One training run on every host; its per-step times, digest, losses and bytes."""
    work.mkdir(parents=True, exist_ok=True)
    loss_log = work / "losses.txt"
    script = [str(ROOT / "examples" / "fsdp2" / "train_fsdp2.py"), *flags, *extra, "--loss-log", str(loss_log)]
    text = "\n".join(_torchrun_all(tb, script, nproc=1, timeout=timeout, log_dir=work))
    ms = [float(x) for x in ITER_MS.findall(text)]
    sha = SHA.search(text)
    b = BYTES.search(text)
    return {"ms": statistics.median(ms[2:] or ms) if ms else None, "ms_all": ms,
            "sha256": sha.group(1) if sha else None, "losses": loss_log.read_text() if loss_log.exists() else "",
            "raw_mib": float(b.group(1)) if b else None, "wire_mib": float(b.group(2)) if b else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", default="1gbit", help="link rate per host (tc tbf), default 1gbit")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=["baseline", "exponents", "values"],
                   help="which runs (baseline first: the others are compared with it)")
    p.add_argument("--out-md", default=None, help="also write the table here (Markdown)")
    a = p.parse_args(argv)
    flags = ["--steps", str(a.steps), "--micro-batches", str(a.micro_batches), "--dim", str(a.dim),
             "--ffn", str(a.ffn), "--experts", str(a.experts), "--layers", str(a.layers), "--lr", str(a.lr),
             "--batch", "2", "--seq", "32"]
    try:
        with Testbed(TestbedConfig(hosts=2, link=LinkSpec(rate=a.rate))) as tb, tempfile.TemporaryDirectory() as tmp:
            bw = probe_link(tb)
            head = (f"testbed {tb.name}: 2 hosts, link {a.rate} (one TCP stream: {bw / 1e6:.0f} MB/s); "
                    f"FSDP2 ZeRO-3, {a.layers} blocks of {a.experts} experts ({a.dim}x{a.ffn}), "
                    f"{a.micro_batches} micro-batches per step, {a.steps} steps per run")
            print(head, flush=True)
            results = {}
            for name in a.runs:
                label, extra = RUNS[name]
                print(f"  running {label} ...", flush=True)
                results[name] = run(tb, flags=flags, extra=extra, work=Path(tmp) / name, timeout=900)
    except TestbedUnavailable as e:
        print(f"bench_zero3: the testbed is unavailable here: {e}", file=sys.stderr)
        return 2
    base = results[a.runs[0]]
    lines = [f"# ZeRO-3 (FSDP2) on the testbed ({datetime.date.today()}, {platform.node()}, {os.cpu_count()} CPUs)", "",
             f"Command: `{' '.join(['tools/testbed/bench_zero3.py', *(argv or sys.argv[1:])])}`", "", head, "",
             "| run | median ms / step | speed-up | gathers MiB raw -> wire | losses and params sha256 | ms per step |",
             "|---|---|---|---|---|---|"]
    ok = True
    for name in a.runs:
        label, r = RUNS[name][0], results[name]
        same = r["sha256"] == base["sha256"] and r["losses"] == base["losses"] and r["sha256"] is not None
        ok &= same
        wire = "-" if r["raw_mib"] is None else f"{r['raw_mib']:.1f} -> {r['wire_mib']:.1f}"
        lines.append(f"| {label} | {r['ms']:.1f} | {base['ms'] / r['ms']:.2f}x | {wire} | "
                     f"{'identical' if same else 'DIFFER'} | {' '.join(f'{x:.0f}' for x in r['ms_all'])} |")
    text = "\n".join(lines)
    print(text)
    print(f"bit-identical: {'yes' if ok else 'NO'}")
    if a.out_md:
        Path(a.out_md).write_text(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
