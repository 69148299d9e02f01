"""Project iteration time of raw vs CIERA gathers from a trace onto a cluster, 8..128 GPUs.

    PYTHONPATH=. python tools/sim/simulate.py --trace tools/sim/traces/olmoe.json \
        --cluster tools/sim/clusters/a100_paper.json --gpus 8 16 32 64 128 \
        --out-md /tmp/sim.md --out-png /tmp/sim.png

Several ``--trace`` files give one table each and one panel each in the PNG. Modes: ``raw`` (the
baseline), every codec in the trace compressing every bucket, ``auto`` (per bucket,
``ciera.cost_model.decide``), and ``auto+ovl`` (``auto`` with encode overlapped off the compute
stream). See tools/sim/README.md for the timeline model.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from tools.sim.timeline import AUTO, IterationResult, modes_for, simulate_iteration
from tools.sim.trace import Cluster, Trace, load_cluster, load_trace
from tools.sim.zero3 import simulate_zero3_step

ZERO3_MODES = (("raw", "exponents"), ("exponent_reuse", "exponents"), ("auto", "exponents"), ("delta", "values"),
               ("auto", "values"))
"""ZeRO-3 columns: (mode, receiver cache)."""

OVL = "auto+ovl"


@dataclass(frozen=True)
class Row:
    """One trace at one GPU count: every mode's simulated iteration."""

    trace: str
    gpus: int
    results: dict  # mode -> IterationResult

    def speedup(self, mode: str) -> float:
        return self.results["raw"].iteration_s / self.results[mode].iteration_s


def project(*, trace: Trace, cluster: Cluster, gpus: list[int], algorithm: str | None = None) -> list[Row]:
    """Simulate every mode of ``trace`` at every GPU count on ``cluster``."""
    link = cluster.link(algorithm=algorithm)
    rows = []
    for g in gpus:
        res: dict[str, IterationResult] = {}
        for mode in modes_for(trace):
            res[mode] = simulate_iteration(trace=trace, world=g, link=link, mode=mode)
        res[OVL] = simulate_iteration(trace=trace, world=g, link=link, mode=AUTO, overlap_encode=True)
        rows.append(Row(trace.name, g, res))
    return rows


def markdown(rows: list[Row], *, title: str) -> str:
    modes = list(rows[0].results)
    head = ["GPUs", "raw ms"] + [f"{m} ms (x)" for m in modes[1:]] + ["auto: compressed buckets"]
    lines = [f"**{title}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r.gpus), f"{r.results['raw'].iteration_s * 1e3:.1f}"]
        cells += [f"{r.results[m].iteration_s * 1e3:.1f} ({r.speedup(m):.2f}x)" for m in modes[1:]]
        auto = r.results[AUTO].buckets
        cells.append(f"{sum(b.choice != 'raw' for b in auto)}/{len(auto)}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(all_rows: list[list[Row]], path: str, *, cluster: str) -> None:
    """One panel per trace: each mode's simulated iteration speed-up over raw gathers, per GPU count;
    ``cluster`` names the cluster in the title. The legend sits below the panels, off the data."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(all_rows)
    cols = min(3, n)
    nrows = (n + cols - 1) // cols
    width = max(5.0 * cols, 7.0)
    fig, axes = plt.subplots(nrows, cols, figsize=(width, 3.8 * nrows + 1.0), squeeze=False, layout="constrained")
    for ax, rows in zip(axes.flat, all_rows):
        gpus = [r.gpus for r in rows]
        for mode in list(rows[0].results)[1:]:
            ax.plot(gpus, [r.speedup(mode) for r in rows], marker="o", label=mode)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xticks(gpus, [str(g) for g in gpus])
        ax.set_title(rows[0].trace, fontsize=10)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("iteration speed-up vs raw gather (x)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    title = (f"Simulated training iteration speed-up, CIERA parameter all-gather vs a raw one, on {cluster} "
             "(a projection from traces, not a measurement; 1.0 = raw)")
    fig.suptitle(textwrap.fill(title, width=int(width * 12)), fontsize=11)
    fig.legend(handles, labels, loc="outside lower center", ncol=len(labels), fontsize=9, frameon=False)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def project_zero3(*, trace: Trace, cluster: Cluster, gpus: list[int], micro_batches: int = 1,
                  algorithm: str | None = None) -> str:
    """ZeRO-3 (:mod:`tools.sim.zero3`): every unit gathered in forward and backward; one Markdown
    table of every (mode, cache) at every GPU count."""
    link = cluster.link(algorithm=algorithm)
    head = ["GPUs", "raw ms"] + [f"{m} ({c} cache) ms (x)" for m, c in ZERO3_MODES[1:]]
    lines = [f"**{trace.name}, ZeRO-3 ({micro_batches} micro-batch{'es' if micro_batches > 1 else ''} per step), "
             f"on {cluster.name}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in gpus:
        res = [simulate_zero3_step(trace=trace, world=g, link=link, mode=m, cache=c, micro_batches=micro_batches)
               for m, c in ZERO3_MODES]
        raw = res[0].iteration_s
        lines.append("| " + " | ".join([str(g), f"{raw * 1e3:.1f}"] + [
            f"{r.iteration_s * 1e3:.1f} ({raw / r.iteration_s:.2f}x)" for r in res[1:]]) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", nargs="+", required=True, help="trace JSON file(s)")
    ap.add_argument("--cluster", required=True, help="cluster JSON file")
    ap.add_argument("--gpus", nargs="+", type=int, default=[8, 16, 32, 64, 128])
    ap.add_argument("--algorithm", choices=["ring", "hierarchical"], default=None,
                    help="override the cluster's all-gather algorithm")
    ap.add_argument("--zero3", action="store_true",
                    help="ZeRO-3 timeline (every unit gathered in forward and backward; tools/sim/zero3.py): "
                         "a table per trace, no PNG")
    ap.add_argument("--micro-batches", type=int, default=1, help="with --zero3: micro-batches per step")
    ap.add_argument("--out-md", default=None)
    ap.add_argument("--out-png", default=None)
    args = ap.parse_args(argv)

    cluster = load_cluster(args.cluster)
    algo = args.algorithm or cluster.algorithm
    all_rows, parts = [], []
    for path in args.trace:
        trace = load_trace(path)
        if args.zero3:
            parts.append(project_zero3(trace=trace, cluster=cluster, gpus=args.gpus, micro_batches=args.micro_batches,
                                       algorithm=args.algorithm))
            continue
        rows = project(trace=trace, cluster=cluster, gpus=args.gpus, algorithm=args.algorithm)
        all_rows.append(rows)
        parts.append(markdown(rows, title=f"{trace.name} on {cluster.name} ({algo} all-gather)"))
    text = "\n".join(parts)
    print(text)
    if args.out_md:
        Path(args.out_md).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out_md).write_text(text)
    if args.out_png and all_rows:
        plot(all_rows, args.out_png, cluster=f"{cluster.name} ({algo} all-gather)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
