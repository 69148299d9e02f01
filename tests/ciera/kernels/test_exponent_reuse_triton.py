"""The Triton twins of exponent reuse against the pure-torch reference: on CUDA when there is one,
else on CPU under the Triton interpreter.

Every check is exact: payload bytes (every section, and nothing outside them: both encoders start
from the same garbage-filled buffer), the updated sender state, the needed bytes, and the decoded
bit patterns. ``_encode``/``_decode`` take a small chunk size so that inputs of a few hundred
values already span many tiles (the cross-tile slot numbering is the delicate part).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Kernels run on CUDA when there is one, else on CPU under Triton's interpreter. The interpreter is
# chosen when ``@triton.jit`` decorates a function, triton.language's own helpers included, so the
# variable must be set before anything imports triton; it stays set (on a CPU-only run every Triton
# kernel needs it). If triton was already imported without it, this module reruns in a subprocess.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ciera.codecs.base import HEADER_BYTES, align_up  # noqa: E402
from ciera.codecs.exponent_reuse import (  # noqa: E402
    ExponentReuseCodec,
    ExponentReuseLayout,
    decode_reference,
    encode_reference,
    split_fields,
)
from ciera.codecs.formats import as_bits, float_format, to_unsigned  # noqa: E402


def _interpreted(fn) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(fn, InterpretedFunction)


IN_PROCESS = DEVICE == "cuda" or _interpreted(triton.language.zeros)
if IN_PROCESS:
    K = importlib.import_module("ciera.codecs.exponent_reuse.kernels")
    if DEVICE == "cpu" and not _interpreted(K._encode_tiles):
        importlib.reload(importlib.import_module("ciera.kernels.lookback"))
        K = importlib.reload(K)  # imported earlier, before TRITON_INTERPRET was set


@pytest.fixture(autouse=True)
def _needs_kernels(request):
    if not IN_PROCESS and request.node.originalname != "test_module_in_subprocess":
        pytest.skip("triton was imported without TRITON_INTERPRET; test_module_in_subprocess runs these")


def test_module_in_subprocess():
    """Run this module in a fresh interpreter when this process cannot interpret the kernels."""
    if IN_PROCESS:
        pytest.skip("the kernels run in this process")
    root = Path(__file__).resolve().parents[3]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(root), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__],
                          cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GARBAGE = 0xA5
GUARD = 64  # bytes after the payload that nobody may write


# -- data ------------------------------------------------------------------------------------------

def _specials(dtype: torch.dtype) -> torch.Tensor:
    """+-0, +-Inf, NaNs with different payloads and signs, subnormals, extremes, as bit patterns."""
    fmt = float_format(dtype)
    e_all, m_top = ((1 << fmt.exp_bits) - 1) << fmt.mant_bits, 1 << (fmt.mant_bits - 1)
    sign = 1 << (fmt.total_bits - 1)
    pos = [0, e_all, e_all | m_top, e_all | 1, e_all | (m_top - 1), 1, m_top, (1 << fmt.mant_bits) - 1,
           e_all - 1, 1 << fmt.mant_bits, (e_all >> 1) & e_all]
    u = torch.tensor(pos + [p | sign for p in pos], dtype=torch.int64)
    width = fmt.total_bits
    u = torch.where(u >= 1 << (width - 1), u - (1 << width), u)
    return u.to(fmt.bits_dtype).view(dtype).to(DEVICE)


def _random_bits(n: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Uniform bit patterns: every exponent, NaNs and subnormals included."""
    fmt = float_format(dtype)
    lo, hi = -(1 << (fmt.total_bits - 1)), 1 << (fmt.total_bits - 1)
    return torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64).to(fmt.bits_dtype).view(dtype).to(DEVICE)


def _step(prev: torch.Tensor, g: torch.Generator, *, rate: float) -> torch.Tensor:
    """Next shard: a small relative change (few exponent changes) plus ``rate`` of fresh bit patterns."""
    nxt = (prev.float() * (1 + 1e-2 * torch.randn(prev.shape, generator=g).to(DEVICE))).to(prev.dtype)
    fresh = torch.rand(prev.shape, generator=g).to(DEVICE) < rate
    return torch.where(fresh, _random_bits(prev.numel(), prev.dtype, g), nxt)


def _exps(layout: ExponentReuseLayout, x: torch.Tensor) -> torch.Tensor:
    return split_fields(layout.fmt, to_unsigned(as_bits(x)))[0].to(torch.uint8)


def _capacities(layout: ExponentReuseLayout) -> list[int]:
    """No slot (K = 0), one slot, about half the blocks, never-overflowing."""
    full = layout.off_exps + layout.n_blocks * layout.block_size
    half = layout.off_exps + (layout.n_blocks // 2) * layout.block_size
    caps = {layout.off_exps, layout.off_exps + layout.block_size, align_up(half), align_up(full)}
    return sorted(c for c in caps if c <= align_up(full))


def _small_tile(block_size: int) -> int:
    """Chunk size giving tiles of 8 blocks (64 for B <= 8) in one chunk: many tiles, cheap to interpret."""
    return max(64, 8 * block_size)


# -- checks ----------------------------------------------------------------------------------------

def _section(layout: ExponentReuseLayout, i: int) -> str:
    for name, start in (("exps", layout.off_exps), ("bitmap", layout.off_bitmap), ("planes", layout.off_planes),
                        ("signmant", layout.off_signmant)):
        if i >= start:
            return name
    return "header"


def _assert_same_payload(layout, ref: torch.Tensor, got: torch.Tensor, what: str) -> None:
    if not torch.equal(ref, got):
        bad = (ref != got).nonzero().flatten()[:8].tolist()
        raise AssertionError(f"{what}: payload differs at bytes {bad} ({[_section(layout, i) for i in bad]}); "
                             f"reference {ref[bad].tolist()} vs triton {got[bad].tolist()}")


def _check_step(layout, prev: torch.Tensor, new: torch.Tensor, state: torch.Tensor, capacity: int, *,
                tile_values: int, what: str) -> torch.Tensor:
    """Encode ``new`` both ways against ``state`` (updated in place), compare everything, decode
    both ways when it fits. Returns the Triton payload."""
    buf_ref = torch.full((capacity + GUARD,), GARBAGE, dtype=torch.uint8, device=DEVICE)
    buf_tri = buf_ref.clone()
    state_ref = state.clone()
    need_ref = encode_reference(layout=layout, shard_bits=as_bits(new), state=state_ref, out=buf_ref[:capacity])
    need_tri = K._encode(layout=layout, shard_bits=as_bits(new), state=state, out=buf_tri[:capacity],
                         tile_values=tile_values)
    assert isinstance(need_tri, torch.Tensor) and need_tri.dtype == torch.int64 and need_tri.dim() == 0, what
    assert int(need_tri) == int(need_ref), f"{what}: needed {int(need_tri)} != reference {int(need_ref)}"
    assert torch.equal(state, state_ref), f"{what}: state differs"
    assert (buf_tri[capacity:] == GARBAGE).all(), f"{what}: wrote past the capacity"
    assert (buf_tri[:HEADER_BYTES] == GARBAGE).all(), f"{what}: wrote into the header"
    _assert_same_payload(layout, buf_ref, buf_tri, what)

    if int(need_ref) <= capacity:
        out_ref, out_tri = prev.clone(), prev.clone()
        decode_reference(layout=layout, payload=buf_ref[:capacity], target_bits=as_bits(out_ref))
        K._decode(layout=layout, payload=buf_tri[:capacity], target_bits=as_bits(out_tri), tile_values=tile_values)
        assert torch.equal(as_bits(out_tri), as_bits(out_ref)), f"{what}: decode differs from the reference"
        assert torch.equal(as_bits(out_tri), as_bits(new)), f"{what}: decode is not the encoded shard"
    return buf_tri[:capacity]


# -- tests -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("numel", [0, 1, 7, 9, 67, 1031])
@pytest.mark.parametrize("block_size", [1, 2, 8, 64, 512])
def test_matches_reference_every_capacity(dtype, numel, block_size):
    g = torch.Generator().manual_seed(numel * 1009 + block_size)
    layout = ExponentReuseLayout(float_format(dtype), numel, block_size)
    prev = torch.randn(numel, generator=g).to(dtype).to(DEVICE)
    new = _step(prev, g, rate=0.02)
    for capacity in _capacities(layout):
        _check_step(layout, prev, new, _exps(layout, prev), capacity, tile_values=_small_tile(block_size),
                    what=f"{dtype} n={numel} B={block_size} cap={capacity}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size,tile_values", [(16, 8), (64, 64), (1, 4096), (8, 4096)])
def test_chunked_blocks_and_default_tiles(dtype, block_size, tile_values):
    """Blocks walked in several chunks (BC < B), and the default tiles (one tile here)."""
    g = torch.Generator().manual_seed(block_size)
    layout = ExponentReuseLayout(float_format(dtype), 397, block_size)
    prev = torch.randn(397, generator=g).to(dtype).to(DEVICE)
    new = _step(prev, g, rate=0.02)
    for capacity in (layout.off_exps, align_up(layout.off_exps + 5 * block_size),
                     align_up(layout.off_exps + layout.n_blocks * block_size)):
        _check_step(layout, prev, new, _exps(layout, prev), capacity, tile_values=tile_values,
                    what=f"{dtype} B={block_size} tile={tile_values} cap={capacity}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_specials_and_random_bit_patterns(dtype):
    """NaN payloads, +-Inf, +-0, subnormals, and uniformly random patterns, changing into each other."""
    g = torch.Generator().manual_seed(7)
    sp = _specials(dtype)
    prev = torch.cat([sp, sp.flip(0), _random_bits(300, dtype, g)])
    new = torch.cat([sp.roll(3), sp, _random_bits(300, dtype, g)])
    new[-100:] = prev[-100:]  # an unchanged stretch
    for block_size in (1, 8, 64):
        layout = ExponentReuseLayout(float_format(dtype), prev.numel(), block_size)
        for capacity in (layout.off_exps, align_up(layout.off_exps + layout.n_blocks * block_size)):
            _check_step(layout, prev, new, _exps(layout, prev), capacity, tile_values=_small_tile(block_size),
                        what=f"{dtype} B={block_size} cap={capacity}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [1, 8, 64])
def test_sequence_of_steps(dtype, block_size):
    """Sender state and receiver buffer stay in step over several encodes, incl. an unchanged step
    and one with every exponent changed."""
    g = torch.Generator().manual_seed(block_size)
    n = 611
    layout = ExponentReuseLayout(float_format(dtype), n, block_size)
    shard = torch.randn(n, generator=g).to(dtype).to(DEVICE)
    state = _exps(layout, shard)
    receiver = shard.clone()
    capacity = align_up(layout.off_exps + layout.n_blocks * block_size)
    steps = [_step(shard, g, rate=0.0), None, _random_bits(n, dtype, g), None]
    for i, new in enumerate(steps):
        new = shard.clone() if new is None else new  # None: nothing changed
        payload = _check_step(layout, shard, new, state, capacity, tile_values=_small_tile(block_size),
                              what=f"{dtype} B={block_size} step {i}")
        K.decode_triton(layout=layout, payload=payload, target_bits=as_bits(receiver))
        assert torch.equal(as_bits(receiver), as_bits(new)), f"step {i}: receiver out of step"
        assert torch.equal(state, _exps(layout, new)), f"step {i}: state is not the new exponents"
        shard = _step(new, g, rate=0.01)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_block_and_default_tiles(dtype):
    """B = 4096 spans several chunks per block (default tiles) and a partial last block."""
    g = torch.Generator().manual_seed(3)
    n = 4096 + 1500
    layout = ExponentReuseLayout(float_format(dtype), n, 4096)
    prev = torch.randn(n, generator=g).to(dtype).to(DEVICE)
    new = prev.clone()
    new[5000] = -new[5000] * 4  # only the second (partial) block changes its exponents
    for capacity in (layout.off_exps, layout.off_exps + 4096, align_up(layout.off_exps + 2 * 4096)):
        _check_step(layout, prev, new, _exps(layout, prev), capacity, tile_values=K._TILE_VALUES,
                    what=f"{dtype} B=4096 cap={capacity}")


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(DTYPES), numel=st.integers(0, 200), log_b=st.integers(0, 6),
       log_tile=st.integers(3, 9), rate=st.sampled_from([0.0, 0.01, 0.3, 1.0]), seed=st.integers(0, 2**16),
       slots=st.integers(0, 200))
def test_property_matches_reference(dtype, numel, log_b, log_tile, rate, seed, slots):
    g = torch.Generator().manual_seed(seed)
    layout = ExponentReuseLayout(float_format(dtype), numel, 1 << log_b)
    prev = _random_bits(numel, dtype, g)
    new = _step(prev, g, rate=rate)
    capacity = layout.off_exps + min(slots, layout.n_blocks) * layout.block_size
    _check_step(layout, prev, new, _exps(layout, prev), capacity, tile_values=1 << log_tile,
                what=f"{dtype} n={numel} B={1 << log_b} tile={1 << log_tile} cap={capacity}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_codec_backend_triton_matches_torch(dtype):
    """Through the codec class (header included): backend='triton' on CPU runs the interpreted twins."""
    g = torch.Generator().manual_seed(11)
    n = 333
    ref = ExponentReuseCodec(dtype=dtype, numel=n, backend="torch")
    tri = ExponentReuseCodec(dtype=dtype, numel=n, backend="triton")
    prev = torch.randn(n, generator=g).to(dtype).to(DEVICE)
    new = _step(prev, g, rate=0.05)
    for capacity in (ref.fixed_bytes, ref.clamp_capacity(ref.max_bytes)):
        out_ref = torch.zeros(capacity, dtype=torch.uint8, device=DEVICE)
        out_tri = torch.zeros(capacity, dtype=torch.uint8, device=DEVICE)
        s_ref, s_tri = ref.new_state(shard=prev), tri.new_state(shard=prev)
        ref.encode(shard=new, state=s_ref, out=out_ref)
        tri.encode(shard=new, state=s_tri, out=out_tri)
        _assert_same_payload(ref.layout, out_ref, out_tri, f"{dtype} cap={capacity}")
        assert torch.equal(s_ref, s_tri)
        if capacity == ref.clamp_capacity(ref.max_bytes):
            target = prev.clone()
            tri.decode(payload=out_tri, target=target)
            assert torch.equal(as_bits(target), as_bits(new))
