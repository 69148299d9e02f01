#!/usr/bin/env python
"""Merge several ``bench_cluster.py`` runs into one report, with the simulator beside every figure.

A sweep is best run as several short ``bench_cluster.py`` calls (gathers of every rate, then
training at the rates that matter, each under ``--lock``); this joins their ``results.json`` by
(layout, rate), predicts every configuration (``sim_testbed.predict``: gathers, and training from
the measured baseline) and Megatron's baseline at each rate from the same layout's baseline at
another rate (``sim_testbed.predict_baseline``), and writes ``bench_cluster.md`` (the tables plus
predicted-vs-measured errors) and ``bench_cluster.png``.

    python tools/testbed/collate.py /tmp/g/results.json /tmp/t/results.json --out-dir outputs/bench-cluster
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from tools.testbed.bench_cluster import plot, report
from tools.testbed.netns import parse_rate
from tools.testbed.sim_testbed import predict, predict_baseline, single_core_speeds


def merge(files: list[Path]) -> tuple[list[dict], list[dict]]:
    """Configurations joined by (layout, rate), in layout then rate order; and each file's meta."""
    by_key: dict[tuple, dict] = {}
    metas = []
    for f in files:
        d = json.loads(Path(f).read_text())
        metas.append(d["meta"])
        for r in d["results"]:
            key = (r["layout"], r["rate"])
            cfg = by_key.setdefault(key, {k: v for k, v in r.items() if k not in ("train", "gathers", "gather", "sim")}
                                    | {"train": [], "load_avg": []})
            cfg["load_avg"] = cfg["load_avg"] + r.get("load_avg", [])
            if r.get("gathers"):
                cfg["gathers"] = cfg.get("gathers", []) + r["gathers"]
                cfg.setdefault("gather", r["gathers"][0])
            if r.get("train"):
                cfg["train"] += r["train"]
                cfg["model"] = r["model"]
            for k in ("link_probe_bytes_per_s", "link_duplex_bytes_per_s", "link_latency_s"):
                if cfg.get(k) is None and r.get(k) is not None:
                    cfg[k] = r[k]
    cfgs = sorted(by_key.values(), key=lambda c: (c["layout"], parse_rate(c["rate"])))
    return cfgs, metas


def pool_train(cfg: dict) -> None:
    """One entry per (mode, gather) from several invocations' runs of one configuration: every
    run's ms/iter pooled (median over all), each Megatron timer the median over the invocations,
    sha256 and losses kept only where all agree."""
    by: dict[tuple, list[dict]] = {}
    for t in cfg["train"]:
        by.setdefault((t["mode"], t["overlap"]), []).append(t)
    pooled = []
    for runs in by.values():
        out = dict(runs[0])
        out["ms_runs"] = [x for t in runs for x in (t.get("ms_runs") or [t["ms"]]) if x is not None]
        out["ms"] = statistics.median(out["ms_runs"]) if out["ms_runs"] else None
        names = {k for t in runs for k in (t.get("timers_ms") or {})}
        out["timers_ms"] = {k: statistics.median(t["timers_ms"][k] for t in runs if k in (t.get("timers_ms") or {}))
                            for k in names}
        out["log_lines"] = sorted({line for t in runs for line in t.get("log_lines", [])})
        if len({t["sha256"] for t in runs}) != 1 or len({tuple(t["losses"]) for t in runs}) != 1:
            out["sha256"], out["losses"] = "repeats differ", []
        pooled.append(out)
    cfg["train"] = pooled


def attach_probes(cfgs: list[dict], specs: list[str]) -> None:
    """``LAYOUT@RATE=FILE``: that configuration's ``gloo_probe`` (where it has none of its own)."""
    for spec in specs:
        key, _, path = spec.partition("=")
        layout, _, rate = key.partition("@")
        if not path or not rate:
            raise SystemExit(f"collate: --gloo-probe {spec!r}: expected LAYOUT@RATE=FILE")
        probe = json.loads(Path(path).read_text())
        hits = [c for c in cfgs if c["layout"] == layout and c["rate"] == rate]
        if not hits:
            raise SystemExit(f"collate: --gloo-probe {spec!r}: no run at {layout}@{rate}")
        for c in hits:
            c.setdefault("gloo_probe", probe)


def errors(cfgs: list[dict]) -> tuple[list[str], list[float]]:
    """Markdown rows of predicted vs measured, and every relative error (predicted / measured - 1)."""
    rows, errs = [], []
    for c in cfgs:
        for g in c.get("gathers", [])[:1]:
            sim = c["sim"]["gather"]
            pairs = [("gather plain", g["plain_ms"], sim.get("plain_ms"))]
            pairs += [(f"gather {m}", s["ms"], sim.get(m)) for m, s in g["modes"].items()]
            for what, meas, pred in pairs:
                if pred:
                    errs.append(pred / meas - 1)
                    rows.append(f"| {c['layout']} | {c['rate']} | {what} | {meas:.1f} | {pred:.1f} | {pred / meas - 1:+.0%} |")
        for t in c.get("train", []):
            gm = "overlap" if t["overlap"] else "sync"
            pred = c["sim"]["train"].get(f"{t['mode']}:{gm}") if t["mode"] != "baseline" else \
                c.get("baseline_pred", {}).get(gm)
            if pred and t["ms"]:
                errs.append(pred / t["ms"] - 1)
                src = "from the baseline at " + c["baseline_ref"] if t["mode"] == "baseline" else "from this baseline"
                rows.append(f"| {c['layout']} | {c['rate']} | train {gm} {t['mode']} ({src}) | {t['ms']:.1f} "
                            f"| {pred:.1f} | {pred / t['ms'] - 1:+.0%} |")
            # synchronous: the iteration's gathers alone, Megatron's params-all-gather timer (the
            # slowest rank's ms per iteration), free of the compute's run-to-run noise
            meas = (t.get("timers_ms") or {}).get("params-all-gather")
            pg = c["sim"].get("train_gather", {}).get(f"{t['mode']}:{gm}")
            if gm == "sync" and meas and pg:
                errs.append(pg / meas - 1)
                rows.append(f"| {c['layout']} | {c['rate']} | train sync {t['mode']}: params-all-gather timer "
                            f"| {meas:.1f} | {pg:.1f} | {pg / meas - 1:+.0%} |")
    return rows, errs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", type=Path)
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--pool", action="store_true",
                   help="pool the runs of one mode across the files (median of all runs, timers' medians)")
    p.add_argument("--gloo-probe", action="append", default=[], metavar="LAYOUT@RATE=FILE",
                   help="link_probe.py JSON taken on that configuration's testbed (the simulator's link: "
                        "sim_testbed.MeasuredLink), for runs that recorded none")
    a = p.parse_args(argv)
    cfgs, metas = merge(a.results)
    attach_probes(cfgs, a.gloo_probe)
    if a.pool:
        for c in cfgs:
            pool_train(c)
    single = single_core_speeds(cfgs)  # per rate: the codecs' speeds where ranks do not share cores
    for c in cfgs:
        c["sim"] = predict(c, single_core=single.get(c["rate"]) or next(iter(single.values()), None))
    for c in cfgs:  # the baseline at each rate from the same layout's baseline at its fastest other rate
        others = [o for o in cfgs if o["layout"] == c["layout"] and o is not c
                  and any(t["mode"] == "baseline" for t in o["train"])]
        if others:
            ref = max(others, key=lambda o: parse_rate(o["rate"]))
            c["baseline_ref"] = ref["rate"]
            c["baseline_pred"] = {gm: v for gm in ("overlap", "sync")
                                  if (v := predict_baseline(c, ref, overlap=gm == "overlap")) is not None}
    meta = {"date": metas[0]["date"], "machine": metas[0]["machine"],
            "command": "; ".join(m["command"] for m in metas)}
    rows, errs = errors(cfgs)
    md = report(cfgs, meta)
    md += ("\n## Simulator vs measured (serial timeline: encode, link, decode in series; ranks sharing "
           "cores: codec and agreement x ranks/cores on single-core speeds)\n\n"
           "| layout | link | what | measured ms | predicted ms | error |\n|---|---|---|---|---|---|\n"
           + "\n".join(rows) + "\n")
    if errs:
        md += f"\n|error| median {sorted(abs(e) for e in errs)[len(errs) // 2]:.0%}, max {max(abs(e) for e in errs):.0%} over {len(errs)} figures\n"
    a.out_dir.mkdir(parents=True, exist_ok=True)
    (a.out_dir / "bench_cluster.md").write_text(md)
    (a.out_dir / "results.json").write_text(json.dumps({"meta": meta, "results": cfgs}, indent=1))
    plot(cfgs, a.out_dir / "bench_cluster.png")
    print(md)
    return 1 if "| NO |" in md else 0


if __name__ == "__main__":
    raise SystemExit(main())
