"""Triton twins of :mod:`ciera.codecs.delta_ans`: same signatures, same bytes.

One program per block of ``B = 32 L`` values; the block's 32 streams are a ``[32]`` vector (one
lane per stream, as a warp of DietGPU's ANS), and a runtime loop walks the block's steps (the
encoder backwards). Prefix sums of block sizes are ``torch.cumsum`` on the device; nothing is
read on the host.

encode (5 kernels and one cumsum):

1. ``_hist``: per chunk of values, (previous exponent, symbol) counts (``tl.histogram``, then one
   atomic add per non-zero bin into a global histogram).
2. ``_table``: one program quantises every context's counts, 32 contexts a trip (the reference's
   rule: floor, raised to 1 where present, the remainder on the first most frequent symbol) into
   packed ``f | cum << 13`` entries, ranks the mapped contexts and clears the histogram.
3. ``_encode_blocks``: per block, rANS over its steps backwards (the state in uint32); each lane's
   words go to a scratch ``[n_blocks, max_words, 32]`` in emission order; its final states, word
   counts, the block's ANS size and its raw decision (ANS larger than raw) are stored.
4. (``torch.cumsum`` of the block sizes) ``_emit``: per block, the whole-shard-raw decision and
   ``needed`` from the last prefix, then (when the payload fits) the block's counts and its data:
   states and words reversed into reading order, or the raw ``z``. Every block writes its new
   sender state.
5. ``_head``: one program writes the bytes needed and (when the payload fits) the map, the tables
   and the zero bytes that align each section.

decode (3 kernels and one cumsum; ``decode_many_triton`` runs the same over ``k x blocks``):

1. ``_sizes``: per block, the counts' checks (raw marks, words per stream) and the block's size.
2. ``_lut``: per mapped context (8 contexts a program), its table's sum check and a 4096-slot
   lookup of packed ``symbol | f << 6 | cum << 19`` (one load per decoded symbol).
3. (``torch.cumsum``) ``_decode_blocks``: per block, the section bound check, then the raw ``z`` or
   the 32 streams step by step (symbol, refill, low raw bits, refill, high raw bits, refill), the
   stream-end checks, and the new values stored in place.

Corruption: every check of :func:`ciera.codecs.delta_ans.decode_reference` is made on the device
and lowers a per-payload error word to the code of the earliest check that failed (the
reference's order). The launcher turns a code into the reference's ``ValueError`` at once for CPU
tensors (the interpreter); for CUDA tensors it returns the word unread as a
:class:`ciera.codecs.deferred.DeviceError` (no host sync on the hot path), which the codec raises at
its next decode or at the caller's sync point (:meth:`ciera.codecs.base.Codec.raise_pending_errors`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ciera.codecs.deferred import DeviceError
from ciera.codecs.delta_ans.codec import LANES, RAW_MARK, DeltaAnsLayout

_MARK = tl.constexpr(RAW_MARK)
"""The raw marker, visible inside kernels."""
_HIST_VALUES = 4096
"""Values per ``_hist`` program: amortises its per-bin atomics."""
_CHUNK = 16
"""Words (or raw values) per lane moved per trip of ``_emit``'s and ``_decode_blocks``' copy loops."""
_EMIT_WARPS = 4
"""``_emit``: its [32, _CHUNK] copies over 4 warps (a block's 32 lanes are not a warp there)."""
_TABLE_CONTEXTS = 32
"""Contexts per trip of ``_table`` and ``_head`` (keeps their [contexts, symbols] tiles in registers)."""
_LUT_CONTEXTS = 8
"""Contexts per ``_lut`` program (the mapped ones of a shard are a few neighbouring exponents)."""
_NO_ERROR = 99
"""Initial error word: above every code."""
_ERRORS = {
    1: "a section runs past the payload's end",
    2: "a frequency table does not sum to 2^12",
    3: "a raw block's streams are not all marked raw",
    4: "a stream holds more words than its values can emit",
    5: "a section runs past the payload's end",
    6: "a value's context has no table",
    7: "a stream reads past its words",
    8: "a stream does not end on its last word and initial state",
}
"""Device error codes, in the order the reference makes its checks, and the reference's words."""
REPORT_WIRE_RATIO = 0.12
"""Wire bytes over raw bytes assumed for the trips of the copy of words (AdamW steps, lr 1e-4)."""
REPORT_LOOP_TRIPS = {
    "_encode_blocks": lambda c: c["B"] // 32,
    "_emit": lambda c: [1, max(1, int(REPORT_WIRE_RATIO * c["W"] * c["B"] / 32 / 16 / c["CH"])),
                        c["B"] // (32 * c["CH"])],
    "_head": lambda c: c["NCLS"] // c["CC"],
    "_table": lambda c: c["NCLS"] // c["CC"],
    "_lut": lambda c: c["CPP"],
    "_decode_blocks": lambda c: [c["B"] // 32, 1],
}
"""Trips of each runtime loop (in SASS order), for tools/kernel_report.py, from the kernel's
constexprs: the encoder's and decoder's step loops run ``L = B / 32`` times; ``_emit`` stores an
entropy-coded block (its raw-block loop: 1 trip), copies each lane's words (``REPORT_WIRE_RATIO``
x ``W`` x ``L`` / 16 words a lane, ``CH`` a trip) and writes the state (``B / (32 CH)`` trips);
``_decode_blocks``' raw loop runs once for an entropy-coded block; ``_table``, ``_head`` and
``_lut`` walk their contexts ``CC`` / ``CPP`` at a time."""


@triton.jit
def _bit_length(z, W: tl.constexpr):
    """Bits needed by non-negative ``z`` < 2^W (0 for 0; ``z``'s dtype), from the exponent of an exact float."""
    if W <= 16:
        e = (z.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF
        return tl.where(z == 0, 0, e - 126).to(z.dtype)
    else:
        e = (z.to(tl.float64).to(tl.int64, bitcast=True) >> 52) & 0x7FF
        return tl.where(z == 0, 0, e - 1022)


@triton.jit
def _z_ctx(shard_ptr, state_ptr, offs, mask, W: tl.constexpr, MANT: tl.constexpr, EXPMASK: tl.constexpr,
           UT: tl.constexpr):
    """(z, previous exponent, symbol, raw bit count, new pattern) of the values at ``offs``, in ``UT``
    (int32 for 16-bit formats, int64 for fp32)."""
    M: tl.constexpr = (1 << W) - 1
    new = tl.load(shard_ptr + offs, mask=mask, other=0).to(UT) & M
    old = tl.load(state_ptr + offs, mask=mask, other=0).to(UT) & M
    d = (new - old) & M
    z = ((d << 1) ^ -(d >> (W - 1))) & M
    bl = _bit_length(z, W)
    direct = z < 16
    sym = tl.where(direct, z, bl + 11)
    k = tl.where(direct, 0, bl - 1)
    return z, (old >> MANT) & EXPMASK, sym, k, new


@triton.jit
def _hist(shard_ptr, state_ptr, hist_ptr, n, W: tl.constexpr, MANT: tl.constexpr, EXPMASK: tl.constexpr,
          A: tl.constexpr, NBINS: tl.constexpr, T: tl.constexpr, UT: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * T + tl.arange(0, T)
    valid = offs < n
    z, ctx, sym, k, new = _z_ctx(shard_ptr, state_ptr, offs, valid, W, MANT, EXPMASK, UT)
    h = tl.histogram((ctx * A + sym).to(tl.int32), NBINS, mask=valid)
    tl.atomic_add(hist_ptr + tl.arange(0, NBINS), h, mask=h > 0, sem="relaxed")


@triton.jit
def _table(hist_ptr, tab_ptr, rank_ptr, ntab_ptr, NCLS: tl.constexpr, A: tl.constexpr, AP: tl.constexpr,
           CC: tl.constexpr):
    """Frequencies (quantize's rule) packed ``f | cum << 13`` per (context, symbol); each context's
    rank among the mapped ones (-1: unmapped); their number; then clear the histogram. ``CC``
    contexts a trip."""
    s = tl.arange(0, AP)[None, :]
    n_tab = tl.program_id(0) * 0
    for c0 in range(0, NCLS, CC):
        c = c0 + tl.arange(0, CC)[:, None]
        inside = (s < A) & (c >= 0)
        h = tl.load(hist_ptr + c * A + s, mask=inside, other=0).to(tl.int64)
        tl.store(hist_ptr + c * A + s, tl.zeros([CC, AP], tl.int32), mask=inside)
        total = tl.sum(h, axis=1)
        mapped = total > 0
        f = h * 4096 // tl.maximum(total, 1)[:, None]
        f = tl.where((h > 0) & (f == 0), 1, f)
        top = tl.argmax(h, axis=1, tie_break_left=True)
        f += tl.where(s == top[:, None], 4096 - tl.sum(f, axis=1)[:, None], 0)
        f = tl.where(mapped[:, None], f, 0)
        cum = tl.cumsum(f, axis=1) - f
        tl.store(tab_ptr + c * AP + s, (f | (cum << 13)).to(tl.int32))
        m = mapped.to(tl.int32)
        tl.store(rank_ptr + c0 + tl.arange(0, CC), tl.where(mapped, n_tab + tl.cumsum(m, axis=0) - 1, -1))
        n_tab += tl.sum(m, axis=0)
    tl.store(ntab_ptr, n_tab)


@triton.jit
def _put(x, active, nb, bits, cnt, wptr):
    """One encoder event: emit ``x``'s low word when ``nb`` (1..16 where ``active``) more bits would not
    fit (``x >= 2^(32 - nb)``; a shift below 32), then push ``bits``. ``x``: uint32."""
    emit = active & ((x >> (31 - nb)) > 1)
    tl.store(wptr + cnt.to(tl.int64) * 32, (x & 0xFFFF).to(tl.int16), mask=emit)
    x = tl.where(emit, x >> 16, x)
    x = tl.where(active, (x << nb) | bits, x)
    return x, cnt + emit.to(tl.int32)


@triton.jit
def _encode_blocks(shard_ptr, state_ptr, tab_ptr, words_ptr, cnt_ptr, xfin_ptr, bytes_ptr, raw_ptr, n,
                   W: tl.constexpr, MANT: tl.constexpr, EXPMASK: tl.constexpr, AP: tl.constexpr, B: tl.constexpr,
                   MW: tl.constexpr, S: tl.constexpr, UT: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, 32)
    nvb = tl.minimum(n - b * B, B)
    x = tl.full([32], 65536, tl.uint32)  # in [2^16, 2^32) between steps
    cnt = tl.zeros([32], tl.int32)
    wptr = words_ptr + b * (MW * 32) + lane
    steps = (nvb + 31) // 32
    for tt in range(0, steps):
        t = steps - 1 - tt
        j = t * 32 + lane
        v = j < nvb
        z, ctx, sym, k, new = _z_ctx(shard_ptr, state_ptr, b * B + j, v, W, MANT, EXPMASK, UT)
        p = tl.load(tab_ptr + ctx * AP + sym, mask=v, other=1)
        low = (z & ((tl.full([32], 1, UT) << k) - 1)).to(tl.uint32)
        hi_n = tl.maximum(k - 16, 0).to(tl.uint32)
        x, cnt = _put(x, v & (hi_n > 0), hi_n, low >> 16, cnt, wptr)
        lo_n = tl.minimum(k, 16).to(tl.uint32)
        x, cnt = _put(x, v & (lo_n > 0), lo_n, low & 0xFFFF, cnt, wptr)
        f = tl.where(v, p & 0x1FFF, 1).to(tl.uint32)
        c = tl.where(v, p >> 13, 0).to(tl.uint32)
        emit = v & ((x >> 20) >= f)  # x >= f 2^20 (f 2^20 may be 2^32)
        tl.store(wptr + cnt.to(tl.int64) * 32, (x & 0xFFFF).to(tl.int16), mask=emit)
        cnt += emit.to(tl.int32)
        x = tl.where(emit, x >> 16, x)
        x = tl.where(v, ((x // f) << 12) + x % f + c, x)
    nvl = tl.maximum((nvb - lane + 31) // 32, 0)
    ans = tl.sum(tl.where(nvl > 0, 4 + 2 * cnt.to(tl.int64), 0), axis=0)
    raw = ans > nvb * S
    tl.store(cnt_ptr + b * 32 + lane, cnt)
    tl.store(xfin_ptr + b * 32 + lane, x)
    tl.store(bytes_ptr + b, tl.where(raw, nvb * S, ans))
    tl.store(raw_ptr + b, raw.to(tl.int32))


@triton.jit
def _store_le(ptr, value, mask, NB: tl.constexpr):
    for t in tl.static_range(NB):
        tl.store(ptr + t, ((value >> (8 * t)) & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def _off_data(n_tab, OFF_TABLES: tl.constexpr, TABLE_BYTES: tl.constexpr, NS2: tl.constexpr):
    """(off_counts, off_data) of a payload with ``n_tab`` tables (``NS2`` = 2 x streams)."""
    off_counts = (OFF_TABLES + n_tab * TABLE_BYTES + 15) // 16 * 16
    return off_counts, (off_counts + NS2 + 15) // 16 * 16


@triton.jit
def _sections(ntab_ptr, ends_ptr, n_blocks, OFF_TABLES: tl.constexpr, TABLE_BYTES: tl.constexpr,
              NS2: tl.constexpr, MAX_BYTES: tl.constexpr):
    """(tables, off_counts, off_data, needed, whole shard raw) of the payload being encoded."""
    n_tab = tl.load(ntab_ptr).to(tl.int64)
    off_counts, off_data = _off_data(n_tab, OFF_TABLES, TABLE_BYTES, NS2)
    needed = off_data + tl.load(ends_ptr + n_blocks - 1)
    whole_raw = needed > MAX_BYTES  # the tables cost more than the streams save
    if whole_raw:
        n_tab = n_tab * 0
        off_counts, off_data = _off_data(n_tab, OFF_TABLES, TABLE_BYTES, NS2)
        needed = needed * 0 + MAX_BYTES
    return n_tab, off_counts, off_data, needed, whole_raw


@triton.jit
def _emit(shard_ptr, state_ptr, out_ptr, ntab_ptr, words_ptr, cnt_ptr, xfin_ptr, bytes_ptr, raw_ptr, ends_ptr,
          n, n_blocks, cap, W: tl.constexpr, MANT: tl.constexpr, EXPMASK: tl.constexpr, B: tl.constexpr,
          MW: tl.constexpr, S: tl.constexpr, OFF_TABLES: tl.constexpr, TABLE_BYTES: tl.constexpr,
          NS2: tl.constexpr, MAX_BYTES: tl.constexpr, CH: tl.constexpr, UT: tl.constexpr):
    """Block ``program_id(0)``: its counts and data (when the payload fits), its new sender state."""
    b = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, 32)
    nvb = tl.minimum(n - b * B, B)
    n_tab, off_counts, off_data, needed, whole_raw = _sections(ntab_ptr, ends_ptr, n_blocks, OFF_TABLES,
                                                               TABLE_BYTES, NS2, MAX_BYTES)
    if whole_raw:
        start = off_data + b * (B * S)
        raw = whole_raw
    else:
        start = off_data + tl.load(ends_ptr + b) - tl.load(bytes_ptr + b)
        raw = tl.load(raw_ptr + b) != 0
    cnt = tl.load(cnt_ptr + b * 32 + lane)
    if needed <= cap:
        _store_le(out_ptr + off_counts + 2 * (b * 32 + lane), tl.where(raw, _MARK, cnt), lane >= 0, 2)
        if raw:
            for i0 in range(0, nvb, 32 * CH):
                j = i0 + tl.arange(0, 32 * CH)
                v = j < nvb
                z, ctx, sym, k, new = _z_ctx(shard_ptr, state_ptr, b * B + j, v, W, MANT, EXPMASK, UT)
                _store_le(out_ptr + start + j * S, z, v, S)
        else:
            nvl = tl.maximum((nvb - lane + 31) // 32, 0)
            sb = tl.where(nvl > 0, 4 + 2 * cnt.to(tl.int64), 0)
            ls = start + tl.cumsum(sb, axis=0) - sb
            _store_le(out_ptr + ls, tl.load(xfin_ptr + b * 32 + lane), nvl > 0, 4)
            # The r-th word a lane emitted is its (count - 1 - r)-th in reading order.
            for p0 in range(0, tl.max(cnt, axis=0), CH):
                p = p0 + tl.arange(0, CH)[None, :]
                m = p < cnt[:, None]
                w = tl.load(words_ptr + b * (MW * 32) + (cnt[:, None] - 1 - p).to(tl.int64) * 32 + lane[:, None],
                            mask=m, other=0).to(tl.int32) & 0xFFFF
                _store_le(out_ptr + ls[:, None] + 4 + 2 * p, w, m, 2)
    for i0 in range(0, nvb, 32 * CH):  # the new sender state, after every read of the old one
        j = i0 + tl.arange(0, 32 * CH)
        v = j < nvb
        tl.store(state_ptr + b * B + j, tl.load(shard_ptr + b * B + j, mask=v), mask=v)


@triton.jit
def _head(out_ptr, tab_ptr, rank_ptr, ntab_ptr, ends_ptr, needed_ptr, n_blocks, cap, A: tl.constexpr,
          AP: tl.constexpr, NCLS: tl.constexpr, CC: tl.constexpr, OFF_MAP: tl.constexpr, MAP_BYTES: tl.constexpr,
          OFF_TABLES: tl.constexpr, TABLE_BYTES: tl.constexpr, NS2: tl.constexpr, MAX_BYTES: tl.constexpr):
    """The bytes needed; when the payload fits, the map, the tables (``CC`` contexts a trip) and the
    zero bytes that align each section."""
    n_tab, off_counts, off_data, needed, whole_raw = _sections(ntab_ptr, ends_ptr, n_blocks, OFF_TABLES,
                                                               TABLE_BYTES, NS2, MAX_BYTES)
    tl.store(needed_ptr, needed)
    if needed <= cap:
        r = tl.load(rank_ptr + tl.arange(0, NCLS))
        bits = tl.reshape(tl.where((r >= 0) & (n_tab > 0), 1, 0), [MAP_BYTES, 8])
        tl.store(out_ptr + OFF_MAP + tl.arange(0, MAP_BYTES), tl.sum(bits << tl.arange(0, 8)[None, :], axis=1).to(tl.uint8))
        if n_tab > 0:
            s = tl.arange(0, AP)[None, :]
            for c0 in range(0, NCLS, CC):
                c = c0 + tl.arange(0, CC)[:, None]
                rc = tl.load(rank_ptr + c)
                f = tl.load(tab_ptr + c * AP + s) & 0x1FFF
                _store_le(out_ptr + OFF_TABLES + rc.to(tl.int64) * TABLE_BYTES + 2 * s, f, (rc >= 0) & (s < A), 2)
        g = tl.arange(0, 16)
        zero = tl.zeros([16], tl.uint8)
        tl.store(out_ptr + OFF_MAP + MAP_BYTES + g, zero, mask=OFF_MAP + MAP_BYTES + g < OFF_TABLES)
        e = OFF_TABLES + n_tab * TABLE_BYTES
        tl.store(out_ptr + e + g, zero, mask=e + g < off_counts)
        tl.store(out_ptr + off_counts + NS2 + g, zero, mask=off_counts + NS2 + g < off_data)


@triton.jit
def _payload_at(payload_ptr, offsets_ptr, plen, BATCHED: tl.constexpr):
    """(start, length) of this program's payload: the row's offset and its header's needed bytes
    (at most what the buffer of ``plen`` bytes holds from there, as a slice) when batched, else 0
    and the buffer's length."""
    if BATCHED:
        row = tl.program_id(0)
        pbase = tl.multiple_of(tl.load(offsets_ptr + row), 16)
        hdr = (payload_ptr + pbase + 16).to(tl.pointer_type(tl.int64), bitcast=True)
        return pbase, tl.minimum(tl.load(hdr), plen - pbase)
    else:
        return plen * 0, plen


@triton.jit
def _map_rank(payload_ptr, pbase, OFF_MAP: tl.constexpr, NCLS: tl.constexpr):
    """Mapped bit of every context ``[NCLS]`` (int32) from the payload's map."""
    c = tl.arange(0, NCLS)
    byte = tl.load(payload_ptr + pbase + OFF_MAP + c // 8).to(tl.int32)
    return (byte >> (c % 8)) & 1


@triton.jit
def _spread(flag, like):
    """Scalar ``flag`` as a mask shaped like ``like`` (the interpreter does not broadcast a scalar mask)."""
    return (like * 0 + flag.to(tl.int32)) != 0


@triton.jit
def _fail(err_ptr, code, bad):
    tl.atomic_min(err_ptr + tl.program_id(0), tl.where(bad, code, 99), sem="relaxed")


@triton.jit
def _sizes(payload_ptr, offsets_ptr, bytes_ptr, err_ptr, plen, n, n_blocks,
           OFF_MAP: tl.constexpr, NCLS: tl.constexpr, OFF_TABLES: tl.constexpr, TABLE_BYTES: tl.constexpr,
           NS2: tl.constexpr, B: tl.constexpr, S: tl.constexpr, MW: tl.constexpr, BATCHED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    pbase, length = _payload_at(payload_ptr, offsets_ptr, plen, BATCHED)
    n_tab = tl.sum(_map_rank(payload_ptr, pbase, OFF_MAP, NCLS), axis=0).to(tl.int64)
    off_counts, off_data = _off_data(n_tab, OFF_TABLES, TABLE_BYTES, NS2)
    lane = tl.arange(0, 32)
    _fail(err_ptr, 1, off_data > length)
    at = pbase + off_counts + 2 * (b * 32 + lane)
    inside = off_data <= length
    cnt = (tl.load(payload_ptr + at, mask=_spread(inside, lane), other=0).to(tl.int64)
           | tl.load(payload_ptr + at + 1, mask=_spread(inside, lane), other=0).to(tl.int64) << 8)
    marks = cnt == _MARK
    raw = tl.sum(marks.to(tl.int32), axis=0) > 0
    first = tl.sum(tl.where(lane == 0, marks.to(tl.int32), 0), axis=0) > 0
    _fail(err_ptr, 3, inside & raw & ~first)  # (the reference's check: some marked, the first not)
    _fail(err_ptr, 4, inside & (tl.sum(tl.where(~marks & (cnt > MW), 1, 0), axis=0) > 0))
    nvb = tl.minimum(n - b * B, B)
    nvl = tl.maximum((nvb - lane + 31) // 32, 0)
    sb = tl.where(marks | (nvl == 0), 0, 4 + 2 * cnt)
    tl.store(bytes_ptr + row * n_blocks + b, tl.where(first, nvb * S, tl.sum(sb, axis=0)))


@triton.jit
def _lut(payload_ptr, offsets_ptr, lut_ptr, err_ptr, plen,
         OFF_MAP: tl.constexpr, NCLS: tl.constexpr, OFF_TABLES: tl.constexpr, TABLE_BYTES: tl.constexpr,
         NS2: tl.constexpr, A: tl.constexpr, AP: tl.constexpr, CPP: tl.constexpr, BATCHED: tl.constexpr):
    """Slot lookups of the mapped tables among contexts ``CPP * program_id(1) ..`` (``CPP`` of them):
    ``symbol | f << 6 | cum << 19`` per slot."""
    row = tl.program_id(0).to(tl.int64)
    pbase, length = _payload_at(payload_ptr, offsets_ptr, plen, BATCHED)
    mapped = _map_rank(payload_ptr, pbase, OFF_MAP, NCLS)
    c = tl.arange(0, NCLS)
    n_tab = tl.sum(mapped, axis=0).to(tl.int64)
    off_counts, off_data = _off_data(n_tab, OFF_TABLES, TABLE_BYTES, NS2)
    s = tl.arange(0, AP)
    bad = n_tab < 0
    for i in range(0, CPP):
        ctx = tl.program_id(1) * CPP + i
        rank = tl.sum(tl.where(c < ctx, mapped, 0), axis=0).to(tl.int64)
        mine = tl.sum(tl.where(c == ctx, mapped, 0), axis=0) > 0
        if mine & (off_data <= length):
            at = pbase + OFF_TABLES + rank * TABLE_BYTES + 2 * s
            f = (tl.load(payload_ptr + at, mask=s < A, other=0).to(tl.int32)
                 | tl.load(payload_ptr + at + 1, mask=s < A, other=0).to(tl.int32) << 8)
            bad = bad | (tl.sum(f, axis=0) != 4096)
            ends = tl.cumsum(f, axis=0)
            # symbol(slot) = #{s : cum_end[s] <= slot} (searchsorted, right), at most A - 1.
            starts = tl.histogram(ends, 4096, mask=(s < A) & (ends < 4096))
            sym = tl.minimum(tl.cumsum(starts, axis=0), A - 1)
            fs = tl.gather(f, sym, 0)
            cs = tl.gather(ends - f, sym, 0)
            tl.store(lut_ptr + (row * NCLS + ctx) * 4096 + tl.arange(0, 4096), sym | (fs << 6) | (cs << 19))
    _fail(err_ptr, 2, bad)


@triton.jit
def _refill(x, at, need, payload_ptr, lim, WORDS: tl.constexpr):
    """``x << 16 | word at`` where ``need`` (reads stay below byte ``lim``); the next word's address.
    ``x`` is uint32: a refill only follows ``x < 2^16``. ``WORDS``: one 16-bit load (the buffer is
    2-byte aligned, and so is every word: sections and streams are), else two byte loads; they
    differ only on a word cut by ``lim``, which is read past its stream's end (an error either way)."""
    if WORDS:
        w = tl.load((payload_ptr + at).to(tl.pointer_type(tl.uint16), bitcast=True), mask=need & (at + 1 < lim),
                    other=0).to(tl.uint32)
    else:
        w = (tl.load(payload_ptr + at, mask=need & (at < lim), other=0).to(tl.uint32)
             | tl.load(payload_ptr + at + 1, mask=need & (at + 1 < lim), other=0).to(tl.uint32) << 8)
    return tl.where(need, (x << 16) | w, x), at + 2 * need.to(tl.int64)


@triton.jit
def _decode_blocks(payload_ptr, target_ptr, rows_ptr, offsets_ptr, bytes_ptr, ends_ptr, lut_ptr, err_ptr,
                   plen, n, n_blocks, W: tl.constexpr, MANT: tl.constexpr, EXPMASK: tl.constexpr,
                   OFF_MAP: tl.constexpr, NCLS: tl.constexpr, OFF_TABLES: tl.constexpr, TABLE_BYTES: tl.constexpr,
                   NS2: tl.constexpr, B: tl.constexpr, S: tl.constexpr, MW: tl.constexpr, CH: tl.constexpr,
                   UT: tl.constexpr, BATCHED: tl.constexpr, WORDS: tl.constexpr):
    M: tl.constexpr = (1 << W) - 1
    row = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    pbase, length = _payload_at(payload_ptr, offsets_ptr, plen, BATCHED)
    if BATCHED:
        target_ptr += tl.load(rows_ptr + row) * n
    mapped = _map_rank(payload_ptr, pbase, OFF_MAP, NCLS)
    n_tab = tl.sum(mapped, axis=0).to(tl.int64)
    off_counts, off_data = _off_data(n_tab, OFF_TABLES, TABLE_BYTES, NS2)
    lane = tl.arange(0, 32)
    total = tl.load(ends_ptr + row * n_blocks + n_blocks - 1)
    _fail(err_ptr, 5, (off_data <= length) & (off_data + total > length))
    lim = pbase + length
    inside = off_data + total <= length  # (off_data > length: flagged by _sizes)
    start = pbase + off_data + tl.load(ends_ptr + row * n_blocks + b) - tl.load(bytes_ptr + row * n_blocks + b)
    at = pbase + off_counts + 2 * (b * 32 + lane)
    cnt = (tl.load(payload_ptr + at, mask=_spread(inside, lane), other=0).to(tl.int64)
           | tl.load(payload_ptr + at + 1, mask=_spread(inside, lane), other=0).to(tl.int64) << 8)
    marks = cnt == _MARK
    nvb = tl.minimum(n - b * B, B)
    # A block is raw when its first stream is marked; streams not marked are entropy-coded (a raw
    # block with unmarked streams is corrupt: they are decoded, as the reference does, for its checks,
    # from the previous values, and not stored; the raw values are stored after).
    first = tl.sum(tl.where(lane == 0, marks.to(tl.int32), 0), axis=0) > 0
    if inside & (tl.sum(marks.to(tl.int32), axis=0) < 32) & (tl.max(tl.where(marks, 0, cnt), axis=0) <= MW):
        nvl = tl.maximum((nvb - lane + 31) // 32, 0)
        live = (nvl > 0) & ~marks
        sb = tl.where(live, 4 + 2 * cnt, 0)
        ls = start + tl.cumsum(sb, axis=0) - sb
        # The state in uint32: it starts below 2^32 (4 bytes) and no step takes it past
        # (f (x >> 12) + slot - c < f 2^20 <= 2^32; a refill follows x < 2^16), corrupt or not.
        x = tl.zeros([32], tl.uint32)
        for t in tl.static_range(4):
            x |= tl.load(payload_ptr + ls + t, mask=live & (ls + t < lim), other=0).to(tl.uint32) << (8 * t)
        word_at = ls + 4
        end = word_at + 2 * cnt
        stop = tl.minimum(end, lim)  # word reads stay inside the stream and the payload
        past = tl.zeros([32], tl.int1)
        orphan = tl.zeros([32], tl.int1)
        steps = (nvb + 31) // 32
        lut_row = lut_ptr + row * (NCLS * 4096)
        keep = ~_spread(first, lane)  # the values of an entropy-coded block
        for t in range(0, steps):
            j = t * 32 + lane
            v = (j < nvb) & ~marks
            old = tl.load(target_ptr + b * B + j, mask=v, other=0).to(UT) & M
            ctx = ((old >> MANT) & EXPMASK).to(tl.int32)
            has = (tl.load(payload_ptr + pbase + OFF_MAP + (ctx >> 3), mask=v, other=0).to(tl.int32) >> (ctx & 7)) & 1
            orphan = orphan | (v & (has == 0))
            slot = x & 4095
            p = tl.load(lut_row + ctx * 4096 + slot, mask=v & (has != 0), other=1 << 6)
            sym = p & 63
            x = tl.where(v, ((p >> 6) & 0x1FFF).to(tl.uint32) * (x >> 12) + slot - (p >> 19).to(tl.uint32), x)
            x, word_at = _refill(x, word_at, v & (x < 65536), payload_ptr, stop, WORDS)
            k = tl.where(sym >= 16, sym - 12, 0)
            lo_n = tl.minimum(k, 16).to(tl.uint32)
            lo = x & ((tl.full([32], 1, tl.uint32) << lo_n) - 1)
            x = tl.where(v, x >> lo_n, x)
            x, word_at = _refill(x, word_at, v & (lo_n > 0) & (x < 65536), payload_ptr, stop, WORDS)
            hi_n = tl.maximum(k - 16, 0).to(tl.uint32)
            hi = x & ((tl.full([32], 1, tl.uint32) << hi_n) - 1)
            x = tl.where(v, x >> hi_n, x)
            x, word_at = _refill(x, word_at, v & (hi_n > 0) & (x < 65536), payload_ptr, stop, WORDS)
            past = past | (v & (word_at > end))
            zu = tl.where(sym < 16, sym.to(tl.uint32), (tl.full([32], 1, tl.uint32) << k.to(tl.uint32)) | (hi << 16) | lo)
            z = zu.to(UT) & M
            u = (old + ((z >> 1) ^ -(z & 1))) & M
            tl.store(target_ptr + b * B + j, u.to(target_ptr.dtype.element_ty), mask=v & keep)
        _fail(err_ptr, 6, tl.sum(orphan.to(tl.int32), axis=0) > 0)
        _fail(err_ptr, 7, tl.sum(past.to(tl.int32), axis=0) > 0)
        _fail(err_ptr, 8, tl.sum((live & ((word_at != end) | (x != 65536))).to(tl.int32), axis=0) > 0)
    if inside & first:
        for i0 in range(0, nvb, 32 * CH):
            j = i0 + tl.arange(0, 32 * CH)
            v = j < nvb
            z = tl.zeros([32 * CH], tl.int64)
            for t in tl.static_range(S):
                z |= tl.load(payload_ptr + start + j * S + t, mask=v, other=0).to(tl.int64) << (8 * t)
            old = tl.load(target_ptr + b * B + j, mask=v, other=0).to(tl.int64) & M
            u = (old + ((z >> 1) ^ -(z & 1))) & M
            tl.store(target_ptr + b * B + j, u.to(target_ptr.dtype.element_ty), mask=v)


# -- launchers -------------------------------------------------------------------------------------
def _consts(layout: DeltaAnsLayout) -> dict:
    """Constexprs of the payload's sections shared by the kernels of one layout."""
    return dict(OFF_MAP=layout.off_map, NCLS=layout.n_classes, OFF_TABLES=layout.off_tables,
                TABLE_BYTES=layout.table_bytes, NS2=2 * layout.n_streams, B=layout.block_size,
                S=layout.high_bytes, MW=layout.max_words)


def _fmt_consts(layout: DeltaAnsLayout) -> dict:
    """Constexprs of the value format."""
    return dict(W=layout.width, MANT=layout.fmt.mant_bits, EXPMASK=layout.n_classes - 1,
                UT=tl.int32 if layout.width <= 16 else tl.int64)


def _ap(layout: DeltaAnsLayout) -> int:
    """The alphabet padded to a power of two."""
    return triton.next_power_of_2(layout.n_symbols)


@functools.lru_cache(maxsize=16)
def _hist_buffer(layout: DeltaAnsLayout, device: torch.device, stream) -> torch.Tensor:
    """The global histogram of one layout on one device and stream, allocated once and kept all-zero
    between calls by ``_table``."""
    return torch.zeros(triton.next_power_of_2(layout.n_classes * layout.n_symbols), dtype=torch.int32,
                       device=device)


def _stream_of(device: torch.device):
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None


def encode_triton(*, layout: DeltaAnsLayout, shard_bits: torch.Tensor, state: torch.Tensor,
                  out: torch.Tensor) -> torch.Tensor:
    """Triton twin of :func:`ciera.codecs.delta_ans.encode_reference`: five launches and one
    ``torch.cumsum``, no host read; returns the bytes needed as a 0-d int64 device tensor."""
    n, dev = layout.numel, out.device
    if n == 0:
        return torch.tensor(layout.off_data(0), dtype=torch.int64, device=dev)
    A, AP, NCLS, nb = layout.n_symbols, _ap(layout), layout.n_classes, layout.n_blocks
    fc = _fmt_consts(layout)
    hist = _hist_buffer(layout, dev, _stream_of(dev))
    _hist[(-(-n // _HIST_VALUES),)](shard_bits, state, hist, n, A=A, NBINS=hist.numel(), T=_HIST_VALUES, **fc,
                                     num_warps=8)
    tab = torch.empty(NCLS * AP, dtype=torch.int32, device=dev)
    rank = torch.empty(NCLS, dtype=torch.int32, device=dev)
    ntab = torch.empty(1, dtype=torch.int32, device=dev)
    _table[(1,)](hist, tab, rank, ntab, NCLS=NCLS, A=A, AP=AP, CC=_TABLE_CONTEXTS, num_warps=4)
    words = torch.empty(nb * layout.max_words * LANES, dtype=torch.int16, device=dev)
    cnt = torch.empty(layout.n_streams, dtype=torch.int32, device=dev)
    xfin = torch.empty(layout.n_streams, dtype=torch.int64, device=dev)
    sizes = torch.empty(nb, dtype=torch.int64, device=dev)
    raw = torch.empty(nb, dtype=torch.int32, device=dev)
    _encode_blocks[(nb,)](shard_bits, state, tab, words, cnt, xfin, sizes, raw, n, AP=AP, B=layout.block_size,
                          MW=layout.max_words, S=layout.high_bytes, **fc, num_warps=1)
    ends = torch.cumsum(sizes, 0)
    needed = torch.empty(1, dtype=torch.int64, device=dev)
    c = _consts(layout)
    sec = dict(OFF_TABLES=c["OFF_TABLES"], TABLE_BYTES=c["TABLE_BYTES"], NS2=c["NS2"],
               MAX_BYTES=layout.off_data(0) + n * layout.high_bytes)
    _emit[(nb,)](shard_bits, state, out, ntab, words, cnt, xfin, sizes, raw, ends, n, nb, out.numel(),
                 B=layout.block_size, MW=layout.max_words, S=layout.high_bytes, CH=_CHUNK, **sec, **fc,
                 num_warps=_EMIT_WARPS)
    _head[(1,)](out, tab, rank, ntab, ends, needed, nb, out.numel(), A=A, AP=AP, NCLS=NCLS, CC=_TABLE_CONTEXTS,
                OFF_MAP=layout.off_map, MAP_BYTES=layout.map_bytes, **sec, num_warps=4)
    return needed[0]


def _raise_code(err: torch.Tensor) -> None:
    code = int(err.min())
    if code != _NO_ERROR:
        raise ValueError(_describe(code))


def _describe(code: int) -> str:
    return f"delta_ans: corrupt payload: {_ERRORS[code]}"


def _decode(layout: DeltaAnsLayout, payload: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor,
            offsets: torch.Tensor, k: int, batched: bool) -> DeviceError | None:
    dev = payload.device
    n, nb, NCLS = layout.numel, layout.n_blocks, layout.n_classes
    plen = payload.numel()
    if not batched and plen < layout.off_data(0):
        raise ValueError(f"delta_ans: corrupt payload: {_ERRORS[1]}")
    c = _consts(layout)
    err = torch.full((k,), _NO_ERROR, dtype=torch.int32, device=dev)
    sizes = torch.empty(k * nb, dtype=torch.int64, device=dev)
    _sizes[(k, nb)](payload, offsets, sizes, err, plen, n, nb, BATCHED=batched, **c, num_warps=1)
    lut = torch.empty(k * NCLS * 4096, dtype=torch.int32, device=dev)
    _lut[(k, NCLS // _LUT_CONTEXTS)](payload, offsets, lut, err, plen, A=layout.n_symbols, AP=_ap(layout),
                                    CPP=_LUT_CONTEXTS, BATCHED=batched,
                    **{key: v for key, v in c.items() if key in ("OFF_MAP", "NCLS", "OFF_TABLES", "TABLE_BYTES", "NS2")},
                    num_warps=4)
    ends = torch.cumsum(sizes.view(k, nb), 1)
    _decode_blocks[(k, nb)](payload, targets, rows, offsets, sizes, ends, lut, err, plen, n, nb, CH=_CHUNK,
                            BATCHED=batched, WORDS=payload.data_ptr() % 2 == 0, **c,
                            **_fmt_consts(layout), num_warps=1)
    if dev.type == "cuda":
        return DeviceError(word=err, clean=_NO_ERROR, describe=_describe)
    _raise_code(err)
    return None


def decode_triton(*, layout: DeltaAnsLayout, payload: torch.Tensor, target_bits: torch.Tensor) -> DeviceError | None:
    """Triton twin of :func:`ciera.codecs.delta_ans.decode_reference`: three launches and one
    ``torch.cumsum``; a corrupt payload raises the reference's ``ValueError`` (see the module
    docstring for when, on CUDA)."""
    if layout.numel == 0:
        return None
    return _decode(layout, payload, target_bits, payload, payload, 1, False)


def decode_many_triton(*, layout: DeltaAnsLayout, payloads: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor,
                       targets_bits: torch.Tensor) -> DeviceError | None:
    """Batched twin of :func:`decode_triton` (see Codec.decode_many): payload ``i`` starts at byte
    ``offsets[i]`` of ``payloads`` (its length: its header's needed bytes) and decodes into row
    ``rows[i]`` of ``targets_bits`` (``[world, n]``). The same launches over ``k x blocks``
    programs, whatever ``k``; no host reads."""
    n, k = layout.numel, rows.numel()
    if targets_bits.dim() != 2 or targets_bits.shape[1] != n or not targets_bits.is_contiguous():
        raise ValueError(f"delta_ans: targets_bits must be a contiguous [world, {n}] tensor; "
                         f"got {tuple(targets_bits.shape)}")
    if offsets.numel() != k or rows.dtype != torch.int64 or offsets.dtype != torch.int64:
        raise ValueError("delta_ans: rows and offsets must be int64 tensors of the same length")
    if n == 0 or k == 0:
        return None
    return _decode(layout, payloads, targets_bits, rows, offsets, k, True)
