"""Several gloo ranks on one device: the CIERA gather on real trajectories, bit for bit.

NCCL cannot put two ranks on one GPU; gloo carries CUDA tensors, so ``--device cuda`` runs the
gather's CUDA branch (side-stream encodes, Triton codecs, the stream policy) with every rank on
``cuda:0``. ``--device cpu`` runs the same code on CPU tensors (the default test suite does, short).

Parts (``--parts``):

* ``zero1``: the distributed optimizer's buckets. Every rank trains the same
  :class:`ciera.testing.model_trajectory.ModelTrajectory` (a tiny MoE, AdamW), writes its shard of each
  bucket after every step, prepares all buckets with one agreement, starts them all, then waits
  them; each bucket must equal the plain ``all_gather_into_tensor`` (and the trajectory's buffer)
  bit for bit after every step. CIERA's device bytes per rank (:meth:`CieraAllGather.device_bytes`)
  after the first compressed gather are reported, with how often they changed later (receive
  buffers grow only at agreements).
* ``fsdp2``: ZeRO-3 units through FSDP2 (``fully_shard`` per block, ``ciera.fsdp2.enable``), the
  same tiny MoE trained with and without CIERA: per-micro-batch losses and the final parameters'
  sha256 must be identical.

* ``pretrain``: ``pretrain_gpt.py`` on ``--world`` ranks over gloo (``--distributed-backend gloo``)
  with the ZeRO-1 distributed optimizer and with FSDP2, each with and without
  ``--ciera-allgather``: per-iteration losses and the final parameters' sha256 must be identical.

Writes a Markdown table (``--out-md``) for BENCHMARKS.md and exits 1 on any mismatch::

    python tools/gloo_one_gpu.py --device cuda --world 2 --steps 300 --out-md /tmp/gloo_w2.md
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ciera import CieraAllGather, CieraConfig  # noqa: E402
from ciera.codecs import as_bits  # noqa: E402
from ciera.testing.model_trajectory import MoEShape, ModelTrajectory, TinyMoE, param_kind  # noqa: E402
from ciera.testing import run_on_ranks  # noqa: E402
from ciera.testing.lm_steps import full_params_sha256, train_steps  # noqa: E402


def _buckets(numel: int, world: int, n: int) -> list[tuple[int, int]]:
    """``n`` contiguous (start, end) bucket ranges of a flat buffer, each a multiple of ``world``."""
    size = max(world, numel // (n * world) * world)
    edges = [min(i * size, numel) for i in range(n)] + [numel]
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]


def zero1_worker(rank: int, world: int, device: str, steps: int, codec: str, n_buckets: int,
                 per_rank_sizes: bool = True) -> dict:
    dev = torch.device(device)
    traj = ModelTrajectory(world=1, shape=MoEShape(), seed=0)  # every rank trains the same model
    numel = traj.numel - traj.numel % world
    ranges = _buckets(numel, world, n_buckets)
    bufs = [torch.zeros(b - a, dtype=torch.bfloat16, device=dev) for a, b in ranges]
    start = traj.current()
    for buf, (a, b) in zip(bufs, ranges):
        buf.copy_(start[a:b])
    config = CieraConfig(codec=codec, selection="always", per_rank_sizes=per_rank_sizes)
    gathers = [CieraAllGather(buf, config=config, name=f"zero1.bucket{i}") for i, buf in enumerate(bufs)]
    bytes_first, grown, mismatches, t_ciera, t_plain = None, 0, [], 0.0, 0.0
    for step in range(steps):
        new = traj.step()
        for buf, (a, b) in zip(bufs, ranges):
            buf.view(world, -1)[rank].copy_(new[a:b].view(world, -1)[rank])
        t0 = time.perf_counter()
        CieraAllGather.prepare_many(gathers, group=None)
        handles = [g.start() for g in gathers]  # every bucket in flight
        for h in handles:
            h.wait()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t_ciera += time.perf_counter() - t0
        for i, (buf, (a, b)) in enumerate(zip(bufs, ranges)):
            ref = torch.empty_like(buf)
            t0 = time.perf_counter()
            dist.all_gather_into_tensor(ref, buf.view(world, -1)[rank].clone())
            t_plain += time.perf_counter() - t0
            if not (torch.equal(as_bits(buf), as_bits(ref)) and torch.equal(as_bits(buf.cpu()), as_bits(new[a:b]))):
                mismatches.append((step, i))
        now = sum(g.device_bytes()["total"] for g in gathers)
        if step == 1:  # after the first compressed gather (the first one is the raw warmup)
            bytes_first = now
        elif step > 1 and now != bytes_first:
            grown += 1
            bytes_first = now  # receive buffers grow only at agreements: counted, reported
    stats = [g.stats for g in gathers]
    return {"mismatches": mismatches, "device_bytes": bytes_first, "growths": grown,
            "compressed": sum(s.compressed_gathers for s in stats), "gathers": sum(s.gathers for s in stats),
            "wire": sum(s.wire_bytes for s in stats), "raw": sum(s.raw_bytes for s in stats),
            "ciera_s": t_ciera, "plain_s": t_plain, "model_bytes": sum(b.numel() * 2 for b in bufs)}


def fsdp2_worker(rank: int, world: int, device: str, steps: int, use_ciera: bool, codec: str) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import ciera.fsdp2

    dev = torch.device(device)
    shape = MoEShape()
    model = TinyMoE(shape)  # some of its parameters are left uninitialised: set them as the trajectory does
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if param_kind(name=name) == "norm" else torch.randn(p.shape, generator=gen) * 0.02)
    model = model.to(dev)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.decoder.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if use_ciera:
        ciera.fsdp2.enable(model, optimizer=opt, config=CieraConfig(codec=codec, selection="always"))
    losses = train_steps(model, opt, steps=steps, micro_batches=2, vocab=shape.vocab, batch=4, seq=shape.seq,
                         generator=torch.Generator().manual_seed(100 + rank), device=dev)
    digest = full_params_sha256(model)
    if not all(math.isfinite(v) for v in losses):
        raise RuntimeError(f"rank {rank}: a loss is not finite: {losses}")
    return {"losses": [v.hex() for v in losses], "sha256": digest}


PRETRAIN_MODEL = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
                  "--seq-length", "64", "--max-position-embeddings", "64", "--normalization", "RMSNorm",
                  "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
                  "--untie-embeddings-and-output-weights", "--num-experts", "4", "--moe-router-topk", "2",
                  "--moe-ffn-hidden-size", "64", "--moe-token-dispatcher-type", "alltoall", "--bf16",
                  "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255",
                  "--micro-batch-size", "2", "--seed", "1234", "--eval-iters", "0", "--log-interval", "1"]
"""A tiny MoE GPT for the pretrain part (the engine's flags are added per run)."""
PRETRAIN_ENGINES = {"zero1": ["--use-distributed-optimizer"],
                    "fsdp2": ["--use-torch-fsdp2", "--no-gradient-accumulation-fusion"]}


def pretrain_rows(*, device: str, world: int, iters: int) -> tuple[list[str], bool]:
    """The pretrain part: one table row per engine, and whether every pair matched."""
    from megatron.ciera.app.launch import run_pretrain

    rows, ok_all = [], True
    for engine, flags in PRETRAIN_ENGINES.items():
        common = [*PRETRAIN_MODEL, *flags, "--device", device, "--distributed-backend", "gloo",
                  "--train-iters", str(iters), "--global-batch-size", str(4 * world)]
        t0 = time.perf_counter()
        base = run_pretrain(common, nproc=world, timeout=300)
        t1 = time.perf_counter()
        ours = run_pretrain([*common, "--ciera-allgather", "--ciera-selection", "always"], nproc=world, timeout=300)
        t2 = time.perf_counter()
        ran = base.returncode == 0 and ours.returncode == 0 and len(base.losses) == iters
        ok = ran and base.losses == ours.losses and base.sha256 == ours.sha256 and base.sha256 is not None
        if not ran:
            print((base.output if base.returncode else ours.output)[-3000:], flush=True)
        ok_all &= ok
        rows.append(f"| pretrain_gpt.py {engine} | {iters} iterations | base {t1 - t0:.0f} s, CIERA {t2 - t1:.0f} s | "
                    f"{'yes' if ok else 'NO'} (losses, sha256 {(ours.sha256 or '-')[:12]}) |")
        print(rows[-1], flush=True)
    return rows, ok_all


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--world", type=int, default=2, help="gloo ranks, all on the one device")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps of the zero1 trajectory")
    p.add_argument("--fsdp2-steps", type=int, default=20)
    p.add_argument("--buckets", type=int, default=4)
    p.add_argument("--codecs", nargs="+", default=["exponent_reuse", "delta", "delta_ans"])
    p.add_argument("--parts", nargs="+", choices=["zero1", "fsdp2", "pretrain"], default=["zero1", "fsdp2"])
    p.add_argument("--pretrain-iters", type=int, default=10)
    p.add_argument("--no-per-rank-sizes", dest="per_rank_sizes", action="store_false",
                   help="equal-size payload gathers only (off NCCL, per-rank sizes are a ring of point-to-point "
                        "steps; gloo's point-to-point on CUDA tensors is checked by the runs without this)")
    p.add_argument("--out-md", default=None)
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device (use --device cpu)")
    lines = [f"{a.world} gloo ranks on one {a.device} device "
             f"({torch.cuda.get_device_name() if a.device == 'cuda' else 'CPU'}), torch {torch.__version__}", "",
             "| part | codec | steps | gathers (compressed) | wire / raw | CIERA device bytes per rank | "
             "growths | CIERA s | plain s | bit-exact |", "|---|---|---|---|---|---|---|---|---|---|"]
    failed = False
    for codec in a.codecs:
        if "zero1" in a.parts:
            try:
                r = run_on_ranks(zero1_worker, world=a.world, timeout_s=300,
                                 args=(a.device, a.steps, codec, a.buckets, a.per_rank_sizes))
            except Exception as e:  # a rank died (e.g. a collective gloo lacks on this device): report, go on
                failed = True
                lines.append(f"| zero1 buckets | {codec} | {a.steps} | ERROR: {type(e).__name__}: "
                             f"{str(e).splitlines()[-1][:150] if str(e) else ''} | | | | | | NO |")
                print(lines[-1], flush=True)
                continue
            ok = not any(x["mismatches"] for x in r)
            failed |= not ok
            x = r[0]
            lines.append(f"| zero1 buckets | {codec} | {a.steps} | {x['gathers']} ({x['compressed']}) | "
                         f"{x['wire'] / max(x['raw'], 1):.3f} | {x['device_bytes']} (model {x['model_bytes']}) | "
                         f"{x['growths']} | {x['ciera_s']:.2f} | {x['plain_s']:.2f} | {'yes' if ok else 'NO'} |")
            print(lines[-1], flush=True)
        if "fsdp2" in a.parts and codec != "delta":  # FSDP2's buffers do not persist: no values codec
            try:
                plain = run_on_ranks(fsdp2_worker, world=a.world, args=(a.device, a.fsdp2_steps, False, codec),
                                     timeout_s=300)
                ours = run_on_ranks(fsdp2_worker, world=a.world, args=(a.device, a.fsdp2_steps, True, codec),
                                    timeout_s=300)
            except Exception as e:
                failed = True
                lines.append(f"| fsdp2 units | {codec} | {a.fsdp2_steps} | ERROR: {type(e).__name__}: "
                             f"{str(e).splitlines()[-1][:150] if str(e) else ''} | | | | | | NO |")
                print(lines[-1], flush=True)
                continue
            ok = all(x == y for x, y in zip(plain, ours))
            failed |= not ok
            lines.append(f"| fsdp2 units | {codec} | {a.fsdp2_steps} | - | - | - | - | - | - | "
                         f"{'yes' if ok else 'NO'} (losses, sha256 {ours[0]['sha256'][:12]}) |")
            print(lines[-1], flush=True)
    if "pretrain" in a.parts:
        rows, ok = pretrain_rows(device=a.device, world=a.world, iters=a.pretrain_iters)
        failed |= not ok
        lines += ["", "| run | length | wall | identical |", "|---|---|---|---|", *rows]
    text = "\n".join(lines) + "\n"
    if a.out_md:
        Path(a.out_md).write_text(text)
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
