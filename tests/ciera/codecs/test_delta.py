"""delta codec: exact round trips, sizes, overflow, long trajectories, Triton == reference.

Triton runs on CUDA tensors when a GPU is present, otherwise on CPU tensors under the interpreter.
``TRITON_INTERPRET`` is read when a kernel is decorated, so it is set here before
``ciera.codecs.delta.kernels`` is imported; if that module was already imported without it, the Triton
comparisons skip.
"""

import os
import sys

import torch

_ON_GPU = torch.cuda.is_available()
if not _ON_GPU:
    _KERNELS_COMPILED = "ciera.codecs.delta.kernels" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    _KERNELS_COMPILED = False

import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ciera.codecs import FLAG_OVERFLOW, HEADER_BYTES, PayloadHeader, as_bits, make_codec  # noqa: E402
from ciera.codecs.delta import DeltaCodec, DeltaLayout, decode_reference, encode_reference  # noqa: E402
from ciera.codecs.formats import float_format  # noqa: E402
from ciera.kernels import triton_available  # noqa: E402
from ciera.testing.trajectory import AdamTrajectory, adversarial_step  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
BLOCKS = [8, 64, 256, 1024]
SIZES = [0, 1, 2, 7, 8, 13, 63, 64, 65, 127, 257, 1009, 4099]


# -- helpers -------------------------------------------------------------------------------------
def bits_of(dtype, ints):
    """Tensor of ``dtype`` from unsigned bit patterns (Python ints)."""
    width = float_format(dtype).total_bits
    t = torch.tensor(ints, dtype=torch.int64)
    t = torch.where(t >= (1 << (width - 1)), t - (1 << width), t)
    return t.to(float_format(dtype).bits_dtype).view(dtype)


def special_values(dtype):
    """NaNs with payloads (both signs), +-Inf, +-0, subnormals, max/min normal, ordinary values."""
    f = float_format(dtype)
    W, M = f.total_bits, f.mant_bits
    exp_all = ((1 << f.exp_bits) - 1) << M
    sign = 1 << (W - 1)
    pats = [0, sign, exp_all, exp_all | sign,  # +-0, +-Inf
            exp_all | 1, exp_all | (1 << (M - 1)) | 5, exp_all | sign | 3,  # NaNs with payloads
            1, sign | 1, (1 << M) - 1,  # subnormals (smallest, negative, largest)
            1 << M, sign | (1 << M),  # smallest normals
            exp_all - 1, (exp_all - 1) | sign]  # +-max normal
    fi = torch.finfo(dtype)
    ordinary = torch.tensor([1.0, -1.0, 0.5, 1e-3, -2.5, fi.eps], dtype=torch.float32).to(dtype)
    return torch.cat([bits_of(dtype, pats), ordinary])


def capacity_of(codec, capacity=None):
    return codec.clamp_capacity(codec.max_bytes if capacity is None else capacity)


def encode(codec, new, state, capacity=None, fill=0xAB):
    out = torch.full((capacity_of(codec, capacity),), fill, dtype=torch.uint8, device=new.device)
    codec.encode(shard=new, state=state, out=out)
    return out, PayloadHeader(out[:HEADER_BYTES].view(torch.int64).cpu())


def roundtrip(codec, prev, new, state, capacity=None):
    """Encode ``new`` against ``state``, decode into a copy of ``prev``; the decoded tensor."""
    out, h = encode(codec, new, state, capacity)
    assert h.needed <= codec.max_bytes and h.capacity == out.numel()
    assert not h.overflow
    target = prev.clone()
    codec.decode(payload=out, target=target)
    return target, h


def assert_bits_equal(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(as_bits(a), as_bits(b))


# -- construction and sizes ------------------------------------------------------------------------
def test_registered():
    codec = make_codec("delta", dtype=torch.bfloat16, numel=100)
    assert isinstance(codec, DeltaCodec) and codec.codec_id == 2 and codec.name == "delta"
    assert make_codec("delta", dtype=torch.float32, numel=100, block_size=32).block_size == 32


@pytest.mark.parametrize("block", [0, 4, 48, 8192])
def test_block_size_validated(block):
    with pytest.raises(ValueError, match="block_size"):
        DeltaCodec(dtype=torch.bfloat16, numel=10, block_size=block)


@pytest.mark.parametrize("dtype,classes,high", [(torch.bfloat16, 256, 2), (torch.float16, 32, 2), (torch.float32, 256, 4)])
@pytest.mark.parametrize("block,count_b,index_b", [(8, 1, 1), (128, 1, 1), (256, 2, 1), (4096, 2, 2)])
def test_layout(dtype, classes, high, block, count_b, index_b):
    lay = DeltaLayout(float_format(dtype), 10_000, block)
    assert (lay.n_classes, lay.high_bytes, lay.count_bytes, lay.index_bytes) == (classes, high, count_b, index_b)
    assert lay.group_size == min(block, 64) and lay.block_size % lay.group_size == 0
    # The counts field must hold every count up to B and the raw mark above them.
    assert lay.raw_mark > block and lay.raw_mark < 1 << (8 * count_b)
    assert lay.off_table == HEADER_BYTES
    assert lay.off_counts >= lay.off_table + classes
    assert lay.off_data >= lay.off_counts + lay.n_blocks * count_b
    assert all(o % 16 == 0 for o in (lay.off_counts, lay.off_data))
    codec = DeltaCodec(dtype=dtype, numel=10_000, block_size=block)
    assert codec.fixed_bytes == lay.off_data
    assert codec.max_bytes == lay.off_data + 10_000 * high


def test_unchanged_shard_costs_only_the_fixed_part():
    x = torch.randn(5000).to(torch.bfloat16)
    codec = DeltaCodec(dtype=torch.bfloat16, numel=5000)
    _, h = roundtrip(codec, x, x, codec.new_state(shard=x))
    assert h.needed == codec.fixed_bytes


def test_one_ulp_steps_cost_about_two_bits():
    n = 1 << 14
    x = (torch.rand(n) + 1).to(torch.bfloat16)  # one exponent class
    y = (as_bits(x) + torch.randint(-1, 2, (n,), dtype=torch.int16)).view(torch.bfloat16)
    codec = DeltaCodec(dtype=torch.bfloat16, numel=n)
    got, h = roundtrip(codec, x, y, codec.new_state(shard=x))
    assert_bits_equal(got, y)
    assert h.needed - codec.fixed_bytes <= n * 2 / 8 + codec.layout.n_blocks * 8


def test_worst_case_is_bounded_by_raw_blocks():
    """Random bit patterns: the raw escape keeps every block at its raw size."""
    for dtype in DTYPES:
        n = 3000
        W = float_format(dtype).total_bits
        gen = torch.Generator().manual_seed(1)
        prev = bits_of(dtype, torch.randint(0, 1 << W, (n,), generator=gen, dtype=torch.int64).tolist())
        new = bits_of(dtype, torch.randint(0, 1 << W, (n,), generator=gen, dtype=torch.int64).tolist())
        codec = DeltaCodec(dtype=dtype, numel=n, block_size=64)
        got, h = roundtrip(codec, prev, new, codec.new_state(shard=prev))
        assert_bits_equal(got, new)
        assert codec.fixed_bytes < h.needed <= codec.max_bytes


# -- round trips ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("block", BLOCKS)
def test_roundtrip_sizes_and_blocks(dtype, n, block):
    gen = torch.Generator().manual_seed(n * 7 + block)
    codec = DeltaCodec(dtype=dtype, numel=n, block_size=block)
    prev = (torch.randn(n, generator=gen) * 0.02).to(dtype)
    state = codec.new_state(shard=prev)
    for scale in (0.0, 1e-3, 1e-1, 10.0):
        new = (prev.float() * (1 + scale * torch.randn(n, generator=gen))).to(dtype)
        got, _ = roundtrip(codec, prev, new, state)
        assert_bits_equal(got, new)
        assert_bits_equal(state.view(dtype), new)
        prev = new


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [8, 64])
def test_special_value_transitions(dtype, block):
    """Every special value to every other: NaN payloads, Inf, signed zeros, subnormals, extremes."""
    s = special_values(dtype)
    k = s.numel()
    prev, new = s.repeat_interleave(k), s.repeat(k)  # all ordered pairs
    codec = DeltaCodec(dtype=dtype, numel=prev.numel(), block_size=block)
    state = codec.new_state(shard=prev)
    got, _ = roundtrip(codec, prev, new, state)
    assert_bits_equal(got, new)
    got2, _ = roundtrip(codec, new, prev, state)  # and back
    assert_bits_equal(got2, prev)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), dtype=st.sampled_from(DTYPES), block=st.sampled_from([8, 16, 64, 512]))
def test_property_arbitrary_bit_patterns(data, dtype, block):
    W = float_format(dtype).total_bits
    n = data.draw(st.integers(0, 300))
    ints = st.integers(0, (1 << W) - 1)
    prev_l = data.draw(st.lists(ints, min_size=n, max_size=n))
    # Mix small moves (most values) with arbitrary new patterns.
    moves = data.draw(st.lists(st.one_of(st.integers(-3, 3), st.integers(-(1 << W), 1 << W), ints),
                               min_size=n, max_size=n))
    prev = bits_of(dtype, prev_l)
    new = bits_of(dtype, [(p + m) % (1 << W) for p, m in zip(prev_l, moves)])
    codec = DeltaCodec(dtype=dtype, numel=n, block_size=block)
    state = codec.new_state(shard=prev)
    got, h = roundtrip(codec, prev, new, state)
    assert_bits_equal(got, new)
    assert codec.fixed_bytes <= h.needed <= codec.max_bytes
    # needed does not depend on the capacity, and a payload of exactly `needed` decodes.
    got2, h2 = roundtrip(codec, prev, new, codec.new_state(shard=prev), capacity=h.needed)
    assert h2.needed == h.needed
    assert_bits_equal(got2, new)


@pytest.mark.parametrize("dtype", DTYPES)
def test_adversarial_sequence_chained(dtype):
    """Exponent changes, NaN/Inf bursts, sign flips, zeros, whole-shard replacement, in a row."""
    n = 2000
    gen = torch.Generator().manual_seed(3)
    tr = AdamTrajectory(numel=n, dtype=dtype, lr=3e-4, seed=5)
    x = tr.step()
    codec = DeltaCodec(dtype=dtype, numel=n)
    state = codec.new_state(shard=x)
    receiver = x.clone()
    kinds = ["all_exponents", "nan_inf", "sign_flip", "zeros", "replace", "same", "replace", "nan_inf"]
    for kind in kinds + kinds[::-1]:
        y = adversarial_step(x, kind=kind, gen=gen, fraction=0.05)
        out, h = encode(codec, y, state)
        codec.decode(payload=out, target=receiver)
        assert_bits_equal(receiver, y)
        x = y
    # Back to a smooth trajectory after the storm: still exact.
    for _ in range(5):
        y = tr.step()
        out, _ = encode(codec, y, state)
        codec.decode(payload=out, target=receiver)
        assert_bits_equal(receiver, y)


# -- overflow --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [8, 256])
def test_overflow_reported_never_written_past_capacity(dtype, block):
    n = 3001
    gen = torch.Generator().manual_seed(2)
    prev = torch.randn(n, generator=gen).to(dtype)
    new = adversarial_step(prev, kind="replace", gen=gen)
    codec = DeltaCodec(dtype=dtype, numel=n, block_size=block)
    _, full = encode(codec, new, codec.new_state(shard=prev))
    assert not full.overflow and full.needed > codec.fixed_bytes + 64
    for cap in (codec.fixed_bytes, codec.fixed_bytes + 16, codec.clamp_capacity(full.needed - 16)):
        buf = torch.full((cap + 64,), 0x5A, dtype=torch.uint8)
        out = buf[:cap]
        state = codec.new_state(shard=prev)
        codec.encode(shard=new, state=state, out=out)
        h = PayloadHeader(out[:HEADER_BYTES].view(torch.int64))
        assert h.overflow and h.flags & FLAG_OVERFLOW
        assert h.needed == full.needed > cap == h.capacity
        assert torch.all(buf[cap:] == 0x5A), "encode wrote past its capacity"
        assert_bits_equal(state.view(dtype), new)  # the sender's state still follows the shard
        with pytest.raises(ValueError, match="overflow"):
            codec.decode(payload=out, target=prev.clone())


def test_wrong_codec_payload_rejected():
    x = torch.randn(100).to(torch.bfloat16)
    other = make_codec("raw", dtype=torch.bfloat16, numel=100)
    out = torch.zeros(other.clamp_capacity(other.max_bytes), dtype=torch.uint8)
    other.encode(shard=x, state=None, out=out)
    with pytest.raises(ValueError, match="not a delta payload"):
        DeltaCodec(dtype=torch.bfloat16, numel=100).decode(payload=out, target=x.clone())


def test_state_helpers():
    codec = DeltaCodec(dtype=torch.float16, numel=10)
    a, b = torch.randn(10).half(), torch.randn(10).half()
    state = codec.new_state(shard=a)
    assert torch.equal(state, as_bits(a)) and state.data_ptr() != a.data_ptr()
    codec.reset_state(state=state, shard=b)
    assert torch.equal(state, as_bits(b))
    with pytest.raises(ValueError, match="contiguous"):
        codec.new_state(shard=torch.randn(10))


# -- long trajectories -----------------------------------------------------------------------------
def _run_trajectory(dtype, n, steps, lr, block=128, check_every=1):
    tr = AdamTrajectory(numel=n, dtype=dtype, lr=lr, seed=11)
    x = tr.current()
    codec = DeltaCodec(dtype=dtype, numel=n, block_size=block)
    state = codec.new_state(shard=x)
    receiver = x.clone()
    out = torch.empty(codec.clamp_capacity(codec.max_bytes), dtype=torch.uint8)
    total = 0
    for i in range(steps):
        x = tr.step()
        codec.encode(shard=x, state=state, out=out)
        total += int(out[16:24].view(torch.int64)[0])
        codec.decode(payload=out, target=receiver)
        if i % check_every == 0:
            assert_bits_equal(receiver, x)
    assert_bits_equal(receiver, x)
    assert_bits_equal(state.view(dtype), x)
    return total / steps / codec.raw_bytes


@pytest.mark.parametrize("dtype,steps", [(torch.bfloat16, 1000), (torch.float32, 200)])
def test_long_trajectory_no_drift(dtype, steps):
    _run_trajectory(dtype, n=300, steps=steps, lr=3e-4, check_every=50)


def test_compresses_adam_trajectory():
    """delta's wire-size target on a small shard: at most 0.25 of raw bytes at lr 1e-4."""
    tr = AdamTrajectory(numel=1 << 15, dtype=torch.bfloat16, lr=1e-4)
    for _ in range(30):
        x = tr.step()
    codec = DeltaCodec(dtype=torch.bfloat16, numel=1 << 15)
    state = codec.new_state(shard=x)
    ratios = []
    for _ in range(3):
        y = tr.step()
        got, h = roundtrip(codec, x, y, state)
        assert_bits_equal(got, y)
        ratios.append(h.needed / codec.raw_bytes)
        x = y
    assert max(ratios) < 0.25, ratios


@pytest.mark.slow
@pytest.mark.parametrize("lr", [1e-4, 1e-3])
def test_long_trajectory_full(lr):
    ratio = _run_trajectory(torch.bfloat16, n=1 << 15, steps=2000, lr=lr, block=128)
    assert ratio < 0.5


# -- Triton twin == reference ------------------------------------------------------------------------
triton_only = pytest.mark.skipif(
    not triton_available() or _KERNELS_COMPILED,
    reason="needs Triton (on CPU: the interpreter, set before ciera.codecs.delta.kernels is imported)",
)
DEV = "cuda" if _ON_GPU else "cpu"


def _compare(layout, prev, new, capacity):
    from ciera.codecs.delta.kernels import decode_triton, encode_triton

    outs, states, needs = [], [], []
    for impl in (encode_reference, encode_triton):
        out = torch.zeros(capacity, dtype=torch.uint8, device=DEV)
        state = as_bits(prev).clone()
        needs.append(int(impl(layout=layout, shard_bits=as_bits(new), state=state, out=out)))
        outs.append(out)
        states.append(state)
    assert needs[0] == needs[1]
    assert torch.equal(outs[0], outs[1]), (outs[0] != outs[1]).nonzero().flatten()[:20].tolist()
    assert torch.equal(states[0], states[1]) and torch.equal(states[0], as_bits(new))
    if needs[0] <= capacity:
        for impl in (decode_reference, decode_triton):
            target = as_bits(prev).clone()
            impl(layout=layout, payload=outs[0], target_bits=target)
            assert torch.equal(target, as_bits(new))
    return needs[0]


@triton_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,block", [(1, 8), (203, 64), (517, 256)])
def test_triton_matches_reference(dtype, n, block):
    gen = torch.Generator().manual_seed(n)
    codec = DeltaCodec(dtype=dtype, numel=n, block_size=block)
    tr = AdamTrajectory(numel=n, dtype=dtype, lr=3e-4, seed=n)
    for _ in range(3):
        x = tr.step()
    steps = [tr.step(), adversarial_step(x, kind="nan_inf", gen=gen, fraction=0.05),
             adversarial_step(x, kind="replace", gen=gen)]  # replace: raw blocks
    for y in steps:
        x, y = x.to(DEV), y.to(DEV)
        needed = _compare(codec.layout, x, y, capacity_of(codec))
        if needed > codec.fixed_bytes + 16:  # overflow: the same prefix of blocks written
            _compare(codec.layout, x, y, codec.clamp_capacity((codec.fixed_bytes + needed) // 2))
        x = y.cpu()


@triton_only
def test_triton_special_values_and_codec_dispatch():
    s = special_values(torch.bfloat16)
    prev, new = s.repeat_interleave(s.numel()).to(DEV), s.repeat(s.numel()).to(DEV)
    codec = DeltaCodec(dtype=torch.bfloat16, numel=prev.numel(), block_size=64, backend="triton")
    _compare(codec.layout, prev, new, capacity_of(codec))
    # The codec dispatches to the kernels (backend='triton' also takes CPU tensors under the
    # interpreter) and its payload decodes with the reference.
    state = codec.new_state(shard=prev)
    out, h = encode(codec, new, state)
    target = prev.clone()
    DeltaCodec(dtype=torch.bfloat16, numel=prev.numel(), block_size=64, backend="torch").decode(
        payload=out, target=target)
    assert_bits_equal(target, new)
    target = prev.clone()
    codec.decode(payload=out, target=target)
    assert_bits_equal(target, new)
