"""Native CPU codecs == the pure-torch references (== the Triton twins), byte for byte, bit for bit.

1. **Every existing codec test, re-run comparing implementations.** The test functions of
   ``test_codecs_common``, ``test_delta`` and ``test_exponent_reuse`` are collected again here
   (``test_all_impls_<module>_<name>``, parametrisations and hypothesis included) with
   ``Codec._impl`` replaced, for ``backend='auto'``, by a runner that calls the reference, the
   native twin and (with ``--runslow``, under the Triton interpreter) the Triton twin on copies of
   the same inputs, asserts identical ``needed``, payload bytes (the whole buffer: the twins write
   exactly what the reference writes), sender state and decoded bits, and hands the reference's
   results back to the test. Nothing is copied from those modules: a new case there is a new case
   here.
2. ``decode_many_native`` against a loop of ``decode_reference`` over rows.
3. What only the native code has: thread-count independence, memory safety on corrupt payloads,
   dispatch and the logged fall-back.
4. The cost model's CPU decision with measured native speeds.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import random
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import test_codecs_common
import test_delta
import test_delta_ans
import test_exponent_reuse
from ciera import native
from ciera.codecs import HEADER_BYTES, as_bits, codec_spec, codec_specs, make_codec
from ciera.codecs.base import Codec
from ciera.cost_model import CodecEstimate, CodecSpeed, LinkModel, decide
from ciera.measure import measure_codec_speed
from ciera.native import _lib
from ciera.testing.trajectory import AdamTrajectory, adversarial_step

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native codecs not built: {native.unavailable_reason()}")

NATIVE_CODECS = [spec.name for spec in codec_specs() if spec.native]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


# -- 1. every existing case, all implementations compared ---------------------------------------
def _twins(codec: Codec, which: str, with_triton: bool):
    twins = [("native", getattr(native.codec_module(codec_spec(codec.name), required=True), f"{which}_native"))]
    if with_triton and codec.kernels:  # every codec with a Triton twin (under the interpreter on CPU)
        import importlib

        twins.append(("triton", getattr(importlib.import_module(codec.kernels), f"{which}_triton")))
    return twins


def _comparing_impl(with_triton: bool):
    original = Codec._impl

    def _impl(self, which, t):
        if self.backend != "auto" or self.name not in NATIVE_CODECS:
            return original(self, which, t)
        ref = getattr(type(self), f"{which}_reference")
        twins = _twins(self, which, with_triton)
        if which == "encode":
            def encode(*, layout, shard_bits, state, out):
                results = []
                for name, fn in [("reference", ref)] + twins:
                    o, s = out.clone(), state.clone()
                    results.append((name, int(fn(layout=layout, shard_bits=shard_bits, state=s, out=o)), o, s))
                _, needed, o_ref, s_ref = results[0]
                for name, n, o, s in results[1:]:
                    assert n == needed, f"{self.name} {name}: needed {n} != reference {needed}"
                    diff = (o != o_ref).nonzero().flatten()
                    assert diff.numel() == 0, f"{self.name} {name}: payload bytes differ at {diff[:16].tolist()}"
                    assert torch.equal(s, s_ref), f"{self.name} {name}: sender state differs"
                out.copy_(o_ref)
                state.copy_(s_ref)
                return needed
            return encode

        def decode(*, layout, payload, target_bits):
            results = []
            for name, fn in [("reference", ref)] + twins:
                t = target_bits.clone()
                try:
                    fn(layout=layout, payload=payload, target_bits=t)
                    results.append((name, t, None))
                except ValueError as e:  # corrupt payloads: every implementation refuses them
                    results.append((name, None, e))
            _, t_ref, e_ref = results[0]
            for name, t, e in results[1:]:
                assert (e is None) == (e_ref is None), f"{self.name} {name}: error {e!r} vs reference {e_ref!r}"
                if e is None:
                    assert torch.equal(t, t_ref), f"{self.name} {name}: decoded bits differ"
            if e_ref is not None:
                raise e_ref
            target_bits.copy_(t_ref)
        return decode

    return _impl


@pytest.fixture
def compare_all_implementations(monkeypatch, request):
    slow = request.config.getoption("--runslow") or os.environ.get("CIERA_RUN_SLOW") == "1"
    from ciera.kernels import triton_available

    monkeypatch.setattr(Codec, "_impl", _comparing_impl(with_triton=slow and triton_available()))
    monkeypatch.setattr(Codec, "_direct", lambda self, t: None)  # every call through _impl, compared


# Long trajectories through the (slow) delta reference: compared in the --runslow run only; their
# native-only originals still run by default.
_SLOW_WHEN_COMPARED = {"test_long_trajectory_no_drift", "test_adam_trajectory_no_drift"}


def _recollect(module, prefix):
    """Test functions of ``module`` under new names in this module, with the comparing fixture."""
    for name, fn in list(vars(module).items()):
        if name.startswith("test_") and callable(fn) and "triton" not in name:
            wrapper = functools.wraps(fn)(lambda *a, __fn=fn, **kw: __fn(*a, **kw))
            # A copy of the marks (parametrize...): the original function must stay as it was.
            wrapper.pytestmark = list(getattr(fn, "pytestmark", []))
            wrapper = pytest.mark.usefixtures("compare_all_implementations")(wrapper)
            if name in _SLOW_WHEN_COMPARED:
                wrapper = pytest.mark.slow(wrapper)
            globals()[f"test_all_impls_{prefix}_{name[5:]}"] = wrapper


_recollect(test_codecs_common, "common")
_recollect(test_delta, "delta")
_recollect(test_delta_ans, "dans")
_recollect(test_exponent_reuse, "er")


def test_comparison_runs_every_implementation(compare_all_implementations, monkeypatch):
    """The comparing runner really calls the native twin (guards the re-collection above)."""
    calls = []
    mod = native.codec_module(codec_spec("delta"))
    real = mod.encode_native
    monkeypatch.setattr(mod, "encode_native", lambda **kw: calls.append(1) or real(**kw))
    codec = make_codec("delta", dtype=torch.bfloat16, numel=100)
    x = torch.randn(100).to(torch.bfloat16)
    codec.encode(shard=x, state=codec.new_state(shard=x), out=torch.empty(codec.clamp_capacity(codec.max_bytes),
                                                                           dtype=torch.uint8))
    assert calls == [1]
    assert sum(n.startswith("test_all_impls_") for n in globals()) > 30


# -- 2. decode_many ------------------------------------------------------------------------------
def _payloads(codec, prevs, news, capacity):
    """Flat uint8 buffer of one payload per shard (16-byte aligned offsets, gaps filled with junk)."""
    parts, offsets, pos = [], [], 0
    for p, n in zip(prevs, news):
        out = torch.empty(capacity, dtype=torch.uint8)
        codec.encode(shard=n, state=codec.new_state(shard=p), out=out)
        gap = torch.full((16 * len(parts),), 0x5C, dtype=torch.uint8)  # uneven spacing
        parts += [gap, out]
        pos += gap.numel()
        offsets.append(pos)
        pos += out.numel()
    return torch.cat(parts), torch.tensor(offsets, dtype=torch.int64)


@pytest.mark.parametrize("name", NATIVE_CODECS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_many_matches_a_loop_of_decode_reference(name, dtype):
    world, n = 5, 1031
    gen = torch.Generator().manual_seed(4)
    codec = make_codec(name, dtype=dtype, numel=n)
    trajs = [AdamTrajectory(numel=n, dtype=dtype, lr=3e-4, seed=r) for r in range(world)]
    prevs = [t.step() for t in trajs]
    news = [t.step() for t in trajs]
    news[2] = adversarial_step(prevs[2], kind="nan_inf", gen=gen, fraction=0.1)
    news[4] = adversarial_step(prevs[4], kind="replace", gen=gen)
    payloads, offsets = _payloads(codec, prevs, news, codec.clamp_capacity(codec.max_bytes))
    rows = torch.tensor([3, 0, 4, 2], dtype=torch.int64)  # not every row, not in order
    got = as_bits(torch.stack(prevs)).clone()
    mod = native.codec_module(codec_spec(name), required=True)
    mod.decode_many_native(layout=codec.layout, payloads=payloads, rows=rows, offsets=offsets[rows],
                           targets_bits=got)
    want = as_bits(torch.stack(prevs)).clone()
    for r, off in zip(rows.tolist(), offsets[rows].tolist()):
        cap = int(payloads[off + 24 : off + 32].view(torch.int64)[0])
        type(codec).decode_reference(layout=codec.layout, payload=payloads[off : off + cap], target_bits=want[r])
    assert torch.equal(got, want)
    assert torch.equal(got[3], as_bits(news[3])) and torch.equal(got[1], as_bits(prevs[1]))  # row 1 untouched


@pytest.mark.parametrize("name", NATIVE_CODECS)
def test_decode_many_rejects_bad_headers_and_offsets(name):
    n = 300
    codec = make_codec(name, dtype=torch.bfloat16, numel=n)
    other = make_codec("exponent_reuse" if name == "delta" else "delta", dtype=torch.bfloat16, numel=n)
    x = torch.randn(n).to(torch.bfloat16)
    y = adversarial_step(x, kind="replace", gen=torch.Generator().manual_seed(0))
    mod = native.codec_module(codec_spec(name), required=True)
    good, off = _payloads(codec, [x], [y], codec.clamp_capacity(codec.max_bytes))
    overflowed, _ = _payloads(codec, [x], [y], codec.fixed_bytes)
    wrong, _ = _payloads(other, [x], [y], other.clamp_capacity(other.max_bytes))
    rows = torch.zeros(1, dtype=torch.int64)
    cases = [(overflowed, off, "header"), (wrong, off, "header"), (good, off + 16, "header|arguments"),
             (good, torch.tensor([good.numel()]), "arguments"), (good[:-16], off, "header")]
    for payloads, offsets, match in cases:
        target = as_bits(x).clone().view(1, n)
        with pytest.raises(ValueError, match=match):
            mod.decode_many_native(layout=codec.layout, payloads=payloads, rows=rows, offsets=offsets,
                                   targets_bits=target)
    with pytest.raises(ValueError, match="arguments"):  # row outside targets
        mod.decode_many_native(layout=codec.layout, payloads=good, rows=torch.ones(1, dtype=torch.int64),
                               offsets=off, targets_bits=as_bits(x).clone().view(1, n))


# -- 3. native-only properties -------------------------------------------------------------------
@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("name", NATIVE_CODECS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bytes_do_not_depend_on_threads(name, dtype, threads):
    n = 70_001
    tr = AdamTrajectory(numel=n, dtype=dtype, lr=1e-4, seed=2)
    prev, new = tr.step(), tr.step()
    codec = make_codec(name, dtype=dtype, numel=n, backend="native")
    full = codec.clamp_capacity(codec.max_bytes)
    outs = {}
    for k in (1, 2, 3, 7):
        threads(k)
        for cap in (full, codec.clamp_capacity((codec.fixed_bytes + full) // 3)):  # the second overflows
            out = torch.full((cap,), 0x33, dtype=torch.uint8)
            codec.encode(shard=new, state=codec.new_state(shard=prev), out=out)
            outs.setdefault(cap, out)
            assert torch.equal(out, outs[cap]), (k, cap)
        target = prev.clone()
        codec.decode(payload=outs[full], target=target)
        assert torch.equal(as_bits(target), as_bits(new)), k


def _assert_native_equals_reference(ref, nat, x, steps, *, fill, thread_counts, threads, monkeypatch):
    """For each step ``y`` from ``x``: the native codec, on the portable, the AVX2 and the AVX-512
    path (where the CPU has them; otherwise the widest it has) at each thread count, writes the
    reference's payload bytes (out pre-filled with ``fill``) and state, and decodes the reference's
    payload to ``y``'s bits."""
    n, cap = x.numel(), ref.clamp_capacity(ref.max_bytes)
    for y in steps:
        want, want_state = torch.full((cap,), fill, dtype=torch.uint8), ref.new_state(shard=x)
        ref.encode(shard=y, state=want_state, out=want)
        for avx2, avx512 in (("0", "0"), ("1", "0"), ("1", "1")):
            monkeypatch.setenv("CIERA_NATIVE_AVX2", avx2)
            monkeypatch.setenv("CIERA_NATIVE_AVX512", avx512)
            for k in thread_counts:
                threads(k)
                got, state = torch.full((cap,), fill, dtype=torch.uint8), nat.new_state(shard=x)
                nat.encode(shard=y, state=state, out=got)
                assert torch.equal(got, want) and torch.equal(state, want_state), (n, avx2, avx512, k)
                target = x.clone()
                nat.decode(payload=want, target=target)
                assert torch.equal(as_bits(target), as_bits(y)), (n, avx2, avx512, k)


@pytest.mark.parametrize("name", NATIVE_CODECS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_portable_and_avx2_paths_equal_the_reference(name, dtype, threads, monkeypatch):
    """The C library has AVX2 (+BMI2) and, for delta's 16-bit values, AVX-512 (VBMI, VBMI2) paths
    next to portable ones (width lookups, exception masks, group packing and unpacking);
    ``CIERA_NATIVE_AVX2=0`` forces the portable ones and ``CIERA_NATIVE_AVX512=0`` the AVX2 ones
    (read on every call). All give the
    reference's bytes, state and decoded bits on a trajectory step and on adversarial steps, at
    sizes with partial blocks and groups, at 1 and 3 threads (section 1 runs every case with the
    default path only)."""
    small = {"exponent_reuse": (8, 16), "delta": (16, 1024)}.get(name, (64, 1024))  # delta_ans: >= 64
    for n, block in ((70_001, None), (1_037, None), (515, small[0]), (4_099, small[1])):  # delta: 2-byte counts and indices
        tr = AdamTrajectory(numel=n, dtype=dtype, lr=3e-4, seed=5)
        x = tr.step()
        steps = [tr.step()] + [adversarial_step(x, kind=k, gen=torch.Generator().manual_seed(n))
                               for k in ("nan_inf", "all_exponents", "replace", "sign_flip")]
        ref = make_codec(name, dtype=dtype, numel=n, backend="torch", block_size=block)
        nat = make_codec(name, dtype=dtype, numel=n, backend="native", block_size=block)
        _assert_native_equals_reference(ref, nat, x, steps, fill=0x5A, thread_counts=(1, 3),
                                        threads=threads, monkeypatch=monkeypatch)


def _needed_and_capacities(ref, x, y, fractions):
    """The reference's full capacity, its needed bytes for the step x -> y, and the capacities at
    ``fractions`` (eighths) of the way from its fixed part to needed (sorted, distinct)."""
    full = ref.clamp_capacity(ref.max_bytes)
    probe = torch.empty(full, dtype=torch.uint8)
    ref.encode(shard=y, state=ref.new_state(shard=x), out=probe)
    needed = int(probe[16:24].view(torch.int64)[0])
    caps = sorted({ref.clamp_capacity(ref.fixed_bytes + (needed - ref.fixed_bytes) * f // 8) for f in fractions})
    return full, needed, caps


def _assert_encode_equals(nat, x, y, cap, fill, want, want_state, ctx):
    """The native encode of x -> y into ``cap`` bytes pre-filled with ``fill`` writes ``want``
    over the whole buffer and leaves ``want_state``."""
    got, state = torch.full((cap,), fill, dtype=torch.uint8), nat.new_state(shard=x)
    nat.encode(shard=y, state=state, out=got)
    diff = (got != want).nonzero().flatten()
    assert diff.numel() == 0, (*ctx, diff[:8].tolist())
    assert torch.equal(state, want_state), ctx


@pytest.mark.parametrize("name", NATIVE_CODECS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_any_split_of_the_claims_equals_the_reference(name, dtype, threads, monkeypatch):
    """Threads claim grains as they get to them (thread 0 from the front, in place; the others from
    the back, into scratch, until it holds 1.5x an even share). ``CIERA_NATIVE_STALL=k`` starts
    thread k 2 ms late, so the others take what they may: thread 0 nothing (3 threads), a quarter
    (2 threads), or everything (a back thread stalled). Every split writes the reference's bytes
    over the whole buffer at full and partial capacities (the cut inside a back thread's piece),
    the same state, and decodes to the same bits -- at blocks that write their exponents inline and
    larger ones (exponent_reuse 8, 256; delta 128, 1024), on shards of many grains."""
    n = 100_003
    tr = AdamTrajectory(numel=n, dtype=dtype, lr=3e-4, seed=21)
    x = tr.step()
    y = tr.step()
    blocks = (8, 256) if name == "exponent_reuse" else (128, 1024)
    for block in blocks:
        ref = make_codec(name, dtype=dtype, numel=n, backend="torch", block_size=block)
        nat = make_codec(name, dtype=dtype, numel=n, backend="native", block_size=block)
        full, _, caps = _needed_and_capacities(ref, x, y, (3, 7))
        for cap in [full] + caps:
            want, want_state = torch.full((cap,), 0x6B, dtype=torch.uint8), ref.new_state(shard=x)
            ref.encode(shard=y, state=want_state, out=want)
            for stall in ("", "0", "1", "2"):
                monkeypatch.setenv("CIERA_NATIVE_STALL", stall)
                for k in (2, 3):
                    threads(k)
                    _assert_encode_equals(nat, x, y, cap, 0x6B, want, want_state, (block, cap, stall, k))
                    if cap == full:
                        target = x.clone()
                        nat.decode(payload=want, target=target)
                        assert torch.equal(as_bits(target), as_bits(y)), (block, stall, k)


@pytest.mark.parametrize("name", NATIVE_CODECS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_short_shards_and_odd_thread_splits_equal_the_reference(name, dtype, threads, monkeypatch):
    """Shards shorter than one thread's grain (one block, one 64-value tile, one group), and sizes
    whose split over 1..3 threads ends mid-block or mid-tile: reference bytes, state and bits on
    both the portable and the AVX2 exception and width paths (the exceptions come from the values
    masked to their widths)."""
    for n in (1, 7, 63, 64, 65, 127, 129, 383, 385, 1_000):
        tr = AdamTrajectory(numel=n, dtype=dtype, lr=3e-4, seed=n)
        x = tr.step()
        steps = [tr.step(), adversarial_step(x, kind="all_exponents", gen=torch.Generator().manual_seed(n))]
        ref = make_codec(name, dtype=dtype, numel=n, backend="torch")
        nat = make_codec(name, dtype=dtype, numel=n, backend="native")
        _assert_native_equals_reference(ref, nat, x, steps, fill=0xA5, thread_counts=(1, 2, 3),
                                        threads=threads, monkeypatch=monkeypatch)


@pytest.mark.parametrize("name", NATIVE_CODECS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_partial_capacities_equal_the_reference(name, dtype, threads, monkeypatch):
    """Capacities between the fixed part and the payload: the room for exponent slots (delta:
    blocks) runs out inside a 64-value tile, on a tile's edge and inside a later thread's chunk.
    Every path (portable, AVX2, AVX-512) at 1 and 3 threads writes the reference's bytes over the
    whole buffer (nothing past what fits), the same overflow header, and the same state."""
    n = 4_099
    tr = AdamTrajectory(numel=n, dtype=dtype, lr=3e-4, seed=11)
    x = tr.step()
    y = tr.step()
    ref = make_codec(name, dtype=dtype, numel=n, backend="torch")
    nat = make_codec(name, dtype=dtype, numel=n, backend="native")
    _, needed, caps = _needed_and_capacities(ref, x, y, (1, 3, 5, 7))
    assert needed > ref.fixed_bytes + 64, "the step must change enough to overflow part-way"
    for cap in caps:
        want, want_state = torch.full((cap,), 0x3C, dtype=torch.uint8), ref.new_state(shard=x)
        ref.encode(shard=y, state=want_state, out=want)
        assert int(want[8:16].view(torch.int64)[0]) & 1, cap  # overflowed
        for avx2, avx512 in (("0", "0"), ("1", "0"), ("1", "1")):
            monkeypatch.setenv("CIERA_NATIVE_AVX2", avx2)
            monkeypatch.setenv("CIERA_NATIVE_AVX512", avx512)
            for k in (1, 3):
                threads(k)
                _assert_encode_equals(nat, x, y, cap, 0x3C, want, want_state, (cap, avx2, avx512, k))


def _skewed_shard(kind: str, dtype: torch.dtype, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    if kind == "one_key":  # nothing moves: one bin in every lane, as many counts as the planes take
        x = torch.full((n,), -1.5, dtype=dtype)
        return x, x.clone()
    if kind == "two_keys":  # one exponent: the first half unchanged, then 70% unchanged and 30% one ulp up
        x = torch.full((n,), 0.75, dtype=dtype)
        y = x.clone()
        i = torch.arange(n)
        y.view(torch.int16)[(i >= n // 2) & (i % 10 < 3)] += 1
        return x, y
    x = (torch.randn(n, generator=gen) * 0.02).to(dtype)
    if kind == "sample_misses":  # the sampled values hold an exponent no other value has
        y = (x.float() + torch.randn(n, generator=gen) * 1e-3).to(dtype)
        keep = torch.arange(1024) * n // 1024
        x[keep] = y[keep] = 3000.0
        return x, y
    if kind == "wide_moves":  # every bit length 0-16, sign flips included
        bits = x.view(torch.int16).clone()
        step = torch.randint(-(1 << 14), 1 << 14, (n,), generator=gen, dtype=torch.int32)
        step = step >> torch.randint(0, 15, (n,), generator=gen, dtype=torch.int32)
        y = (bits.int() + step).to(torch.int16).view(dtype)
        return x, y
    # top_exponents: Inf and NaN patterns, and the largest finite exponents, moving a few ulps
    big = torch.tensor([float("inf"), float("nan"), torch.finfo(dtype).max], dtype=dtype)
    x = big[torch.randint(0, 3, (n,), generator=gen)]
    x.view(torch.int16).add_(torch.randint(-8, 8, (n,), generator=gen, dtype=torch.int16) & 0x7)
    y = (x.view(torch.int16) + torch.randint(-3, 4, (n,), generator=gen, dtype=torch.int16)).view(dtype)
    return x, y


@pytest.mark.parametrize("kind,dtype,n", [("two_keys", torch.bfloat16, (1 << 21) - 128 * 37 - 5), ("sample_misses", torch.bfloat16, 1 << 20),
                                          ("wide_moves", torch.bfloat16, 1 << 18), ("wide_moves", torch.float16, 1 << 18),
                                          ("top_exponents", torch.bfloat16, 1 << 17), ("top_exponents", torch.float16, 1 << 17)])
def test_delta_histogram_counts_equal_the_reference_on_skewed_shards(kind, dtype, n, threads, monkeypatch):
    """delta's 16-bit AVX-512 histogram counts, in bit planes of carry-save adders, the values
    whose previous exponent lies in a window of 8 chosen from a sample and whose bit length is at
    most 7; the others one by one. ``two_keys``: about 2^21 values of one exponent, the first half
    unchanged (every lane of one bin: the planes fill as fast as they can, up to the plane a flush
    must come before), then 70% unchanged and 30% one ulp up (the table's width for that exponent
    depends on both counts); the last flush finds pending carries, and a short tail remains. ``sample_misses``: the sampled values hold an exponent no other
    value has, so the window counts almost nothing. ``wide_moves``: every bit length, most of them
    outside the registers. ``top_exponents``: windows at the top of the exponent range (Inf, NaN).
    Every case gives the reference's table and bytes on every path."""
    x, y = _skewed_shard(kind, dtype, n)
    ref = make_codec("delta", dtype=dtype, numel=n, backend="torch")
    nat = make_codec("delta", dtype=dtype, numel=n, backend="native")
    cap = ref.clamp_capacity(ref.max_bytes)
    want = torch.zeros(cap, dtype=torch.uint8)
    ref.encode(shard=y, state=ref.new_state(shard=x), out=want)
    for avx512 in ("0", "1"):
        monkeypatch.setenv("CIERA_NATIVE_AVX512", avx512)
        for k in (1, 2):
            threads(k)
            got = torch.zeros(cap, dtype=torch.uint8)
            nat.encode(shard=y, state=nat.new_state(shard=x), out=got)
            assert torch.equal(got, want), (kind, dtype, avx512, k)


@pytest.mark.parametrize("kind,dtype,n", [("two_keys", torch.bfloat16, (1 << 21) - 128 * 37 - 5), ("sample_misses", torch.bfloat16, 1 << 20),
                                          ("wide_moves", torch.float16, 1 << 18), ("top_exponents", torch.float16, 1 << 17),
                                          ("top_exponents", torch.bfloat16, 1 << 17), ("trajectory", torch.bfloat16, 1 << 20),
                                          ("one_key", torch.bfloat16, (1 << 22) + 3)])
def test_delta_histogram_equals_the_reference_count_for_count(kind, dtype, n, monkeypatch):
    """The width table hides small count errors (its choice rarely sits on a tipping point), so the
    histogram itself is compared, every count, on every path, over the whole shard and over ranges
    that start and end mid-iteration (an AVX-512 range counts 128 values per step, the rest one by
    one)."""
    from ciera.codecs.delta import histogram_reference
    from ciera.codecs.delta.native import histogram_native

    if kind == "trajectory":
        traj = AdamTrajectory(numel=n, dtype=dtype, lr=1e-4, seed=0)
        for _ in range(3):
            traj.step()
        x, y = traj.current(), traj.step()
    else:
        x, y = _skewed_shard(kind, dtype, n)
    layout = make_codec("delta", dtype=dtype, numel=n, backend="native").layout
    xb, yb = as_bits(x), as_bits(y)
    for avx512 in ("0", "1"):
        monkeypatch.setenv("CIERA_NATIVE_AVX512", avx512)
        for lo, hi in ((0, n), (77, n - 1000), (4096 * 3 + 5, 4096 * 5 - 3), (n - 4095, n)):
            want = histogram_reference(layout=layout, shard_bits=yb[lo:hi], state=xb[lo:hi])
            got = histogram_native(layout=layout, shard_bits=yb, state=xb, lo=lo, hi=hi)
            bad = (got != want).nonzero().flatten()
            assert bad.numel() == 0, (kind, dtype, avx512, lo, hi, bad[:4].tolist(), got[bad[:4]].tolist(), want[bad[:4]].tolist())


@pytest.mark.parametrize("dtype,n", [(torch.bfloat16, 128 * 6 + 50), (torch.float16, 128 * 6 + 50), (torch.bfloat16, 128 * 8)])
def test_delta_corrupt_payloads_give_the_same_result_on_every_path(dtype, n, threads, monkeypatch):
    """The AVX-512 decode checks whole blocks on its own (counts, exception indices, sizes against
    the payload's end, in both directions): on payloads with garbage in the counts or the data,
    and on truncated ones, every path reports the same error or decodes the same values, at each
    thread count (at 2 and 3 the last chunk runs backwards from the header's end when that is
    plausible). With whole blocks only, the run's own checks are the last ones."""
    from ciera.codecs.delta.native import decode_native

    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(n, generator=gen) * 0.02).to(dtype)
    y = (x.float() + torch.randn(n, generator=gen) * 2e-3).to(dtype)
    codec = make_codec("delta", dtype=dtype, numel=n, backend="native")
    lay = codec.layout
    out = torch.zeros(codec.clamp_capacity(codec.max_bytes), dtype=torch.uint8)
    codec.encode(shard=y, state=codec.new_state(shard=x), out=out)
    needed = int(out[16:24].view(torch.int64)[0])
    counts = out[lay.off_counts: lay.off_counts + lay.n_blocks]
    assert ((counts > 0) & (counts < lay.raw_mark)).any()  # blocks with exceptions: indices to corrupt

    def decode(payload):
        target = as_bits(x.clone())
        try:
            decode_native(layout=lay, payload=payload, target_bits=target)
        except ValueError as e:
            return str(e)
        return target

    rng = random.Random(7)
    for trial in range(200):
        p = out[:needed].clone()
        if trial % 4 == 0:
            p = p[: rng.randrange(lay.off_data, needed)]
        else:  # edge values too: an index of exactly the block size is the first one past it
            for _ in range(rng.randint(1, 3)):
                p[rng.randrange(lay.off_counts, needed)] = rng.choice([lay.block_size, lay.block_size - 1, 255, rng.randrange(256)])
        for k in (1, 2, 3):
            threads(k)
            got = []
            for avx2, avx512 in (("0", "0"), ("1", "0"), ("1", "1")):
                monkeypatch.setenv("CIERA_NATIVE_AVX2", avx2)
                monkeypatch.setenv("CIERA_NATIVE_AVX512", avx512)
                got.append(decode(p))
            for r in got[1:]:  # at 2 threads the two meet where their speeds take them: which error is found varies
                if isinstance(r, str) and isinstance(got[0], str):
                    assert k == 2 or r == got[0], (trial, k, got[0], r)
                else:
                    assert not isinstance(r, str) and not isinstance(got[0], str) and torch.equal(r, got[0]), (trial, k)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(NATIVE_CODECS), dtype=st.sampled_from(DTYPES), data=st.data())
def test_corrupt_payloads_never_crash(name, dtype, data):
    """Garbage in any section: a ValueError or some decoded values, never a read or write outside
    the payload and target (an out-of-bounds access would crash the test process)."""
    n = data.draw(st.integers(1, 600))
    codec = make_codec(name, dtype=dtype, numel=n, backend="native")
    x = torch.randn(n).to(dtype)
    y = adversarial_step(x, kind=data.draw(st.sampled_from(["replace", "nan_inf", "same"])),
                         gen=torch.Generator().manual_seed(n))
    out = torch.empty(codec.clamp_capacity(codec.max_bytes), dtype=torch.uint8)
    codec.encode(shard=y, state=codec.new_state(shard=x), out=out)
    needed = int(out[16:24].view(torch.int64)[0])
    cut = data.draw(st.integers(HEADER_BYTES, out.numel()))
    for _ in range(data.draw(st.integers(1, 20))):
        out[data.draw(st.integers(HEADER_BYTES, out.numel() - 1))] = data.draw(st.integers(0, 255))
    payload = out[: max(cut - cut % 16, codec.fixed_bytes)] if data.draw(st.booleans()) or needed > cut else out
    target = torch.cat([x.clone(), torch.zeros(8, dtype=dtype)])  # guard values after the target
    try:
        native.codec_module(codec_spec(name)).decode_native(layout=codec.layout, payload=payload.clone(),
                                                target_bits=as_bits(target[:n]))
    except ValueError as e:
        assert "corrupt payload" in str(e)
    assert torch.equal(as_bits(target[n:]), torch.zeros(8, dtype=as_bits(target).dtype))


def test_errors_name_the_codec_and_reason():
    codec = make_codec("exponent_reuse", dtype=torch.bfloat16, numel=64, backend="native")
    x = torch.randn(64).to(torch.bfloat16)
    out = torch.empty(codec.fixed_bytes, dtype=torch.uint8)  # room for no exponent block
    codec.encode(shard=x * 4, state=codec.new_state(shard=x), out=out)
    with pytest.raises(ValueError, match="exponent_reuse: corrupt payload: more changed blocks"):
        native.codec_module(codec_spec("exponent_reuse")).decode_native(layout=codec.layout, payload=out,
                                                            target_bits=as_bits(x.clone()))
    with pytest.raises(ValueError, match="contiguous CPU"):
        native.codec_module(codec_spec("delta")).decode_native(layout=make_codec("delta", dtype=torch.bfloat16, numel=64).layout,
                                                   payload=out, target_bits=as_bits(x.clone())[::2])


@pytest.mark.parametrize("name", NATIVE_CODECS)
def test_layouts_are_read_from_the_library(name):
    """The C layout struct the Python side passes is built from the library's own field list and
    size, each field the Python layout's value of that name (or its float format's)."""
    lib = native.library()
    for dtype, block in [(torch.bfloat16, 8), (torch.float16, 64), (torch.float32, 256)]:
        codec = make_codec(name, dtype=dtype, numel=1000, block_size=64 * block if name == "delta_ans" else block)
        c = native.c_layout(codec)
        fields = [f for f, _ in c._fields_]
        assert fields == lib.ciera_layout_fields(codec.codec_id).decode().split()
        assert ctypes.sizeof(c) == lib.ciera_layout_bytes(codec.codec_id) == 8 * len(fields)
        for f in fields:
            owner = codec.layout if hasattr(codec.layout, f) else codec.layout.fmt
            assert getattr(c, f) == getattr(owner, f), f"{name} {dtype}: field {f}"
    other = "delta" if name == "exponent_reuse" else "exponent_reuse"
    with pytest.raises(RuntimeError, match=f"knows codec id .* as {name}"):
        _lib.layout_type(make_codec(name, dtype=torch.bfloat16, numel=8).codec_id, other)


def test_statuses_and_messages_are_read_from_the_library():
    codes = _lib.statuses()
    assert codes["CIERA_OK"] == 0 and sorted(codes.values()) == list(range(-len(codes) + 1, 1))
    messages = {_lib.message(rc) for rc in codes.values() if rc < 0}
    assert len(messages) == len(codes) - 1 and not any(m.startswith("native error") for m in messages)
    assert _lib.message(min(codes.values()) - 1) == f"native error {min(codes.values()) - 1}"
    with pytest.raises(ValueError, match=f"^delta: {_lib.message(codes['CIERA_E_TRUNCATED'])}$"):
        _lib.raise_for("delta", codes["CIERA_E_TRUNCATED"])
    bad = ctypes.c_int64(0)  # an unknown codec id is refused before any entry is read
    rc = native.library().ciera_decode_many(99, None, None, 0, None, None, 1, None, 1, 0, 1, ctypes.byref(bad))
    assert rc == codes["CIERA_E_CODEC"] and bad.value == -1


@pytest.mark.parametrize("codec_id", [0, 4, 99, -1])  # 0: raw, which has no native twin
def test_unknown_codec_id_fails_with_a_named_status_at_every_entry_point(codec_id):
    lib, codes = native.library(), _lib.statuses()
    assert lib.ciera_codec_name(codec_id) is None
    out = torch.zeros(64, dtype=torch.uint8)
    assert lib.ciera_encode(codec_id, None, None, None, out.data_ptr(), out.numel(), 1) == codes["CIERA_E_CODEC"]
    assert lib.ciera_decode(codec_id, None, out.data_ptr(), out.numel(), None, 1) == codes["CIERA_E_CODEC"]
    with pytest.raises(ValueError, match=f"unknown codec id .*: codec id {codec_id}$"):
        _lib.decode_many(name="x", codec_id=codec_id, clayout=ctypes.c_int64(0), bits_dtype=torch.int16, numel=4,
                         payloads=out, rows=torch.zeros(1, dtype=torch.int64),
                         offsets=torch.zeros(1, dtype=torch.int64), targets_bits=torch.zeros(2, 4, dtype=torch.int16))


def test_native_codec_ids_are_the_wire_table():
    from ciera.codecs.registry import WIRE_WORDS

    ids = {name: word for name, word in WIRE_WORDS.items() if word > 0 and codec_spec(name).native}
    assert set(ids) == set(NATIVE_CODECS)
    assert {name: make_codec(name, dtype=torch.bfloat16, numel=8).codec_id for name in ids} == ids
    assert {name: native.library().ciera_codec_name(word).decode() for name, word in ids.items()} == \
        {name: name for name in ids}
    # The library lists exactly these (CIERA_CODECS), and _lib declares each one's entry points.
    listed = {native.library().ciera_codec_name(i).decode(): i for i in range(1, _lib.MAX_CODEC_ID + 1)
              if native.library().ciera_codec_name(i) is not None}
    assert listed == ids
    for word in ids.values():
        symbol = native.library().ciera_codec_symbol(word).decode()
        assert getattr(native.library(), f"ciera_{symbol}_encode").argtypes is not None


def test_dispatch_auto_native_torch(monkeypatch):
    seen = []
    mod = native.codec_module(codec_spec("exponent_reuse"))
    real, real_direct = mod.decode_native, _lib.Direct.decode
    monkeypatch.setattr(mod, "decode_native", lambda **kw: seen.append("native") or real(**kw))
    monkeypatch.setattr(_lib.Direct, "decode", lambda self, **kw: seen.append("direct") or real_direct(self, **kw))
    x = torch.randn(64).to(torch.bfloat16)
    for backend, expect in (("auto", ["direct"]), ("native", ["direct"]), ("torch", [])):
        codec = make_codec("exponent_reuse", dtype=torch.bfloat16, numel=64, backend=backend)
        out = torch.empty(codec.clamp_capacity(codec.max_bytes), dtype=torch.uint8)
        codec.encode(shard=x, state=codec.new_state(shard=x), out=out)
        seen.clear()
        codec.decode(payload=out, target=x.clone())
        assert seen == expect, backend
        seen.clear()  # a header read on the host: the checked path, through decode_native
        codec.decode(payload=out, target=x.clone(), header=codec._check_payload(out))
        assert seen == (["native"] if expect else []), backend
    with pytest.raises(ValueError, match="'native'"):
        make_codec("delta", dtype=torch.bfloat16, numel=8, backend="numba")


@pytest.mark.parametrize("name", NATIVE_CODECS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_direct_calls_equal_the_checked_path(name, dtype, threads, monkeypatch):
    """``Codec.encode``/``decode``'s one-call native path (header written and checked in C) gives
    the checked path's payload bytes (header included), state and bits, at 1..3 threads and on an
    overflowing capacity; arguments it does not take and refused headers go to the checked path,
    whose errors name the problem."""
    n = 5_003
    tr = AdamTrajectory(numel=n, dtype=dtype, lr=1e-4, seed=9)
    prev = tr.step()
    steps = [tr.step(), adversarial_step(prev, kind="replace", gen=torch.Generator().manual_seed(3))]
    codec = make_codec(name, dtype=dtype, numel=n)
    direct = codec._direct(prev)
    assert direct is not None
    full = codec.clamp_capacity(codec.max_bytes)
    overflows = 0
    for k in (1, 2, 3):
        threads(k)
        for new in steps:
            for cap in (full, codec.clamp_capacity(codec.fixed_bytes)):  # the second may overflow
                got, want = (torch.full((cap,), 0x3C, dtype=torch.uint8) for _ in range(2))
                s_got, s_want = codec.new_state(shard=prev), codec.new_state(shard=prev)
                assert direct.encode(shard=new, state=s_got, out=got)
                with monkeypatch.context() as m:
                    m.setattr(Codec, "_direct", lambda self, t: None)
                    codec.encode(shard=new, state=s_want, out=want)
                assert torch.equal(got, want) and torch.equal(s_got, s_want), (k, cap)
                target = prev.clone()
                overflowed = bool(int(got[8:16].view(torch.int64)[0]) & 1)
                overflows += overflowed
                assert direct.decode(payload=got, target=target) == (not overflowed)
                if overflowed:  # refused by the direct call (target untouched), named by the checked one
                    assert torch.equal(target, prev)
                    with pytest.raises(ValueError, match="overflow"):
                        codec.decode(payload=got, target=target)
                else:
                    assert torch.equal(as_bits(target), as_bits(new)), (k, cap)
    assert overflows >= 3
    new = steps[0]
    out = torch.empty(full, dtype=torch.uint8)
    codec.encode(shard=new, state=codec.new_state(shard=prev), out=out)
    assert not direct.encode(shard=new[:-1], state=codec.new_state(shard=prev), out=out)  # wrong size
    assert not direct.decode(payload=out, target=prev.to(torch.float64))  # wrong dtype
    other = make_codec("exponent_reuse" if name == "delta" else "delta", dtype=dtype, numel=n)
    o = torch.empty(other.clamp_capacity(other.max_bytes), dtype=torch.uint8)
    other.encode(shard=new, state=other.new_state(shard=prev), out=o)
    with pytest.raises(ValueError, match="not a"):
        codec.decode(payload=o, target=prev.clone())


def test_fewer_threads_granted_than_asked():
    """A runtime that grants fewer OpenMP threads than torch asks for (``OMP_THREAD_LIMIT=1``, read
    at start-up: a fresh process) still gives the reference's bytes and bits: every parallel region
    cuts its chunks for the threads it gets."""
    code = ("import torch; torch.set_num_threads(3)\n"
            "from ciera.codecs import make_codec, as_bits\n"
            "n = 70_001; p = torch.randn(n).to(torch.bfloat16); q = (p.float() * 1.001).to(torch.bfloat16)\n"
            "for name in ('delta', 'exponent_reuse'):\n"
            "    c, r = (make_codec(name, dtype=torch.bfloat16, numel=n, backend=b) for b in ('native', 'torch'))\n"
            "    o, w = (torch.zeros(c.clamp_capacity(c.max_bytes), dtype=torch.uint8) for _ in range(2))\n"
            "    c.encode(shard=q, state=c.new_state(shard=p), out=o); r.encode(shard=q, state=r.new_state(shard=p), out=w)\n"
            "    t = p.clone(); c.decode(payload=o, target=t)\n"
            "    assert torch.equal(o, w) and torch.equal(as_bits(t), as_bits(q)), name\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_THREAD_LIMIT": "1"})
    assert r.returncode == 0, r.stderr


def test_missing_library_falls_back_with_one_log_line(monkeypatch, caplog):
    monkeypatch.setenv("CIERA_NATIVE", "0")
    _lib._load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="ciera.native._lib"):
            assert native.codec_module(codec_spec("delta")) is None and not native.available()
            codec = make_codec("delta", dtype=torch.bfloat16, numel=50)
            x = torch.randn(50).to(torch.bfloat16)
            out = torch.empty(codec.clamp_capacity(codec.max_bytes), dtype=torch.uint8)
            codec.encode(shard=x * 2, state=codec.new_state(shard=x), out=out)  # the reference
            target = x.clone()
            codec.decode(payload=out, target=target)
            assert torch.equal(as_bits(target), as_bits(x * 2))
            with pytest.raises(RuntimeError, match="backend='native'.*CIERA_NATIVE=0"):
                make_codec("delta", dtype=torch.bfloat16, numel=50, backend="native").decode(payload=out, target=x.clone())
        lines = [r for r in caplog.records if "C codecs unavailable" in r.getMessage()]
        assert len(lines) == 1
    finally:
        monkeypatch.delenv("CIERA_NATIVE")
        _lib._load.cache_clear()
    assert native.available()


def test_stale_or_absent_build_is_refused_in_a_fresh_process(tmp_path):
    """Without the library file the package still imports and encodes, saying why once."""
    code = ("import logging, torch; logging.basicConfig(level=logging.WARNING);"
            "from ciera.native import _lib; _lib._candidates = lambda: [];"
            "from ciera.codecs import make_codec; c = make_codec('exponent_reuse', dtype=torch.bfloat16, numel=8);"
            "x = torch.ones(8, dtype=torch.bfloat16); o = torch.empty(c.clamp_capacity(c.max_bytes), dtype=torch.uint8);"
            "c.encode(shard=x, state=c.new_state(shard=x), out=o); c.encode(shard=x, state=c.new_state(shard=x), out=o)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("C codecs unavailable") == 1 and "not built" in r.stderr


# -- 4. the cost model with measured native speeds ------------------------------------------------
@pytest.mark.parametrize("name", NATIVE_CODECS)
def test_cost_model_cpu_decisions_with_measured_native_speeds(name, threads):
    """On one host (the link is a memcpy) ``auto`` keeps raw; on a 1 Gbit/s link it compresses.

    Speeds are measured here, on this machine's native codec at one thread; the one-host link is
    the measured bandwidth of a copy into a preallocated buffer, which no codec reading and writing
    the same bytes can beat. Each figure is the best of several runs (the machine may be shared)."""
    threads(1)
    n = 1 << 18
    codec = make_codec(name, dtype=torch.bfloat16, numel=n)
    sp = [measure_codec_speed(codec=codec, repeats=5) for _ in range(3)]
    speed = CodecSpeed(encode_bytes_per_s=max(s.encode_bytes_per_s for s in sp),
                       decode_bytes_per_s=max(s.decode_bytes_per_s for s in sp))
    x, dst = torch.randn(n).to(torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    best = min(_timed(lambda: dst.copy_(x)) for _ in range(50))
    memcpy = LinkModel(bandwidth_bytes_per_s=codec.raw_bytes / best)
    # delta_ans's entropy coder runs at a fraction of delta's speed: it pays on slower links.
    gbit = LinkModel(bandwidth_bytes_per_s=(1e8 if name == "delta_ans" else 1e9) / 8, latency_s=50e-6)
    ratio = {"exponent_reuse": 0.56, "delta_ans": 0.12}.get(name, 0.2)  # lr 1e-4 wire ratios (BENCHMARKS.md)
    cand = [CodecEstimate(name, wire_ratio=ratio, speed=speed)]
    for world in (2, 4, 8):
        d = decide(raw_bytes_per_rank=codec.raw_bytes, world=world, link=memcpy, candidates=cand)
        assert d.choice == "raw", d.reason
        d = decide(raw_bytes_per_rank=codec.raw_bytes, world=world, link=gbit, candidates=cand)
        assert d.choice == name, (d.reason, speed)


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
