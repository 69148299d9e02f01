"""Triton twins of :func:`ciera.codecs.exponent_reuse.encode_reference` and ``decode_reference``.

Same signatures, same semantics, byte-identical payload sections (the header is the codec's job)
and bit-identical decoded values. Neither twin synchronises with the host: the bytes an encode
needs come back as a 0-d int64 tensor on the shard's device.

Work is split in *tiles* of ``TB`` whole blocks (``TB`` a multiple of 8, so every bitmap byte
belongs to exactly one tile). A program walks its tile as ``[TB, BC]`` chunks (``BC`` columns of
each of the ``TB`` blocks, ``BC`` dividing ``B``), so one chunk holds ``TB * BC`` values whatever
the block size. Each path is one kernel (a second launch of it, masked, for a partial last tile;
full tiles load and store unmasked, so they vectorise whatever the shard length), one pass over
memory, no torch glue:

* ``_encode_tiles``: per tile, write sign|mantissa bytes and bit planes, compare each new exponent
  exactly with ``state`` (uint8) and overwrite it with the new exponents, write the tile's bitmap
  bytes; the first exponent slot of the tile comes from a decoupled look-back over earlier tiles'
  changed-block counts (:mod:`ciera.kernels.lookback`); every changed block whose slot is below
  the payload's slot count ``K`` writes its ``B`` new exponents (padding of a partial last block
  is 0; blocks past ``K`` are not written: the payload has overflowed, the codec flags it). The
  last tile writes the bytes needed.
* ``_decode_tiles``: per tile, its bitmap bits, the same look-back for its first slot, then every
  value from its sign|mantissa bytes and planes and either its block's slot (changed block) or
  the exponent already in ``target``. ``decode_many_triton`` runs it over ``k x tiles`` programs.

Tile sizes (H100/H200): a chunk holds ``_TILE_VALUES = 4096`` values, 16 per thread with 8 warps,
which keeps enough bytes in flight per SM for these memory-bound kernels without spilling; small
blocks give tiles of ``4096 // B`` blocks (one chunk), blocks above 512 values give tiles of 8
blocks walked in ``B // 512`` chunks. Tests pass smaller tiles to :func:`_encode`/:func:`_decode`
to exercise many tiles on small inputs.

Bit arithmetic is done on int32: 16-bit patterns are sign-extended on load, which only affects
bits above bit 15, and every field is masked after shifting. fp32 sign|mantissa is 24 bits, so it
also fits int32; the rebuilt fp32 pattern sets bit 31 through a wrapping int32 shift.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ciera.codecs.exponent_reuse.codec import ExponentReuseLayout
from ciera.kernels.lookback import look_back, scratch, tile_ticket

_TILE_VALUES = 4096
"""Values per ``[TB, BC]`` chunk; a power of two >= 8."""
_NUM_WARPS = 8

REPORT_LOOP_TRIPS = {"_encode_tiles": 2, "_decode_tiles": 2}
"""Trips of each runtime loop, for tools/kernel_report.py: the look-back reads one or two flags (the
tile before has usually published its inclusive prefix), counted as 2, an upper bound. (Blocks
above 512 values add chunk loops of ``B / 512`` trips; the report runs the default ``B = 8``.)"""


def _tile_shape(block_size: int, tile_values: int) -> tuple[int, int]:
    """(TB blocks per tile, BC columns per chunk) for a power-of-two block size."""
    if tile_values < 8 or tile_values & (tile_values - 1):
        raise ValueError(f"tile_values={tile_values} must be a power of two >= 8")
    tb = max(8, tile_values // block_size)
    # BC == B, or BC a multiple of 8: groups of 8 consecutive values (one plane byte) never
    # straddle two chunks.
    bc = min(block_size, max(8, tile_values // tb))
    return tb, bc


@triton.jit
def _changed_flags(payload_ptr, off_bitmap, blocks, n_blocks):
    """0/1 int32 flags of ``blocks`` read back from the bitmap (LSB first); 0 past ``n_blocks``."""
    byte = tl.load(payload_ptr + off_bitmap + blocks // 8, mask=blocks < n_blocks, other=0).to(tl.int32)
    return (byte >> (blocks % 8).to(tl.int32)) & 1


@triton.jit
def _ld(ptr, mask, EVEN: tl.constexpr):
    """Load; unmasked in full tiles (``EVEN``), so it vectorises whatever the shard length."""
    if EVEN:
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=mask, other=0)


@triton.jit
def _st(ptr, value, mask, EVEN: tl.constexpr):
    """Store; unmasked in full tiles (``EVEN``)."""
    if EVEN:
        tl.store(ptr, value)
    else:
        tl.store(ptr, value, mask=mask)


@triton.jit
def _store_sm24(out_ptr, off_signmant, first, sm, N: tl.constexpr):
    """Sign|mantissa (24 bits each) of ``N`` contiguous fp32 values from value ``first``: three
    little-endian 32-bit words per 4 values (the same bytes as 3 byte stores per value)."""
    even, odd = tl.split(tl.reshape(sm, [N // 4, 2, 2]))  # [N/4, 2]: values 4g + 2j, 4g + 2j + 1
    s0, s2 = tl.split(even)
    s1, s3 = tl.split(odd)
    # off_signmant (the 32-byte header) and first * 3 (first: a multiple of 4) are word aligned
    words = (out_ptr + off_signmant + first * 3).to(tl.pointer_type(tl.int32), bitcast=True)
    g3 = tl.arange(0, N // 4) * 3
    tl.store(words + g3, s0 | (s1 << 24))
    tl.store(words + g3 + 1, (s1 >> 8) | (s2 << 16))
    tl.store(words + g3 + 2, (s2 >> 16) | (s3 << 8))


@triton.jit
def _load_sm24(payload_ptr, off_signmant, first, TB: tl.constexpr, BC: tl.constexpr):
    """Inverse of :func:`_store_sm24` for a ``[TB, BC]`` chunk of contiguous values."""
    N: tl.constexpr = TB * BC
    words = (payload_ptr + off_signmant + first * 3).to(tl.pointer_type(tl.int32), bitcast=True)
    g3 = tl.arange(0, N // 4) * 3
    w0 = tl.load(words + g3)
    w1 = tl.load(words + g3 + 1)
    w2 = tl.load(words + g3 + 2)
    s0 = w0 & 0xFFFFFF
    s1 = ((w0 >> 24) & 0xFF) | ((w1 & 0xFFFF) << 8)
    s2 = ((w1 >> 16) & 0xFFFF) | ((w2 & 0xFF) << 16)
    s3 = (w2 >> 8) & 0xFFFFFF
    return tl.reshape(tl.join(tl.join(s0, s2), tl.join(s1, s3)), [TB, BC])


@triton.jit
def _fields(bits_ptr, state_ptr, out_ptr, offs, inside, first, off_signmant, off_planes, plane_bytes,
            TB: tl.constexpr, BC: tl.constexpr, TOTAL_BITS: tl.constexpr, EXP_BITS: tl.constexpr,
            MANT_BITS: tl.constexpr, SM_BYTES: tl.constexpr, N_PLANES: tl.constexpr, WORDS: tl.constexpr,
            EVEN: tl.constexpr):
    """One ``[TB, BC]`` chunk of the encoder: writes its sign|mantissa bytes, bit planes and new
    exponents (into ``state``); returns (new exponents, 1 per block row where one differs).
    ``WORDS``: the chunk is ``TB * BC`` contiguous values from ``first`` and fp32's 3 bytes per
    value go out as words (full tiles; a partial one stores bytes, exactly up to the shard's end)."""
    x = _ld(bits_ptr + offs, inside, EVEN).to(tl.int32)
    # Fields, all masked after shifting: the sign extension of 16-bit patterns never leaks.
    exp = (x >> MANT_BITS) & ((1 << EXP_BITS) - 1)
    sm = (x & ((1 << MANT_BITS) - 1)) | (((x >> (TOTAL_BITS - 1)) & 1) << MANT_BITS)
    # Outside the shard x = 0, so sm = 0: plane padding bits come out 0, as pack_bits pads.
    old = _ld(state_ptr + offs, inside, EVEN).to(tl.int32)
    if EVEN:
        diff = (exp != old).to(tl.int32)
    else:
        diff = ((exp != old) & inside).to(tl.int32)
    # Each value's state byte is read and written by this program only.
    _st(state_ptr + offs, exp.to(tl.uint8), inside, EVEN)
    if WORDS and EVEN:
        _store_sm24(out_ptr, off_signmant, first, sm, TB * BC)
    else:
        for k in tl.static_range(SM_BYTES):
            _st(out_ptr + off_signmant + offs * SM_BYTES + k, ((sm >> (8 * k)) & 0xFF).to(tl.uint8), inside, EVEN)
    if N_PLANES > 0:
        # Groups of 8 consecutive values make one byte of each plane: BC >= 8, or BC == B < 8 and
        # the chunk is TB * B contiguous values; either way row-major groups of 8 are consecutive.
        # Plane p's bit of value j of a group goes to bit 8 p + j of one word per group (the bits
        # are disjoint: the sum is an OR), so all planes take one reduction.
        hb = sm >> (8 * SM_BYTES)
        spread = hb & 1
        for p in tl.static_range(1, N_PLANES):
            spread |= ((hb >> p) & 1) << (8 * p)
        groups = tl.reshape(offs, [TB * BC // 8, 8])
        byte_idx = tl.min(groups, axis=1) // 8
        word = tl.sum(tl.reshape(spread, [TB * BC // 8, 8]) << tl.arange(0, 8)[None, :], axis=1)
        for p in tl.static_range(N_PLANES):
            tl.store(out_ptr + off_planes + p * plane_bytes + byte_idx, ((word >> (8 * p)) & 0xFF).to(tl.uint8),
                     mask=byte_idx < plane_bytes)
    return exp, tl.max(diff, axis=1)


@triton.jit
def _encode_tiles(bits_ptr, state_ptr, out_ptr, counter_ptr, flags_ptr, needed_ptr, n, n_blocks, n_full, n_tiles,
                  off_signmant, off_planes, plane_bytes, off_bitmap, off_exps, slots,
                  B: tl.constexpr, TB: tl.constexpr, BC: tl.constexpr, TOTAL_BITS: tl.constexpr,
                  EXP_BITS: tl.constexpr, MANT_BITS: tl.constexpr, SM_BYTES: tl.constexpr,
                  N_PLANES: tl.constexpr, WORDS: tl.constexpr, EVEN: tl.constexpr):
    epoch, _, tile = tile_ticket(counter_ptr, 1, n_full, n_tiles, EVEN)
    blocks = tile * TB + tl.arange(0, TB)                     # [TB] block ids of this tile
    cols = tl.arange(0, BC)
    if B == BC:  # one chunk: the new exponents stay in registers
        offs = blocks[:, None] * B + cols[None, :]            # [TB, BC] value index (int64)
        inside = offs < n
        exp, changed = _fields(bits_ptr, state_ptr, out_ptr, offs, inside, tile * TB * B, off_signmant, off_planes,
                               plane_bytes, TB, BC, TOTAL_BITS, EXP_BITS, MANT_BITS, SM_BYTES, N_PLANES, WORDS, EVEN)
    else:
        changed = tl.zeros([TB], dtype=tl.int32)              # 1 where some exponent differs
        for j in range(0, B, BC):
            offs = blocks[:, None] * B + j + cols[None, :]
            _, c = _fields(bits_ptr, state_ptr, out_ptr, offs, offs < n, tile * TB * B + j, off_signmant,
                           off_planes, plane_bytes, TB, BC, TOTAL_BITS, EXP_BITS, MANT_BITS, SM_BYTES, N_PLANES,
                           False, EVEN)
            changed = tl.maximum(changed, c)
    # TB is a multiple of 8: this tile owns bitmap bytes [tile * TB / 8, (tile + 1) * TB / 8).
    bm = tl.sum(tl.reshape(changed, [TB // 8, 8]) * (1 << tl.arange(0, 8))[None, :], axis=1)
    bm_idx = tile * (TB // 8) + tl.arange(0, TB // 8)
    tl.store(out_ptr + off_bitmap + bm_idx, bm.to(tl.uint8), mask=bm_idx * 8 < n_blocks)
    # Slot of a changed block: changed blocks of earlier tiles (look-back) + earlier in this tile.
    count = tl.sum(changed, axis=0).to(tl.int64)
    first = look_back(flags_ptr, tile, count, epoch)
    slot = first + (tl.cumsum(changed, axis=0) - changed).to(tl.int64)
    write = (changed != 0) & (slot < slots)                   # only the first `slots` fit
    if B == BC:
        # padding past the shard is sent as 0
        e = exp if EVEN else tl.where(inside, exp, 0)
        tl.store(out_ptr + off_exps + slot[:, None] * B + cols[None, :], e.to(tl.uint8), mask=write[:, None])
    else:
        tl.debug_barrier()  # state (the new exponents) was written by other threads of this program
        for j in range(0, B, BC):
            offs = blocks[:, None] * B + j + cols[None, :]
            e = tl.load(state_ptr + offs, mask=write[:, None] & (offs < n), other=0)
            tl.store(out_ptr + off_exps + slot[:, None] * B + j + cols[None, :], e, mask=write[:, None])
    if tile == n_tiles - 1:
        tl.store(needed_ptr, off_exps + (first + count) * B)


@triton.jit
def _decode_tiles(payload_ptr, target_ptr, counter_ptr, flags_ptr, rows_ptr, offsets_ptr, n, k, n_blocks, n_full,
                  n_tiles, capacity, off_signmant, off_planes, plane_bytes, off_bitmap, off_exps,
                  B: tl.constexpr, TB: tl.constexpr, BC: tl.constexpr, TOTAL_BITS: tl.constexpr,
                  EXP_BITS: tl.constexpr, MANT_BITS: tl.constexpr, SM_BYTES: tl.constexpr,
                  N_PLANES: tl.constexpr, WORDS: tl.constexpr, BATCHED: tl.constexpr, EVEN: tl.constexpr):
    epoch, row, tile = tile_ticket(counter_ptr, k, n_full, n_tiles, EVEN)
    if BATCHED:
        # Payloads start 16-byte aligned (see Codec.decode_many): lets the sign|mantissa bytes vectorise.
        payload_ptr += tl.multiple_of(tl.load(offsets_ptr + row), 16)
        target_ptr += tl.load(rows_ptr + row) * n
        # Capacity of this row's payload: header word 3 (the payload's own length).
        capacity = tl.load((payload_ptr + 24).to(tl.pointer_type(tl.int64), bitcast=True))
    blocks = tile * TB + tl.arange(0, TB)
    cols = tl.arange(0, BC)
    flag = _changed_flags(payload_ptr, off_bitmap, blocks, n_blocks)
    count = tl.sum(flag, axis=0).to(tl.int64)
    slot = look_back(flags_ptr + row * n_tiles, tile, count, epoch) + (tl.cumsum(flag, axis=0) - flag).to(tl.int64)
    sent = (flag != 0)[:, None]
    for j in range(0, B, BC):
        offs = blocks[:, None] * B + j + cols[None, :]
        inside = offs < n
        if WORDS and EVEN:  # fp32, contiguous chunk (B == BC), full tile: 3 words per 4 values
            sm = _load_sm24(payload_ptr, off_signmant, tile * TB * B, TB, BC)
        else:
            sm = tl.zeros([TB, BC], dtype=tl.int32)
            for b in tl.static_range(SM_BYTES):
                byte = _ld(payload_ptr + off_signmant + offs * SM_BYTES + b, inside, EVEN)
                sm = sm | (byte.to(tl.int32) << (8 * b))
        if N_PLANES > 0:
            # One byte per plane per group of 8 values, combined into one word (plane p at bits
            # 8 p ..), then spread back to the group's values.
            g8 = tl.min(tl.reshape(offs, [TB * BC // 8, 8]), axis=1) // 8
            gin = g8 < plane_bytes
            word = tl.zeros([TB * BC // 8], dtype=tl.int32)
            for p in tl.static_range(N_PLANES):
                pb = _ld(payload_ptr + off_planes + p * plane_bytes + g8, gin, EVEN)
                word |= pb.to(tl.int32) << (8 * p)
            bits = tl.reshape(word[:, None] >> tl.arange(0, 8)[None, :], [TB, BC])
            for p in tl.static_range(N_PLANES):
                sm = sm | (((bits >> (8 * p)) & 1) << (8 * SM_BYTES + p))
        old = _ld(target_ptr + offs, inside, EVEN).to(tl.int32)
        exp_old = (old >> MANT_BITS) & ((1 << EXP_BITS) - 1)
        # A valid (non-overflowed) payload holds every changed block's slot; the capacity bound
        # only keeps a corrupt one from reading past the payload.
        at = off_exps + slot[:, None] * B + j + cols[None, :]
        exp_new = tl.load(payload_ptr + at, mask=inside & sent & (at < capacity), other=0).to(tl.int32)
        exp = tl.where(sent, exp_new, exp_old)
        # sign << (TOTAL_BITS - 1) wraps into bit 31 for fp32; the int16 store keeps the low 16 bits.
        val = (((sm >> MANT_BITS) & 1) << (TOTAL_BITS - 1)) | (exp << MANT_BITS) | (sm & ((1 << MANT_BITS) - 1))
        _st(target_ptr + offs, val.to(target_ptr.dtype.element_ty), inside, EVEN)


def _fmt_args(layout: ExponentReuseLayout) -> dict:
    fmt = layout.fmt
    return dict(TOTAL_BITS=fmt.total_bits, EXP_BITS=fmt.exp_bits, MANT_BITS=fmt.mant_bits,
                SM_BYTES=layout.sm_bytes, N_PLANES=layout.n_planes)


def _geometry(n: int, block_size: int, tile_values: int) -> tuple[int, int, int, int]:
    """(TB, BC, full tiles, tiles) of a shard: full tiles run unmasked, a partial last tile in a
    second launch of the same kernel."""
    tb, bc = _tile_shape(block_size, tile_values)
    return tb, bc, n // (tb * block_size), -(-n // (tb * block_size))


def _encode(*, layout: ExponentReuseLayout, shard_bits: torch.Tensor, state: torch.Tensor, out: torch.Tensor,
            tile_values: int = _TILE_VALUES) -> torch.Tensor:
    """:func:`encode_triton` with a chosen chunk size (tests use small ones for many tiles)."""
    n, B, nb = layout.numel, layout.block_size, layout.n_blocks
    if shard_bits.numel() != n or state.numel() != n or state.dtype != torch.uint8:
        raise ValueError(f"exponent_reuse: shard has {shard_bits.numel()} values and state {state.numel()} "
                         f"{state.dtype}; layout expects {n} values and uint8 state")
    if n == 0:
        return torch.tensor(layout.off_exps, dtype=torch.int64, device=out.device)
    tb, bc, n_full, n_tiles = _geometry(n, B, tile_values)
    s = scratch(("exponent_reuse.encode", n_tiles, 1), out.device, n_tiles)
    needed = s["needed"]
    args = (shard_bits, state, out, s["counter"], s["flags"], needed, n, nb, n_full, n_tiles, layout.off_signmant,
            layout.off_planes, layout.plane_bytes, layout.off_bitmap, layout.off_exps, layout.slots(out.numel()))
    kw = dict(B=B, TB=tb, BC=bc, **_fmt_args(layout), WORDS=layout.sm_bytes == 3 and bc == B,
              num_warps=_NUM_WARPS)
    if n_full:
        _encode_tiles[(n_full,)](*args, EVEN=True, **kw)
    if n_tiles > n_full:
        _encode_tiles[(1,)](*args, EVEN=False, **kw)
    return needed[0].clone()


def _decode_rows(layout: ExponentReuseLayout, payload: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor,
                 offsets: torch.Tensor, k: int, batched: bool, tile_values: int) -> None:
    n, B, nb = layout.numel, layout.block_size, layout.n_blocks
    tb, bc, n_full, n_tiles = _geometry(n, B, tile_values)
    s = scratch(("exponent_reuse.decode_many" if batched else "exponent_reuse.decode", n_tiles, k), payload.device,
                k * n_tiles)
    args = (payload, targets, s["counter"], s["flags"], rows, offsets, n, k, nb, n_full, n_tiles,
            0 if batched else payload.numel(), layout.off_signmant, layout.off_planes, layout.plane_bytes,
            layout.off_bitmap, layout.off_exps)
    kw = dict(B=B, TB=tb, BC=bc, **_fmt_args(layout), WORDS=layout.sm_bytes == 3 and bc == B, BATCHED=batched,
              num_warps=_NUM_WARPS)
    if n_full:
        _decode_tiles[(k * n_full,)](*args, EVEN=True, **kw)
    if n_tiles > n_full:
        _decode_tiles[(k,)](*args, EVEN=False, **kw)


def _decode(*, layout: ExponentReuseLayout, payload: torch.Tensor, target_bits: torch.Tensor,
            tile_values: int = _TILE_VALUES) -> None:
    """:func:`decode_triton` with a chosen chunk size (tests use small ones for many tiles)."""
    n = layout.numel
    if target_bits.numel() != n or not target_bits.is_contiguous():
        raise ValueError(f"exponent_reuse: target has {target_bits.numel()} values "
                         f"(contiguous={target_bits.is_contiguous()}); layout expects {n} contiguous")
    if n == 0:
        return
    _decode_rows(layout, payload, target_bits, payload, payload, 1, False, tile_values)


def _decode_many(*, layout: ExponentReuseLayout, payloads: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor,
                 targets_bits: torch.Tensor, tile_values: int = _TILE_VALUES) -> None:
    """:func:`decode_many_triton` with a chosen chunk size."""
    n = layout.numel
    k = rows.numel()
    if targets_bits.dim() != 2 or targets_bits.shape[1] != n or not targets_bits.is_contiguous():
        raise ValueError(f"exponent_reuse: targets_bits must be a contiguous [world, {n}] tensor; "
                         f"got {tuple(targets_bits.shape)}")
    if offsets.numel() != k or rows.dtype != torch.int64 or offsets.dtype != torch.int64:
        raise ValueError("exponent_reuse: rows and offsets must be int64 tensors of the same length")
    if n == 0 or k == 0:
        return
    _decode_rows(layout, payloads, targets_bits, rows, offsets, k, True, tile_values)


def encode_triton(*, layout: ExponentReuseLayout, shard_bits: torch.Tensor, state: torch.Tensor,
                  out: torch.Tensor) -> torch.Tensor:
    """Triton twin of ``encode_reference``: writes every section of ``out`` but the header, updates
    ``state`` and returns the bytes needed as a 0-d int64 tensor on ``out``'s device (no host sync)."""
    return _encode(layout=layout, shard_bits=shard_bits, state=state, out=out)


def decode_triton(*, layout: ExponentReuseLayout, payload: torch.Tensor, target_bits: torch.Tensor) -> None:
    """Triton twin of ``decode_reference``: ``target_bits`` (previous values) becomes the encoded shard."""
    _decode(layout=layout, payload=payload, target_bits=target_bits)


def decode_many_triton(*, layout: ExponentReuseLayout, payloads: torch.Tensor, rows: torch.Tensor,
                       offsets: torch.Tensor, targets_bits: torch.Tensor) -> None:
    """Batched twin of :func:`decode_triton` (see Codec.decode_many): payload ``i`` starts at byte
    ``offsets[i]`` of ``payloads`` and decodes into row ``rows[i]`` of ``targets_bits``
    (``[world, n]``). One launch (two with a partial last tile) whatever ``k``; no host reads;
    scratch cached per (tiles, k, device, stream). Each payload's capacity comes from its own header."""
    _decode_many(layout=layout, payloads=payloads, rows=rows, offsets=offsets, targets_bits=targets_bits)
