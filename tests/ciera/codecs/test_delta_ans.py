"""delta_ans codec: the format's pieces, sizes and escapes, corrupt payloads, and what it saves.

The properties every codec keeps (round trips of every dtype, size and bit pattern, overflow) are in
test_codecs_common (parametrised over every registered codec); test_native re-runs this module and
that one comparing the reference and the native twin byte for byte.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ciera.codecs import FLAG_OVERFLOW, HEADER_BYTES, as_bits, codec_spec, make_codec
from ciera.codecs.delta_ans import (LANES, PROB_BITS, RAW_MARK, DeltaAnsCodec, DeltaAnsLayout, quantize,
                                    symbols)
from ciera.codecs.formats import float_format
from ciera.testing.trajectory import AdamTrajectory, adversarial_step

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def encode(codec, prev, new, capacity=None):
    cap = codec.clamp_capacity(codec.max_bytes if capacity is None else capacity)
    out = torch.full((cap,), 0xA7, dtype=torch.uint8)
    codec.encode(shard=new, state=codec.new_state(shard=prev), out=out)
    return out, int(out[16:24].view(torch.int64)[0])


def decoded(codec, prev, payload):
    target = prev.clone()
    codec.decode(payload=payload, target=target)
    return target


def test_registered():
    codec = make_codec("delta_ans", dtype=torch.bfloat16, numel=10)
    assert isinstance(codec, DeltaAnsCodec) and codec.codec_id == 3 and codec.reads_previous == "values"
    assert codec.block_size == 32768 and codec.layout.steps == 1024
    assert codec.kernels == "ciera.codecs.delta_ans.kernels"  # its Triton twin: tests/ciera/kernels/test_delta_ans_triton.py


@pytest.mark.parametrize("block", [0, 32, 96, 1 << 20])
def test_block_size_validated(block):
    with pytest.raises(ValueError, match=f"block_size={block} must be a power of two"):
        make_codec("delta_ans", dtype=torch.bfloat16, numel=10, block_size=block)


@pytest.mark.parametrize("dtype,symbols_,words,fixed", [(torch.bfloat16, 28, 2 * 1024, 64 + 128),
                                                        (torch.float16, 28, 2 * 1024, 48 + 128),
                                                        (torch.float32, 44, 3 * 1024, 64 + 128)])
def test_layout(dtype, symbols_, words, fixed):
    lay = DeltaAnsLayout(float_format(dtype), 40000, 32768)
    assert (lay.n_blocks, lay.n_streams, lay.n_symbols, lay.max_words) == (2, 64, symbols_, words)
    assert lay.off_data(0) == fixed and lay.off_data(3) == lay.off_data(0) + 16 * -(-3 * 2 * symbols_ // 16)
    assert lay.lane_values("cpu").tolist() == [1024] * 32 + [226] * 32  # 40000 - 32768 = 32 * 226
    assert DeltaAnsLayout(float_format(dtype), 100, 64).lane_values("cpu").tolist() == [2] * 32 + [2] * 4 + [1] * 28
    assert lay.block_values("cpu").tolist() == [32768, 7232]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_symbols_split_small_and_large_changes(dtype):
    lay = DeltaAnsLayout(float_format(dtype), 1, 64)
    W = lay.width
    z = torch.tensor([0, 1, 15, 16, 17, 31, 32, (1 << W) - 1], dtype=torch.int64)
    sym, k = symbols(lay, z)
    assert sym.tolist() == [0, 1, 15, 16, 16, 16, 17, W + 11]
    assert k.tolist() == [0, 0, 0, 4, 4, 4, 5, W - 1]
    assert int(sym.max()) == lay.n_symbols - 1


def test_quantized_tables_sum_to_the_total_and_keep_every_symbol():
    gen = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 5, (50, 28), generator=gen) * torch.randint(0, 2, (50, 28), generator=gen)
    counts[:, 3] += torch.randint(1, 10**6, (50,), generator=gen)  # skewed rows
    counts[0] = 0
    counts[0, 7] = 9  # one symbol: all of it
    f = quantize(counts)
    assert torch.all(f.sum(1) == 1 << PROB_BITS)
    assert torch.all((f > 0) == (counts > 0))
    assert f[0, 7] == 1 << PROB_BITS


@pytest.mark.parametrize("dtype", DTYPES)
def test_unchanged_shard_costs_only_tables_and_states(dtype):
    n = 3 * 32768 + 1000
    x = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(dtype)
    codec = make_codec("delta_ans", dtype=dtype, numel=n)
    out, needed = encode(codec, x, x)
    lay = codec.layout
    n_tab = int(torch.unique((as_bits(x).to(torch.int64) >> lay.fmt.mant_bits) & ((1 << lay.fmt.exp_bits) - 1)).numel())
    # z = 0 everywhere: probability 1, no words; a stream is its 4-byte state
    assert needed == lay.off_data(n_tab) + 4 * int((lay.lane_values("cpu") > 0).sum())
    assert torch.equal(as_bits(decoded(codec, x, out)), as_bits(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_replaced_shard_goes_raw_and_stays_within_max_bytes(dtype):
    n = 70_001
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(n, generator=gen).to(dtype)
    y = adversarial_step(x, kind="replace", gen=gen)
    codec = make_codec("delta_ans", dtype=dtype, numel=n, block_size=1024)
    out, needed = encode(codec, x, y)
    assert needed <= codec.max_bytes
    lay = codec.layout
    n_tab = int(out[lay.off_map : lay.off_map + lay.map_bytes].to(torch.int64).bitwise_count().sum()) \
        if hasattr(torch.Tensor, "bitwise_count") else None
    counts = out[lay.off_counts(n_tab or 0) if n_tab is not None else 0:][: 2 * lay.n_streams] if n_tab is not None else None
    if counts is not None:
        marks = counts.view(torch.int16).to(torch.int64) & 0xFFFF
        assert torch.all(marks == RAW_MARK)  # every block raw: random patterns do not compress
    assert torch.equal(as_bits(decoded(codec, x, out)), as_bits(y))


def test_tables_dearer_than_the_shard_send_it_all_raw():
    """64 values with 64 different previous exponents: 64 tables of 56 bytes against 128 raw
    bytes. The payload is the fixed part plus raw values: max_bytes exactly, an empty map."""
    x = (2.0 ** torch.arange(-32, 32, dtype=torch.float32)).to(torch.bfloat16)
    y = (x.float() * 1.01).to(torch.bfloat16)
    codec = make_codec("delta_ans", dtype=torch.bfloat16, numel=64, block_size=64)
    out, needed = encode(codec, x, y)
    lay = codec.layout
    assert needed == codec.max_bytes == lay.off_data(0) + 128
    assert torch.all(out[lay.off_map : lay.off_map + lay.map_bytes] == 0)
    assert torch.all(out[lay.off_counts(0) : lay.off_counts(0) + 2 * LANES] == 0xFF)
    assert torch.equal(as_bits(decoded(codec, x, out)), as_bits(y))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [64, 1024, 32768])
@pytest.mark.parametrize("n", [1, 31, 33, 64, 65, 1000, 4099])
def test_roundtrip_blocks_and_partial_lanes(dtype, block, n):
    tr = AdamTrajectory(numel=n, dtype=dtype, lr=3e-4, seed=n)
    x = tr.step().clone()
    codec = make_codec("delta_ans", dtype=dtype, numel=n, block_size=block)
    for y in (tr.step().clone(), adversarial_step(x, kind="nan_inf", gen=torch.Generator().manual_seed(n))):
        out, needed = encode(codec, x, y)
        assert needed <= codec.max_bytes
        assert torch.equal(as_bits(decoded(codec, x, out[:needed + (-needed) % 16])), as_bits(y))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(DTYPES), data=st.data())
def test_property_small_moves_any_pattern(dtype, data):
    """Arbitrary previous patterns moved by small signed steps (the coder's common case, all
    symbols and bit lengths) round-trip, in blocks of 64 (2 steps per stream)."""
    n = data.draw(st.integers(1, 300))
    width = float_format(dtype).total_bits
    prev = torch.tensor(data.draw(st.lists(st.integers(0, (1 << width) - 1), min_size=n, max_size=n)), dtype=torch.int64)
    step = torch.tensor(data.draw(st.lists(st.integers(-(1 << 20), 1 << 20), min_size=n, max_size=n)), dtype=torch.int64)
    shift = torch.tensor(data.draw(st.lists(st.integers(0, 20), min_size=n, max_size=n)), dtype=torch.int64)
    new = (prev + (step >> shift)) & ((1 << width) - 1)
    bits = float_format(dtype).bits_dtype
    wrap = lambda u: torch.where(u >= 1 << (width - 1), u - (1 << width), u).to(bits).view(dtype)  # noqa: E731
    x, y = wrap(prev), wrap(new)
    codec = make_codec("delta_ans", dtype=dtype, numel=n, block_size=64)
    out, _ = encode(codec, x, y)
    assert torch.equal(as_bits(decoded(codec, x, out)), as_bits(y))


@pytest.mark.parametrize("dtype", DTYPES)
def test_overflow_writes_only_the_header(dtype):
    n = 4099
    tr = AdamTrajectory(numel=n, dtype=dtype, lr=3e-4, seed=4)
    x = tr.step().clone()
    y = tr.step()
    codec = make_codec("delta_ans", dtype=dtype, numel=n)
    out, needed = encode(codec, x, y, capacity=codec.fixed_bytes)
    assert int(out[8:16].view(torch.int64)[0]) & FLAG_OVERFLOW and needed > codec.fixed_bytes
    assert torch.all(out[HEADER_BYTES:] == 0xA7)


def _corrupt_cases(codec, out, needed):
    lay = codec.layout
    n_tab = int(sum(bin(int(b)).count("1") for b in out[lay.off_map : lay.off_map + lay.map_bytes]))
    table = out.clone()
    table[lay.off_tables] ^= 1  # first frequency off by one
    count = out.clone()
    count[lay.off_counts(n_tab)] += 1  # the first stream claims one word more
    word = out.clone()
    word[lay.off_data(n_tab) + 3] ^= 0x10  # a high bit of the first stream's state: every step after differs
    mark = out.clone()
    mark[lay.off_counts(n_tab) + 2 : lay.off_counts(n_tab) + 4] = 0xFF  # one stream of an ANS block marked raw
    nomap = out.clone()
    nomap[lay.off_map : lay.off_map + lay.map_bytes] = 0  # no tables: the counts move, contexts have none
    return [("frequency table", table[:needed]), ("past the payload's end", count[:needed]), ("stream", word[:needed]),
            ("marked raw", mark[:needed]), ("", nomap[:needed]), ("past the payload", out[: lay.off_data(n_tab) + 8])]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("backend", ["torch", "native"])
def test_corrupt_payloads_are_errors(dtype, backend):
    """Every check of the decoder, on the reference and the native twin: a corrupt payload raises a
    'corrupt payload' error rather than decoding to wrong values. (Like delta's packed bits, the raw
    bits below a large change's leading one carry no redundancy: a flip there is caught by the
    gather's verify hash, not here.)"""
    from ciera import native

    if backend == "native" and not native.available():
        pytest.skip(native.unavailable_reason())
    n = 5000
    tr = AdamTrajectory(numel=n, dtype=dtype, lr=1e-4, seed=6)
    x = tr.step().clone()
    y = tr.step()
    codec = make_codec("delta_ans", dtype=dtype, numel=n, backend=backend, block_size=1024)
    out, needed = encode(codec, x, y)
    impl = native.codec_module(codec_spec("delta_ans")) if backend == "native" else DeltaAnsCodec
    decode = impl.decode_native if backend == "native" else impl.decode_reference
    for what, payload in _corrupt_cases(codec, out, needed):
        with pytest.raises(ValueError, match=f"delta_ans: corrupt payload.*{what}"):
            decode(layout=codec.layout, payload=payload.clone(), target_bits=as_bits(x.clone()))


@pytest.mark.parametrize("lr,most", [(1e-4, 0.15), (3e-4, 0.2)])
def test_compresses_adam_trajectory_below_delta(lr, most):
    """After warm-up, bf16 AdamW steps of a 2^16-value shard: at most ``most`` of raw (the
    project's targets) and at most 0.85 of what delta sends."""
    n = 1 << 16
    tr = AdamTrajectory(numel=n, dtype=torch.bfloat16, lr=lr, seed=0)
    for _ in range(30):
        tr.step()
    x = tr.current().clone()
    y = tr.step()
    ans = encode(make_codec("delta_ans", dtype=torch.bfloat16, numel=n), x, y)[1] / (2 * n)
    delta = encode(make_codec("delta", dtype=torch.bfloat16, numel=n), x, y)[1] / (2 * n)
    assert ans <= most and ans <= 0.85 * delta, (ans, delta)


@pytest.mark.parametrize("avx512", ["0", "1"])
def test_every_context_with_a_table(avx512, monkeypatch):
    """bf16 previous values with all 256 exponents: 256 tables, so no context lacks one (the
    AVX-512 decoder's table bytes then use 0xFF as a table, not as "none"). The native twin, on
    the portable and the AVX-512 path, writes the reference's bytes and decodes them."""
    from ciera import native

    if not native.available():
        pytest.skip(native.unavailable_reason())
    monkeypatch.setenv("CIERA_NATIVE_AVX512", avx512)
    g = torch.Generator().manual_seed(3)
    n = 256 * 200
    exps = torch.arange(n) % 256
    prev = (torch.randint(0, 2, (n,), generator=g) << 15) | (exps << 7) | torch.randint(0, 128, (n,), generator=g)
    new = (prev + torch.randint(-3, 4, (n,), generator=g)) & 0xFFFF
    x, y = (t.to(torch.int32).to(torch.int16).view(torch.bfloat16) for t in (prev, new))
    ref = make_codec("delta_ans", dtype=torch.bfloat16, numel=n, backend="torch", block_size=1024)
    nat = make_codec("delta_ans", dtype=torch.bfloat16, numel=n, backend="native", block_size=1024)
    want, needed = encode(ref, x, y)
    got, _ = encode(nat, x, y)
    assert torch.equal(got, want)
    assert int(want[ref.layout.off_map : ref.layout.off_map + 32].sum()) == 32 * 255  # every context mapped
    assert needed < ref.max_bytes // 2  # coded, not sent raw
    assert torch.equal(as_bits(decoded(nat, x, want)), as_bits(y))
