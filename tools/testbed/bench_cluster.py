#!/usr/bin/env python
"""The testbed measurement: gather and training, baseline vs CIERA, over real shaped links.

For every layout (``HOSTSxRANKS``: 2x1, 2x2) and link rate (1, 2.5, 10 Gbit/s) it builds the testbed
(``tools/testbed/netns.py``), then on every host launches torchrun (c10d rendezvous on host 0):

* **gather** (``bench_gather.py``): plain ``all_gather_into_tensor`` vs CieraAllGather per codec
  (forced) and ``auto`` on a bf16 AdamW trajectory at lr 1e-4, bit-exact every step; time and bytes;
* **training** (``pretrain_gpt.py``): iteration time without and with ``--ciera-allgather`` (auto
  and each codec forced), overlapped (``--overlap-param-gather``) and synchronous; every run's
  per-iteration losses and final params sha256 compared exactly with the baseline's.

Then the simulator (``tools/sim``) is fed each configuration (link: gloo's all-gather timed on the
testbed per size, ``link_probe.py``; codec speeds: the CIERA gathers' and training runs' own timers;
the training runs' bucket sizes) and its predictions are put next to the measured times. Writes ``results.json``, ``bench_cluster.md`` and
``bench_cluster.png`` under ``--out-dir``. Needs root (network namespaces).

    python tools/testbed/bench_cluster.py --out-dir outputs/bench-cluster            # everything (~1 h, 2 cores)
    python tools/testbed/bench_cluster.py --layouts 2x1 --rates 1gbit --train-modes baseline auto
    python tools/testbed/bench_cluster.py --smoke --out-dir /tmp/bc                   # tiny, checks it runs
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import json
import os
import platform
import re
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from tools.bench_training import ITER_MS, model_flags
from tools.testbed.netns import LinkSpec, Testbed, TestbedConfig, TestbedUnavailable, parse_rate
from tools.testbed.sim_testbed import PROBE_SIZES, predict, probe_duplex, probe_gloo, probe_latency, probe_link
from tools.testbed.testbed import torchrun_command

TRAIN_MODES = {
    "baseline": [],
    "default": ["--ciera-allgather"],  # what a user adds: every --ciera-* flag at its default
    "cache-values": ["--ciera-allgather", "--ciera-cache", "values"],
    "cache-exponents": ["--ciera-allgather", "--ciera-cache", "exponents"],
    # compressed across hosts from a cache of one shard per host, raw within (LOCAL_WORLD_SIZE from torchrun)
    "cache-two-level": ["--ciera-allgather", "--ciera-cache", "two_level"],
    "auto": ["--ciera-allgather", "--ciera-selection", "auto", "--ciera-codec", "auto"],
    "exponent_reuse": ["--ciera-allgather", "--ciera-selection", "always", "--ciera-codec", "exponent_reuse"],
    "delta": ["--ciera-allgather", "--ciera-selection", "always", "--ciera-codec", "delta"],
    # the same codecs with every rank sending the largest payload: what per-rank sizes save
    "exponent_reuse-equal": ["--ciera-allgather", "--ciera-selection", "always", "--ciera-codec", "exponent_reuse",
                             "--ciera-per-rank-sizes", "false"],
    "delta-equal": ["--ciera-allgather", "--ciera-selection", "always", "--ciera-codec", "delta",
                    "--ciera-per-rank-sizes", "false"],
    "delta_ans": ["--ciera-allgather", "--ciera-selection", "always", "--ciera-codec", "delta_ans"],
    "delta_ans-equal": ["--ciera-allgather", "--ciera-selection", "always", "--ciera-codec", "delta_ans",
                        "--ciera-per-rank-sizes", "false"],
}
DEFAULT_TRAIN_MODES = ("baseline", "auto", "exponent_reuse", "delta")
SHA = re.compile(r"^params sha256: ([0-9a-f]{64})$", re.M)
TOTAL = re.compile(r"^total\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x", re.M)
TIMER = re.compile(r"^\s+([a-z][a-z0-9-]+) \.*: \(([\d.]+), ([\d.]+)\)$", re.M)


def timer_ms(text: str) -> dict[str, float]:
    """Megatron's timer block (``--timing-log-level`` >= 1): per timer, the median over the log
    intervals after the first of the slowest rank's ms per iteration."""
    seen: dict[str, list[float]] = {}
    for m in TIMER.finditer(text):
        seen.setdefault(m.group(1), []).append(float(m.group(3)))
    return {k: statistics.median(v[1:] or v) for k, v in seen.items()}


def train_flags(*, hidden: int, layers: int, experts: int, iters: int, seq: int, dp: int,
                bucket_size: int | None = None, moe_ffn: int | None = None,
                extra_flags: tuple[str, ...] = (), drop_flags: tuple[str, ...] = ()) -> list[str]:
    """bench_training's model, made communication-bound: short sequences, one micro-batch per rank
    (params large relative to compute: top-2 of many experts); ``bucket_size`` (``--ddp-bucket-size``)
    splits the params into several buckets, so that overlapped gathers pipeline; ``moe_ffn``
    (``--moe-ffn-hidden-size``, default ``hidden``) sizes each expert; ``extra_flags`` are appended
    as given (e.g. ``--grad-reduce-in-bf16``, ``--timing-log-level 1``); ``drop_flags`` (switches
    without a value) are left out of the base (``--use-distributed-optimizer`` for FSDP2)."""
    extra = [] if bucket_size is None else ["--ddp-bucket-size", str(bucket_size)]
    base = [f for f in model_flags(hidden=hidden, layers=layers, experts=experts, ep=1, iters=iters)
            if f not in drop_flags]
    if moe_ffn is not None:
        base[base.index("--moe-ffn-hidden-size") + 1] = str(moe_ffn)
    return base + [
        "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--micro-batch-size", "1",
        "--global-batch-size", str(dp), "--log-interval", "2", *extra, *extra_flags]


def _torchrun_all(tb: Testbed, script: list[str], *, nproc: int, timeout: float, log_dir: Path) -> list[str]:
    cmds = [torchrun_command(tb, i, nproc_per_node=nproc, port=29400, script=script) for i in range(tb.hosts)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    codes = tb.run_all(cmds, timeout=timeout, env=env, log_dir=log_dir)
    logs = [(log_dir / f"host{i}.log").read_text(errors="replace") for i in range(tb.hosts)]
    if any(codes):
        raise RuntimeError(f"{script[0]}: exit codes {codes}\n" + "\n".join(x[-3000:] for x in logs))
    return logs


@contextlib.contextmanager
def locked(path: Path | None):
    """Hold an exclusive ``flock`` on ``path`` (None: no lock) for one measurement run, so that
    timing runs of different jobs sharing the machine never overlap."""
    if path is None:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def bench_gather(tb, *, nproc, numel, warmup, steps, timeout, work: Path, buckets: int = 1) -> dict:
    out = work / "gather.json"
    _torchrun_all(tb, [str(ROOT / "tools/testbed/bench_gather.py"), "--numel", str(numel), "--warmup", str(warmup),
                       "--steps", str(steps), "--buckets", str(buckets), "--out", str(out)],
                  nproc=nproc, timeout=timeout, log_dir=work)
    return json.loads(out.read_text())


def bench_train(tb, *, nproc, flags, mode, overlap, timeout, work: Path) -> dict:
    loss_log = work / "losses.txt"
    f = list(flags) + TRAIN_MODES[mode] + ["--ciera-loss-log", str(loss_log)]
    if "--ciera-allgather" in f:
        f.append("--ciera-log-buckets")  # each bucket's selection line: the simulator reads its bytes
    if not overlap and "--overlap-param-gather" in f:
        f.remove("--overlap-param-gather")
    logs = _torchrun_all(tb, [str(ROOT / "pretrain_gpt.py"), *f], nproc=nproc, timeout=timeout, log_dir=work)
    text = "\n".join(logs)
    per_interval = [float(m.group(1)) for m in ITER_MS.finditer(text)]
    sha = SHA.search(text)
    total = TOTAL.findall(text)
    losses = loss_log.read_text().split() if loss_log.exists() else []
    picked = sorted({line.strip()[:160] for line in text.splitlines()
                     if "ciera" in line.lower() and ("auto" in line.lower() or "select" in line.lower())
                     and "iteration" not in line})[:40]
    return {"mode": mode, "overlap": overlap,
            "ms": statistics.median(per_interval[1:] or per_interval) if per_interval else None,
            "intervals_ms": per_interval, "sha256": sha.group(1) if sha else None, "losses": losses,
            "raw_mb": float(total[-1][0]) if total else None, "wire_mb": float(total[-1][1]) if total else None,
            "log_lines": picked, "timers_ms": timer_ms(text)}


def _merge(runs: list[dict]) -> dict:
    """Repeats of one mode: median time and median of each timer (every run's kept beside them);
    sha256 and losses kept only if every repeat agrees."""
    out = dict(runs[-1])
    out["ms_runs"] = [r["ms"] for r in runs]
    out["intervals_runs"] = [r["intervals_ms"] for r in runs]
    out["timers_runs"] = [r["timers_ms"] for r in runs]
    names = [k for k in runs[-1]["timers_ms"] if all(k in r["timers_ms"] for r in runs)]
    out["timers_ms"] = {k: statistics.median(r["timers_ms"][k] for r in runs) for k in names}
    out["ms"] = statistics.median(r["ms"] for r in runs) if all(r["ms"] for r in runs) else None
    if len({r["sha256"] for r in runs}) != 1 or len({tuple(r["losses"]) for r in runs}) != 1:
        out["sha256"], out["losses"] = "repeats differ", []
    return out


def simulate(cfg: dict) -> dict:
    """The simulator's prediction for this configuration (see tools/testbed/sim_testbed.py)."""
    return predict(cfg)


def _fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def report(results: list[dict], meta: dict) -> str:
    lines = [f"# bench_cluster ({meta['date']}, {meta['machine']})", "",
             f"Command: `{meta['command']}`", "",
             "Load average (1 min) per configuration, after each run: " + "; ".join(
                 f"{r['layout']}@{r['rate']} " + " ".join(f"{x:.1f}" for x in r.get("load_avg", [])) for r in results), "", "## Gather (bf16 AdamW trajectory, lr 1e-4; median per gather)", "",
             "| layout | link | TCP MB/s one way / duplex | numel | buckets | plain ms | mode | CIERA ms | speed-up | wire/raw "
             "| encode / decode ms | codec used | bit-exact | sim plain ms | sim CIERA ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for g in r.get("gathers", [r["gather"]] if r.get("gather") else []):
            sim = r.get("sim", {}).get("gather", {}) if g is r.get("gather") else {}
            probe = f"{r['link_probe_bytes_per_s'] / 1e6:.0f} / {r.get('link_duplex_bytes_per_s', 0) / 1e6:.0f}"
            for m, s in g["modes"].items():
                lines.append(
                    f"| {r['layout']} | {r['rate']} | {probe} | {g['numel']:,} | {g.get('buckets', 1)} | {g['plain_ms']:.1f} "
                    f"| {m} | {s['ms']:.1f} | {g['plain_ms'] / s['ms']:.2f}x | {s['wire_bytes'] / max(1, s['raw_bytes']):.3f} "
                    f"| {s['encode_ms']:.1f} / {s['decode_ms']:.1f} | {s['codec']} | {g['bit_exact_steps']} steps "
                    f"| {_fmt(sim.get('plain_ms'))} | {_fmt(sim.get(m))} |")
    lines += ["", "## Training (pretrain_gpt.py; median ms per iteration after the first interval)", "",
              "| layout | link | gather | mode | ms / iter | vs baseline | all-gather MB raw -> wire | losses + sha256 = baseline | sim ms |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        sim = r.get("sim", {}).get("train", {})
        for t in r.get("train", []):
            base = next((b for b in r["train"] if b["mode"] == "baseline" and b["overlap"] == t["overlap"]), None)
            same = "-" if t["mode"] == "baseline" or base is None else (  # no baseline run: nothing to compare
                "yes" if t["sha256"] == base["sha256"] and t["losses"] == base["losses"] else "NO")
            rel = f"{base['ms'] / t['ms']:.2f}x" if base and base["ms"] and t["ms"] else "-"
            mb = f"{t['raw_mb']:.1f} -> {t['wire_mb']:.1f}" if t["raw_mb"] else "-"
            key = f"{t['mode']}:{'overlap' if t['overlap'] else 'sync'}"
            lines.append(f"| {r['layout']} | {r['rate']} | {'overlap' if t['overlap'] else 'sync'} | {t['mode']} "
                         f"| {_fmt(t['ms'])} | {rel} | {mb} | {same} | {_fmt(sim.get(key))} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path) -> None:
    """Two panels over the link rate: the gather's and the training iteration's speed-up per mode
    and layout (HOSTSxRANKS). Each panel's legend sits below it, off the data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 6.5), layout="constrained")
    series: list[dict[str, list]] = [{}, {}]  # per panel: label -> [(Gbit/s, speed-up)], one line each
    for r in results:
        x = parse_rate(r["rate"]) / 1e9
        for g in r.get("gathers", [r["gather"]] if r.get("gather") else [])[:1]:
            for m, s in g["modes"].items():
                series[0].setdefault(f"{r['layout']} {m}", []).append((x, g["plain_ms"] / s["ms"]))
        for t in r.get("train", []):
            base = next((b for b in r["train"] if b["mode"] == "baseline" and b["overlap"] == t["overlap"]), None)
            if base and t["mode"] != "baseline" and t["ms"] and base["ms"]:
                label = f"{r['layout']} {t['mode']} {'overlap' if t['overlap'] else 'sync'}"
                series[1].setdefault(label, []).append((x, base["ms"] / t["ms"]))
    rates = sorted({parse_rate(r["rate"]) / 1e9 for r in results})
    titles = ["parameter all-gather: CIERA mode vs plain all_gather_into_tensor",
              "training iteration: CIERA mode vs the baseline run"]
    for ax, lines, title in zip(axes, series, titles):
        for label, pts in sorted(lines.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o" if label.startswith("2x1") else "s",
                    ls="-" if "sync" not in label else "--", label=label)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log")
        ax.set_xticks(rates, [f"{x:g}" for x in rates])
        ax.minorticks_off()
        ax.set_xlabel("link rate per host (Gbit/s)")
        ax.set_ylabel("speed-up (x, above 1 = CIERA faster)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if lines:
            ax.legend(fontsize=8, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.14), frameon=False)
    fig.suptitle("Multi-host testbed (network namespaces on one machine, gloo over tc-shaped links): "
                 "speed-up by link rate; layouts HOSTSxRANKS per host", fontsize=11)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", nargs="+", default=["2x1", "2x2"], help="HOSTSxRANKS_PER_HOST")
    p.add_argument("--rates", nargs="+", default=["1gbit", "2.5gbit", "10gbit"])
    p.add_argument("--numel", type=int, default=1 << 23, help="gather bucket values")
    p.add_argument("--gather-warmup", type=int, default=6)
    p.add_argument("--gather-steps", type=int, default=6)
    p.add_argument("--gather-buckets", type=int, nargs="+", default=[1],
                   help="buckets per gathered step (K > 1: pipelined, see bench_gather.py); one gather run each")
    p.add_argument("--autogroup-nice", type=int, default=None,
                   help="scheduler priority of the hosts' sessions (TestbedConfig.autogroup_nice), e.g. -19 "
                        "on a shared machine with autogroup scheduling, where others' nice 19 does not yield")
    p.add_argument("--lock", type=Path, default=None,
                   help="flock this file around each measurement run (probe, gather, training launch)")
    p.add_argument("--train-modes", nargs="*", default=list(DEFAULT_TRAIN_MODES), choices=list(TRAIN_MODES),
                   help="*-equal: the codec with --ciera-per-rank-sizes false (the saving of per-rank sizes)")
    p.add_argument("--train-gather", nargs="+", default=["overlap", "sync"], choices=["overlap", "sync"])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--bucket-size", type=int, default=None, help="--ddp-bucket-size of the training runs")
    p.add_argument("--moe-ffn", type=int, default=None, help="--moe-ffn-hidden-size (default: --hidden)")
    p.add_argument("--extra-flags", default="",
                   help="more pretrain_gpt.py flags for every training run, one string "
                        "(e.g. '--grad-reduce-in-bf16 --timing-log-level 1')")
    p.add_argument("--drop-flags", default="",
                   help="base flags to leave out of every training run, one string (e.g. "
                        "'--use-distributed-optimizer --overlap-param-gather' for --use-torch-fsdp2)")
    p.add_argument("--repeats", type=int, default=2, help="training runs per mode, order rotated")
    p.add_argument("--no-gather", action="store_true")
    p.add_argument("--gloo-probe-reps", type=int, default=15,
                   help="repetitions of the link probe (link_probe.py: gloo all-gathers at every size of "
                        "sim_testbed.PROBE_SIZES, the simulator's link input); 0: none")
    p.add_argument("--timeout", type=float, default=900, help="per launch")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one layout and rate")
    p.add_argument("--out-dir", type=Path, default=ROOT / "outputs" / "bench-cluster")
    a = p.parse_args(argv)
    if a.smoke:
        a.layouts, a.rates, a.numel, a.gather_warmup, a.gather_steps = ["2x1"], ["1gbit"], 1 << 14, 3, 2
        a.hidden, a.experts, a.iters, a.train_modes, a.train_gather = 32, 2, 4, ["baseline", "auto"], ["overlap"]
        a.repeats, a.gloo_probe_reps = 1, min(a.gloo_probe_reps, 3)
    a.out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.node()} {os.cpu_count()} cores, shared with other jobs",
            "command": shlex.join(["python", "tools/testbed/bench_cluster.py",
                                   *(argv if argv is not None else sys.argv[1:])])}
    results = []
    try:
        for layout in a.layouts:
            hosts, nproc = (int(x) for x in layout.split("x"))
            dp = hosts * nproc
            flags = train_flags(hidden=a.hidden, layers=a.layers, experts=a.experts, iters=a.iters, seq=a.seq, dp=dp,
                                bucket_size=a.bucket_size, moe_ffn=a.moe_ffn, extra_flags=tuple(a.extra_flags.split()),
                                drop_flags=tuple(a.drop_flags.split()))
            for rate in a.rates:
                cfg = {"layout": layout, "hosts": hosts, "nproc": nproc, "rate": rate, "train": [],
                       "cores": os.cpu_count()}
                with Testbed(TestbedConfig(hosts=hosts, link=LinkSpec(rate=rate),
                                          autogroup_nice=a.autogroup_nice)) as tb, \
                        tempfile.TemporaryDirectory() as tmp:
                    work = Path(tmp)
                    with locked(a.lock):
                        cfg["link_probe_bytes_per_s"] = probe_link(tb)
                        cfg["link_duplex_bytes_per_s"] = probe_duplex(tb)
                        cfg["link_latency_s"] = probe_latency(tb)
                    if a.gloo_probe_reps:  # the simulator's link: gloo's all-gather per size, medians
                        with locked(a.lock):
                            cfg["gloo_probe"] = probe_gloo(tb, nproc=nproc, reps=a.gloo_probe_reps,
                                                           sizes=PROBE_SIZES[:3] if a.smoke else PROBE_SIZES)
                    cfg["load_avg"] = [os.getloadavg()[0]]
                    print(f"== {layout} at {rate} (testbed {tb.name}): one TCP stream "
                          f"{cfg['link_probe_bytes_per_s'] / 1e6:.0f} MB/s, both ways at once "
                          f"{cfg['link_duplex_bytes_per_s'] / 1e6:.0f} MB/s, latency "
                          f"{cfg['link_latency_s'] * 1e6:.0f} us", flush=True)
                    for k in ([] if a.no_gather else a.gather_buckets):
                        with locked(a.lock):
                            g = bench_gather(tb, nproc=nproc, numel=a.numel, warmup=a.gather_warmup,
                                             steps=a.gather_steps, timeout=a.timeout, work=work, buckets=k)
                        cfg["load_avg"].append(os.getloadavg()[0])
                        cfg.setdefault("gathers", []).append(g)
                        cfg["gather"] = cfg["gathers"][0]  # the simulator's codec speeds: the first
                        print(f"   gather x{k} plain {g['plain_ms']:.1f} ms; " + "; ".join(
                            f"{m} {s['ms']:.1f} ms ({s['codec']})" for m, s in g["modes"].items()), flush=True)
                    for gather_mode in a.train_gather:
                        runs: dict[str, list[dict]] = {m: [] for m in a.train_modes}
                        for rep in range(a.repeats):  # modes rotated per repeat: load drift hits all alike
                            k = rep % max(1, len(a.train_modes))
                            for mode in a.train_modes[k:] + a.train_modes[:k]:
                                t0 = time.monotonic()
                                with locked(a.lock):
                                    r = bench_train(tb, nproc=nproc, flags=flags, mode=mode,
                                                    overlap=gather_mode == "overlap", timeout=a.timeout, work=work)
                                cfg["load_avg"].append(os.getloadavg()[0])
                                runs[mode].append(r)
                                gather_ms = r["timers_ms"].get("params-all-gather")
                                print(f"   train {gather_mode:<7} {mode:<15} {_fmt(r['ms'])} ms/iter "
                                      f"({time.monotonic() - t0:.0f} s)"
                                      + ("" if gather_ms is None else f", params-all-gather {gather_ms:.1f} ms"), flush=True)
                        for mode in a.train_modes:
                            cfg["train"].append(_merge(runs[mode]))
                # the binding's synchronous timeline: every group started at once, after one agreement
                cfg["sync_waves"] = 1
                cfg["model"] = {"hidden": a.hidden, "layers": a.layers, "experts": a.experts, "seq": a.seq, "dp": dp,
                                "iters": a.iters, "bucket_size": a.bucket_size, "moe_ffn": a.moe_ffn,
                                "extra_flags": a.extra_flags, "drop_flags": a.drop_flags}
                try:
                    cfg["sim"] = simulate(cfg)
                except Exception as e:  # the measurement stands without the simulator's column
                    cfg["sim"] = {"error": f"{type(e).__name__}: {e}"}
                results.append(cfg)
                (a.out_dir / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    except TestbedUnavailable as e:
        print(f"bench_cluster: cannot run here: {e}", file=sys.stderr)
        return 77
    md = report(results, meta)
    (a.out_dir / "bench_cluster.md").write_text(md)
    plot(results, a.out_dir / "bench_cluster.png")
    print(md)
    return 1 if "| NO |" in md else 0


if __name__ == "__main__":
    raise SystemExit(main())
