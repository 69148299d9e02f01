"""CIERA in Megatron training, on a laptop: same training bit for bit, fewer all-gather bytes.

Trains a tiny GPT-MoE (2 layers, hidden 64, 4 experts top-2, bf16, distributed optimizer with
overlapped parameter gather) on 2 CPU ranks (gloo) twice: with Megatron's all-gather and with
``--ciera-allgather --ciera-selection always``. On one host the "link" is gloo's loopback memory
copy, faster than any encode + decode, so the default ``--ciera-selection auto`` would rightly send
every bucket raw; ``always`` shows the compression (``make demo-cluster`` shows the speed-up on real
1 Gbit/s links). Then compares every iteration's loss and the final parameters exactly and reports
the all-gather bytes.

    python examples/cpu_demo.py                 # 40-60 s on 2 vCPUs
    python examples/cpu_demo.py --iters 50 --codec delta

Exit status 0 when both runs are bit-identical, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.ciera.app.launch import TABLE_TOTAL, run_pretrain  # noqa: E402

MODEL = [
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "64",
    "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type", "alltoall",
]
TRAINING = [
    "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--bf16",
    "--optimizer", "adam", "--lr-decay-style", "constant", "--weight-decay", "0.01", "--clip-grad", "1.0",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--micro-batch-size", "2",
    "--global-batch-size", "8", "--device", "cpu", "--eval-iters", "0", "--num-workers", "0",
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--lr", default="1e-4")
    p.add_argument("--seed", default="1234")
    p.add_argument("--codec", default=None, choices=["exponent_reuse", "delta", "auto", "raw"],
                   help="--ciera-codec for the CIERA run (default: the library's default codec)")
    p.add_argument("--log-interval", type=int, default=5)
    p.add_argument("--timeout", type=float, default=600)
    a = p.parse_args(argv)

    common = [*MODEL, *TRAINING, "--lr", a.lr, "--min-lr", a.lr, "--seed", a.seed,
              "--train-iters", str(a.iters), "--log-interval", str(a.log_interval)]
    runs = {}
    # --ciera-selection always: on one host gloo's loopback copy beats any encode + decode, so the
    # default cost model (auto) would send every bucket raw; the demo shows the compression.
    ciera_flags = ["--ciera-allgather", "--ciera-selection", "always"] + (["--ciera-codec", a.codec] if a.codec else [])
    for label, extra in (("megatron all-gather", []), (" ".join(ciera_flags), ciera_flags)):
        print(f"=== {label}: 2 gloo ranks, {a.iters} iterations ===", flush=True)
        if extra:
            print("(always: on one host gloo's loopback copy is faster than any encode + decode, so the "
                  "default --ciera-selection auto would send raw; always shows the bytes saved)", flush=True)
        t0 = time.time()
        result = run_pretrain(common + extra, nproc=2, timeout=a.timeout)
        if result.returncode != 0:
            print(result.output[-6000:])
            print(f"run '{label}' failed with exit status {result.returncode}")
            return 1
        for line in result.iteration_lines():
            print(line)
        if result.summary_block():
            print(result.summary_block())
        print(f"params sha256: {result.sha256}   ({time.time() - t0:.0f} s)\n", flush=True)
        runs[label] = result

    base, ciera = runs.values()
    same_losses = base.losses == ciera.losses
    same_params = base.sha256 is not None and base.sha256 == ciera.sha256
    total = TABLE_TOTAL.search(ciera.summary_block())
    raw_mb, wire_mb = (float(total.group(1)), float(total.group(2))) if total else (float("nan"),) * 2
    print("=== summary ===")
    print(f"parameter all-gather, bytes received by rank 0: raw {raw_mb:.3f} MB, on the wire {wire_mb:.3f} MB "
          f"-> saved {raw_mb - wire_mb:.3f} MB ({raw_mb / wire_mb:.2f}x)")
    print(f"params sha256 without CIERA: {base.sha256}")
    print(f"params sha256 with CIERA:    {ciera.sha256}")
    differing = [i for i in sorted(base.losses) if base.losses.get(i) != ciera.losses.get(i)]
    print(f"per-iteration lm loss: {len(base.losses)} iterations compared exactly (float.hex), "
          f"{len(differing)} differ{(' at ' + str(differing)) if differing else ''}")
    first, last = min(base.losses), max(base.losses)
    print(f"lm loss of single iterations (the log lines print the mean over each log interval): "
          f"iteration {first} {base.losses[first]:.6f} -> iteration {last} {base.losses[last]:.6f}")
    ok = same_losses and same_params
    print(f"bit-identical: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
