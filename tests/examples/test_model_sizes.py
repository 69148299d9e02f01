"""The parameter counts and memory figures in examples/README.md: one closed-form count, checked
against the model pretrain_gpt.py really builds (TINY widths, every model's layout), then used to
recompute the README's table at the published widths."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from ciera.testing import free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
MODELS = ("olmoe", "deepseek", "qwen2", "minicpm", "mixtral", "scout")
README_NAMES = {"olmoe": "OLMoE-1B-7B", "deepseek": "DeepSeek-MoE-16B", "qwen2": "Qwen2-57B-A14B",
                "minicpm": "MiniCPM-MoE-8x2B", "mixtral": "Mixtral-8x7B", "scout": "Llama-4-Scout-17B-16E"}


@dataclass(frozen=True)
class Arch:
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    experts: int
    topk: int
    moe_ffn: int
    shared_ffn: int
    vocab: int
    tied: bool
    dense_layers: int

    @classmethod
    def from_script(cls, model: str) -> "Arch":
        text = (EXAMPLES / model / f"train_{model}.sh").read_text()
        v = {k.lower(): int(x) for k, x in re.findall(r"^MODEL_([A-Z_]+)=(\d+)$", text, re.M)}
        return cls(v["layers"], v["hidden"], v["ffn"], v["heads"], v["kv_heads"], v["experts"], v["topk"],
                   v["moe_ffn"], v["shared_ffn"], v["vocab"], bool(v["tied"]), v["dense_layers"])


@dataclass(frozen=True)
class Count:
    total: int
    active: int
    routed: int  # routed-expert parameters (split EP ways, sharded over world / EP)

    @property
    def non_expert(self) -> int:
        return self.total - self.routed


def count_params(arch: Arch, num_layers: int) -> Count:
    """Bias-free SwiGLU GPT with RMSNorm: embedding (+ untied output), per layer 2 norms, QKV and
    output projections, a dense SwiGLU MLP or a router + routed experts + shared expert; final norm.
    The vocabulary is padded to a multiple of 128 as Megatron does."""
    h, d = arch.hidden, arch.hidden // arch.heads
    vocab = -(-arch.vocab // 128) * 128
    embed = vocab * h * (1 if arch.tied else 2) + h
    attention = h * (arch.heads * d + 2 * arch.kv_heads * d) + arch.heads * d * h + 2 * h
    expert = 3 * h * arch.moe_ffn
    dense = min(arch.dense_layers, num_layers)
    moe = num_layers - dense
    routed = moe * arch.experts * expert
    non_expert = embed + num_layers * attention + dense * 3 * h * arch.ffn + moe * (arch.experts * h + 3 * h * arch.shared_ffn)
    return Count(non_expert + routed, non_expert + moe * arch.topk * expert, routed)


def memory_gib(count: Count, *, world: int, ep: int) -> float:
    """Parameters + gradients + Adam with the distributed optimizer, per GPU: 2 B bf16 parameter,
    4 B fp32 gradient, 12 B / (data-parallel shards) fp32 master + Adam m and v."""
    dense = count.non_expert * (2 + 4 + 12 / world)
    experts = count.routed / ep * (2 + 4 + 12 / (world // ep))
    return (dense + experts) / 2**30


_COUNT_IN_MEGATRON = r"""
import json, sys
from megatron.ciera.app import arguments, data, model as model_lib, parallel
args = arguments.parse_args(json.loads(sys.argv[1]))
parallel.initialize(args)
vocab = data.padded_vocab_size(data.build_tokenizer(args).vocab_size, args.make_vocab_size_divisible_by)
model = model_lib.build_model_chunks(args, model_lib.transformer_config(args), vocab)[0]
print(json.dumps({"total": sum(p.numel() for p in model.parameters()),
                  "routed": sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)}))
"""


# DeepSeek (dense first layer, shared experts) runs by default; the rest with --runslow.
@pytest.mark.parametrize(
    "model", [m if m == "deepseek" else pytest.param(m, marks=pytest.mark.slow) for m in MODELS]
)
def test_count_matches_the_model_pretrain_gpt_builds(model):
    env = {k: v for k, v in os.environ.items() if k not in ("FULL_DEPTH", "CIERA", "DATA_PATH", "TOKENIZER",
                                                             "NUM_LAYERS", "VOCAB_SIZE", "EP")}
    proc = subprocess.run(["bash", str(EXAMPLES / model / f"train_{model}.sh")],
                          env=dict(env, DRY_RUN="1", TINY="1", PYTHON=sys.executable),
                          capture_output=True, text=True, timeout=60, check=True)
    words = shlex.split(proc.stdout)
    argv = words[next(i for i, w in enumerate(words) if w.endswith("pretrain_gpt.py")) + 1 :]
    proc = subprocess.run(
        [sys.executable, "-c", _COUNT_IN_MEGATRON, json.dumps(argv)],
        env=dict(os.environ, WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(free_port()), PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore"),
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    built = json.loads(proc.stdout.strip().splitlines()[-1])
    full = Arch.from_script(model)
    tiny = Arch(layers=2, hidden=64, ffn=128, heads=4, kv_heads=2 if full.kv_heads < full.heads else 4,
                experts=min(full.experts, 16), topk=full.topk, moe_ffn=128,
                shared_ffn=128 if full.shared_ffn else 0, vocab=512, tied=full.tied, dense_layers=full.dense_layers)
    expected = count_params(tiny, 2)
    assert (built["total"], built["routed"]) == (expected.total, expected.routed)


def _readme_rows() -> dict[str, list[str]]:
    rows = {}
    for line in (EXAMPLES / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        for model, name in README_NAMES.items():
            if cells and cells[0] == name:
                rows[model] = cells
    return rows


def _billions(cell: str) -> tuple[float, float]:
    total, active = re.fullmatch(r"([\d.]+)B / ([\d.]+)B", cell).groups()
    return float(total), float(active)


@pytest.mark.parametrize("model", MODELS)
def test_readme_table_matches_the_count(model):
    arch = Arch.from_script(model)
    row = _readme_rows()[model]
    four, full = count_params(arch, 4), count_params(arch, arch.layers)
    assert _billions(row[1]) == (round(four.total / 1e9, 2), round(four.active / 1e9, 2))
    assert _billions(row[2]) == (round(full.total / 1e9, 2), round(full.active / 1e9, 2))
    assert row[3] == f"{100 * full.routed / full.total:.0f}%"
    assert float(row[4]) == round(memory_gib(four, world=8, ep=1), 1)
    assert float(row[5]) == round(memory_gib(four, world=16, ep=1), 1)
    for cell, world in ((row[6], 16), (row[7], 64)):
        for value, ep in re.findall(r"([\d.]+) \(EP=(\d+)\)", cell):
            assert float(value) == round(memory_gib(full, world=world, ep=int(ep)), 1), (cell, ep)
