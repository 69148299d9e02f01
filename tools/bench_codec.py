#!/usr/bin/env python
"""Codec throughput and wire size on a realistic trajectory, side by side with clone().

The trajectory is an fp32 master updated by AdamW (``ciera.trajectory.AdamTrajectory``) and cast
to the gathered dtype after every step, as Megatron's distributed optimizer does. For every codec
and learning rate this prints: wire/raw (bytes the payload needs over the shard's bytes), the
compression ratio, and encode/decode throughput in raw GB/s and as a ratio to ``clone()`` of the
same shard, timed in the same loop. Every decode is checked bit for bit.

    python tools/bench_codec.py                       # 4M bf16 values, lr 1e-4 and 3e-4
    python tools/bench_codec.py --sweep-block         # exponent_reuse ratio vs block size
    python tools/bench_codec.py --device cuda         # Triton kernels on a GPU
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ciera.codecs import HEADER_BYTES, as_bits, available_codecs, make_codec  # noqa: E402
from ciera.trajectory import AdamTrajectory  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device):
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def make_snapshots(*, numel, dtype, lr, warmup, steps, device, seed=0):
    """``steps + 1`` consecutive cast parameter vectors after ``warmup`` steps."""
    traj = AdamTrajectory(numel=numel, dtype=dtype, lr=lr, seed=seed, device=device)
    for _ in range(warmup):
        traj.step()
    snaps = [traj.current()]
    for _ in range(steps):
        snaps.append(traj.step())
    return snaps


def bench_one(*, name, snaps, block_size, backend, device):
    """Encode/decode every consecutive pair; returns a row of figures."""
    dtype, numel = snaps[0].dtype, snaps[0].numel()
    codec = make_codec(name, dtype=dtype, numel=numel, block_size=block_size, backend=backend)
    state = codec.new_state(shard=snaps[0])
    out = torch.empty(codec.clamp_capacity(codec.max_bytes), dtype=torch.uint8, device=device)
    enc, dec, clone, needed = [], [], [], []
    for prev, new in zip(snaps, snaps[1:]):
        target = prev.clone()
        clone.append(_timed(lambda: new.clone(), device))
        enc.append(_timed(lambda: codec.encode(shard=new, state=state, out=out), device))
        header = out[:HEADER_BYTES].view(torch.int64).tolist()
        needed.append(header[2])
        dec.append(_timed(lambda: codec.decode(payload=out, target=target), device))
        if not torch.equal(as_bits(target), as_bits(new)):
            raise AssertionError(f"{name}: decode is not bit-exact")
    raw = codec.raw_bytes
    med = statistics.median
    wire = statistics.mean(needed) / raw
    return {
        "codec": name, "block": getattr(codec, "block_size", "-"), "wire_over_raw": wire, "ratio": 1 / wire,
        "encode_GBps": raw / med(enc) / 1e9, "decode_GBps": raw / med(dec) / 1e9,
        "clone_GBps": raw / med(clone) / 1e9,
        "encode_vs_clone": med(clone) / med(enc), "decode_vs_clone": med(clone) / med(dec),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=1 << 22, help="values per shard (default 4M)")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--lr", type=float, nargs="+", default=[1e-4, 3e-4])
    p.add_argument("--warmup", type=int, default=30, help="AdamW steps before measuring")
    p.add_argument("--steps", type=int, default=8, help="measured encode/decode pairs")
    p.add_argument("--codecs", nargs="+", default=None, help="default: every registered codec")
    p.add_argument("--backend", choices=["auto", "torch", "triton"], default="auto")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sweep-block", action="store_true", help="exponent_reuse wire ratio vs block size")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks the benchmark runs")
    p.add_argument("--out-md", type=Path, default=None, help="also write the table as markdown")
    args = p.parse_args(argv)
    if args.smoke:
        args.numel, args.warmup, args.steps, args.lr = 4099, 3, 2, args.lr[:1]
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    codecs = args.codecs or available_codecs()
    torch.set_num_threads(max(1, torch.get_num_threads()))

    machine = (torch.cuda.get_device_name() if device.type == "cuda"
               else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads")
    print(f"# bench_codec: {args.numel} {args.dtype} values/shard, warmup {args.warmup}, "
          f"{args.steps} steps, device {device} ({machine}), torch {torch.__version__}")
    rows = []
    for lr in args.lr:
        snaps = make_snapshots(numel=args.numel, dtype=dtype, lr=lr, warmup=args.warmup,
                               steps=args.steps, device=device)
        if args.sweep_block:
            for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
                rows.append({"lr": lr, **bench_one(name="exponent_reuse", snaps=snaps, block_size=b,
                                                   backend=args.backend, device=device)})
            continue
        for name in codecs:
            rows.append({"lr": lr, **bench_one(name=name, snaps=snaps, block_size=None,
                                               backend=args.backend, device=device)})

    header = ("| lr | codec | block | wire/raw | ratio | encode GB/s | decode GB/s | clone GB/s "
              "| encode vs clone | decode vs clone |")
    lines = [header, "|" + "---|" * 10]
    for r in rows:
        lines.append(
            f"| {r['lr']:g} | {r['codec']} | {r['block']} | {r['wire_over_raw']:.3f} | {r['ratio']:.2f}x "
            f"| {r['encode_GBps']:.2f} | {r['decode_GBps']:.2f} | {r['clone_GBps']:.2f} "
            f"| {r['encode_vs_clone']:.3f} | {r['decode_vs_clone']:.3f} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out_md:
        args.out_md.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
