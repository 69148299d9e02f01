"""The exponent cache's two in-place passes (ciera.zero3.seed_exponents / store_exponents) against
the plain field arithmetic, on every bit pattern class: NaN payloads, infinities, -0.0, subnormals."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ciera.codecs.formats import as_bits, float_format
from ciera.zero3 import seed_exponents, store_exponents

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _fields(values):
    fmt = float_format(values.dtype)
    return ((as_bits(values) >> fmt.mant_bits) & ((1 << fmt.exp_bits) - 1)).to(torch.uint8)


def _from_patterns(patterns, dtype):
    fmt = float_format(dtype)
    width = 8 * fmt.itemsize
    u = torch.tensor([p % (1 << width) for p in patterns], dtype=torch.int64)
    u = torch.where(u >= 1 << (width - 1), u - (1 << width), u)
    return u.to(fmt.bits_dtype).view(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=1, max_size=300),
       st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=1, max_size=300))
def test_store_then_seed_gives_the_exponent_fields(dtype, src, junk):
    src = _from_patterns(src, dtype)
    exps = torch.empty(src.numel(), dtype=torch.uint8)
    store_exponents(src, exps)
    assert torch.equal(exps, _fields(src))
    target = _from_patterns((junk * (src.numel() // len(junk) + 1))[: src.numel()], dtype)
    seed_exponents(target, exps)
    assert torch.equal(_fields(target), exps)


@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values_and_strided_rows(dtype):
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-40, -1e-45, 65504.0])
    x = torch.cat([specials, torch.randn(56)]).to(dtype).view(8, 8)
    exps = torch.empty(8, 8, dtype=torch.uint8)
    store_exponents(x[2:5], exps[2:5])  # a range of rows, as a gather seeds the other ranks'
    assert torch.equal(exps[2:5], _fields(x[2:5]))
    y = torch.zeros(8, 8, dtype=dtype)
    seed_exponents(y[2:5], exps[2:5])
    assert torch.equal(_fields(y[2:5]), _fields(x[2:5]))
    assert torch.equal(as_bits(y[:2]), torch.zeros_like(as_bits(y[:2])))  # rows outside untouched


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_passes_write_what_the_cpu_passes_write(dtype):
    x = torch.randn(4, 1 << 16).to(dtype)
    exps = torch.empty(4, 1 << 16, dtype=torch.uint8)
    store_exponents(x, exps)
    gx, gexps = x.cuda(), torch.empty_like(exps, device="cuda")
    store_exponents(gx, gexps)
    assert torch.equal(gexps.cpu(), exps)
    y, gy = torch.zeros_like(x), torch.zeros_like(gx)
    seed_exponents(y[1:3], exps[1:3])
    seed_exponents(gy[1:3], gexps[1:3])
    assert torch.equal(as_bits(gy).cpu(), as_bits(y))
