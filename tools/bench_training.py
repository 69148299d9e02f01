#!/usr/bin/env python
"""Iteration time of pretrain_gpt.py with and without CIERA, side by side in one run.

Launches the same tiny GPT-MoE on local gloo ranks once per mode and repeats the whole set
``--repeats`` times in rotating order, so drift in machine load hits every mode alike. Reports the
median over runs of each run's median iteration time (first log interval excluded: warm-up),
the ratio to the baseline, the all-gather bytes, and whether every run's ``params sha256`` matched
the baseline's.

Modes: ``baseline`` (Megatron's gather), ``never`` (CIERA path, every gather raw), ``always``
(exponent_reuse and delta every gather) and ``auto`` (the cost model decides per bucket).

    python tools/bench_training.py                  # 4 ranks, EP 2
    python tools/bench_training.py --smoke          # tiny, checks it runs
"""

from __future__ import annotations

import argparse
import re
import statistics
from pathlib import Path

from megatron.ciera.app.launch import TABLE_TOTAL, run_pretrain
from tools._common import write_table

MODES = {
    "baseline": [],
    "never": ["--ciera-allgather", "--ciera-selection", "never"],
    "always-exponent_reuse": ["--ciera-allgather", "--ciera-selection", "always", "--ciera-codec", "exponent_reuse"],
    "always-delta": ["--ciera-allgather", "--ciera-selection", "always", "--ciera-codec", "delta"],
    "auto": ["--ciera-allgather", "--ciera-selection", "auto", "--ciera-codec", "auto"],
}
ITER_MS = re.compile(r"elapsed time per iteration \(ms\): ([\d.]+)")


def model_flags(*, hidden: int, layers: int, experts: int, ep: int, iters: int) -> list[str]:
    return [
        "--num-layers", str(layers), "--hidden-size", str(hidden), "--ffn-hidden-size", str(2 * hidden),
        "--num-attention-heads", "4", "--seq-length", "128", "--max-position-embeddings", "128",
        "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
        "--untie-embeddings-and-output-weights", "--num-experts", str(experts), "--moe-router-topk", "2",
        "--moe-ffn-hidden-size", str(hidden), "--moe-router-load-balancing-type", "aux_loss",
        "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type", "alltoall",
        "--expert-model-parallel-size", str(ep), "--use-distributed-optimizer", "--overlap-grad-reduce",
        "--overlap-param-gather", "--bf16", "--optimizer", "adam", "--lr", "1e-4", "--min-lr", "1e-4",
        "--lr-decay-style", "constant", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1023",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(iters), "--log-interval", "5",
        "--device", "cpu", "--seed", "1234", "--eval-iters", "0",  # iteration time only: no evaluation
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--ep", type=int, default=2, help="--expert-model-parallel-size")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out-md", type=Path, default=None)
    a = p.parse_args(argv)
    if a.smoke:
        a.nproc, a.ep, a.hidden, a.experts, a.iters, a.repeats = 2, 1, 32, 2, 10, 1
        a.modes = ["baseline", "auto"]
    flags = model_flags(hidden=a.hidden, layers=a.layers, experts=a.experts, ep=a.ep, iters=a.iters)
    print(f"# bench_training: {a.nproc} gloo ranks, EP {a.ep}, hidden {a.hidden}, {a.layers} layers, "
          f"{a.experts} experts, {a.iters} iterations x {a.repeats} repeats, modes rotated", flush=True)
    times = {m: [] for m in a.modes}
    bytes_ = {}
    digests = {m: set() for m in a.modes}
    for r in range(a.repeats):
        order = a.modes[r % len(a.modes):] + a.modes[: r % len(a.modes)]
        for mode in order:
            res = run_pretrain(flags + MODES[mode], nproc=a.nproc, timeout=1200)
            if res.returncode != 0:
                print(res.output[-4000:])
                raise SystemExit(f"{mode}: pretrain_gpt failed ({res.returncode})")
            per_interval = [float(m.group(1)) for m in map(ITER_MS.search, res.iteration_lines()) if m]
            times[mode].append(statistics.median(per_interval[1:] or per_interval))
            digests[mode].add(res.sha256)
            total = TABLE_TOTAL.search(res.summary_block())
            if total:
                bytes_[mode] = (float(total.group(1)), float(total.group(2)))
            print(f"  repeat {r} {mode:<22} {times[mode][-1]:8.1f} ms/iter", flush=True)

    base_digests = digests.get("baseline", set())
    base = statistics.median(times["baseline"]) if "baseline" in times else None
    lines = ["| mode | ms / iteration | vs baseline | all-gather MB raw -> wire | ratio | params sha256 = baseline |",
             "|---|---|---|---|---|---|"]
    for mode in a.modes:
        t = statistics.median(times[mode])
        raw, wire = bytes_.get(mode, (None, None))
        mb = f"{raw:.1f} -> {wire:.1f}" if raw else "-"
        ratio = f"{raw / wire:.2f}x" if raw else "-"
        same = "yes" if base_digests and digests[mode] == base_digests else ("-" if mode == "baseline" else "NO")
        rel = f"{base / t:.2f}x" if base else "-"
        lines.append(f"| {mode} | {t:.1f} | {rel} | {mb} | {ratio} | {same} |")
    write_table(lines, a.out_md)
    return 0 if all(lines[i].endswith("| yes |") or "| baseline |" in lines[i] for i in range(2, len(lines))) else 1


if __name__ == "__main__":
    raise SystemExit(main())
