#!/usr/bin/env python
"""Codec throughput and wire size on a realistic trajectory, side by side with clone().

The trajectory is an fp32 master updated by AdamW (``ciera.testing.trajectory.AdamTrajectory``) and cast
to the gathered dtype after every step, as Megatron's distributed optimizer does. For every codec
and learning rate this prints: wire/raw (bytes the payload needs over the shard's bytes), the
compression ratio, and encode/decode throughput in raw GB/s and as a ratio to ``clone()`` of the
same shard, timed in the same loop. Every decode is checked bit for bit. A second table gives every
codec's bits per value next to the order-0 entropies of the same changes (``ciera.entropy``), per
rank with ``--layout model`` (a tiny MoE's bucket, ``ciera.testing.model_trajectory``).

On CPU (``--compare``, the default there) every codec runs as the pure-torch reference and as the
native C twin at 1 and 2 threads (interleaved: every repeat runs each thread count in turn, so both
see the same machine), next to the lossless compressors a user would pick instead -- ZipNN and
zstd-3 on the raw values and on the XOR with the previous values (optional rows: ``pip install -e
'.[peers]'``; skipped with a note where absent). Each time is the best of ``--repeats``
runs (the machine may be shared), the median over the measured steps; clone() runs at one thread.
Every measurement is taken on both clocks at once: wall time, and CPU time (what the work costs;
the fair one-thread figure on a shared machine: the process's over all its threads, the calling
thread's for a native call at one thread), one row each,
with the 1-minute load average beside it. The run ends with one verdict line per target
(met / MISSED, with the figures; TARGET_VS_CLONE, TARGET_SPEEDUP below): encode and decode vs clone() at one thread, the 2-thread
speed-up (wall), and each codec vs the peers -- on the setting it is judged by (exponent_reuse on
the raw values, delta on the XOR with the previous values) and vs every peer row.

    python tools/bench_codec.py                       # 4M bf16 values, lr 1e-4 and 3e-4
    python tools/bench_codec.py --sweep-block         # exponent_reuse ratio vs block size
    python tools/bench_codec.py --device cuda         # Triton kernels on a GPU
    python tools/bench_codec.py --layout model --world 8 --no-timing
                                                      # bits/value vs entropy per rank of a real bucket
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from ciera.codecs import HEADER_BYTES, as_bits, available_codecs, make_codec
from ciera.entropy import ChangeEntropy
from ciera.testing.model_trajectory import SHAPES, ModelTrajectory
from ciera.native import available as native_available
from ciera.native import unavailable_reason as native_reason
from ciera.testing.trajectory import AdamTrajectory
from tools._common import timed

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def make_snapshots(*, numel, dtype, lr, warmup, steps, device, seed=0):
    """``steps + 1`` consecutive cast parameter vectors after ``warmup`` steps."""
    traj = AdamTrajectory(numel=numel, dtype=dtype, lr=lr, seed=seed, device=device)
    for _ in range(warmup):
        traj.step()
    snaps = [traj.current()]
    for _ in range(steps):
        snaps.append(traj.step())
    return snaps


def model_snapshots(*, shape, world, lr, warmup, steps, device, seed=0):
    """``steps + 1`` consecutive flat buffers of :class:`ciera.testing.model_trajectory.ModelTrajectory`
    (a tiny MoE laid out as the distributed optimizer's bucket over ``world`` ranks) after ``warmup``
    steps, and the trajectory (its :meth:`shards` cut a buffer into the ranks' shards)."""
    traj = ModelTrajectory(world=world, shape=SHAPES[shape], lr=lr, warmup=warmup, seed=seed)
    snaps = [traj.current().to(device)]
    for _ in range(steps):
        snaps.append(traj.step().to(device))
    return snaps, traj


def bits_rows(*, parts: dict[str, list[torch.Tensor]], codecs, backend, device) -> list[dict]:
    """Per part (a shard's consecutive versions: one rank's, or the synthetic shard) and codec: the
    payload's bits per value (header included) next to the order-0 entropies of the same changes
    (``ciera.entropy``: ``H(d)`` and ``H(d | previous exponent)``); with several parts, an ``all``
    row pools them (bytes summed; entropies of the pooled histogram). Every decode is checked bit
    for bit."""
    rows, pooled_h, pooled = [], ChangeEntropy(), {}
    for part, snaps in parts.items():
        h = ChangeEntropy()
        for prev, new in zip(snaps, snaps[1:]):
            h.add(prev=prev, new=new)
        pooled_h.merge(h)
        for name in codecs:
            codec = make_codec(name, dtype=snaps[0].dtype, numel=snaps[0].numel(), backend=backend)
            state = codec.new_state(shard=snaps[0])
            out = torch.empty(codec.clamp_capacity(codec.max_bytes), dtype=torch.uint8, device=device)
            needed = 0
            for prev, new in zip(snaps, snaps[1:]):
                codec.encode(shard=new, state=state, out=out)
                needed += out[:HEADER_BYTES].view(torch.int64).tolist()[2]
                target = prev.clone()
                codec.decode(payload=out, target=target)
                if not torch.equal(as_bits(target), as_bits(new)):
                    raise AssertionError(f"{name} on {part}: decode is not bit-exact")
            acc = pooled.setdefault(name, [0, 0])
            acc[0] += needed
            acc[1] += h.values
            rows.append({"part": part, "codec": name, "bits": 8 * needed / h.values, "order0": h.order0,
                         "given_exponent": h.given_exponent})
    if len(parts) > 1:
        rows += [{"part": "all", "codec": name, "bits": 8 * b / v, "order0": pooled_h.order0,
                  "given_exponent": pooled_h.given_exponent} for name, (b, v) in pooled.items()]
    return rows


def _best(fn, setup, repeats, device, own_thread: bool = False) -> tuple[float, float]:
    """Best (wall, CPU) times of ``repeats`` runs of ``fn``, each after an untimed ``setup``; each
    clock's best is taken on its own. CPU: the process's over all its threads, or with
    ``own_thread`` the calling thread's alone -- for a native call at one thread, which runs wholly
    on it, so that an OpenMP worker still spinning after an interleaved 2-thread call is not
    charged to it (charged, it halved delta's one-thread encode figure). Not for the peers: ZipNN
    works on a helper thread even at ``threads=1``."""
    clock = time.thread_time if own_thread else time.process_time
    wall = cpu = float("inf")
    for _ in range(repeats):
        setup()
        w, c = timed(fn, device=device, cpu_clock=clock)
        wall, cpu = min(wall, w), min(cpu, c)
    return wall, cpu


def _rows(*, name, impl, threads, block, raw, needed, enc, dec, clone):
    """One row per clock (``wall``, ``cpu``) from per-step (wall, CPU) pairs."""
    med = statistics.median
    wire = statistics.mean(needed) / raw
    out = []
    for k, clock in enumerate(("wall", "cpu")):
        e, d, c = (med(t[k] for t in ts) for ts in (enc, dec, clone))
        out.append({
            "codec": name, "impl": impl, "threads": threads, "block": block, "clock": clock,
            "wire_over_raw": wire, "ratio": 1 / wire, "encode_GBps": raw / e / 1e9, "decode_GBps": raw / d / 1e9,
            "both_GBps": raw / (e + d) / 1e9, "clone_GBps": raw / c / 1e9, "encode_vs_clone": c / e,
            "decode_vs_clone": c / d, "both_vs_clone": 2 * c / (e + d),
        })
    return out


def bench_one(*, name, snaps, block_size, backend, device, repeats=1, threads=None, impl=None):
    """Encode/decode every consecutive pair; returns a wall-clock row and a CPU-time row per thread
    count. ``threads``: torch's (and the native codecs') thread count while the codec runs, or a
    tuple of them, measured interleaved (every repeat of every step runs each count in turn, so
    each count sees the same machine: a fair ratio on a shared one); clone() always runs at one
    thread."""
    dtype, numel = snaps[0].dtype, snaps[0].numel()
    codec = make_codec(name, dtype=dtype, numel=numel, block_size=block_size, backend=backend)
    state = codec.new_state(shard=snaps[0])
    out = torch.empty(codec.clamp_capacity(codec.max_bytes), dtype=torch.uint8, device=device)
    before = torch.get_num_threads()
    counts = tuple(threads) if isinstance(threads, (tuple, list)) else (threads or before,)
    enc, dec = ({k: [] for k in counts} for _ in range(2))
    clone, needed = [], []
    inf = (float("inf"), float("inf"))
    best = lambda a, b: (min(a[0], b[0]), min(a[1], b[1]))  # noqa: E731 (each clock's best on its own)
    for prev, new in zip(snaps, snaps[1:]):
        target = prev.clone()
        torch.set_num_threads(1)
        clone.append(_best(lambda: new.clone(), lambda: None, repeats, device))
        e, d = dict.fromkeys(counts, inf), dict.fromkeys(counts, inf)
        for _ in range(repeats):
            for k in counts:
                torch.set_num_threads(k)
                own = k == 1 and impl == "native"  # runs wholly on this thread (see _best)
                e[k] = best(e[k], _best(lambda: codec.encode(shard=new, state=state, out=out),
                                        lambda: codec.reset_state(state=state, shard=prev), 1, device, own))
                d[k] = best(d[k], _best(lambda: codec.decode(payload=out, target=target), lambda: target.copy_(prev),
                                        1, device, own))
                if not torch.equal(as_bits(target), as_bits(new)):
                    raise AssertionError(f"{name}: decode is not bit-exact ({k} threads)")
        torch.set_num_threads(before)
        for k in counts:
            enc[k].append(e[k])
            dec[k].append(d[k])
        needed.append(out[:HEADER_BYTES].view(torch.int64).tolist()[2])
        codec.reset_state(state=state, shard=new)
    return [row for k in counts for row in
            _rows(name=name, impl=impl or backend, threads=k, block=getattr(codec, "block_size", "-"),
                  raw=codec.raw_bytes, needed=needed, enc=enc[k], dec=dec[k], clone=clone)]


# -- peers: what a user would otherwise run on the same data -------------------------------------
def peer_compressors():
    """(name, compress(bytearray) -> bytes, decompress(bytes) -> buffer) of the peers installed."""
    peers, missing = [], []
    try:
        import zipnn

        z = zipnn.ZipNN(input_format="byte", bytearray_dtype="bfloat16", threads=1)
        peers.append(("zipnn", z.compress, z.decompress))
    except ImportError:
        missing.append("zipnn")
    try:
        import zstandard

        zc, zd = zstandard.ZstdCompressor(level=3, threads=0), zstandard.ZstdDecompressor()
        peers.append(("zstd-3", zc.compress, zd.decompress))
    except ImportError:
        missing.append("zstandard")
    return peers, missing


def bench_peer(*, name, compress, decompress, snaps, xor, repeats, device):
    """One thread. ``xor``: compress ``new ^ previous`` (the XOR and its inverse are timed with the
    compressor); else the raw values. Turning tensors into the bytearray a peer takes is not timed
    (ZipNN reorders its input in place, so every run gets a fresh copy)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    enc, dec, clone, needed = [], [], [], []
    try:
        for prev, new in zip(snaps, snaps[1:]):
            pb, nb = as_bits(prev), as_bits(new)
            data_t = torch.bitwise_xor(nb, pb) if xor else nb
            x_s = _best(lambda: torch.bitwise_xor(nb, pb), lambda: None, repeats, device) if xor else (0.0, 0.0)
            data = bytes(data_t.view(torch.uint8).numpy())
            box = {}
            c_s = _best(lambda: box.__setitem__("c", compress(box["in"])),
                        lambda: box.__setitem__("in", bytearray(data)), repeats, device)
            d_s = _best(lambda: box.__setitem__("d", decompress(box["c"])), lambda: None, repeats, device)
            got = torch.frombuffer(bytearray(box["d"]), dtype=nb.dtype)
            u_s = _best(lambda: torch.bitwise_xor(got, pb), lambda: None, repeats, device) if xor else (0.0, 0.0)
            if not torch.equal(torch.bitwise_xor(got, pb) if xor else got, nb):
                raise AssertionError(f"{name}: round trip is not bit-exact")
            enc.append((x_s[0] + c_s[0], x_s[1] + c_s[1]))
            dec.append((d_s[0] + u_s[0], d_s[1] + u_s[1]))
            needed.append(len(box["c"]))
            clone.append(_best(lambda: new.clone(), lambda: None, repeats, device))
    finally:
        torch.set_num_threads(before)
    return _rows(name=name + (" (xor prev)" if xor else ""), impl="peer", threads=1, block="-",
                raw=nb.numel() * nb.element_size(), needed=needed, enc=enc, dec=dec, clone=clone)


# -- verdicts: the project's CPU codec targets, judged on one run's rows ----------------------------
TARGET_VS_CLONE = {"exponent_reuse": 0.3, "delta": 0.1}
"""One thread: encode and decode each at least this fraction of clone()'s speed."""
TARGET_SPEEDUP = 1.7
"""Two threads vs one (wall clock, encode + decode)."""
PAIRING = {"exponent_reuse": "raw values", "delta": "xor prev", "delta_ans": "xor prev"}
"""The peer setting each codec is judged against: exponent_reuse (no temporal state beyond
exponents) vs the peers on the raw values, delta and delta_ans (send the change) vs the peers on
the XOR with the previous values. delta_ans has no clone() or thread targets: it trades speed for
bytes, and its target is the peers'."""


def _pick(rows, *, lr, codec, impl, threads, clock):
    return next((r for r in rows if r["lr"] == lr and r["codec"] == codec and r["impl"] == impl
                 and r["threads"] == threads and r["clock"] == clock), None)


def verdicts(rows, *, lrs, codecs, threads) -> list[str]:
    """One line per target per learning rate: ``met`` / ``MISSED`` with the figures. One-thread
    targets on the CPU clock (what the work costs, fair on a shared machine; the wall figure is
    shown beside it); the speed-up on the wall clock."""
    lines = []
    fmt = lambda ok: "met" if ok else "MISSED"  # noqa: E731
    for lr in lrs:
        peers = [r for r in rows if r["lr"] == lr and r["impl"] == "peer" and r["clock"] == "cpu"]
        for name in codecs:
            one = _pick(rows, lr=lr, codec=name, impl="native", threads=1, clock="cpu")
            one_w = _pick(rows, lr=lr, codec=name, impl="native", threads=1, clock="wall")
            if one is None or name not in PAIRING:
                continue
            t = TARGET_VS_CLONE.get(name)
            if t is not None:
                ok = one["encode_vs_clone"] >= t and one["decode_vs_clone"] >= t
                lines.append(f"lr {lr:g} {name}: encode/decode >= {t}x clone() at 1 thread: {fmt(ok)} "
                             f"(cpu {one['encode_vs_clone']:.3f}x / {one['decode_vs_clone']:.3f}x, "
                             f"wall {one_w['encode_vs_clone']:.3f}x / {one_w['decode_vs_clone']:.3f}x)")
            for k in (k for k in threads if k > 1 and t is not None):
                many = _pick(rows, lr=lr, codec=name, impl="native", threads=k, clock="wall")
                if many is None:
                    continue
                sp = many["both_GBps"] / one_w["both_GBps"]
                lines.append(f"lr {lr:g} {name}: {k} threads >= {TARGET_SPEEDUP}x one thread (wall, enc+dec): "
                             f"{fmt(sp >= TARGET_SPEEDUP)} ({sp:.2f}x: {one_w['both_GBps']:.2f} -> "
                             f"{many['both_GBps']:.2f} GB/s)")
            if not peers:
                continue
            judged = [r for r in peers if (PAIRING[name] == "xor prev") == r["codec"].endswith("(xor prev)")]
            for group, label in ((judged, f"the peers on {PAIRING[name]} (the pairing it is judged by)"),
                                 (peers, "every peer row")):
                beat = [r for r in group if one["both_GBps"] > r["both_GBps"] and one["wire_over_raw"] < r["wire_over_raw"]]
                worst = [f"{r['codec']} {r['both_GBps']:.2f} GB/s at {r['wire_over_raw']:.3f}" for r in group
                         if r not in beat]
                lines.append(f"lr {lr:g} {name} vs {label}: faster (enc+dec, cpu) AND fewer bytes: "
                             f"{fmt(len(beat) == len(group))} ({name} {one['both_GBps']:.2f} GB/s at "
                             f"wire {one['wire_over_raw']:.3f}" + (f"; not beaten: {', '.join(worst)}" if worst else "")
                             + ")")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=1 << 22, help="values per shard (default 4M)")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--lr", type=float, nargs="+", default=[1e-4, 3e-4])
    p.add_argument("--warmup", type=int, default=30, help="AdamW steps before measuring")
    p.add_argument("--steps", type=int, default=8, help="measured encode/decode pairs")
    p.add_argument("--codecs", nargs="+", default=None, help="default: every registered codec")
    p.add_argument("--backend", choices=["auto", "torch", "triton", "native"], default="auto")
    p.add_argument("--compare", action=argparse.BooleanOptionalAction, default=None,
                   help="CPU: reference vs native at 1 and 2 threads, and the peers (default on CPU)")
    p.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True,
                   help="with --compare: also time the pure-torch references (slow: delta's moves ~0.02 GB/s)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="native thread counts (--compare)")
    p.add_argument("--repeats", type=int, default=5, help="runs per measurement; the best counts")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layout", choices=["synthetic", "model"], default="synthetic",
                   help="synthetic: one shard of --numel values on ciera.testing.trajectory.AdamTrajectory; model: a "
                        "tiny MoE trained with AdamW (ciera.testing.model_trajectory), its bucket sharded over --world "
                        "ranks as the distributed optimizer shards it (the bits table per rank; timing on the "
                        "whole bucket; --numel ignored)")
    p.add_argument("--world", type=int, default=4, help="--layout model: ranks sharing the bucket")
    p.add_argument("--model-shape", choices=list(SHAPES), default="small", help="--layout model: the MoE's size")
    p.add_argument("--timing", action=argparse.BooleanOptionalAction, default=True,
                   help="the throughput table (--no-timing: only the bits-per-value table)")
    p.add_argument("--sweep-block", action="store_true", help="exponent_reuse wire ratio vs block size")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks the benchmark runs")
    p.add_argument("--out-md", type=Path, default=None, help="also write the table (and verdicts) as markdown")
    args = p.parse_args(argv)
    if args.smoke:
        args.numel, args.warmup, args.steps, args.lr, args.repeats = 4099, 3, 2, args.lr[:1], 1
        args.model_shape, args.world = "tiny", 2
    device = torch.device(args.device)
    compare = (device.type == "cpu") if args.compare is None else args.compare
    dtype = DTYPES[args.dtype]
    codecs = args.codecs or available_codecs()
    torch.set_num_threads(max(1, torch.get_num_threads()))

    def load() -> str:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())

    machine = (torch.cuda.get_device_name() if device.type == "cuda"
               else f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    size = (f"--layout model {args.model_shape} over {args.world} ranks" if args.layout == "model"
            else f"{args.numel} {args.dtype} values/shard")
    title = (f"# bench_codec: {size}, warmup {args.warmup}, {args.steps} steps, "
             f"best of {args.repeats}, wall and CPU clocks, device {device} ({machine}), torch {torch.__version__}, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average at start {load()}")
    print(title)
    peers, missing = peer_compressors() if compare and not args.sweep_block else ([], [])
    notes = []
    if missing:
        notes.append(f"# peers skipped (not installed: {', '.join(missing)}): pip install -e '.[peers]'")
        print(notes[-1])

    class _Rows(list):
        def add(self, lr, new_rows):  # progress on stderr: a full run takes minutes
            for row in new_rows:
                self.append({"lr": lr, "load1": os.getloadavg()[0], **row})
            row = new_rows[0]
            ks = "/".join(str(k) for k in dict.fromkeys(r["threads"] for r in new_rows))
            print(f"# done: lr {lr:g} {row['codec']} {row['impl']} x{ks} "
                  f"({len(self)} rows, {time.perf_counter() - t_start:.0f} s, load {load()})", file=sys.stderr, flush=True)

    rows, bits, t_start = _Rows(), [], time.perf_counter()
    for lr in args.lr:
        if args.layout == "model":
            snaps, traj = model_snapshots(shape=args.model_shape, world=args.world, lr=lr, warmup=args.warmup,
                                          steps=args.steps, device=device)
            parts = {f"rank {r} ({traj.describe_shard(r)})": [traj.shards(x)[r] for x in snaps]
                     for r in range(args.world)}
        else:
            snaps = make_snapshots(numel=args.numel, dtype=dtype, lr=lr, warmup=args.warmup,
                                   steps=args.steps, device=device)
            parts = {"shard": snaps}
        if not args.sweep_block:
            bits += [{"lr": lr, **r}
                     for r in bits_rows(parts=parts, codecs=codecs, backend=args.backend, device=device)]
        if not args.timing:
            continue
        if args.sweep_block:
            for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
                rows.add(lr, bench_one(name="exponent_reuse", snaps=snaps, block_size=b, repeats=args.repeats,
                                       backend=args.backend, device=device)[:1])
            continue
        for name in codecs:
            if not compare or name == "raw":
                rows.add(lr, bench_one(name=name, snaps=snaps, block_size=None, backend=args.backend,
                                       device=device, repeats=args.repeats))
                continue
            if args.reference:
                rows.add(lr, bench_one(name=name, snaps=snaps, block_size=None, backend="torch", device=device,
                                       repeats=args.repeats, threads=1, impl="reference"))
            if not native_available():
                notes.append(f"# native rows skipped: {native_reason()}")
                print(notes[-1])
                continue
            rows.add(lr, bench_one(name=name, snaps=snaps, block_size=None, backend="native", device=device,
                                   repeats=args.repeats, threads=tuple(args.threads), impl="native"))
        for pname, compress, decompress in peers:
            for xor in (False, True):
                rows.add(lr, bench_peer(name=pname, compress=compress, decompress=decompress, snaps=snaps, xor=xor,
                                        repeats=args.repeats, device=device))

    header = ("| lr | codec | impl | threads | clock | block | wire/raw | ratio | encode GB/s | decode GB/s "
              "| enc+dec GB/s | clone GB/s | encode x clone | decode x clone | enc+dec x clone | load |")
    lines = [header, "|" + "---|" * 16]
    for r in sorted(rows, key=lambda r: (r["lr"], r["clock"] != "cpu", r["impl"] == "peer", r["codec"], r["impl"],
                                         r["threads"])):
        lines.append(
            f"| {r['lr']:g} | {r['codec']} | {r['impl']} | {r['threads']} | {r['clock']} | {r['block']} "
            f"| {r['wire_over_raw']:.3f} | {r['ratio']:.2f}x | {r['encode_GBps']:.2f} | {r['decode_GBps']:.2f} "
            f"| {r['both_GBps']:.2f} | {r['clone_GBps']:.2f} | {r['encode_vs_clone']:.3f} | {r['decode_vs_clone']:.3f} "
            f"| {r['both_vs_clone']:.3f} | {r['load1']:.1f} |"
        )
    table = "\n".join(lines) if rows else ""
    print(table)
    bits_lines = ["| lr | shard | codec | bits/value | H(d) | H(d given previous exponent) | bits / H(d given exp) |",
                  "|---|---|---|---|---|---|---|"] + [
        f"| {r['lr']:g} | {r['part']} | {r['codec']} | {r['bits']:.3f} | {r['order0']:.3f} | {r['given_exponent']:.3f} "
        f"| {r['bits'] / r['given_exponent'] if r['given_exponent'] else float('nan'):.3f} |" for r in bits]
    bits_title = ("Bits per value of every codec's payloads (header included) and the order-0 entropies of the "
                  "same changes d = new - previous (bit patterns, mod 2^W): " +
                  (f"--layout model {args.model_shape} over {args.world} ranks" if args.layout == "model"
                   else f"synthetic {args.numel}-value shard") + f", {args.steps} steps after {args.warmup}:")
    if bits:
        print(f"\n{bits_title}\n" + "\n".join(bits_lines))
    verdict = [] if args.sweep_block or not compare else verdicts(rows, lrs=args.lr, codecs=codecs,
                                                                    threads=args.threads)
    if verdict:
        print("\nVerdicts (CPU codec targets: encode/decode vs clone() at 1 thread, 2-thread speed-up, vs peers):")
        for v in verdict:
            print(f"- {v}")
    print(f"# load average at end {load()}")
    if args.out_md:
        args.out_md.write_text("\n".join([title, *notes, "", table, "", *(f"- {v}" for v in verdict),
                                          *([bits_title, "", *bits_lines, ""] if bits else []),
                                          f"# load average at end {load()}"]) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
