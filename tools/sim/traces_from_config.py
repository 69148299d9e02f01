"""Build simulator traces for the paper's six MoE models from their published configs.

    PYTHONPATH=. python tools/sim/traces_from_config.py --out-dir tools/sim/traces

What each number is and where it comes from (every assumption is also written into the trace's
``meta``):

* **Buckets**: truncated models of ``--layers`` (4) layers, in forward order: ``embedding``; per
  layer ``attn`` (QKV/O projections, both RMSNorms, router), ``shared`` (shared experts, or the
  dense FFN of a dense layer) when present, ``experts`` (all routed experts: ``kind=expert``);
  ``output`` (final norm + untied LM head; final norm only when tied). Sizes from the configs in
  ``/work/shared/reference/models.md``; SwiGLU FFNs have 3 matrices of hidden x ffn.
* **Compute**: forward FLOPs of ``--seq`` (1024) tokens per GPU (micro-batch 1): 2 x tokens x
  active parameters of the bucket, plus 4 x tokens x seq x (heads x head_dim) for attention
  scores; at ``--mfu`` (35%) of the A100's 312 TFLOP/s bf16 peak. Iteration compute = 3 x forward
  (backward = 2 x forward); the optimizer step is left out (equal for raw and CIERA).
* **Wire ratios**: the real codecs (``ciera.codecs``, default block sizes) run on an
  :class:`ciera.testing.trajectory.AdamTrajectory` sample (bf16, lr 1e-4, ``--sample-numel`` values, 30
  warmup steps then 10 measured steps). The ratio is what the gather would send: exact payloads
  at the agreed size, i.e. the largest payload needed (16-aligned), over the raw bytes. Cached in ``<out-dir>/codec_sample.json``; the same
  sample serves every bucket (no per-type change rates: a synthetic trajectory has none).
* **Codec throughput on A100**: not measurable here (no GPU). ``--speed NAME=ENC,DEC`` in GB/s of
  raw bytes; the defaults are assumptions for fused Triton kernels (exponent_reuse moves ~2.5 bytes
  of memory per raw byte each way, ~400 GB/s at ~65% of A100 HBM; delta's variable-width packing
  assumed 3x slower). The CPU throughput of the torch reference is recorded in ``meta`` only.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path


import torch

from ciera.codecs import available_codecs, make_codec, read_headers
from ciera.measure import measure_codec_speed
from ciera.testing.trajectory import AdamTrajectory
from tools.sim.trace import TRACE_SCHEMA, save_json, trace_from_dict

A100_BF16_FLOPS = 312e12
DEFAULT_SPEED_GBPS = {"exponent_reuse": (400.0, 400.0), "delta": (130.0, 130.0)}


@dataclass(frozen=True)
class MoEConfig:
    """The architecture figures a trace needs (models.md)."""

    name: str
    hidden: int
    expert_ffn: int
    experts: int
    topk: int
    shared_ffn: int  # total intermediate size of the shared expert(s); 0 = none
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int | None = None
    tied: bool = False
    dense_first_ffn: int = 0  # DeepSeek: layer 0 is a dense FFN of this size instead of MoE

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads


MODELS = {
    "olmoe": MoEConfig("OLMoE-1B-7B", 2048, 1024, 64, 8, 0, 16, 16, 50304),
    "deepseek": MoEConfig("DeepSeek-MoE-16B", 2048, 1408, 64, 6, 2 * 1408, 16, 16, 102400, dense_first_ffn=10944),
    "qwen2": MoEConfig("Qwen2-57B-A14B", 3584, 2560, 64, 8, 20480, 28, 4, 151936),
    "minicpm": MoEConfig("MiniCPM-MoE-8x2B", 2304, 5760, 8, 2, 0, 36, 36, 122753, head_dim=64, tied=True),
    "mixtral": MoEConfig("Mixtral-8x7B", 4096, 14336, 8, 2, 0, 32, 8, 32000),
    "scout": MoEConfig("Llama-4-Scout-17B-16E", 5120, 8192, 16, 1, 8192, 40, 8, 202048, head_dim=128),
}


def buckets_for(cfg: MoEConfig, *, layers: int, seq: int) -> list[dict]:
    """Bucket sizes and forward FLOPs (no timing, no codecs) in forward order."""
    h, t = cfg.hidden, seq
    q, kv = cfg.heads * cfg.hd, cfg.kv_heads * cfg.hd
    out = [dict(name="embedding", numel=cfg.vocab * h, kind="dense", flops=0.0)]
    for i in range(layers):
        attn = h * q + 2 * h * kv + q * h + 2 * h
        dense_layer = i == 0 and cfg.dense_first_ffn > 0
        router = 0 if dense_layer else h * cfg.experts
        out.append(dict(name=f"layer{i}.attn", numel=attn + router, kind="dense",
                        flops=2 * t * (attn + router) + 4 * t * t * q))
        ffn = cfg.dense_first_ffn if dense_layer else cfg.shared_ffn
        if ffn:
            out.append(dict(name=f"layer{i}.{'dense_ffn' if dense_layer else 'shared'}", numel=3 * h * ffn,
                            kind="dense", flops=2 * t * 3 * h * ffn))
        if not dense_layer:
            out.append(dict(name=f"layer{i}.experts", numel=cfg.experts * 3 * h * cfg.expert_ffn, kind="expert",
                            flops=2 * t * cfg.topk * 3 * h * cfg.expert_ffn))
    head = 0 if cfg.tied else cfg.vocab * h
    out.append(dict(name="output", numel=h + head, kind="dense", flops=2 * t * cfg.vocab * h))
    return out


def codec_sample(*, numel: int, lr: float, warmup: int = 30, steps: int = 10, seed: int = 0) -> dict:
    """Run every registered codec on one AdamTrajectory sample: needed/raw and capacity/raw ratios."""
    res = {}
    for name in available_codecs():
        if name == "raw":
            continue
        traj = AdamTrajectory(numel=numel, dtype=torch.bfloat16, lr=lr, seed=seed)
        for _ in range(warmup):
            traj.step()
        codec = make_codec(name, dtype=torch.bfloat16, numel=numel, backend="torch")
        state = codec.new_state(shard=traj.current().clone())
        out = torch.empty(codec.clamp_capacity(codec.max_bytes), dtype=torch.uint8)
        needed = []
        for _ in range(steps):
            codec.encode(shard=traj.step().contiguous(), state=state, out=out)
            needed.append(int(read_headers(out.view(1, -1))[0, 2]))
        cap = codec.clamp_capacity(max(needed))  # exact payloads at the agreed (largest) size
        speed = measure_codec_speed(codec=codec, repeats=2)
        res[name] = dict(needed_ratio_mean=sum(needed) / len(needed) / codec.raw_bytes,
                         needed_ratio_max=max(needed) / codec.raw_bytes, wire_ratio=cap / codec.raw_bytes,
                         cpu_encode_bytes_per_s=speed.encode_bytes_per_s,
                         cpu_decode_bytes_per_s=speed.decode_bytes_per_s)
    return res


def cached_sample(*, path: Path, numel: int, lr: float) -> dict:
    key = f"bf16 numel={numel} lr={lr} warmup=30 steps=10 codecs={','.join(available_codecs())}"
    cache = json.loads(path.read_text()) if path.exists() else {}
    if key not in cache:
        cache[key] = codec_sample(numel=numel, lr=lr)
        save_json(cache, path)
    return cache[key]


def build_trace(*, model: str, layers: int, seq: int, mfu: float, sample: dict, speeds: dict, lr: float) -> dict:
    cfg = MODELS[model]
    flops_per_s = A100_BF16_FLOPS * mfu
    buckets = []
    for b in buckets_for(cfg, layers=layers, seq=seq):
        codecs = {name: dict(wire_ratio=s["wire_ratio"], encode_bytes_per_s=speeds[name][0] * 1e9,
                             decode_bytes_per_s=speeds[name][1] * 1e9)
                  for name, s in sample.items() if name in speeds}
        buckets.append(dict(name=b["name"], numel=b["numel"], dtype="bfloat16", kind=b["kind"],
                            compute_s=b["flops"] / flops_per_s, codecs=codecs))
    fwd = sum(b["compute_s"] for b in buckets)
    meta = dict(model=cfg.name, layers=layers, seq=seq, micro_batch=1, mfu=mfu, peak_flops=A100_BF16_FLOPS,
                lr=lr, params=sum(b["numel"] for b in buckets),
                compute="forward FLOPs / (peak x mfu); iteration = 3 x forward; optimizer step excluded",
                codec_sample=sample, assumed_a100_speed_gbps={k: list(v) for k, v in speeds.items()})
    d = dict(schema=TRACE_SCHEMA, name=f"{cfg.name} ({layers}L, seq {seq})", iteration_compute_s=3 * fwd,
             meta=meta, buckets=buckets)
    trace_from_dict(d)  # validate
    return d


def parse_speeds(items: list[str]) -> dict:
    speeds = dict(DEFAULT_SPEED_GBPS)
    for it in items or []:
        name, _, val = it.partition("=")
        enc, _, dec = val.partition(",")
        speeds[name] = (float(enc), float(dec or enc))
    return speeds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--mfu", type=float, default=0.35)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--sample-numel", type=int, default=1 << 16)
    ap.add_argument("--speed", action="append", metavar="NAME=ENC,DEC",
                    help=f"assumed A100 codec throughput, GB/s of raw bytes (default {DEFAULT_SPEED_GBPS})")
    ap.add_argument("--out-dir", default="tools/sim/traces")
    args = ap.parse_args(argv)
    out = Path(args.out_dir)
    sample = cached_sample(path=out / "codec_sample.json", numel=args.sample_numel, lr=args.lr)
    speeds = parse_speeds(args.speed)
    for m in args.models:
        d = build_trace(model=m, layers=args.layers, seq=args.seq, mfu=args.mfu, sample=sample, speeds=speeds,
                        lr=args.lr)
        save_json(d, out / f"{m}.json")
        gb = d["meta"]["params"] * 2 / 1e9
        print(f"{m}: {len(d['buckets'])} buckets, {gb:.2f} GB bf16, forward {d['iteration_compute_s'] / 3 * 1e3:.2f} ms,"
              f" wire ratios " + ", ".join(f"{k} {v['wire_ratio']:.3f}" for k, v in sample.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
