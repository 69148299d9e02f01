"""Properties every registered codec keeps: bit-exact in-place round trips, honest overflow."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ciera.codecs import FLAG_OVERFLOW, HEADER_BYTES, as_bits, available_codecs, make_codec
from ciera.testing.trajectory import AdamTrajectory, adversarial_step

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SIZES = [0, 1, 2, 7, 8, 9, 13, 63, 64, 65, 127, 1000, 4099]
CODECS = available_codecs()


def special_values(dtype):
    fi = torch.finfo(dtype)
    vals = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), fi.max, -fi.max, fi.tiny, -fi.tiny,
            fi.tiny / 2, -fi.tiny / 4, fi.eps, 1.0, -1.0, 2.0, 0.5]
    t = torch.tensor(vals, dtype=torch.float32).to(dtype)
    bits = as_bits(t)
    width = 16 if bits.dtype == torch.int16 else 32
    mant = 7 if dtype == torch.bfloat16 else (10 if dtype == torch.float16 else 23)
    exp_all = ((1 << (width - 1 - mant)) - 1) << mant
    # NaNs with distinct payloads, both signs.
    nans = torch.tensor([exp_all | 1, exp_all | 3, exp_all | (1 << (mant - 1)) | 5], dtype=torch.int64)
    nans = torch.cat([nans, nans | (1 << (width - 1))])
    nans = torch.where(nans >= (1 << (width - 1)), nans - (1 << width), nans).to(bits.dtype)
    return torch.cat([t, nans.view(dtype)])


def roundtrip(codec, prev, new, state, capacity=None):
    cap = codec.clamp_capacity(codec.max_bytes if capacity is None else capacity)
    out = torch.full((cap,), 0xAB, dtype=torch.uint8)
    codec.encode(shard=new, state=state, out=out)
    header = out[:HEADER_BYTES].view(torch.int64)
    assert header[2] <= codec.max_bytes
    target = prev.clone()
    if header[1] & FLAG_OVERFLOW:
        return None, out
    codec.decode(payload=out, target=target)
    return target, out


def assert_bits_equal(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(as_bits(a), as_bits(b))


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_roundtrip_random_sequence(name, dtype, n):
    gen = torch.Generator().manual_seed(n)
    codec = make_codec(name, dtype=dtype, numel=n)
    prev = torch.randn(n, generator=gen).to(dtype)
    state = codec.new_state(shard=prev)
    for scale in (0.0, 1e-3, 1e-1, 10.0):
        new = (prev.float() * (1 + scale * torch.randn(n, generator=gen))).to(dtype)
        got, _ = roundtrip(codec, prev, new, state)
        assert_bits_equal(got, new)
        prev = new


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values_survive(name, dtype):
    sv = special_values(dtype)
    gen = torch.Generator().manual_seed(1)
    prev = torch.randn(sv.numel() * 5, generator=gen).to(dtype)
    codec = make_codec(name, dtype=dtype, numel=prev.numel())
    state = codec.new_state(shard=prev)
    new = prev.clone()
    new[::5] = sv
    got, _ = roundtrip(codec, prev, new, state)
    assert_bits_equal(got, new)
    # and back again: specials as the *previous* values
    back = torch.randn(prev.numel(), generator=gen).to(dtype)
    got, _ = roundtrip(codec, new, back, state)
    assert_bits_equal(got, back)


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("kind", ["all_exponents", "nan_inf", "sign_flip", "zeros", "replace", "same"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_adversarial_sequences(name, kind, dtype):
    gen = torch.Generator().manual_seed(7)
    n = 777
    codec = make_codec(name, dtype=dtype, numel=n)
    prev = torch.randn(n, generator=gen).to(dtype)
    state = codec.new_state(shard=prev)
    for _ in range(4):
        new = adversarial_step(prev, kind=kind, gen=gen, fraction=0.05)
        got, _ = roundtrip(codec, prev, new, state)
        assert_bits_equal(got, new)
        prev = new


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_adam_trajectory_no_drift(name, dtype):
    tr = AdamTrajectory(numel=3001, dtype=dtype, lr=3e-4, seed=3)
    prev = tr.current()
    codec = make_codec(name, dtype=dtype, numel=prev.numel())
    state = codec.new_state(shard=prev)
    receiver = prev.clone()
    for _ in range(60):
        new = tr.step()
        got, _ = roundtrip(codec, receiver, new, state)
        receiver = got
    assert_bits_equal(receiver, new)


@pytest.mark.parametrize("name", [c for c in CODECS if c != "raw"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_overflow_is_reported_and_never_written_past_capacity(name, dtype):
    gen = torch.Generator().manual_seed(5)
    n = 1000
    codec = make_codec(name, dtype=dtype, numel=n)
    prev = torch.randn(n, generator=gen).to(dtype)
    state = codec.new_state(shard=prev)
    new = adversarial_step(prev, kind="replace", gen=gen)
    cap = codec.fixed_bytes
    buf = torch.full((cap + 64,), 0x5A, dtype=torch.uint8)
    out = buf[:cap]
    codec.encode(shard=new, state=state, out=out)
    header = out[:HEADER_BYTES].view(torch.int64)
    assert header[1] & FLAG_OVERFLOW
    assert header[2] > cap
    assert torch.all(buf[cap:] == 0x5A), "encoder wrote past its capacity"
    with pytest.raises(ValueError, match="overflow"):
        codec.decode(payload=out, target=prev.clone())


@pytest.mark.parametrize("name", CODECS)
def test_unsupported_dtype_is_a_clear_error(name):
    with pytest.raises(TypeError, match="CIERA gathers"):
        make_codec(name, dtype=torch.float64, numel=8)


def test_unknown_codec():
    with pytest.raises(ValueError, match="unknown codec"):
        make_codec("zstd", dtype=torch.bfloat16, numel=8)


@pytest.mark.parametrize("name", CODECS)
def test_wrong_payload_codec_rejected(name):
    other = "raw" if name != "raw" else "exponent_reuse"
    a = make_codec(name, dtype=torch.bfloat16, numel=64)
    b = make_codec(other, dtype=torch.bfloat16, numel=64)
    x = torch.randn(64).to(torch.bfloat16)
    out = torch.zeros(b.clamp_capacity(b.max_bytes), dtype=torch.uint8)
    b.encode(shard=x, state=b.new_state(shard=x), out=out)
    with pytest.raises(ValueError, match="not a"):
        a.decode(payload=out, target=x.clone())


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(CODECS),
    dtype=st.sampled_from(DTYPES),
    data=st.data(),
)
def test_property_arbitrary_bit_patterns(name, dtype, data):
    """Any two arrays of bit patterns (NaN payloads included) round-trip exactly."""
    n = data.draw(st.integers(0, 200))
    width = 16 if dtype != torch.float32 else 32
    ints = st.integers(-(1 << (width - 1)), (1 << (width - 1)) - 1)
    bits_dtype = torch.int16 if width == 16 else torch.int32
    prev = torch.tensor(data.draw(st.lists(ints, min_size=n, max_size=n)), dtype=bits_dtype).view(dtype)
    new = torch.tensor(data.draw(st.lists(ints, min_size=n, max_size=n)), dtype=bits_dtype).view(dtype)
    codec = make_codec(name, dtype=dtype, numel=n)
    state = codec.new_state(shard=prev)
    got, _ = roundtrip(codec, prev, new, state)
    assert_bits_equal(got, new)
