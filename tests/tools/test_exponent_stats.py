"""tools/exponent_stats.py: hand-built trajectories give the rates computed by hand; the CLI writes
its table, JSON and PNGs from snapshot files and from synthetic trajectories."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from ciera.codecs import make_codec

TOOL = Path(__file__).resolve().parents[2] / "tools" / "exponent_stats.py"


@pytest.fixture(scope="module")
def es():
    spec = importlib.util.spec_from_file_location("exponent_stats", TOOL)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the file executes
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


BF16 = torch.bfloat16


def _transition(es, prev, cur, block_sizes=(4, 64, 1024), codecs=None, codec_block_size=None):
    probe = None
    if codecs:
        probe = es.CodecProbe(codecs=codecs, block_size=codec_block_size)
        probe.prime(params=prev)
    counts, skipped = es.measure_transition(prev=prev, cur=cur, block_sizes=block_sizes, probe=probe)
    return {k: c.rates() for k, c in counts.items()}, skipped


# -- classification ----------------------------------------------------------------------------

@pytest.mark.parametrize("name, expected", [
    ("decoder.layers.0.self_attention.linear_qkv.weight", "attention"),
    ("decoder.layers.3.self_attention.linear_proj.weight", "attention"),
    ("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", "norm"),
    ("decoder.layers.0.self_attention.q_layernorm.weight", "norm"),
    ("decoder.layers.0.input_layernorm.weight", "norm"),
    ("decoder.layers.0.pre_mlp_layernorm.weight", "norm"),
    ("decoder.final_layernorm.weight", "norm"),
    ("decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight", "expert_ffn"),
    ("decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight", "expert_ffn"),
    ("decoder.layers.0.mlp.experts.linear_fc1.weight0", "expert_ffn"),
    ("decoder.layers.0.mlp.experts.linear_fc2.weight7", "expert_ffn"),
    ("decoder.layers.0.mlp.shared_experts.linear_fc1.weight", "shared_expert"),
    ("decoder.layers.0.mlp.shared_experts.linear_fc2.weight", "shared_expert"),
    ("decoder.layers.0.mlp.router.weight", "router"),
    ("decoder.layers.0.mlp.router.expert_bias", "router"),
    ("embedding.word_embeddings.weight", "embedding"),
    ("output_layer.weight", "embedding"),
    ("module.module.decoder.layers.1.mlp.router.weight", "router"),
    ("decoder.layers.0.mlp.linear_fc1.weight", "other"),
])
def test_classify_param(es, name, expected):
    assert es.classify_param(name) == expected


# -- known trajectories ------------------------------------------------------------------------

def test_zero_change_is_zero_everywhere(es):
    g = torch.Generator().manual_seed(0)
    snap = {"decoder.layers.0.self_attention.linear_qkv.weight": (torch.randn(300, generator=g) * 0.02).to(BF16),
            "decoder.layers.0.input_layernorm.weight": torch.ones(64, dtype=BF16)}
    rates, skipped = _transition(es, snap, {k: v.clone() for k, v in snap.items()})
    assert not skipped
    for ptype in ("attention", "norm", "all"):
        r = rates[ptype]
        assert r["exp_changed"] == r["value_changed"] == r["sign_changed"] == 0
        assert all(v == 0 for v in r["block_changed"].values())
        assert r["xor_entropy_bits"] == 0.0 and r["delta_entropy_bits"] == 0.0


def test_sign_flips_change_values_not_exponents(es):
    x = torch.linspace(0.01, 2.0, 256).to(BF16)
    rates, _ = _transition(es, {"output_layer.weight": x}, {"output_layer.weight": -x})
    r = rates["embedding"]
    assert r["value_changed"] == 1.0 and r["sign_changed"] == 1.0
    assert r["exp_changed"] == 0 and all(v == 0 for v in r["block_changed"].values())
    assert r["xor_entropy_bits"] == 0.0  # every XOR is the sign bit: one pattern
    assert r["delta_entropy_bits"] == 0.0  # and every difference is 0x8000 mod 2^16


def test_known_exponent_changes_and_blocks(es):
    """1024 values of 1.5; four doubled (exponent + 1) at indices 0, 197, 198, 900.

    B=4: blocks 0, 49, 225 of 256. B=64: blocks 0, 3, 14 of 16. B=1024: the one block.
    XOR: 1.5 = 0x3FC0, 3.0 = 0x4040, so four values XOR to 0x7F80 and 1020 to 0.
    """
    prev = torch.full((1024,), 1.5, dtype=BF16)
    cur = prev.clone()
    cur[[0, 197, 198, 900]] = 3.0
    norm = torch.ones(256, dtype=BF16)
    rates, _ = _transition(es, {"decoder.layers.0.mlp.experts.linear_fc1.weight0": prev,
                                "decoder.final_layernorm.weight": norm},
                           {"decoder.layers.0.mlp.experts.linear_fc1.weight0": cur,
                            "decoder.final_layernorm.weight": norm.clone()})
    r = rates["expert_ffn"]
    assert r["exp_changed"] == 4 / 1024 and r["value_changed"] == 4 / 1024 and r["sign_changed"] == 0
    assert r["block_changed"] == {"4": 3 / 256, "64": 3 / 16, "1024": 1.0}
    p = 4 / 1024
    assert r["xor_entropy_bits"] == pytest.approx(-(p * math.log2(p) + (1 - p) * math.log2(1 - p)), abs=1e-12)
    assert r["delta_entropy_bits"] == pytest.approx(r["xor_entropy_bits"], abs=1e-12)  # one exponent: same split
    # Pooled with the unchanged 256-value norm: counts add, the norm's blocks add unchanged blocks.
    a = rates["all"]
    assert a["exp_changed"] == 4 / 1280
    assert a["block_changed"] == {"4": 3 / (256 + 64), "64": 3 / (16 + 4), "1024": 1 / 2}
    q = 4 / 1280
    assert a["xor_entropy_bits"] == pytest.approx(-(q * math.log2(q) + (1 - q) * math.log2(1 - q)), abs=1e-12)


def test_every_tenth_exponent_in_known_blocks_with_a_short_tail(es):
    """700 values of -0.75; every 10th of the first 320 halves (exponent - 1): 10% of those, in
    B=64 blocks 0..4; the last value (index 699) changes too, in the short tail block (700 values:
    11 blocks of 64, 6 of 128). 33 changes in all."""
    prev = torch.full((700,), -0.75, dtype=BF16)
    cur = prev.clone()
    idx = torch.arange(0, 320, 10)
    cur[idx] = -0.375
    cur[699] = -0.375
    rates, _ = _transition(es, {"decoder.layers.0.mlp.router.weight": prev},
                           {"decoder.layers.0.mlp.router.weight": cur}, block_sizes=(64, 128))
    r = rates["router"]
    assert r["exp_changed"] == 33 / 700
    assert r["block_changed"] == {"64": 6 / 11, "128": 4 / 6}  # 128-blocks 0, 1, 2 (to 383) and 5


def test_real_codec_wire_bytes(es):
    """Wire bytes come from the codec header: exponent_reuse at B=8 sends its fixed part plus
    one B-byte exponent slot per changed block."""
    prev = torch.full((1024,), 1.5, dtype=BF16)
    cur = prev.clone()
    cur[[0, 197, 198, 900]] = 3.0  # B=8 blocks 0, 24, 112: three slots
    name = "decoder.layers.0.self_attention.linear_proj.weight"
    rates, _ = _transition(es, {name: prev}, {name: cur}, codecs=["exponent_reuse", "raw"], codec_block_size=8)
    codec = make_codec("exponent_reuse", dtype=BF16, numel=1024, block_size=8)
    assert rates["attention"]["codec_bytes"]["exponent_reuse"] == {"raw": 2048, "wire": codec.fixed_bytes + 3 * 8}
    raw = make_codec("raw", dtype=BF16, numel=1024)
    assert rates["attention"]["codec_ratio"]["raw"] == 2048 / raw.fixed_bytes
    assert rates["all"]["codec_bytes"] == rates["attention"]["codec_bytes"]


def test_delta_entropy_uses_the_previous_exponent(es):
    """1.5 (0x3FC0) steps up one ulp, 0.375 (0x3EC0) two ulps: XORs 1 and 2, half each (1 bit);
    the arithmetic delta is fixed by the previous exponent (0 bits given the exponent)."""
    prev = torch.tensor([1.5, 0.375] * 50, dtype=BF16)
    cur = torch.tensor([1.5078125, 0.37890625] * 50, dtype=BF16)
    bits = lambda t: es.to_unsigned(es.as_bits(t))  # noqa: E731
    assert set((bits(cur) - bits(prev)).tolist()) == {1, 2}
    rates, _ = _transition(es, {"output_layer.weight": prev}, {"output_layer.weight": cur})
    assert rates["embedding"]["xor_entropy_bits"] == pytest.approx(1.0)
    assert rates["embedding"]["delta_entropy_bits"] == pytest.approx(0.0, abs=1e-12)


def test_histogram_merge_and_entropy(es):
    h1 = es.histogram(keys=torch.tensor([0, 1, 2, 3], dtype=torch.int32))
    h2 = es.histogram(keys=torch.tensor([1 << 20, 1 << 20], dtype=torch.int64))  # wide (fp32) patterns
    assert es.entropy_bits(hist=h1) == pytest.approx(2.0)
    merged = es.merge_histograms(hists=[h1, h2])
    assert merged[1].sum() == 6
    assert es.entropy_bits(hist=merged) == pytest.approx(-(4 * (1 / 6) * math.log2(1 / 6) + (1 / 3) * math.log2(1 / 3)))


def test_missing_and_reshaped_params_are_skipped(es):
    a = torch.ones(8, dtype=BF16)
    rates, skipped = _transition(es, {"x.weight": a, "y.weight": a},
                                 {"x.weight": a.clone(), "y.weight": torch.ones(9, dtype=BF16), "z.weight": a})
    assert skipped == ["y.weight", "z.weight"]
    assert rates["other"]["values"] == 8


# -- command line ------------------------------------------------------------------------------

def _write_snapshots(d: Path, iterations, numel=512):
    g = torch.Generator().manual_seed(1)
    base = {"decoder.layers.0.self_attention.linear_qkv.weight": torch.randn(numel, generator=g) * 0.02,
            "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight": torch.randn(numel, generator=g) * 0.02,
            "decoder.layers.0.input_layernorm.weight": torch.ones(64)}
    for k, it in enumerate(iterations):
        snap = {n: (v + 1e-3 * k * torch.randn(v.shape, generator=g)).to(BF16) for n, v in base.items()}
        torch.save(snap, d / f"iter_{it:07d}.pt")


def test_cli_on_snapshot_files(es, tmp_path, capsys):
    snaps, out = tmp_path / "snaps", tmp_path / "out"
    snaps.mkdir()
    _write_snapshots(snaps, [100, 101, 102, 103])
    summary = es.main(["--snapshot-dir", str(snaps), "--warmup", "101", "--out-dir", str(out), "--quiet",
                       "--codecs", "raw,exponent_reuse"])
    table = capsys.readouterr().out
    assert "Rates per iteration, mean over 2 transitions" in table
    assert "| expert_ffn | 1 | 512 |" in table and "exponent_reuse ratio" in table
    assert summary["norm"]["transitions"] == 2
    for png in ("change_rates.png", "block_rates.png", "codec_ratio.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert table in (out / "exponent_stats.md").read_text()
    data = json.loads((out / "exponent_stats.json").read_text())
    assert data["meta"]["intervals"] == [1] and data["meta"]["code_version"]
    assert [r["iteration"] for r in data["iterations"]] == [101, 102, 103]
    assert set(data["iterations"][0]["types"]) == {"attention", "expert_ffn", "norm", "all"}


def test_cli_reports_interval(es, tmp_path, capsys):
    _write_snapshots(tmp_path, [0, 5, 10])
    es.main(["--snapshot-dir", str(tmp_path), "--quiet", "--codecs", "none", "--block-sizes", "64"])
    out = capsys.readouterr().out
    assert "Rates per 5 iterations (snapshot interval 5)" in out and "B=64 blocks" in out
    es.main(["--snapshot-dir", str(tmp_path), "--quiet", "--codecs", "none", "--iterations", "5:"])
    assert "mean over 1 transitions from iteration >= 0 (of 1)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        es.main(["--snapshot-dir", str(tmp_path), "--quiet", "--iterations", ":4"])  # one snapshot left


def test_cli_warmup_past_the_end(es, tmp_path, capsys):
    _write_snapshots(tmp_path, [0, 1])
    assert es.main(["--snapshot-dir", str(tmp_path), "--quiet", "--warmup", "5", "--codecs", "none"]) == {}
    assert "No transition after the warmup" in capsys.readouterr().out


def test_cli_synthetic(es, tmp_path, capsys):
    summary = es.main(["--synthetic", "--iters", "3", "--synthetic-numel", "256", "--lr", "3e-4", "--quiet",
                       "--out-dir", str(tmp_path)])
    assert set(summary) == {"attention", "expert_ffn", "shared_expert", "router", "norm", "embedding", "all"}
    assert 0 < summary["all"]["exp_changed"] < summary["all"]["value_changed"] < 1
    assert summary["norm"]["exp_changed"] == 0  # exactly 1.0 stays put for 3 small steps
    assert "delta ratio" in capsys.readouterr().out or "delta" not in summary["all"]["codec_ratio"]
    assert (tmp_path / "exponent_stats.json").exists()
