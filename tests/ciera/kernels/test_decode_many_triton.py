"""``decode_many_triton`` of both codecs against ``decode_reference`` row by row (see Codec.decode_many):
several payloads at arbitrary 16-byte-aligned offsets of one flat buffer, a subset of the rows of a
``[world, n]`` bucket in any order, partial last blocks, adversarial steps (NaN/Inf, raw blocks).
On CUDA when there is one, else under the Triton interpreter (small inputs)."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from ciera.codecs.base import align_up  # noqa: E402
from ciera.codecs.delta import DeltaCodec  # noqa: E402
from ciera.codecs.exponent_reuse import ExponentReuseCodec  # noqa: E402
from ciera.codecs.formats import as_bits  # noqa: E402
from ciera.testing.trajectory import AdamTrajectory, adversarial_step  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _kernels(name):
    from triton.runtime.interpreter import InterpretedFunction

    mod = importlib.import_module(name)
    if DEV == "cpu" and not isinstance(mod.decode_many_triton.__globals__["triton"].language.zeros,
                                       InterpretedFunction):
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("triton was imported without TRITON_INTERPRET")
        importlib.reload(importlib.import_module("ciera.kernels.lookback"))
        mod = importlib.reload(mod)
    return mod


@pytest.mark.parametrize("codec_cls,kw", [(DeltaCodec, dict(block_size=64)), (ExponentReuseCodec, {})],
                         ids=["delta", "exponent_reuse"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_decode_many_matches_reference(codec_cls, kw, dtype):
    world, n = 4, 300  # partial last block for both codecs
    K = _kernels(codec_cls.kernels)
    gen = torch.Generator().manual_seed(7)
    codec = codec_cls(dtype=dtype, numel=n, backend="torch", **kw)
    ref = codec_cls.decode_reference
    prev, new = [], []
    for r in range(world):
        tr = AdamTrajectory(numel=n, dtype=dtype, lr=3e-4, seed=r)
        x = tr.step()
        y = tr.step() if r % 2 == 0 else adversarial_step(x, kind="nan_inf" if r == 1 else "replace", gen=gen)
        prev.append(x)
        new.append(y)
    cap = codec.clamp_capacity(codec.max_bytes)
    rows = [2, 0, 3]  # a subset, out of order
    offsets, at = [], 48  # payloads do not start at 0
    for r in rows:
        offsets.append(at)
        at = align_up(at + cap + 16 * r)
    flat = torch.full((at + 64,), 0xA5, dtype=torch.uint8)
    for r, off in zip(rows, offsets):
        state = codec.new_state(shard=prev[r])
        codec.encode(shard=new[r], state=state, out=flat[off:off + cap])
    targets = torch.stack([as_bits(p) for p in prev]).to(DEV)
    expect = targets.clone()
    for r, off in zip(rows, offsets):
        ref(layout=codec.layout, payload=flat[off:off + cap].to(DEV), target_bits=expect[r])
    K.decode_many_triton(layout=codec.layout, payloads=flat.to(DEV),
                         rows=torch.tensor(rows, dtype=torch.int64, device=DEV),
                         offsets=torch.tensor(offsets, dtype=torch.int64, device=DEV), targets_bits=targets)
    assert torch.equal(targets, expect)
    for r in rows:
        assert torch.equal(targets[r].cpu(), as_bits(new[r]))
    assert torch.equal(targets[1].cpu(), as_bits(prev[1]))  # a row not listed is untouched


class _CountingLaunches:
    """Wraps a Triton kernel: records every ``kernel[grid]`` launch."""

    def __init__(self, kernel, log):
        self.kernel, self.log = kernel, log

    def __getitem__(self, grid):
        self.log.append(grid)
        return self.kernel[grid]

    def __call__(self, *args, **kwargs):  # a @triton.jit helper called from inside a kernel
        return self.kernel(*args, **kwargs)


@pytest.mark.parametrize("codec_cls", [DeltaCodec, ExponentReuseCodec], ids=["delta", "exponent_reuse"])
def test_decode_many_launches_do_not_grow_with_rows_and_never_read_the_host(codec_cls, monkeypatch):
    from triton.runtime.interpreter import InterpretedFunction

    n, world = 200, 4
    K = _kernels(codec_cls.kernels)
    codec = codec_cls(dtype=torch.bfloat16, numel=n, backend="torch")
    cap = codec.clamp_capacity(codec.max_bytes)
    x = AdamTrajectory(numel=n, dtype=torch.bfloat16, lr=1e-4, seed=1).step()
    flat = torch.zeros(world * cap, dtype=torch.uint8)
    for r in range(world):
        codec.encode(shard=x, state=codec.new_state(shard=x), out=flat[r * cap:(r + 1) * cap])
    log: list = []
    for name in dir(K):
        if isinstance(getattr(K, name), (InterpretedFunction, triton.runtime.JITFunction)):
            monkeypatch.setattr(K, name, _CountingLaunches(getattr(K, name), log))
    for forbidden in ("item", "tolist", "__bool__", "__int__", "cpu"):
        monkeypatch.setattr(torch.Tensor, forbidden, lambda *a, _f=forbidden, **k: pytest.fail(f"host read: {_f}"))
    counts = []
    for k in (1, world):
        targets = as_bits(x.repeat(world, 1).to(DEV))
        log.clear()
        K.decode_many_triton(layout=codec.layout, payloads=flat.to(DEV), rows=torch.arange(k, device=DEV),
                             offsets=torch.arange(k, device=DEV) * cap, targets_bits=targets)
        counts.append(len(log))
    monkeypatch.undo()
    assert counts[0] == counts[1] and 1 <= counts[0] <= 3, counts
