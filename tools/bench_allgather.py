#!/usr/bin/env python
"""Plain all-gather vs CieraAllGather, side by side in one run, on the same buffer trajectory.

Every rank advances its shard along an AdamW trajectory (``ciera.testing.trajectory``); each step the same
new shard is gathered twice: by ``all_gather_into_tensor`` into one buffer and by CieraAllGather
into another, alternating which goes first. The two buffers are compared bit for bit. Printed per
buffer size and codec: median time per gather of each, their ratio, and bytes received per rank:
``wire/raw`` (what the collectives carried) next to ``payload/raw`` (what the codec itself needed,
summed over ranks) and their quotient (the price of the agreed sizes: equal sizes pay for the
largest payload, per-rank sizes only for the 16-byte alignment), what equal sizes would have
delivered (``world x`` the largest payload), the gathers sent with per-rank sizes, the payloads'
bits per value, and the order-0 entropies of the same changes (``ciera.entropy``: ``H(d)`` and
``H(d | previous exponent)``, pooled over ranks).

``--layout model``: every rank's shard is its part of a tiny MoE's bucket trained with AdamW
(``ciera.testing.model_trajectory``, sharded as the distributed optimizer shards it: one rank's shard all
experts, another's output layer and attention), computed once in the launcher; ``--numel`` is
then ignored.

    python tools/bench_allgather.py                       # gloo, 4 ranks, 16M and 64M values
    python tools/bench_allgather.py --world 2 --numel 1048576 --codecs auto --warmup 4 --steps 400
                                                          # auto's price where it must send raw
    python tools/bench_allgather.py --backend nccl        # one process per GPU (torchrun-less spawn)
    python tools/bench_allgather.py --layout model --world 8 --codecs exponent_reuse delta
                                                          # the real layout's bytes on the wire
"""

from __future__ import annotations

import argparse
import statistics
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from ciera import CieraAllGather
from ciera.codecs import as_bits, available_codecs
from ciera.config import CODECS
from ciera.entropy import ChangeEntropy
from ciera.testing.model_trajectory import SHAPES, ModelTrajectory
from ciera.testing import run_on_ranks
from ciera.testing.trajectory import AdamTrajectory
from tools._common import timed_collective
from tools.testbed.bench_gather import mode_config


def _worker(rank, world, numel, codecs, lr, warmup, steps, device_type, buffers=None):
    """``buffers``: the model layout's flat buffer after every step (``warmup + steps`` of them);
    None: this rank's shard follows its own AdamTrajectory."""
    # The plain baseline is all_gather_into_tensor, the collective Megatron calls; newer torch
    # marks it deprecated on every call.
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)
    device = torch.device(f"cuda:{rank}") if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    if buffers is not None:
        numel = buffers[0].numel()
        shards = (b.view(world, -1)[rank].to(device) for b in buffers)
        step_fn = lambda: next(shards)  # noqa: E731
    else:
        step_fn = AdamTrajectory(numel=numel // world, lr=lr, seed=rank, device=device).step
    plain = torch.zeros(numel, dtype=torch.bfloat16, device=device)
    gathers = {c: CieraAllGather(torch.zeros_like(plain), config=mode_config(c), name=c) for c in codecs}
    times = {c: [] for c in ["plain", *codecs]}
    modes = {c: [] for c in codecs}  # the codec each gather of the timed steps used (None: raw)
    uneven = dict.fromkeys(codecs, 0)  # timed gathers sent with per-rank sizes
    equal = dict.fromkeys(codecs, 0)  # bytes the timed compressed gathers would deliver at equal sizes
    entropy, prev = ChangeEntropy(), None

    def launch(name, g):
        handle = g.start()
        if g.plan is not None and not g.plan.raw and step >= warmup:
            uneven[name] += bool(g.plan.sizes)
            equal[name] += world * g.plan.size  # size: the largest payload, 16-aligned
        handle.wait()

    for step in range(warmup + steps):
        if step == warmup:
            before = {c: g.stats for c, g in gathers.items()}
        x = step_fn()
        if step >= warmup:
            entropy.add(prev=prev, new=x)
        prev = x
        plain.view(world, -1)[rank].copy_(x)
        order = [("plain", None), *((c, g) for c, g in gathers.items())]
        if step % 2:
            order.reverse()
        for name, g in order:
            if g is None:
                t = timed_collective(lambda: dist.all_gather_into_tensor(plain, plain.view(world, -1)[rank]),
                                     device=device)
            else:
                g.buffer.view(world, -1)[rank].copy_(x)
                n = g.stats.compressed_gathers
                t = timed_collective(lambda: launch(name, g), device=device)
                if step >= warmup:
                    s = g.stats
                    modes[name].append(s.codec if s.compressed_gathers > n else None)
            if step >= warmup:
                times[name].append(t)
        for c, g in gathers.items():
            if not torch.equal(as_bits(g.buffer), as_bits(plain)):
                raise AssertionError(f"{c}: gathered buffer differs from all_gather_into_tensor")
    return {"times": times, "modes": modes, "stats": {c: g.stats.minus(before[c]) for c, g in gathers.items()},
            "uneven": uneven, "equal": equal, "entropy": entropy, "values": numel // world,
            "decisions": {c: g.selector.decisions if g.selector else 0 for c, g in gathers.items()}}


def _switches(modes) -> str:
    """Where the timed steps changed mode: ``step:mode`` pairs (``raw`` for uncompressed)."""
    out, last = [], "raw"
    for i, m in enumerate(modes):
        m = m or "raw"
        if m != last:
            out.append(f"{i}:{m}")
            last = m
    return " ".join(out) or "-"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--numel", type=int, nargs="+", default=[1 << 24, 1 << 26], help="bucket sizes (values)")
    p.add_argument("--codecs", nargs="+", default=None,
                   help="forced codecs, and/or auto (selection by the cost model); default: every registered "
                        "codec but raw that CieraConfig accepts")
    p.add_argument("--layout", choices=["synthetic", "model"], default="synthetic",
                   help="synthetic: an AdamTrajectory per rank; model: a tiny MoE's bucket (see above)")
    p.add_argument("--model-shape", choices=list(SHAPES), default="small", help="--layout model: the MoE's size")
    p.add_argument("--train-warmup", type=int, default=20,
                   help="--layout model: training steps before the first gather")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=20, help="steps before timing (first gathers are raw)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks the benchmark runs")
    p.add_argument("--out-md", type=Path, default=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.world, args.numel, args.warmup, args.steps, args.model_shape = 2, [4096], 2, 2, "tiny"
    if args.codecs is None:  # every registered codec the gather's config accepts
        args.codecs = [c for c in available_codecs() if c != "raw" and c in CODECS]
        skipped = [c for c in available_codecs() if c not in CODECS]
        if skipped:
            print(f"# registered but not accepted by CieraConfig.codec (skipped): {', '.join(skipped)}")
    if args.backend == "nccl":
        raise SystemExit("--backend nccl: run under torchrun on a GPU node (not wired into this launcher yet)")

    buffers = None
    if args.layout == "model":
        traj = ModelTrajectory(world=args.world, shape=SHAPES[args.model_shape], lr=args.lr, warmup=args.train_warmup)
        buffers = [traj.step() for _ in range(args.warmup + args.steps)]
        args.numel = [traj.numel]
        layout = (f"--layout model {args.model_shape} ({traj.numel:,} values after {args.train_warmup} training steps; "
                  + "; ".join(f"rank {r}: {traj.describe_shard(r)}" for r in range(args.world)) + ")")
    else:
        layout = "--layout synthetic (an AdamTrajectory per rank)"
    print(f"# bench_allgather: {args.backend}, {args.world} ranks, bf16, lr {args.lr:g}, warmup {args.warmup}, "
          f"{args.steps} timed steps, torch {torch.__version__}, {layout}")
    lines = ["| values | codec | plain ms | CIERA ms | speed-up | mean speed-up | wire/raw | payload/raw "
             "| compressed wire/payload | equal sizes: wire/payload | per-rank sizes | bits/value | H(d) "
             "| H(d given exp) | bit-exact | raw gathers | decisions | switches (step:mode) |", "|---" * 18 + "|"]
    print("\n".join(lines), flush=True)  # the header, then each row as it is measured
    for numel in args.numel:
        results = run_on_ranks(_worker, world=args.world,
                               args=(numel, args.codecs, args.lr, args.warmup, args.steps, "cpu", buffers))
        entropy = ChangeEntropy()
        for r in results:
            entropy.merge(r["entropy"])
        h0, he = entropy.order0, entropy.given_exponent
        # A gather is as slow as its slowest rank.
        def slowest(name):
            return [max(r["times"][name][i] for r in results) for i in range(args.steps)]
        plain = statistics.median(slowest("plain"))
        plain_mean = statistics.fmean(slowest("plain"))
        for c in args.codecs:
            s = results[0]["stats"][c]
            t = statistics.median(slowest(c))
            mean = plain_mean / statistics.fmean(slowest(c))  # the decision gathers' probes count here
            wire, payload = s.wire_bytes / s.raw_bytes, s.payload_bytes / s.raw_bytes
            # the compressed gathers' wire: a raw gather delivers the whole bucket
            compressed_wire = s.wire_bytes - s.raw_gathers * (s.raw_bytes // max(1, s.gathers))
            over = compressed_wire / s.payload_bytes if s.payload_bytes else float("nan")
            bits = 8 * s.payload_bytes / (numel * s.compressed_gathers) if s.compressed_gathers else float("nan")
            lines.append(f"| {numel:,} | {c} | {plain * 1e3:.2f} | {t * 1e3:.2f} | {plain / t:.3f}x | {mean:.3f}x "
                         f"| {wire:.4f} | {payload:.4f} | {over:.4f} "
                         f"| {results[0]['equal'][c] / s.payload_bytes if s.payload_bytes else float('nan'):.4f} "
                         f"| {results[0]['uneven'][c]}/{args.steps} "
                         f"| {bits:.3f} | {h0:.3f} | {he:.3f} | {args.steps} steps "
                         f"| {s.raw_gathers} | {results[0]['decisions'][c]} | {_switches(results[0]['modes'][c])} |")
            print(lines[-1], flush=True)
    if args.out_md:
        Path(args.out_md).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
