#!/usr/bin/env python
"""Exponent stability of a training run, per iteration and per parameter type.

Reads periodic snapshots of the gathered parameters (``iter_0000100.pt`` files, each a dict
``{parameter name: tensor}``, as ``pretrain_gpt.py --ciera-snapshot-dir DIR
--ciera-snapshot-interval N`` saves them) or generates them (``--synthetic``), and measures between
consecutive snapshots, for each parameter type (attention, expert FFN, shared expert, router gate,
norms, embeddings/output layer, other):

* the fraction of exponents that changed, of values that changed at all, and of sign flips;
* the fraction of B-value blocks holding at least one changed exponent, for each ``--block-sizes``
  (blocks are laid over each parameter tensor flattened; the last block may be short);
* the empirical entropy of the XOR delta against the previous snapshot, in bits per value (the
  entropy of the distribution of XOR bit patterns over the type's values), and the entropy of the
  arithmetic delta ``(new - previous) mod 2^W`` of the bit patterns given the previous exponent,
  ``H(delta | exponent)``: what a coder that picks its code by the previous exponent (the ``delta``
  codec does) can reach, often well under the XOR entropy;
* every registered codec's wire ratio: the real codecs encode each type's parameters, flattened and
  concatenated in name order (one buffer per type and dtype, like a gather bucket), snapshot after
  snapshot; wire bytes = the ``needed`` word of the payload header, ratio = raw bytes / wire bytes.

Rates are per snapshot interval: with ``--ciera-snapshot-interval 1`` they are per iteration, with
``k > 1`` they are per ``k`` iterations (the table and the JSON say which).

Outputs: a markdown table on stdout (types averaged over the transitions after ``--warmup``); with
``--out-dir``: ``exponent_stats.md``, ``exponent_stats.json`` (every figure, per transition and
averaged) and three PNGs: ``change_rates.png``, ``block_rates.png``, ``codec_ratio.png``.

Examples::

    PYTHONPATH=. python tools/exponent_stats.py --synthetic --lr 1e-4 --iters 100 --warmup 30 \\
        --out-dir /tmp/expstats
    PYTHONPATH=. python tools/exponent_stats.py --snapshot-dir runs/tiny/snapshots --warmup 30 \\
        --out-dir runs/tiny/expstats
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from ciera.codecs import FORMATS, PayloadHeader, as_bits, available_codecs, float_format, make_codec, read_headers
from ciera.codecs.exponent_reuse import split_fields
from ciera.codecs.formats import to_unsigned
from ciera.testing.trajectory import AdamTrajectory

PARAM_TYPES = ("attention", "expert_ffn", "shared_expert", "router", "norm", "embedding", "other")
"""Parameter types, in table order. ``embedding`` holds the input embeddings and the output layer."""

ALL = "all"
"""Row that pools every type."""

DEFAULT_BLOCK_SIZES = (4, 8, 64, 128, 256, 512, 1024)
SNAPSHOT_RE = re.compile(r"^iter_(\d+)\.pt$")
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
          "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}

# Matched in order against the dot-separated parts of a name: the first rule that fits wins, so
# norms fused into a linear layer (``linear_qkv.layer_norm_weight``) are norms, and shared experts
# are tested before routed experts.
_NORM_PARTS = re.compile(r"(^|_)(layernorm|layer_norm|norm)(_|$)")


def classify_param(name: str) -> str:
    """Parameter type of a Megatron-Core GPTModel parameter name (one of :data:`PARAM_TYPES`).

    Tolerates wrapper prefixes (``module.``) and grouped-GEMM suffixes (``weight0``).
    """
    parts = name.split(".")
    if any(_NORM_PARTS.search(p) for p in parts):
        return "norm"
    if "embedding" in parts or "output_layer" in parts:
        return "embedding"
    if "shared_experts" in parts or "shared_expert" in parts or "shared_expert_gate" in parts:
        return "shared_expert"
    if "router" in parts:
        return "router"
    if "experts" in parts:
        return "expert_ffn"
    if "self_attention" in parts or "cross_attention" in parts:
        return "attention"
    return "other"


# ----------------------------------------------------------------------------------------------
# Per-transition measurements
# ----------------------------------------------------------------------------------------------

Histogram = tuple[torch.Tensor, torch.Tensor]
"""Sparse histogram: (distinct values, their counts), both int64."""


def histogram(*, keys: torch.Tensor) -> Histogram:
    """Histogram of non-negative integer keys (a dense bincount when they all fit in 16 bits)."""
    if keys.numel() and int(keys.max()) < (1 << 16):
        counts = torch.bincount(keys.to(torch.int64), minlength=1 << 16)
        values = torch.nonzero(counts).squeeze(1)
        return values, counts[values]
    values, counts = torch.unique(keys.to(torch.int64), return_counts=True)
    return values, counts


def merge_histograms(*, hists: list[Histogram]) -> Histogram:
    """Sum of sparse histograms."""
    hists = [h for h in hists if h[0].numel()]
    if not hists:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    values, inverse = torch.unique(torch.cat([h[0] for h in hists]), return_inverse=True)
    counts = torch.zeros(values.numel(), dtype=torch.int64).scatter_add_(0, inverse, torch.cat([h[1] for h in hists]))
    return values, counts


def entropy_bits(*, hist: Histogram) -> float:
    """Empirical entropy (bits per value) of the distribution a histogram describes; 0 if empty."""
    counts = hist[1].to(torch.float64)
    total = counts.sum()
    if total <= 0:
        return 0.0
    p = counts / total
    return float(-(p * torch.log2(p)).sum()) + 0.0  # + 0.0 turns -0.0 into 0.0


def block_change_counts(*, changed: torch.Tensor, block_sizes: tuple[int, ...]) -> dict[int, tuple[int, int]]:
    """For each B: (blocks, blocks holding a changed value) over ``changed`` cut into B-value blocks."""
    n = changed.numel()
    out = {}
    for b in block_sizes:
        nb = -(-n // b)
        padded = torch.zeros(nb * b, dtype=torch.bool)
        padded[:n] = changed
        out[b] = (nb, int(padded.view(nb, b).any(1).sum()))
    return out


@dataclass
class TypeCounts:
    """Counts for one parameter type over one transition (previous snapshot -> this one)."""

    values: int = 0
    exp_changed: int = 0
    value_changed: int = 0
    sign_changed: int = 0
    blocks: dict[int, list[int]] = field(default_factory=dict)
    """B -> [blocks, blocks with a changed exponent]."""
    hists: dict[str, list[Histogram]] = field(default_factory=dict)
    """Histograms of the type's tensors by kind: ``xor`` (XOR patterns), ``exp`` (previous
    exponents), ``exp_delta`` (previous exponent and arithmetic delta, jointly); folded into the
    entropies by :meth:`finish`."""
    entropy: float = 0.0
    """Entropy of the XOR patterns, bits per value."""
    delta_entropy: float = 0.0
    """H(arithmetic delta | previous exponent), bits per value."""
    codec_bytes: dict[str, list[int]] = field(default_factory=dict)
    """Codec name -> [raw bytes, wire bytes]."""

    def add_tensor(self, *, prev: torch.Tensor, cur: torch.Tensor, block_sizes: tuple[int, ...]) -> None:
        """Count the changes from ``prev`` to ``cur`` (same shape and float dtype)."""
        fmt = float_format(cur.dtype)
        u_prev = to_unsigned(as_bits(prev.contiguous().view(-1)))
        u_cur = to_unsigned(as_bits(cur.contiguous().view(-1)))
        xor = u_prev ^ u_cur
        exp_xor, _ = split_fields(fmt, xor)  # field extraction commutes with XOR
        exp_diff = exp_xor != 0
        exp_prev, _ = split_fields(fmt, u_prev)
        delta = (u_cur - u_prev) & ((1 << fmt.total_bits) - 1)
        self.values += xor.numel()
        self.exp_changed += int(exp_diff.sum())
        self.value_changed += int((xor != 0).sum())
        self.sign_changed += int(((xor >> (fmt.total_bits - 1)) & 1).sum())
        for b, (nb, nc) in block_change_counts(changed=exp_diff, block_sizes=block_sizes).items():
            acc = self.blocks.setdefault(b, [0, 0])
            acc[0] += nb
            acc[1] += nc
        self.hists.setdefault("xor", []).append(histogram(keys=xor))
        self.hists.setdefault("exp", []).append(histogram(keys=exp_prev))
        joint = (exp_prev.to(torch.int64) << fmt.total_bits) | delta
        self.hists.setdefault("exp_delta", []).append(histogram(keys=joint))

    def finish(self) -> None:
        """Merge the histograms of each kind and compute the entropies from them."""
        self.hists = {k: [merge_histograms(hists=v)] for k, v in self.hists.items()}
        h = {k: entropy_bits(hist=v[0]) for k, v in self.hists.items()}
        self.entropy = h.get("xor", 0.0)
        self.delta_entropy = max(h.get("exp_delta", 0.0) - h.get("exp", 0.0), 0.0)

    def rates(self) -> dict:
        """This transition's figures as fractions (JSON-ready)."""
        v = max(self.values, 1)
        return {
            "values": self.values,
            "exp_changed": self.exp_changed / v,
            "value_changed": self.value_changed / v,
            "sign_changed": self.sign_changed / v,
            "block_changed": {str(b): (c / n if n else 0.0) for b, (n, c) in sorted(self.blocks.items())},
            "xor_entropy_bits": self.entropy,
            "delta_entropy_bits": self.delta_entropy,
            "codec_ratio": {k: (r / w if w else float("nan")) for k, (r, w) in sorted(self.codec_bytes.items())},
            "codec_bytes": {k: {"raw": r, "wire": w} for k, (r, w) in sorted(self.codec_bytes.items())},
        }


def pool_counts(*, parts: list[TypeCounts]) -> TypeCounts:
    """All types together: sums of counts, entropy of the merged XOR histogram."""
    total = TypeCounts()
    for p in parts:
        total.values += p.values
        total.exp_changed += p.exp_changed
        total.value_changed += p.value_changed
        total.sign_changed += p.sign_changed
        for b, (n, c) in p.blocks.items():
            acc = total.blocks.setdefault(b, [0, 0])
            acc[0] += n
            acc[1] += c
        for k, (r, w) in p.codec_bytes.items():
            acc = total.codec_bytes.setdefault(k, [0, 0])
            acc[0] += r
            acc[1] += w
        for k, v in p.hists.items():
            total.hists.setdefault(k, []).extend(v)
    total.finish()
    return total


# ----------------------------------------------------------------------------------------------
# Codecs on the trajectory
# ----------------------------------------------------------------------------------------------


class CodecProbe:
    """Runs the real codecs over the trajectory: one flat buffer per (type, dtype), sender state
    carried from snapshot to snapshot exactly as the gather carries it."""

    def __init__(self, *, codecs: list[str], block_size: int | None):
        self.codecs = codecs
        self.block_size = block_size
        self._slots: dict[tuple[str, str, torch.dtype], tuple] = {}

    @staticmethod
    def flat_buffers(*, params: dict[str, torch.Tensor]) -> dict[tuple[str, torch.dtype], torch.Tensor]:
        """(type, dtype) -> the type's tensors of that dtype flattened and concatenated in name order."""
        groups: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}
        for name in sorted(params):
            t = params[name]
            groups.setdefault((classify_param(name), t.dtype), []).append(t.contiguous().view(-1))
        return {k: torch.cat(v) for k, v in groups.items()}

    def prime(self, *, params: dict[str, torch.Tensor]) -> None:
        """Start every codec's sender state from ``params`` (the values receivers already hold)."""
        self._slots.clear()
        for (ptype, dtype), flat in self.flat_buffers(params=params).items():
            for name in self.codecs:
                self._slots[(name, ptype, dtype)] = self._new_slot(name=name, flat=flat)

    def _new_slot(self, *, name: str, flat: torch.Tensor) -> tuple:
        """(codec, sender state describing ``flat``, payload buffer that can never overflow)."""
        codec = make_codec(name, dtype=flat.dtype, numel=flat.numel(), block_size=self.block_size)
        out = torch.empty(codec.clamp_capacity(codec.max_bytes), dtype=torch.uint8)
        return codec, codec.new_state(shard=flat), out

    def encode(self, *, params: dict[str, torch.Tensor], counts: dict[str, TypeCounts]) -> None:
        """Encode ``params`` against the state and add raw / wire bytes to ``counts`` per type.

        A buffer whose shape changed since the last snapshot restarts its codecs (no bytes counted).
        """
        for (ptype, dtype), flat in self.flat_buffers(params=params).items():
            for name in self.codecs:
                slot = self._slots.get((name, ptype, dtype))
                if slot is None or slot[0].numel != flat.numel():
                    self._slots[(name, ptype, dtype)] = self._new_slot(name=name, flat=flat)
                    continue
                codec, state, out = slot
                codec.encode(shard=flat, state=state, out=out)
                needed = PayloadHeader(read_headers(out.view(1, -1))[0]).needed
                acc = counts.setdefault(ptype, TypeCounts()).codec_bytes.setdefault(name, [0, 0])
                acc[0] += codec.raw_bytes
                acc[1] += needed


# ----------------------------------------------------------------------------------------------
# Snapshot sources
# ----------------------------------------------------------------------------------------------


def list_snapshots(*, snapshot_dir: Path, first: int = 0, last: int | None = None) -> list[tuple[int, Path]]:
    """``(iteration, path)`` of every ``iter_<N>.pt`` in ``snapshot_dir`` with ``first <= N <= last``,
    by iteration."""
    found = []
    for p in Path(snapshot_dir).iterdir():
        m = SNAPSHOT_RE.match(p.name)
        if m and first <= int(m.group(1)) and (last is None or int(m.group(1)) <= last):
            found.append((int(m.group(1)), p))
    if len(found) < 2:
        raise SystemExit(f"exponent_stats: {snapshot_dir} holds {len(found)} iter_<N>.pt snapshots at iterations "
                         f"{first}..{'' if last is None else last}; need >= 2")
    return sorted(found)


def load_snapshot(*, path: Path) -> dict[str, torch.Tensor]:
    """One snapshot file: a dict {parameter name: tensor}, loaded on the CPU."""
    obj = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise SystemExit(f"exponent_stats: {path} is not a dict of parameter name -> tensor")
    return obj


def file_snapshots(*, paths: list[tuple[int, Path]]) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """The snapshots ``paths`` lists (from :func:`list_snapshots`), loaded one at a time."""
    for it, path in paths:
        yield it, load_snapshot(path=path)


SYNTHETIC_PARAMS = {
    # name: (values, init std); "norm" entries start at exactly 1.0 like RMSNorm weights.
    "embedding.word_embeddings.weight": (8, 0.02),
    "decoder.layers.0.input_layernorm.weight": (1 / 64, None),
    "decoder.layers.0.self_attention.linear_qkv.weight": (3, 0.02),
    "decoder.layers.0.self_attention.linear_proj.weight": (1, 0.02),
    "decoder.layers.0.pre_mlp_layernorm.weight": (1 / 64, None),
    "decoder.layers.0.mlp.router.weight": (1 / 16, 0.02),
    "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight": (4, 0.02),
    "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight": (2, 0.02),
    "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight": (4, 0.02),
    "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight": (2, 0.02),
    "decoder.layers.0.mlp.shared_experts.linear_fc1.weight": (4, 0.02),
    "decoder.layers.0.mlp.shared_experts.linear_fc2.weight": (2, 0.02),
    "decoder.final_layernorm.weight": (1 / 64, None),
    "output_layer.weight": (8, 0.02),
}
"""Fake parameters of ``--synthetic``: sizes in units of ``--synthetic-numel`` values."""


def synthetic_snapshots(
    *, iters: int, lr: float, unit: int, dtype: torch.dtype, seed: int
) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """Snapshots 0..iters of :class:`ciera.testing.trajectory.AdamTrajectory` parameters, one per step.

    Norm weights start at exactly 1.0; the other parameters use AdamTrajectory's own mix
    (normal weights, a slice at 1.0, a slice of zeros). Types differ only in size and init here:
    the gradients are the trajectory's noise, not a model's.
    """
    trajs = {}
    for i, (name, (size, std)) in enumerate(SYNTHETIC_PARAMS.items()):
        traj = AdamTrajectory(numel=max(1, int(size * unit)), dtype=dtype, lr=lr,
                              init_std=std or 0.02, seed=seed * 1000 + i)
        if std is None:
            traj.master.fill_(1.0)
        trajs[name] = traj
    yield 0, {n: t.current() for n, t in trajs.items()}
    for it in range(1, iters + 1):
        yield it, {n: t.step() for n, t in trajs.items()}


# ----------------------------------------------------------------------------------------------
# The measurement loop
# ----------------------------------------------------------------------------------------------


def cast_params(*, params: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Float parameters only, cast to ``dtype`` when given (the view the stats are taken in)."""
    out = {}
    for name, t in params.items():
        if not t.is_floating_point():
            continue
        t = t.detach()
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        if t.dtype not in FORMATS:
            raise SystemExit(f"exponent_stats: {name} is {t.dtype}; pass --dtype bf16|fp16|fp32 to view it")
        out[name] = t
    return out


def measure_transition(
    *, prev: dict[str, torch.Tensor], cur: dict[str, torch.Tensor], block_sizes: tuple[int, ...],
    probe: CodecProbe | None,
) -> tuple[dict[str, TypeCounts], list[str]]:
    """Counts per type (plus :data:`ALL`) from ``prev`` to ``cur``, and names that were skipped."""
    counts: dict[str, TypeCounts] = {}
    skipped = []
    for name in sorted(cur):
        old = prev.get(name)
        if old is None or old.shape != cur[name].shape or old.dtype != cur[name].dtype:
            skipped.append(name)
            continue
        counts.setdefault(classify_param(name), TypeCounts()).add_tensor(
            prev=old, cur=cur[name], block_sizes=block_sizes)
    if probe is not None:
        probe.encode(params=cur, counts=counts)
    for c in counts.values():
        c.finish()
    counts[ALL] = pool_counts(parts=list(counts.values()))
    return counts, skipped


class Progress:
    """Progress on stderr, at most one line every ``every`` seconds, plus the last one."""

    def __init__(self, *, total: int | None, every: float = 2.0, quiet: bool = False):
        self.total, self.every, self.quiet = total, every, quiet
        self.start = self.last = time.monotonic()

    def update(self, *, done: int, iteration: int) -> None:
        now = time.monotonic()
        final = self.total is not None and done >= self.total
        if self.quiet or (now - self.last < self.every and not final):
            return
        self.last = now
        elapsed = now - self.start
        msg = f"exponent_stats: {done}"
        if self.total:
            left = elapsed / done * (self.total - done)
            msg += f"/{self.total} transitions, iteration {iteration}, {elapsed:.1f} s, ~{left:.0f} s left"
        else:
            msg += f" transitions, iteration {iteration}, {elapsed:.1f} s"
        print(msg, file=sys.stderr, flush=True)


def run_stats(
    *, snapshots: Iterator[tuple[int, dict[str, torch.Tensor]]], total: int | None,
    block_sizes: tuple[int, ...], codecs: list[str], codec_block_size: int | None,
    dtype: torch.dtype | None, quiet: bool = False,
) -> dict:
    """Walk the snapshots; return ``{"iterations": [...], "types": {...}, "skipped": [...]}``.

    Each entry of ``iterations`` is one transition: ``iteration``, ``prev_iteration`` and the
    per-type figures of :meth:`TypeCounts.rates`.
    """
    probe = CodecProbe(codecs=codecs, block_size=codec_block_size) if codecs else None
    progress = Progress(total=total, quiet=quiet)
    prev_it, prev, rows, skipped, shapes = None, None, [], set(), {}
    for it, params in snapshots:
        params = cast_params(params=params, dtype=dtype)
        if prev is None:
            if probe is not None:
                probe.prime(params=params)
        else:
            counts, skip = measure_transition(prev=prev, cur=params, block_sizes=block_sizes, probe=probe)
            skipped.update(skip)
            rows.append({"iteration": it, "prev_iteration": prev_it,
                         "types": {k: c.rates() for k, c in counts.items()}})
            progress.update(done=len(rows), iteration=it)
        for name, t in params.items():
            shapes[name] = (classify_param(name), t.numel(), str(t.dtype).replace("torch.", ""))
        prev_it, prev = it, params
    types = {}
    for name, (ptype, numel, dt) in shapes.items():
        entry = types.setdefault(ptype, {"params": 0, "values": 0, "dtypes": []})
        entry["params"] += 1
        entry["values"] += numel
        if dt not in entry["dtypes"]:
            entry["dtypes"].append(dt)
    return {"iterations": rows, "types": types, "skipped": sorted(skipped)}


def intervals_of(*, rows: list[dict]) -> list[int]:
    """Distinct iteration gaps between consecutive snapshots."""
    return sorted({r["iteration"] - r["prev_iteration"] for r in rows})


def summarize(*, rows: list[dict], warmup: int) -> dict[str, dict]:
    """Per type, averages over the transitions whose earlier snapshot is at iteration >= ``warmup``.

    Rates and entropies: mean over transitions. Codec ratios: total raw / total wire bytes.
    """
    kept = [r for r in rows if r["prev_iteration"] >= warmup]
    out: dict[str, dict] = {}
    for ptype in [*PARAM_TYPES, ALL]:
        per = [r["types"][ptype] for r in kept if ptype in r["types"]]
        if not per:
            continue
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        codec_names = sorted({k for p in per for k in p["codec_bytes"]})
        ratios = {}
        for k in codec_names:
            raw = sum(p["codec_bytes"][k]["raw"] for p in per if k in p["codec_bytes"])
            wire = sum(p["codec_bytes"][k]["wire"] for p in per if k in p["codec_bytes"])
            ratios[k] = raw / wire if wire else float("nan")
        out[ptype] = {
            "transitions": len(per),
            "values": per[-1]["values"],
            "exp_changed": mean([p["exp_changed"] for p in per]),
            "value_changed": mean([p["value_changed"] for p in per]),
            "sign_changed": mean([p["sign_changed"] for p in per]),
            "block_changed": {b: mean([p["block_changed"][b] for p in per]) for b in per[0]["block_changed"]},
            "xor_entropy_bits": mean([p["xor_entropy_bits"] for p in per]),
            "delta_entropy_bits": mean([p["delta_entropy_bits"] for p in per]),
            "codec_ratio": ratios,
        }
    return out


# ----------------------------------------------------------------------------------------------
# Reporting
# ----------------------------------------------------------------------------------------------


def _pct(x: float) -> str:
    """A fraction as a percentage: two decimals, two significant digits below 0.01%."""
    return f"{100 * x:.2f}%" if x >= 1e-4 or x == 0 else f"{100 * x:.2g}%"


def interval_note(*, rows: list[dict]) -> str:
    """'per iteration' or 'per k iterations' (or the spread when the interval varies)."""
    gaps = intervals_of(rows=rows)
    if gaps == [1]:
        return "per iteration"
    if len(gaps) == 1:
        return f"per {gaps[0]} iterations (snapshot interval {gaps[0]})"
    return f"per snapshot interval (interval varies: {gaps[0]}..{gaps[-1]} iterations)"


def markdown_table(*, summary: dict[str, dict], types: dict[str, dict], rows: list[dict], warmup: int) -> str:
    """The summary as a markdown table, with a caption saying what the rates are per."""
    if not summary:
        return f"No transition after the warmup (iteration >= {warmup}); lower --warmup.\n"
    first = next(iter(summary.values()))
    bs = list(first["block_changed"])
    codecs = list(first["codec_ratio"])
    head = (["type", "params", "values", "exp changed", "value changed", "sign flips"]
            + [f"B={b} blocks" for b in bs] + ["XOR entropy (bits/value)", "H(delta given exp) (bits/value)"]
            + [f"{c} ratio" for c in codecs])
    lines = [
        f"Rates {interval_note(rows=rows)}, mean over {first['transitions']} transitions from iteration "
        f">= {warmup} (of {len(rows)}); codec ratio = raw bytes / wire bytes summed over those transitions.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for ptype, s in summary.items():
        n_params = sum(t["params"] for t in types.values()) if ptype == ALL else types.get(ptype, {}).get("params", 0)
        cells = [ptype, str(n_params), str(s["values"]), _pct(s["exp_changed"]), _pct(s["value_changed"]),
                 _pct(s["sign_changed"])]
        cells += [_pct(s["block_changed"][b]) for b in bs]
        cells += [f"{s['xor_entropy_bits']:.3f}", f"{s['delta_entropy_bits']:.3f}"] + [f"{s['codec_ratio'].get(c, float('nan')):.3f}x" for c in codecs]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_plots(*, out_dir: Path, rows: list[dict], summary: dict[str, dict], note: str, warmup: int,
                source: str) -> list[Path]:
    """change_rates.png, block_rates.png and codec_ratio.png in ``out_dir``; their paths.

    Every title says what is plotted and on what (``source``); legends sit below the panels, off the
    data. Time series mark the end of ``warmup`` with a dotted line when it falls inside the run."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    def titled(fig, what: str) -> None:
        fig.suptitle(what + "\n" + textwrap.fill(source, width=110), fontsize=10)

    def legend_below(fig, ax) -> None:
        handles, labels = ax.get_legend_handles_labels()
        if show_warmup:
            handles.append(Line2D([], [], color="grey", ls=":", lw=1))
            labels.append(f"end of warmup (iteration {warmup})")
        if handles:
            fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 4), fontsize=8,
                       frameon=False)

    # "all" first, drawn as a wide pale band underneath; each type on top with its own marker, so a
    # type that runs along the mean stays visible.
    ptypes = [t for t in [ALL, *PARAM_TYPES] if any(t in r["types"] for r in rows)]
    its = lambda t: [r["iteration"] for r in rows if t in r["types"]]  # noqa: E731
    series = lambda t, f: [f(r["types"][t]) for r in rows if t in r["types"]]  # noqa: E731
    markers = dict(zip(PARAM_TYPES, "os^vD<>pPX*h"))

    def style(t: str) -> dict:
        if t == ALL:
            return {"color": "0.55", "lw": 5, "alpha": 0.45, "zorder": 1}
        return {"lw": 1.2, "marker": markers.get(t, "o"), "markersize": 3.5, "zorder": 2}
    show_warmup = bool(rows) and rows[0]["prev_iteration"] < warmup <= rows[-1]["iteration"]
    paths = []

    fig, axes = plt.subplots(3, 1, figsize=(9, 10), sharex=True, layout="constrained")
    panels = [("exponents changed (%)", lambda p: 100 * p["exp_changed"]),
              ("values changed (%)", lambda p: 100 * p["value_changed"]),
              ("entropy (bits/value): XOR solid,\nH(delta | exponent) dashed", lambda p: p["xor_entropy_bits"])]
    for ax, (label, f) in zip(axes, panels):
        for t in ptypes:
            ax.plot(its(t), series(t, f), label=t, **style(t))
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if show_warmup:
            ax.axvline(warmup, color="grey", ls=":", lw=1)
    for line, t in zip(axes[2].get_lines(), ptypes):
        axes[2].plot(its(t), series(t, lambda p: p["delta_entropy_bits"]), ls="--", color=line.get_color(),
                     lw=line.get_linewidth(), alpha=line.get_alpha(), zorder=line.get_zorder())
    axes[0].set_ylim(bottom=0)
    titled(fig, f"Parameter changes between snapshots, {note}, by parameter type")
    legend_below(fig, axes[0])
    axes[-1].set_xlabel("iteration")
    paths.append(out_dir / "change_rates.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 5.5), layout="constrained")
    for t, s in summary.items():
        bs = [int(b) for b in s["block_changed"]]
        ax.plot(bs, [100 * v for v in s["block_changed"].values()], label=t, **{"marker": "o", **style(t)})
    if ALL in summary:
        p = summary[ALL]["exp_changed"]
        bs = [int(b) for b in summary[ALL]["block_changed"]]
        ax.plot(bs, [100 * (1 - (1 - p) ** b) for b in bs], "k--", lw=1, label="all: 1-(1-p)^B (independent)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size B (values)")
    ax.set_ylabel("blocks with a changed exponent (%)")
    titled(fig, f"exponent_reuse: blocks of B values with a changed exponent, {note}, "
                f"mean from iteration {warmup} on")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    paths.append(out_dir / "block_rates.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    # raw's ratio is 1 by definition: no panel for it
    codecs = sorted({k for r in rows for p in r["types"].values() for k in p["codec_ratio"]} - {"raw"})
    fig, axes = plt.subplots(max(1, len(codecs)), 1, figsize=(9, 3 * max(1, len(codecs)) + 1.2), sharex=True,
                             squeeze=False, layout="constrained")
    for ax, c in zip(axes[:, 0], codecs):
        for t in ptypes:
            ax.plot(its(t), series(t, lambda p: p["codec_ratio"].get(c, float("nan"))), label=t, **style(t))
        ax.set_ylabel(f"{c}: raw / wire bytes (x)")
        ax.grid(alpha=0.3)
        if show_warmup:
            ax.axvline(warmup, color="grey", ls=":", lw=1)
    titled(fig, f"Codec compression ratio (raw bytes / wire bytes), {note}, by parameter type"
                + ("" if codecs else " (no codec run)"))
    if codecs:
        legend_below(fig, axes[0, 0])
    axes[-1, 0].set_xlabel("iteration")
    paths.append(out_dir / "codec_ratio.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def write_outputs(*, out_dir: Path, result: dict, summary: dict, table: str, meta: dict) -> list[Path]:
    """The markdown table, the JSON of every figure and the PNGs; their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "exponent_stats.md"
    md.write_text(f"# Exponent statistics\n\nSource: {meta['source']}; code {meta['code_version']}\n\n{table}")
    js = out_dir / "exponent_stats.json"
    js.write_text(json.dumps(_finite({"meta": meta, "types": result["types"], "summary": summary,
                              "iterations": result["iterations"], "skipped": result["skipped"]}),
                             indent=1, allow_nan=False))
    return [md, js, *write_plots(out_dir=out_dir, rows=result["iterations"], summary=summary,
                                 note=interval_note(rows=result["iterations"]), warmup=meta["warmup"],
                                 source=meta["source"])]


def code_version() -> str:
    """``git describe`` of the checkout this tool runs from (codecs evolve; tables should say which
    ran), or ``unknown`` outside a git checkout."""
    import subprocess

    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def _finite(x):
    """``x`` with every NaN / Inf float replaced by None, so the JSON stays standard."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--snapshot-dir", type=Path, help="directory of iter_<N>.pt snapshots")
    src.add_argument("--synthetic", action="store_true", help="generate snapshots from AdamTrajectory")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="view every parameter in this dtype (cast); default: as stored")
    p.add_argument("--block-sizes", default=",".join(map(str, DEFAULT_BLOCK_SIZES)),
                   help="comma-separated B values for the block-change rates (default %(default)s)")
    p.add_argument("--warmup", type=int, default=0,
                   help="average only transitions from snapshots at iteration >= this (default 0)")
    p.add_argument("--codecs", default="all",
                   help="comma-separated codec names, 'all' (every registered codec) or 'none'")
    p.add_argument("--codec-block-size", type=int, default=None, help="block_size for the codecs (default: theirs)")
    p.add_argument("--out-dir", type=Path, default=None, help="write exponent_stats.{md,json} and PNGs here")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--iterations", default=":", metavar="FIRST:LAST",
                   help="--snapshot-dir: read only snapshots at iterations FIRST..LAST (inclusive; "
                        "either may be omitted)")
    g = p.add_argument_group("--synthetic")
    g.add_argument("--lr", type=float, default=1e-4)
    g.add_argument("--iters", type=int, default=100, help="AdamW steps (default %(default)s)")
    g.add_argument("--synthetic-numel", type=int, default=16384,
                   help="size unit of the fake parameters; ~38 units in all (default %(default)s)")
    g.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.block_sizes = tuple(sorted({int(b) for b in args.block_sizes.split(",") if b.strip()}))
    if not args.block_sizes or min(args.block_sizes) < 1:
        p.error(f"--block-sizes {args.block_sizes} must be positive integers")
    if args.codecs == "all":
        args.codecs = available_codecs()
    elif args.codecs == "none":
        args.codecs = []
    else:
        args.codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
        unknown = sorted(set(args.codecs) - set(available_codecs()))
        if unknown:
            p.error(f"unknown codecs {unknown}; registered: {available_codecs()}")
    try:
        first, last = args.iterations.split(":")
        args.first, args.last = int(first or 0), (int(last) if last else None)
    except ValueError:
        p.error(f"--iterations {args.iterations!r}: expected FIRST:LAST, e.g. 30:130 or :500")
    if args.synthetic and args.iters < 1:
        p.error(f"--iters {args.iters} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run the tool; returns the summary (for tests)."""
    args = parse_args(argv)
    dtype = DTYPES[args.dtype] if args.dtype else None
    if args.synthetic:
        snaps = synthetic_snapshots(iters=args.iters, lr=args.lr, unit=args.synthetic_numel,
                                    dtype=dtype or torch.bfloat16, seed=args.seed)
        total, source = args.iters, (f"synthetic AdamTrajectory, lr {args.lr:g}, {args.iters} steps, "
                                     f"unit {args.synthetic_numel} values, seed {args.seed}")
    else:
        paths = list_snapshots(snapshot_dir=args.snapshot_dir, first=args.first, last=args.last)
        total, snaps = len(paths) - 1, file_snapshots(paths=paths)
        source = f"snapshots in {args.snapshot_dir}, iterations {paths[0][0]}..{paths[-1][0]}"
    result = run_stats(snapshots=snaps, total=total, block_sizes=args.block_sizes, codecs=args.codecs,
                       codec_block_size=args.codec_block_size, dtype=dtype, quiet=args.quiet)
    summary = summarize(rows=result["iterations"], warmup=args.warmup)
    table = markdown_table(summary=summary, types=result["types"], rows=result["iterations"], warmup=args.warmup)
    print(table, end="")
    if result["skipped"]:
        print(f"skipped (missing, reshaped or retyped between snapshots): {result['skipped']}", file=sys.stderr)
    if args.out_dir is not None:
        meta = {"source": source, "interval": interval_note(rows=result["iterations"]),
                "intervals": intervals_of(rows=result["iterations"]), "warmup": args.warmup,
                "block_sizes": list(args.block_sizes), "codecs": args.codecs,
                "codec_block_size": args.codec_block_size, "dtype": args.dtype or "as stored",
                "code_version": code_version(), "torch": torch.__version__}
        for path in write_outputs(out_dir=args.out_dir, result=result, summary=summary, table=table, meta=meta):
            print(f"wrote {path}", file=sys.stderr)
    return summary


if __name__ == "__main__":
    main()
