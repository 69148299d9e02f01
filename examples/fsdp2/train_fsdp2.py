#!/usr/bin/env python
"""A small MoE trained with plain PyTorch FSDP2 (ZeRO-3), with or without CIERA's gather.

    torchrun --nproc-per-node 2 examples/fsdp2/train_fsdp2.py            # FSDP2's own all-gather
    torchrun --nproc-per-node 2 examples/fsdp2/train_fsdp2.py --ciera    # the same run through CIERA

The only CIERA line is ``ciera.fsdp2.enable(model, optimizer=opt, config=...)`` after
``fully_shard``. Each block (norm, router, experts) is an FSDP unit resharded after the forward, so
every unit is gathered in the forward and again in the backward of each micro-batch; CIERA encodes
each shard once per optimizer step. Rank 0 prints Megatron-style iteration lines with the gathers'
bytes, and at the end the ``params sha256``: the two commands above print the same losses and digest.
CPU (gloo) or CUDA (NCCL), picked from what the machine has.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ciera.config import CACHES, CieraConfig
from ciera.shutdown import end_process
from ciera.testing.lm_steps import full_params_sha256


class Block(torch.nn.Module):
    """Pre-norm MoE block: a router softly mixing ``experts`` two-layer FFNs (dense dispatch)."""

    def __init__(self, dim: int, ffn: int, experts: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.router = torch.nn.Linear(dim, experts, bias=False)
        self.up = torch.nn.ModuleList(torch.nn.Linear(dim, ffn, bias=False) for _ in range(experts))
        self.down = torch.nn.ModuleList(torch.nn.Linear(ffn, dim, bias=False) for _ in range(experts))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.norm(h)
        w = torch.softmax(self.router(x).float(), dim=-1).to(x.dtype)
        out = sum(w[..., i : i + 1] * d(torch.nn.functional.gelu(u(x))) for i, (u, d) in enumerate(zip(self.up, self.down)))
        return h + out


class TinyMoE(torch.nn.Module):
    def __init__(self, *, vocab: int, dim: int, ffn: int, experts: int, layers: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, ffn, experts) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ciera", action="store_true", help="gather with CIERA (default: FSDP2's own all-gather)")
    p.add_argument("--cache", choices=CACHES, default=CieraConfig.cache,
                   help=f"what receivers keep between gathers (default {CieraConfig.cache}: values where they fit "
                        "half the free memory; values: the gathered values, lets delta in and makes a step's later "
                        "gathers free; exponents: 1 byte per value)")
    p.add_argument("--codec", choices=["auto", "exponent_reuse", "delta", "raw"], default="auto")
    p.add_argument("--selection", choices=["auto", "always", "never"], default="auto")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step (default 2)")
    p.add_argument("--batch", type=int, default=4, help="sequences per micro-batch and rank (default 4)")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--loss-log", default=None, help="rank 0 writes 'step micro loss.hex()' lines here")
    p.add_argument("--units-json", default=None, metavar="FILE",
                   help="with --ciera, rank 0 writes each unit's gather counters here as JSON "
                        "(tools/testbed/bench_zero3.py reads them; default: not written)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(1234)
    model = TinyMoE(vocab=a.vocab, dim=a.dim, ffn=a.ffn, experts=a.experts, layers=a.layers).to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    gathers = None
    if a.ciera:
        import ciera.fsdp2

        gathers = ciera.fsdp2.enable(model, optimizer=opt,
                                     config=CieraConfig(codec=a.codec, selection=a.selection, cache=a.cache))
    n_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"FSDP2 on {world} ranks ({'nccl' if cuda else 'gloo'}): {n_params / 1e6:.2f} M parameters, "
              f"{len(model.blocks)} blocks of {a.experts} experts, {a.micro_batches} micro-batches per step, "
              f"all-gather: {'CIERA (cache ' + a.cache + ', codec ' + a.codec + ', selection ' + a.selection + ')' if a.ciera else 'FSDP2'}",
              flush=True)
    gen = torch.Generator().manual_seed(100 + rank)
    log = open(a.loss_log, "w") if (a.loss_log and rank == 0) else None
    times = []
    for step in range(1, a.steps + 1):
        t0 = time.perf_counter()
        losses = []
        for mb in range(a.micro_batches):
            model.set_requires_gradient_sync(mb == a.micro_batches - 1)  # reduce-scatter once per step
            tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=gen).to(device)
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, a.vocab), tokens[:, 1:].reshape(-1))
            (loss / a.micro_batches).backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses = [float(x) for x in losses]
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if log:
            for mb, x in enumerate(losses):
                log.write(f"{step} {mb} {x.hex()}\n")
        if rank == 0:
            line = (f" iteration {step:5d}/{a.steps:5d} | elapsed time per iteration (ms): {times[-1] * 1e3:.1f} | "
                    f"lm loss: {sum(losses) / len(losses):.6E}")
            if gathers is not None:
                s = gathers.stats()
                line += f" | ciera gathers: {s.gathers} ({s.compressed_gathers} compressed, {s.replays} replayed) | wire/raw: {s.wire_bytes / max(s.raw_bytes, 1):.3f}"
            print(line, flush=True)
    digest = full_params_sha256(model)  # a collective: every rank
    if rank == 0:
        steady = times[2:] or times
        print(f"mean iteration (ms, steps 3+): {1e3 * sum(steady) / len(steady):.1f}", flush=True)
        if gathers is not None:
            s = gathers.stats()
            print(f"CIERA: {s.raw_bytes / 2**20:.1f} MiB raw -> {s.wire_bytes / 2**20:.1f} MiB on the wire "
                  f"({s.ratio:.2f}x), cache {gathers.cache_bytes / 2**20:.2f} MiB per rank", flush=True)
            if a.units_json:
                units = {name or "root": {"fresh_gathers": g.fresh_gathers, **g.stats.as_dict()}
                         for name, g in gathers.gathers.items()}
                Path(a.units_json).write_text(json.dumps(units))
        print(f"params sha256: {digest}", flush=True)
    if log:
        log.close()
    dist.barrier()  # no rank tears its process group down while another still talks to it
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    end_process(main())  # not a plain exit: see end_process (gloo's workers outlive the group)
