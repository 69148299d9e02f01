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
import json
import os
import platform
import re
import statistics
import sys
import tempfile
from pathlib import Path

from tools.sim.trace import BucketTrace, CodecTrace, Trace
from tools.sim.zero3 import simulate_zero3_step
from tools.testbed.bench_cluster import ROOT, _torchrun_all
from tools.testbed.netns import LinkSpec, Testbed, TestbedConfig, TestbedUnavailable
from tools.testbed.sim_testbed import MeasuredLink, probe_gloo, probe_link

RUNS = {"baseline": ("FSDP2 all-gather", []),
        "default": ("--ciera (every setting at its default: cache auto)", ["--ciera", "--cache", "auto"]),
        "exponents": ("--ciera (auto, cache exponents)", ["--ciera", "--cache", "exponents"]),
        "values": ("--ciera (auto, cache values)", ["--ciera", "--cache", "values"]),
        "values-always": ("--ciera (always, cache values)", ["--ciera", "--cache", "values", "--selection", "always"]),
        "exponents-always": ("--ciera (always, cache exponents)", ["--ciera", "--cache", "exponents", "--selection", "always"])}
ITER_MS = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
SHA = re.compile(r"params sha256: ([0-9a-f]{64})")
BYTES = re.compile(r"CIERA: ([0-9.]+) MiB raw -> ([0-9.]+) MiB on the wire")


def run(tb: Testbed, *, flags: list[str], extra: list[str], work: Path, timeout: float) -> dict:
    """One training run on every host; its per-step times, digest, losses and bytes."""
    work.mkdir(parents=True, exist_ok=True)
    loss_log = work / "losses.txt"
    units = work / "units.json"
    script = [str(ROOT / "examples" / "fsdp2" / "train_fsdp2.py"), *flags, *extra, "--loss-log", str(loss_log),
              *(["--units-json", str(units)] if "--ciera" in flags else [])]
    text = "\n".join(_torchrun_all(tb, script, nproc=1, timeout=timeout, log_dir=work))
    ms = [float(x) for x in ITER_MS.findall(text)]
    sha = SHA.search(text)
    b = BYTES.search(text)
    return {"ms": statistics.median(ms[2:] or ms) if ms else None, "ms_all": ms,
            "sha256": sha.group(1) if sha else None, "losses": loss_log.read_text() if loss_log.exists() else "",
            "raw_mib": float(b.group(1)) if b else None, "wire_mib": float(b.group(2)) if b else None,
            "units": json.loads(units.read_text()) if units.exists() else None}


def predict_s(*, base_s: float, units: dict, link, world: int, micro_batches: int, cache: str) -> float:
    """The simulator's step time for a CIERA run: the measured baseline step, less its gathers as
    ``tools/sim/zero3.py`` prices them raw on ``link``, plus the same gathers as it prices them with
    each unit's codec (serial timeline: FSDP2's unshards on CPU are synchronous). Codec speeds and
    wire ratios come from the run's own counters (encode / decode timers, wire bytes); the root unit
    is priced like the blocks (2 gathers per micro-batch; it holds well under 1% of the bytes)."""
    buckets = []
    mode = "raw"
    for name, u in units.items():
        gathers = max(u["gathers"], 1)
        gathered = u["raw_bytes"] / gathers  # bytes of one gathered buffer
        shard = gathered / world
        codecs = {}
        if u["compressed_gathers"]:
            mode = u["codec"]
            sending = u["compressed_gathers"] + (u["replays"] if cache == "exponents" else 0)
            wire = (u["wire_bytes"] - u["raw_gathers"] * gathered) / max(sending, 1) / gathered
            enc = shard * u["compressed_gathers"] / max(u["encode_s"], 1e-12)
            dec = (world - 1) * shard * sending / max(u["decode_s"], 1e-12)
            codecs[mode] = CodecTrace(wire_ratio=wire, encode_bytes_per_s=enc, decode_bytes_per_s=dec)
        buckets.append(BucketTrace(name, numel=int(gathered // 2), dtype="bfloat16", kind="unit", compute_s=0.0,
                                   codecs=codecs))
    trace = Trace(name="fsdp2 example", iteration_compute_s=0.0, buckets=tuple(buckets))
    kw = dict(trace=trace, world=world, link=link, cache=cache, micro_batches=micro_batches, overlap_comm=False)
    gathers_raw = simulate_zero3_step(mode="raw", **kw).iteration_s
    if mode == "raw":
        return base_s
    # units the run left raw have no codec figures: price them raw
    mixed = Trace(name=trace.name, iteration_compute_s=0.0, buckets=tuple(b for b in buckets if b.codecs))
    rest = Trace(name=trace.name, iteration_compute_s=0.0, buckets=tuple(b for b in buckets if not b.codecs))
    ciera = simulate_zero3_step(**{**kw, "trace": mixed}, mode=mode).iteration_s
    ciera += simulate_zero3_step(**{**kw, "trace": rest}, mode="raw").iteration_s if rest.buckets else 0.0
    return base_s - gathers_raw + ciera


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", default="1gbit", help="link rate per host (tc tbf), default 1gbit")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seq", type=int, default=4,
                   help="tokens per micro-batch and rank (default 4: few, so the parameter gathers dominate, "
                        "as for MoE experts, whose tokens are a fraction of the batch)")
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=["baseline", "default", "exponents", "values"],
                   help="which runs (baseline first: the others are compared with it)")
    p.add_argument("--simulate", action="store_true",
                   help="also time gloo's all-gather on the link (link_probe.py) and print the simulator's "
                        "prediction of each CIERA run beside it (tools/sim/zero3.py)")
    p.add_argument("--autogroup-nice", type=int, default=None,
                   help="scheduler priority of the hosts' sessions (-20..19; e.g. -19 against other jobs on the machine)")
    p.add_argument("--out-md", default=None, help="also write the table here (Markdown)")
    a = p.parse_args(argv)
    flags = ["--steps", str(a.steps), "--micro-batches", str(a.micro_batches), "--dim", str(a.dim),
             "--ffn", str(a.ffn), "--experts", str(a.experts), "--layers", str(a.layers), "--lr", str(a.lr),
             "--batch", "1", "--seq", str(a.seq)]
    try:
        with Testbed(TestbedConfig(hosts=2, link=LinkSpec(rate=a.rate), autogroup_nice=a.autogroup_nice)) as tb, tempfile.TemporaryDirectory() as tmp:
            bw = probe_link(tb)
            link = MeasuredLink.from_probe(probe_gloo(tb, nproc=1), rate=a.rate) if a.simulate else None
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
             "| run | median ms / step | speed-up | simulated ms (error) | gathers MiB raw -> wire | losses and params sha256 | ms per step |",
             "|---|---|---|---|---|---|---|"]
    ok = True
    for name in a.runs:
        label, r = RUNS[name][0], results[name]
        same = r["sha256"] == base["sha256"] and r["losses"] == base["losses"] and r["sha256"] is not None
        ok &= same
        wire = "-" if r["raw_mib"] is None else f"{r['raw_mib']:.1f} -> {r['wire_mib']:.1f}"
        sim = "-"
        cache = RUNS[name][1][RUNS[name][1].index("--cache") + 1] if "--cache" in RUNS[name][1] else None
        if link is not None and r["units"] and cache in ("values", "exponents"):  # (auto: chosen inside the run)
            pred = 1e3 * predict_s(base_s=base["ms"] / 1e3, units=r["units"], link=link, world=2,
                                   micro_batches=a.micro_batches, cache=cache)
            sim = f"{pred:.1f} ({(pred - r['ms']) / r['ms']:+.1%})"
        lines.append(f"| {label} | {r['ms']:.1f} | {base['ms'] / r['ms']:.2f}x | {sim} | {wire} | "
                     f"{'identical' if same else 'DIFFER'} | {' '.join(f'{x:.0f}' for x in r['ms_all'])} |")
    text = "\n".join(lines)
    print(text)
    print(f"bit-identical: {'yes' if ok else 'NO'}")
    if a.out_md:
        Path(a.out_md).write_text(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
