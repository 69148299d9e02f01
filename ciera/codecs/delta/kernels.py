"""Triton twins of :mod:`ciera.codecs.delta`: same signatures, same bytes.

Work is cut in *tiles* of ``TB`` whole blocks (``T = TB * B`` values, about 2048), held as
``[TB, NG, G]`` register tensors, one program per tile. Launches:

encode (3 kernels, a 4th for a partial last tile; no torch glue):

1. ``_hist``: per tile, exponent(previous) x bit length(z) counts (``tl.histogram`` in shared
   memory, then one atomic add per non-zero bin into a cached global histogram).
2. ``_table``: one program turns the histogram into the width table (:func:`choose_table`'s rule:
   minimise ``N*w + E*x(w)``, ties to the smaller ``w``), writes it into the payload and clears the
   histogram for the next call.
3. ``_encode_tiles``: per tile, widths, exceptions, the raw decision and every block's size, the
   tile's byte offset from a decoupled look-back over earlier tiles, then the counts of its blocks,
   its bit streams, its exception records and the new sender state. The last tile writes the
   bytes needed. Bit streams: each thread owns *runs* of R contiguous values (8 for 16-bit
   formats, 4 for fp32; at most 128 bits) and concatenates a run in registers (a tree of pair
   merges), shifted into 5 aligned 32-bit words; a word shared by several runs gets the earlier
   runs' bits from one segmented OR scan over the tile's runs, and is stored once, by the last run
   touching it. The tile's first and last words (shared with neighbouring tiles) go bytewise.
   Exception records: the e-th exception of every run in trip e (runs rarely hold more than one).

decode (1 kernel, a 2nd for a partial last tile): ``_decode_tiles``, per tile: widths from the
previous values and the payload's table, block sizes, the same look-back, then every value's low
bits (two aligned 32-bit word loads per value; byte loads when the payload buffer is not 4-aligned
or not a multiple of 4 bytes long), stored in place; then each exception record rewrites its one
value. ``decode_many_triton`` runs the same kernels over ``k x tiles`` programs.

Full tiles load and store without masks (vectorised whatever the shard length); the partial last
tile runs in a second launch of the same kernel with masks. Look-back: :mod:`ciera.kernels.lookback`
(tickets in start order, epoch-tagged flag words that never need clearing). All launches of one
codec shape must be on one stream.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ciera.codecs.delta.codec import DeltaLayout
from ciera.kernels.lookback import look_back as _look_back
from ciera.kernels.lookback import tile_ticket as _tile_id

_TILE_VALUES = 2048
"""Values per decoder tile (whole blocks, at least 2): 16 per thread with 4 warps; the encoder's
16-bit tiles are twice that (see ``_Shape``)."""
_HIST_VALUES = 8192
"""Values per ``_hist`` program (no block structure there): amortises its per-bin atomics."""
_NUM_WARPS = 8
_DECODE_WARPS = 4
"""Decode: 16 values per thread (fewer instructions per value; under 128 registers for every dtype)."""
_ENCODE_WARPS = 4
"""Encode: runs of 8 (16-bit) or 4 (fp32) values per thread, 4 runs per thread (no spills)."""
REPORT_LOOP_TRIPS = {"_encode_tiles": 2, "_decode_tiles": 2}
"""Trips of each runtime loop, for tools/kernel_report.py: the look-back reads one or two flags
(the tile before has usually published its inclusive prefix); the decoder's exception loop takes
``T / 8`` records a trip (one trip below ~6% exceptions); the encoder's exception loop takes the
most exceptions of one run in the tile (AdamTrajectory bf16, 2^20 values after 30 steps, 4096-value
tiles: 0.18% exceptions at lr 1e-4, where at most 2 in every tile; 0.85% at 3e-4, where at most 2
in 254 of 256 tiles, 3 and 4 in one each). All counted as 2 trips."""


@triton.jit
def _bit_length(z, W: tl.constexpr):
    """Bits needed by non-negative ``z`` < 2^W (0 for 0), from the exponent of an exact float."""
    if W <= 16:
        e = (z.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF
        return tl.where(z == 0, 0, e - 126)
    else:
        e = (z.to(tl.float64).to(tl.int64, bitcast=True) >> 52) & 0x7FF
        return tl.where(z == 0, 0, e - 1022)


@triton.jit
def _hist(shard_ptr, state_ptr, hist_ptr, n, n_full, W: tl.constexpr, MANT: tl.constexpr, EXPMASK: tl.constexpr,
          KB: tl.constexpr, NBINS: tl.constexpr, T: tl.constexpr, UT: tl.constexpr, EVEN: tl.constexpr):
    if EVEN:
        vid = tl.program_id(0).to(tl.int64)
    else:
        vid = tl.program_id(0).to(tl.int64) + n_full
    offs = vid * T + tl.arange(0, T)
    if EVEN:
        new = tl.load(shard_ptr + offs).to(UT) & ((1 << W) - 1)
        old = tl.load(state_ptr + offs).to(UT) & ((1 << W) - 1)
        valid = None
    else:
        valid = offs < n
        new = tl.load(shard_ptr + offs, mask=valid, other=0).to(UT) & ((1 << W) - 1)
        old = tl.load(state_ptr + offs, mask=valid, other=0).to(UT) & ((1 << W) - 1)
    d = (new - old) & ((1 << W) - 1)
    z = ((d << 1) ^ -(d >> (W - 1))) & ((1 << W) - 1)
    key = (((old >> MANT) & EXPMASK) * KB + _bit_length(z, W)).to(tl.int32)
    h = tl.histogram(key, NBINS, mask=valid)
    bins = tl.arange(0, NBINS)
    tl.atomic_add(hist_ptr + bins, h, mask=h > 0, sem="relaxed")


@triton.jit
def _table(hist_ptr, out_ptr, off_table, NCLS: tl.constexpr, KB: tl.constexpr, W: tl.constexpr,
           E: tl.constexpr):
    """Width table from the histogram (choose_table's rule), then clear the histogram."""
    at = tl.arange(0, NCLS)[:, None] * KB + tl.arange(0, KB)[None, :]
    h = tl.load(hist_ptr + at).to(tl.int64)
    tl.store(hist_ptr + at, tl.zeros([NCLS, KB], tl.int32))
    total = tl.sum(h, axis=1)[:, None]
    above = total - tl.cumsum(h, axis=1)  # values needing more than w bits
    w = tl.arange(0, KB)[None, :].to(tl.int64)
    key = (total * w + E * above) * 64 + w
    key = tl.where(w <= W, key, 9223372036854775807)
    best = tl.min(key, axis=1) & 63
    tl.store(out_ptr + off_table + tl.arange(0, NCLS), best.to(tl.uint8))


@triton.jit
def _halve(x, TB: tl.constexpr, NG: tl.constexpr, RG: tl.constexpr, H: tl.constexpr):
    """(even, odd) halves of the in-thread last axis: ``[TB, NG, RG, 2H]`` -> two ``[TB, NG, RG, H]``."""
    return tl.split(tl.reshape(x, [TB, NG, RG, H, 2]))


@triton.jit
def _run_image(low, w, TB: tl.constexpr, NG: tl.constexpr, RG: tl.constexpr, W: tl.constexpr):
    """Concatenate each run's values (``low[..., i]`` in ``w[..., i]`` bits, LSB first) into one
    128-bit integer ``(lo, hi)`` (uint64 each) by a tree of in-thread pair merges: bf16/fp16 runs
    are 8 values (<= 128 bits), fp32 runs 4. Shapes ``[TB, NG, RG, R]`` -> ``[TB, NG, RG]``."""
    if W <= 16:
        a, b = _halve(low.to(tl.uint32), TB, NG, RG, 4)
        wa, wb = _halve(w, TB, NG, RG, 4)
        x = a | (b << wa.to(tl.uint32))  # <= 32 bits
        w = wa + wb
    else:
        x = low.to(tl.uint32)
    a, b = _halve(x.to(tl.uint64), TB, NG, RG, 2)
    wa, wb = _halve(w, TB, NG, RG, 2)
    x = a | (b << wa.to(tl.uint64))  # <= 64 bits
    w = wa + wb
    a, b = _halve(x, TB, NG, RG, 1)
    wa, wb = _halve(w, TB, NG, RG, 1)
    sa = wa.to(tl.uint64)
    lo = a | tl.where(wa < 64, b << (sa & 63), 0)
    hi = tl.where(wa == 0, 0, b >> ((64 - sa) & 63))
    return tl.reshape(lo, [TB, NG, RG]), tl.reshape(hi, [TB, NG, RG])


@triton.jit
def _unstack(x, TB: tl.constexpr, NG: tl.constexpr, RG: tl.constexpr, R: tl.constexpr):
    """The ``R`` (4 or 8) in-thread values of each run, in order: ``[TB, NG, RG, R]`` -> a tuple of
    ``R`` tensors ``[TB, NG, RG]`` (register renaming, no data movement)."""
    if R == 8:
        e, o = _halve(x, TB, NG, RG, 4)        # 0 2 4 6 | 1 3 5 7
        ee, eo = _halve(e, TB, NG, RG, 2)      # 0 4 | 2 6
        oe, oo = _halve(o, TB, NG, RG, 2)      # 1 5 | 3 7
        v0, v4 = _halve(ee, TB, NG, RG, 1)
        v2, v6 = _halve(eo, TB, NG, RG, 1)
        v1, v5 = _halve(oe, TB, NG, RG, 1)
        v3, v7 = _halve(oo, TB, NG, RG, 1)
        return (tl.reshape(v0, [TB, NG, RG]), tl.reshape(v1, [TB, NG, RG]), tl.reshape(v2, [TB, NG, RG]),
                tl.reshape(v3, [TB, NG, RG]), tl.reshape(v4, [TB, NG, RG]), tl.reshape(v5, [TB, NG, RG]),
                tl.reshape(v6, [TB, NG, RG]), tl.reshape(v7, [TB, NG, RG]))
    else:
        e, o = _halve(x, TB, NG, RG, 2)        # 0 2 | 1 3
        v0, v2 = _halve(e, TB, NG, RG, 1)
        v1, v3 = _halve(o, TB, NG, RG, 1)
        return (tl.reshape(v0, [TB, NG, RG]), tl.reshape(v1, [TB, NG, RG]), tl.reshape(v2, [TB, NG, RG]),
                tl.reshape(v3, [TB, NG, RG]))


@triton.jit
def _select(v, i, R: tl.constexpr):
    """``v[i]`` per element from the tuple ``v`` of ``R`` (4 or 8) tensors: a tree of selects on i's bits."""
    b0 = (i & 1) != 0
    b1 = (i & 2) != 0
    lo = tl.where(b1, tl.where(b0, v[3], v[2]), tl.where(b0, v[1], v[0]))
    if R == 8:
        hi = tl.where(b1, tl.where(b0, v[7], v[6]), tl.where(b0, v[5], v[4]))
        return tl.where((i & 4) != 0, hi, lo)
    else:
        return lo


@triton.jit
def _pick(j, i0, i1, i2, i3, i4):
    return tl.where(j == 0, i0, tl.where(j == 1, i1, tl.where(j == 2, i2, tl.where(j == 3, i3, i4))))


@triton.jit
def _carry_combine(k1, b1, k2, b2):
    """Segmented OR over runs in stream order: (last word a run touches, its bits there)."""
    return k2, tl.where(k1 == k2, b1 | b2, b2)


@triton.jit
def _store_word_bytes(pb, k, word, lo, hi, mask):
    """Bytes ``[lo, hi)`` of word ``k`` (byte offsets from ``pb``) from ``word``."""
    for t in tl.static_range(4):
        at = k * 4 + t
        tl.store(pb + at, ((word >> (8 * t)) & 0xFF).to(tl.uint8), mask=mask & (at >= lo) & (at < hi))


@triton.jit
def _encode_tiles(shard_ptr, state_ptr, out_ptr, counter_ptr, flags_ptr, needed_ptr,
                  n, n_full, n_tiles, n_blocks, capacity, off_table, off_counts, off_data, out_mis,
                  W: tl.constexpr, MANT: tl.constexpr, EXPMASK: tl.constexpr, B: tl.constexpr, G: tl.constexpr,
                  NG: tl.constexpr, TB: tl.constexpr, C: tl.constexpr, RAW_MARK: tl.constexpr, I: tl.constexpr,
                  S: tl.constexpr, UT: tl.constexpr, R: tl.constexpr, EVEN: tl.constexpr):
    T: tl.constexpr = TB * B
    RG: tl.constexpr = G // R
    NT: tl.constexpr = TB * NG * RG
    epoch, row, vid = _tile_id(counter_ptr, 1, n_full, n_tiles, EVEN)
    bi = tl.arange(0, TB)
    blk = vid * TB + bi
    ri = tl.arange(0, RG)[None, None, :]
    gi = tl.arange(0, NG)[None, :]
    vin = (bi[:, None, None, None] * B + tl.arange(0, NG)[None, :, None, None] * G
           + tl.arange(0, RG)[None, None, :, None] * R + tl.arange(0, R)[None, None, None, :])
    offs = vid * T + vin
    if EVEN:
        bits_new = tl.load(shard_ptr + offs)
        old = tl.load(state_ptr + offs).to(UT) & ((1 << W) - 1)
    else:
        valid = offs < n
        bits_new = tl.load(shard_ptr + offs, mask=valid, other=0)
        old = tl.load(state_ptr + offs, mask=valid, other=0).to(UT) & ((1 << W) - 1)
    new = bits_new.to(UT) & ((1 << W) - 1)
    d = (new - old) & ((1 << W) - 1)
    z = ((d << 1) ^ -(d >> (W - 1))) & ((1 << W) - 1)
    wt = tl.load(out_ptr + off_table + ((old >> MANT) & EXPMASK)).to(tl.int32)
    if EVEN:
        vcount = tl.full([TB], B, tl.int32)
    else:
        wt = tl.where(valid, wt, 0)
        vcount = tl.sum(tl.sum(tl.sum(valid.to(tl.int32), axis=3), axis=2), axis=1)
    exc = (z >> wt.to(UT)) != 0
    xrun = tl.sum(exc.to(tl.int32), axis=3)                                # [TB, NG, RG]
    wrun = tl.sum(wt, axis=3)
    # One cross-thread reduction for both group sums: table bits (< 2^16) | exceptions << 16.
    gsum = tl.sum(wrun + (xrun << 16), axis=2)                             # [TB, NG]
    xcount = tl.sum(gsum >> 16, axis=1)
    table_bytes = tl.sum(((gsum & 0xFFFF) + 7) // 8, axis=1) + xcount * (I + S)
    raw = table_bytes > vcount * S
    if EVEN:
        w = tl.where(raw[:, None, None, None], W, wt)
        rbits = tl.where(raw[:, None, None], W * R, wrun)                 # [TB, NG, RG] bits per run
        gbits = tl.where(raw[:, None], W * G, gsum & 0xFFFF)
    else:
        w = tl.where(raw[:, None, None, None] & valid, W, wt)
        rbits = tl.where(raw[:, None, None], W * tl.sum(valid.to(tl.int32), axis=3), wrun)
        gbits = tl.sum(rbits, axis=2)
    exc = exc & (~raw)[:, None, None, None]
    xrun = tl.where(raw[:, None, None], 0, xrun)
    cnt = tl.where(raw, 0, xcount)
    gbytes = (gbits + 7) // 8                                             # [TB, NG]
    bsize = tl.sum(gbytes, axis=1) + cnt * (I + S)                        # [TB]
    total = tl.sum(bsize, axis=0).to(tl.int64)
    tile_start = off_data + _look_back(flags_ptr, vid, total, epoch)
    # Offsets inside the tile are int32 from the 4-aligned word below the tile's first byte.
    head = ((tile_start + out_mis) & 3).to(tl.int32)  # out_mis: out's address mod 4
    pb = out_ptr + (tile_start - head)
    bstart = head + (tl.cumsum(bsize, axis=0) - bsize)                    # [TB]
    bend = bstart + bsize
    gstart = bstart[:, None] + (tl.cumsum(gbytes, axis=1) - gbytes)       # [TB, NG]
    exc_start = bstart + tl.sum(gbytes, axis=1)
    # Counts of every block (raw_mark: raw), written whether or not the block fits.
    field = tl.where(raw, RAW_MARK, cnt)
    for t in tl.static_range(C):
        tl.store(out_ptr + off_counts + blk * C + t, ((field >> (8 * t)) & 0xFF).to(tl.uint8), mask=blk < n_blocks)
    # Blocks fit as a prefix of the payload; only they are written: bytes [head, end) from pb.
    fits = tile_start + (bend - head) <= capacity
    end = head + tl.minimum(tl.max(tl.where(fits, bend - head, 0), axis=0), total.to(tl.int32))
    # Bit streams. Run (thread-owned R values) bits a .. a + rbits from pb; runs of one group are
    # contiguous, groups start at their byte. Each run builds its <= 128 bits shifted into 5
    # aligned words f .. f + 4 in registers; a word shared by several runs gets the bits of the
    # earlier ones (a segmented OR scan over runs) and is stored by the last run that touches it
    # before the next run starts in a later word. Words holding bytes outside [head, end) are
    # stored bytewise; exception bytes inside the stream's gaps are written after a barrier.
    a = gstart[:, :, None] * 8 + (tl.cumsum(rbits, axis=2) - rbits)      # [TB, NG, RG]
    rend = a + rbits
    last_in_group = ri == RG - 1
    next_group = tl.where(gi == NG - 1, bend[:, None], gstart + gbytes)   # [TB, NG] byte
    nexta = tl.where(last_in_group, next_group[:, :, None] * 8, rend)
    f = a >> 5
    nextword = tl.where(last_in_group & (gi == NG - 1)[:, :, None] & (bi == TB - 1)[:, None, None],
                        (nexta + 31) >> 5, nexta >> 5)
    low = z & ((tl.full(w.shape, 1, UT) << w.to(UT)) - 1)
    lo, hi = _run_image(low, w, TB, NG, RG, W)
    s = (a & 31).to(tl.uint64)
    i0 = (lo << s).to(tl.uint32)
    i1 = ((lo << s) >> 32).to(tl.uint32)
    mid = (hi << 32) | (lo >> 32)
    i2 = ((mid << s) >> 32).to(tl.uint32)
    i3 = ((hi << s) >> 32).to(tl.uint32)
    i4 = (((hi >> 32) << s) >> 32).to(tl.uint32)
    jmax = tl.where(rbits > 0, ((rend - 1) >> 5) - f, 0)
    # Carry: exclusive segmented OR over runs (tile order) of each run's last word.
    key = f + jmax
    kbits = _pick(jmax, i0, i1, i2, i3, i4)
    ks, bs = tl.associative_scan((tl.reshape(key, [NT]), tl.reshape(kbits, [NT])), 0, _carry_combine)
    tix = tl.arange(0, NT)
    prev = tl.maximum(tix - 1, 0)
    ek = tl.where(tix > 0, tl.gather(ks, prev, 0), -1)
    eb = tl.gather(bs, prev, 0)
    carry = tl.where(tl.reshape(ek, [TB, NG, RG]) == f, tl.reshape(eb, [TB, NG, RG]), 0)
    i0 = i0 | carry
    whole_lo = (head + 3) >> 2  # first word fully inside [head, end)
    whole_hi = end >> 2         # one past the last
    for j in tl.static_range(5):
        k = f + j
        if j == 0:
            word = i0
        elif j == 1:
            word = i1
        elif j == 2:
            word = i2
        elif j == 3:
            word = i3
        else:
            word = i4
        mine = (k < nextword) & (j <= jmax)
        tl.store(pb.to(tl.pointer_type(tl.uint32), bitcast=True) + k, word,
                 mask=mine & (k >= whole_lo) & (k < whole_hi))
    # Edge words (shared with the bytes before head or from end on): bytewise.
    _store_word_bytes(pb, f, i0, head, end, (f == 0) & ((f * 0 + head) != 0) & (f < nextword))
    kr = (end >> 2) + f * 0
    jr = kr - f
    _store_word_bytes(pb, kr, _pick(jr, i0, i1, i2, i3, i4), head, end,
                      ((kr * 0 + (end & 3)) != 0) & (jr >= 0) & (jr <= jmax) & (kr < nextword))
    # Exception records overwrite their (zero) bytes of the stream words: after a barrier.
    tl.debug_barrier()
    # Exception records: each run's exceptions take consecutive records after those of the
    # block's earlier runs. Trip e stores the e-th exception of every run (exceptions are rare:
    # trips = the most exceptions of one run in the tile, one or two on training data).
    rank = tl.reshape(tl.cumsum(tl.reshape(xrun, [TB, NG * RG]), axis=1), [TB, NG, RG]) - xrun
    xs = exc_start[:, None, None]
    hs = xs + cnt[:, None, None] * I
    ok = fits[:, None, None]
    jb = tl.arange(0, NG)[None, :, None] * G + ri * R                    # in-block index of value 0
    emask = tl.sum(exc.to(tl.int32) << tl.arange(0, R)[None, None, None, :], axis=3)
    hv = _unstack(z >> w.to(UT), TB, NG, RG, R)
    xmax = tl.max(tl.max(tl.max(xrun, axis=2), axis=1), axis=0)
    for _e in range(0, xmax):
        lsb = emask & -emask
        i = _bit_length(lsb, 16) - 1
        h = _select(hv, i, R)
        m = (emask != 0) & ok
        for t in tl.static_range(I):
            tl.store(pb + xs + rank * I + t, (((jb + i) >> (8 * t)) & 0xFF).to(tl.uint8), mask=m)
        for t in tl.static_range(S):
            tl.store(pb + hs + rank * S + t, ((h >> (8 * t)) & 0xFF).to(tl.uint8), mask=m)
        rank += (emask != 0).to(tl.int32)
        emask = emask ^ lsb
    if EVEN:
        tl.store(state_ptr + offs, bits_new)
    else:
        tl.store(state_ptr + offs, bits_new, mask=valid)
    if vid == n_tiles - 1:
        tl.store(needed_ptr, tile_start + total)


@triton.jit
def _decode_tiles(payload_ptr, target_ptr, counter_ptr, flags_ptr, rows_ptr, offsets_ptr,
                  n, k, n_full, n_tiles, n_blocks, plen, off_table, off_counts, off_data,
                  W: tl.constexpr, MANT: tl.constexpr, EXPMASK: tl.constexpr, B: tl.constexpr, G: tl.constexpr,
                  NG: tl.constexpr, TB: tl.constexpr, C: tl.constexpr, RAW_MARK: tl.constexpr, I: tl.constexpr,
                  S: tl.constexpr, XR: tl.constexpr, UT: tl.constexpr, BATCHED: tl.constexpr,
                  WORDS: tl.constexpr, EVEN: tl.constexpr):
    T: tl.constexpr = TB * B
    epoch, row, vid = _tile_id(counter_ptr, k, n_full, n_tiles, EVEN)
    if BATCHED:
        pbase = tl.multiple_of(tl.load(offsets_ptr + row), 16)  # 16-byte aligned (see Codec.decode_many)
        target_ptr += tl.load(rows_ptr + row) * n
    else:
        pbase = row * 0
    bi = tl.arange(0, TB)
    blk = vid * TB + bi
    vin = bi[:, None, None] * B + tl.arange(0, NG)[None, :, None] * G + tl.arange(0, G)[None, None, :]
    offs = vid * T + vin
    if EVEN:
        old = tl.load(target_ptr + offs).to(UT) & ((1 << W) - 1)
    else:
        valid = offs < n
        old = tl.load(target_ptr + offs, mask=valid, other=0).to(UT) & ((1 << W) - 1)
    wt = tl.load(payload_ptr + pbase + off_table + ((old >> MANT) & EXPMASK)).to(UT)
    field = tl.zeros([TB], tl.int32)
    for t in tl.static_range(C):
        field |= tl.load(payload_ptr + pbase + off_counts + blk * C + t, mask=blk < n_blocks,
                         other=0).to(tl.int32) << (8 * t)
    raw = field == RAW_MARK
    cnt = tl.where(raw, 0, field)
    if EVEN:
        w = tl.where(raw[:, None, None], W, wt)
    else:
        w = tl.where(valid, tl.where(raw[:, None, None], W, wt), 0)
    gbytes = (tl.sum(w.to(tl.int32), axis=2) + 7) // 8
    bsize = tl.sum(gbytes, axis=1) + cnt * (I + S)
    total = tl.sum(bsize, axis=0).to(tl.int64)
    tile_start = pbase + off_data + _look_back(flags_ptr + row * n_tiles, vid, total, epoch)
    bstart = tile_start + (tl.cumsum(bsize, axis=0) - bsize)
    exc_start = bstart + tl.sum(gbytes, axis=1)
    need = w > 0
    if WORDS:
        # Little-endian 32-bit words (payload 4-aligned, length a multiple of 4): bit q of the
        # tile's words is bit q % 32 of word q // 32 from the word holding the tile's first byte;
        # a value spans at most 2 words. Per-value math in 32 bits.
        w32 = w.to(tl.int32)
        head = tile_start & 3
        grel = (bstart - tile_start).to(tl.int32)[:, None] + (tl.cumsum(gbytes, axis=1) - gbytes)
        q = grel[:, :, None] * 8 + (tl.cumsum(w32, axis=2) - w32) + (head * 8).to(tl.int32)
        wbase = (payload_ptr + (tile_start - head)).to(tl.pointer_type(tl.uint32))
        lim = tl.minimum((plen - (tile_start - head)) >> 2, 1 << 30).to(tl.int32)  # words left
        wq = q >> 5
        sh = (q & 31).to(tl.uint32)
        w_lo = tl.load(wbase + wq, mask=need & (wq < lim), other=0)
        w_hi = tl.load(wbase + wq + 1, mask=need & ((q & 31) + w32 > 32) & (wq + 1 < lim), other=0)
        zz = (w_lo >> sh) | ((w_hi << 1) << (31 - sh))
        z = zz.to(UT) & ((tl.full(w.shape, 1, UT) << w) - 1)
    else:
        gstart = bstart[:, None] + (tl.cumsum(gbytes, axis=1) - gbytes)
        bitpos = gstart[:, :, None] * 8 + (tl.cumsum(w.to(tl.int32), axis=2) - w.to(tl.int32))
        at = bitpos >> 3
        zz = tl.zeros([TB, NG, G], UT)
        for t in tl.static_range(W // 8 + 1):
            byte = tl.load(payload_ptr + at + t, mask=need & (at + t < plen), other=0)
            zz |= byte.to(UT) << (8 * t)
        z = (zz >> (bitpos & 7).to(UT)) & ((tl.full(w.shape, 1, UT) << w) - 1)
    u = (old + ((z >> 1) ^ -(z & 1))) & ((1 << W) - 1)
    if EVEN:
        tl.store(target_ptr + offs, u.to(target_ptr.dtype.element_ty))
    else:
        tl.store(target_ptr + offs, u.to(target_ptr.dtype.element_ty), mask=valid)
    # Exceptions, XR records a trip, each rewrites its value after the store above (a barrier
    # orders the two stores): record r belongs to the last block whose first record is <= r; its
    # previous bits and low bits come from one gather of (old | low << W) over the tile.
    xpre = tl.cumsum(cnt, axis=0) - cnt
    n_exc = tl.sum(cnt, axis=0)
    packed = tl.reshape(old | (z << W), [T])
    tl.debug_barrier()
    for r0 in range(0, n_exc, XR):
        r = r0 + tl.arange(0, XR)
        live = r < n_exc
        starts = tl.histogram(xpre - r0, XR, mask=(xpre >= r0) & (xpre < r0 + XR))
        br = tl.maximum(tl.sum((xpre < r0).to(tl.int32), axis=0) + tl.cumsum(starts, axis=0) - 1, 0)
        rank = r - tl.gather(xpre, br, 0)
        base = tl.gather(exc_start, br, 0)
        count = tl.gather(cnt, br, 0)
        idx = tl.zeros([XR], tl.int32)
        for t in tl.static_range(I):
            idx |= tl.load(payload_ptr + base + rank * I + t, mask=live, other=0).to(tl.int32) << (8 * t)
        hi = tl.zeros([XR], UT)
        for t in tl.static_range(S):
            hi |= tl.load(payload_ptr + base + count * I + rank * S + t, mask=live, other=0).to(UT) << (8 * t)
        v = br * B + (idx & (B - 1))
        pk = tl.gather(packed, v, 0)
        o = pk & ((1 << W) - 1)
        wv = tl.load(payload_ptr + pbase + off_table + ((o >> MANT) & EXPMASK)).to(UT)
        zx = (((pk >> W) & ((1 << W) - 1)) | (hi << wv)) & ((1 << W) - 1)
        ux = (o + ((zx >> 1) ^ -(zx & 1))) & ((1 << W) - 1)
        tl.store(target_ptr + vid * T + v, ux.to(target_ptr.dtype.element_ty), mask=live)


# -- launchers -------------------------------------------------------------------------------------
class _Shape:
    """Tile geometry and constexprs of one layout."""

    def __init__(self, layout: DeltaLayout, encode: bool = False):
        fmt, B = layout.fmt, layout.block_size
        # The encoder's 16-bit tiles are twice as long: 4 runs of 8 values per thread amortise
        # the per-tile sums, scans and look-back (fp32 runs are 4 values: 2048 fits its registers).
        values = _TILE_VALUES * (2 if encode and layout.width <= 16 else 1)
        self.TB = max(2, values // B)
        self.T = self.TB * B
        self.n_tiles = -(-layout.numel // self.T)
        self.n_full = layout.numel // self.T
        self.tail = self.n_tiles - self.n_full
        self.KB = 32 if layout.width <= 16 else 64
        self.R = 8 if layout.width <= 16 else 4  # values per encoder run (<= 128 bits)
        self.consts = dict(W=layout.width, MANT=fmt.mant_bits, EXPMASK=(1 << fmt.exp_bits) - 1, B=B,
                           G=layout.group_size, NG=layout.groups_per_block, TB=self.TB, C=layout.count_bytes,
                           RAW_MARK=layout.raw_mark, I=layout.index_bytes, S=layout.high_bytes,
                           UT=tl.int32 if layout.width <= 16 else tl.int64)


def _scratch(layout: DeltaLayout, device: torch.device, k: int, purpose: str) -> dict:
    """Device scratch of one (layout, device, k, purpose) on the current stream, allocated once:
    the look-back ticket counter and flag words, and for encoding the class histogram (kept
    all-zero between calls by ``_table``) and the bytes needed. Per stream, because the ticket
    order is only meaningful for launches that run one after the other."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    return _scratch_on(layout, device, k, purpose, stream)


@functools.lru_cache(maxsize=64)
def _scratch_on(layout: DeltaLayout, device: torch.device, k: int, purpose: str, stream) -> dict:
    sh = _Shape(layout, encode=purpose == "encode")
    s = dict(counter=torch.zeros(1, dtype=torch.int64, device=device),
             flags=torch.zeros(max(1, k * sh.n_tiles), dtype=torch.int64, device=device))
    if purpose == "encode":
        s["hist"] = torch.zeros(layout.n_classes * sh.KB, dtype=torch.int32, device=device)
        s["needed"] = torch.zeros(1, dtype=torch.int64, device=device)
    return s


def encode_triton(*, layout: DeltaLayout, shard_bits: torch.Tensor, state: torch.Tensor,
                  out: torch.Tensor) -> torch.Tensor:
    """Triton twin of :func:`ciera.codecs.delta.encode_reference`: three launches (four with a
    partial last tile), no torch glue, no host sync; returns the bytes needed as a 0-d int64
    device tensor."""
    n = layout.numel
    dev = out.device
    if n == 0:
        return torch.tensor(layout.off_data, dtype=torch.int64, device=dev)
    sh = _Shape(layout, encode=True)
    s = _scratch(layout, dev, 1, "encode")
    c = sh.consts
    hc = dict(W=c["W"], MANT=c["MANT"], EXPMASK=c["EXPMASK"], KB=sh.KB, NBINS=layout.n_classes * sh.KB,
              T=_HIST_VALUES, UT=c["UT"])
    h_full = n // _HIST_VALUES
    if h_full:
        _hist[(h_full,)](shard_bits, state, s["hist"], n, h_full, EVEN=True, **hc, num_warps=_NUM_WARPS)
    if n % _HIST_VALUES:
        _hist[(1,)](shard_bits, state, s["hist"], n, h_full, EVEN=False, **hc, num_warps=_NUM_WARPS)
    _table[(1,)](s["hist"], out, layout.off_table, NCLS=layout.n_classes, KB=sh.KB, W=layout.width,
                 E=layout.exception_bits, num_warps=_NUM_WARPS)
    args = (shard_bits, state, out, s["counter"], s["flags"], s["needed"], n, sh.n_full, sh.n_tiles,
            layout.n_blocks, out.numel(), layout.off_table, layout.off_counts, layout.off_data, out.data_ptr() % 4)
    if sh.n_full:
        _encode_tiles[(sh.n_full,)](*args, EVEN=True, R=sh.R, **c, num_warps=_ENCODE_WARPS)
    if sh.tail:
        _encode_tiles[(1,)](*args, EVEN=False, R=sh.R, **c, num_warps=_ENCODE_WARPS)
    return s["needed"][0].clone()


def _decode(layout: DeltaLayout, payload: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor,
            offsets: torch.Tensor, k: int, batched: bool) -> None:
    sh = _Shape(layout)
    s = _scratch(layout, payload.device, k, "decode_many" if batched else "decode")
    args = (payload, targets, s["counter"], s["flags"], rows, offsets, layout.numel, k, sh.n_full, sh.n_tiles,
            layout.n_blocks, payload.numel(), layout.off_table, layout.off_counts, layout.off_data)
    # 32-bit word loads of the bit streams where every word read stays inside the buffer.
    words = payload.data_ptr() % 4 == 0 and payload.numel() % 4 == 0
    kw = dict(XR=max(16, sh.T // 8), BATCHED=batched, WORDS=words, **sh.consts, num_warps=_DECODE_WARPS)
    if sh.n_full:
        _decode_tiles[(k * sh.n_full,)](*args, EVEN=True, **kw)
    if sh.tail:
        _decode_tiles[(k,)](*args, EVEN=False, **kw)


def decode_triton(*, layout: DeltaLayout, payload: torch.Tensor, target_bits: torch.Tensor) -> None:
    """Triton twin of :func:`ciera.codecs.delta.decode_reference`: one launch (two with a partial
    last tile), no torch glue."""
    if layout.numel == 0:
        return
    _decode(layout, payload, target_bits, payload, payload, 1, False)


def decode_many_triton(*, layout: DeltaLayout, payloads: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor,
                       targets_bits: torch.Tensor) -> None:
    """Batched twin of :func:`decode_triton` (see Codec.decode_many): payload ``i`` starts at byte ``offsets[i]``
    of ``payloads`` and decodes into row ``rows[i]`` of ``targets_bits`` (``[world, n]``).

    The same kernel over ``k x tiles`` programs (a second launch for the partial last tiles),
    whatever ``k``; no host reads, no torch glue; scratch cached per (layout, device, k)."""
    n = layout.numel
    k = rows.numel()
    if targets_bits.dim() != 2 or targets_bits.shape[1] != n or not targets_bits.is_contiguous():
        raise ValueError(f"delta: targets_bits must be a contiguous [world, {n}] tensor; got {tuple(targets_bits.shape)}")
    if offsets.numel() != k or rows.dtype != torch.int64 or offsets.dtype != torch.int64:
        raise ValueError("delta: rows and offsets must be int64 tensors of the same length")
    if n == 0 or k == 0:
        return
    _decode(layout, payloads, targets_bits, rows, offsets, k, True)
