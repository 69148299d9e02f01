#!/usr/bin/env python
"""Batched decode of one bucket on one device: ``Codec.decode_many`` over the ``world - 1``
received payloads against a loop of ``Codec.decode``, plus the device kernels one batched decode
launches (what the gather puts on the critical path per bucket).

    python tools/bench_decode_many.py --device cuda --numel 4194304 --world 8
    python tools/bench_decode_many.py --device cpu --numel 65536 --world 4   # reference, no launch count

The payloads are real: every "rank" encodes its own AdamW trajectory step (bf16, lr 1e-4) and they
are laid out as the gather receives them (equal agreed size, 16-aligned). Decoded buffers are
checked bit for bit against the loop.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ciera.codecs import HEADER_BYTES, as_bits, make_codec
from ciera.codecs.base import align_up
from ciera.testing.trajectory import AdamTrajectory
from tools._common import median_seconds, synchronize, write_table


def _payloads(codec, world, numel, device):
    prev, new, raw = [], [], []
    cap = codec.clamp_capacity(codec.max_bytes)
    for r in range(world):
        traj = AdamTrajectory(numel=numel, seed=r, device=device)
        for _ in range(5):
            traj.step()
        prev.append(traj.current().clone())
        new.append(traj.step().contiguous())
        out = torch.empty(cap, dtype=torch.uint8, device=device)
        codec.encode(shard=new[r], state=codec.new_state(shard=prev[r]), out=out)
        raw.append(out[: int(out[:HEADER_BYTES].view(torch.int64)[2])])
    size = align_up(max(p.numel() for p in raw))
    flat = torch.zeros(world * size, dtype=torch.uint8, device=device)
    for r, p in enumerate(raw):
        flat[r * size : r * size + p.numel()] = p
    return torch.stack(prev), torch.stack(new), flat, size


def _launches(fn, device) -> int | None:
    if device.type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        synchronize(device)
    return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--numel", type=int, default=1 << 22, help="values per shard")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--codecs", nargs="+", default=["exponent_reuse", "delta"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out-md", type=Path, default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    lines = [f"# decode of {args.world - 1} payloads of {args.numel:,} bf16 values on {device} "
             f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), torch {torch.__version__}",
             "| codec | decode_many ms | loop of decode ms | GB/s (raw, batched) | launches per bucket | impl |",
             "|---|---|---|---|---|---|"]
    for name in args.codecs:
        codec = make_codec(name, dtype=torch.bfloat16, numel=args.numel)
        prev, new, flat, size = _payloads(codec, args.world, args.numel, device)
        rows = torch.arange(1, args.world, dtype=torch.int64, device=device)  # rank 0 receives
        offsets = rows * size
        targets = prev.clone()

        def batched():
            targets.copy_(prev)
            codec.decode_many(payloads=flat, rows=rows, offsets=offsets, targets=targets)

        def looped():
            targets.copy_(prev)
            for r in range(1, args.world):
                codec.decode(payload=flat[r * size : (r + 1) * size], target=targets[r])

        times = {}
        for label, fn in (("batched", batched), ("loop", looped)):
            fn()  # warm-up (compiles kernels)
            times[label] = median_seconds(fn, device=device, repeats=args.repeats)
            if not torch.equal(as_bits(targets[1:]), as_bits(new[1:])):
                raise AssertionError(f"{name} {label}: decoded shards differ from the encoded ones")
        copy_launches = _launches(lambda: targets.copy_(prev), device) or 0
        launches = _launches(batched, device)
        launches = "n/a (cpu)" if launches is None else str(launches - copy_launches)
        impl = codec.implementation("decode_many", like=targets)
        gbps = (args.world - 1) * codec.raw_bytes / times["batched"] / 1e9
        lines.append(f"| {name} | {times['batched'] * 1e3:.3f} | {times['loop'] * 1e3:.3f} | {gbps:.2f} "
                     f"| {launches} | {impl} |")
        print(lines[-1], flush=True)
    write_table(lines, args.out_md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
