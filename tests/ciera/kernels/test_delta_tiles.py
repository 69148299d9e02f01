"""The tiled delta kernels (``ciera.codecs.delta.kernels``) against the pure-torch reference across many
tiles: full tiles (unmasked, the main launch) and a partial last tile (the second launch), the
decoupled look-back between tiles, repeated calls on the same cached scratch (epochs), overflow
(a prefix of blocks written), raw blocks, NaN/Inf and exceptions. Small tiles
(``_TILE_VALUES`` patched) keep the interpreter quick; one case runs the default tile."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from ciera.codecs.delta import DeltaCodec, decode_reference, encode_reference  # noqa: E402
from ciera.codecs.formats import as_bits  # noqa: E402
from ciera.testing.trajectory import AdamTrajectory, adversarial_step  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
GARBAGE = 0xA5


@pytest.fixture
def K():
    from triton.runtime.interpreter import InterpretedFunction

    mod = importlib.import_module("ciera.codecs.delta.kernels")
    if DEV == "cpu" and not isinstance(mod._decode_tiles, InterpretedFunction):
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("triton was imported without TRITON_INTERPRET")
        importlib.reload(importlib.import_module("ciera.kernels.lookback"))
        mod = importlib.reload(mod)
    yield mod
    mod._scratch_on.cache_clear()


def _check(K, codec, prev, new, capacity):
    outs, states, needs = [], [], []
    for impl in (encode_reference, K.encode_triton):
        out = torch.full((capacity,), GARBAGE, dtype=torch.uint8, device=DEV)
        state = as_bits(prev).clone()
        needs.append(int(impl(layout=codec.layout, shard_bits=as_bits(new), state=state, out=out)))
        outs.append(out)
        states.append(state)
    assert needs[0] == needs[1]
    diff = (outs[0] != outs[1]).nonzero().flatten()
    assert diff.numel() == 0, diff[:20].tolist()
    assert torch.equal(states[1], as_bits(new))
    if needs[0] <= capacity:
        # 32-bit word loads (aligned buffer) and, one byte longer, the byte-load path.
        for payload in (outs[0], torch.cat([outs[0], outs[0].new_zeros(1)])):
            target = as_bits(prev).clone()
            K.decode_triton(layout=codec.layout, payload=payload, target_bits=target)
            assert torch.equal(target, as_bits(new))
    return needs[0], outs[0]


@pytest.mark.parametrize("dtype,n,block,tile", [
    (torch.bfloat16, 1000, 8, 64),     # 15 full tiles of 8 blocks and a partial one
    (torch.float16, 1100, 64, 128),    # 2-block tiles, partial last block
    (torch.float32, 1024, 128, 256),   # full tiles only (no second launch), 32-bit words
    (torch.bfloat16, 777, 128, 256),   # one partial block, default block size
])
def test_tiles_match_reference(K, monkeypatch, dtype, n, block, tile):
    monkeypatch.setattr(K, "_TILE_VALUES", tile)
    K._scratch_on.cache_clear()
    gen = torch.Generator().manual_seed(n + block)
    codec = DeltaCodec(dtype=dtype, numel=n, block_size=block)
    tr = AdamTrajectory(numel=n, dtype=dtype, lr=3e-4, seed=block)
    x = tr.step()
    steps = [tr.step(), adversarial_step(x, kind="nan_inf", gen=gen, fraction=0.05),
             adversarial_step(x, kind="replace", gen=gen), tr.step()]
    cap = codec.clamp_capacity(codec.max_bytes)
    for y in steps:  # repeated calls: the cached scratch goes through several epochs
        x, y = x.to(DEV), y.to(DEV)
        needed, _ = _check(K, codec, x, y, cap)
        if needed > codec.fixed_bytes + 64:  # overflow: the same prefix of blocks, same needed
            _check(K, codec, x, y, codec.clamp_capacity((codec.fixed_bytes + needed) // 2))
        x = y.cpu()


def test_default_tile_and_decode_many(K):
    n, world = 2 * 2048 + 300, 3  # two full default tiles and a partial one
    codec = DeltaCodec(dtype=torch.bfloat16, numel=n)
    cap = codec.clamp_capacity(codec.max_bytes)
    prev, payloads = [], []
    for r in range(world):
        tr = AdamTrajectory(numel=n, dtype=torch.bfloat16, lr=1e-4, seed=r)
        x, y = tr.step(), tr.step()
        _, out = _check(K, codec, x.to(DEV), y.to(DEV), cap)
        prev.append(x)
        payloads.append((out, y))
    flat = torch.cat([p for p, _ in payloads])
    targets = torch.stack([as_bits(p) for p in prev]).to(DEV)
    K.decode_many_triton(layout=codec.layout, payloads=flat, rows=torch.tensor([2, 0], device=DEV),
                         offsets=torch.tensor([2 * cap, 0], device=DEV), targets_bits=targets)
    assert torch.equal(targets[2].cpu(), as_bits(payloads[2][1]))
    assert torch.equal(targets[0].cpu(), as_bits(payloads[0][1]))
    assert torch.equal(targets[1].cpu(), as_bits(prev[1]))
    expect = as_bits(prev[0]).clone()
    decode_reference(layout=codec.layout, payload=payloads[0][0].cpu(), target_bits=expect)
    assert torch.equal(expect, targets[0].cpu())


def _edge_steps(dtype, n, gen):
    """(previous, new) pairs that stress the run packer: nothing changed (width 0 everywhere),
    a few large changes (width 0 with exceptions), one tile with half its values exceptions (a run
    with up to R exceptions), noise (widest widths and raw blocks)."""
    tr = AdamTrajectory(numel=n, dtype=dtype, lr=1e-4, seed=7)
    x = tr.step()
    bits = as_bits(x)
    flip = bits.clone()
    flip[::97] ^= 0x4000
    half = bits.clone()
    half[128:384:2] ^= 0x3000
    top = 1 << (8 * bits.element_size() - 1)
    noise = torch.randint(-top, top, (n,), generator=gen, dtype=torch.int64).to(bits.dtype)
    return [(x, bits.clone()), (x, flip), (x, half), (x, noise), (x, as_bits(tr.step()))]


@pytest.mark.parametrize("dtype,n,block,mis", [
    (torch.bfloat16, 603, 64, 1),     # length not a multiple of the 8-value run, out 1 byte past a word
    (torch.float16, 403, 8, 3),       # one-group blocks, runs of 8 = a whole group
    (torch.float32, 498, 128, 2),     # 4-value runs, 32-bit widths
    (torch.bfloat16, 512, 256, 0),    # 2-byte counts (B > 255), aligned out
])
def test_run_packer_edges(K, monkeypatch, dtype, n, block, mis):
    """Byte-identical to the reference on width-0, all-exception, widest and raw tiles, into an
    ``out`` that starts off a 4-byte boundary (the packer stores aligned 32-bit words and the
    tile's edge bytes one by one); the shortest capacity cuts a tile inside its stream."""
    monkeypatch.setattr(K, "_TILE_VALUES", max(2 * block, 128))
    K._scratch_on.cache_clear()
    gen = torch.Generator().manual_seed(n)
    codec = DeltaCodec(dtype=dtype, numel=n, block_size=block)
    for prev, new_bits in _edge_steps(dtype, n, gen):
        prev_bits = as_bits(prev)
        for cap in (codec.clamp_capacity(codec.max_bytes), codec.fixed_bytes + 37):
            outs, needs = [], []
            for impl in (encode_reference, K.encode_triton):
                buf = torch.full((cap + mis,), GARBAGE, dtype=torch.uint8, device=DEV)
                out = buf[mis:]
                state = prev_bits.clone().to(DEV)
                needs.append(int(impl(layout=codec.layout, shard_bits=new_bits.to(DEV), state=state, out=out)))
                outs.append(out.cpu())
                assert torch.equal(state.cpu(), new_bits)
            assert needs[0] == needs[1]
            diff = (outs[0] != outs[1]).nonzero().flatten()
            assert diff.numel() == 0, diff[:20].tolist()
