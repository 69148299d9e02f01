"""Triton twins of :func:`ciera.codecs.exponent_reuse.encode_reference` and ``decode_reference``.

Same signatures, same semantics, byte-identical payload sections (the header is the codec's job)
and bit-identical decoded values. Neither twin synchronises with the host: the bytes an encode
needs come back as a 0-d int64 tensor on the shard's device.

Work is split in *tiles* of ``TB`` whole blocks (``TB`` a multiple of 8, so every bitmap byte
belongs to exactly one tile). A program walks its tile as ``[TB, BC]`` chunks (``BC`` columns of
each of the ``TB`` blocks, ``BC`` dividing ``B``), so one chunk holds ``TB * BC`` values whatever
the block size.

Encode, two launches and one device cumsum:

1. ``_encode_fields``: per tile, write sign|mantissa bytes and bit planes, compare each new
   exponent exactly with ``state`` (uint8), overwrite ``state`` with the new exponents, write the
   tile's bitmap bytes and its number of changed blocks.
2. ``torch.cumsum`` of the per-tile counts: the first exponent slot of every tile; the total gives
   the needed bytes.
3. ``_encode_exps``: every changed block whose slot is below the payload's slot count ``K`` copies
   its ``B`` new exponents (now in ``state``) into its slot; padding of a partial last block is 0.
   Blocks past ``K`` are not written (the payload has overflowed; the codec flags it).

Decode, two launches and one device cumsum: ``_count_changed`` (per-tile popcount of the bitmap),
``torch.cumsum``, then ``_decode_values`` rebuilds every value from its sign|mantissa bytes and
planes and either its block's slot (changed block) or the exponent already in ``target``.

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

import functools

import torch
import triton
import triton.language as tl

from ciera.codecs.exponent_reuse import ExponentReuseLayout

_TILE_VALUES = 4096
"""Values per ``[TB, BC]`` chunk; a power of two >= 8."""
_NUM_WARPS = 8


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
def _encode_fields(bits_ptr, state_ptr, out_ptr, counts_ptr, n, n_blocks, off_signmant, off_planes,
                   plane_bytes, off_bitmap, tile0,
                   B: tl.constexpr, TB: tl.constexpr, BC: tl.constexpr, TOTAL_BITS: tl.constexpr,
                   EXP_BITS: tl.constexpr, MANT_BITS: tl.constexpr, SM_BYTES: tl.constexpr,
                   N_PLANES: tl.constexpr, EVEN: tl.constexpr):
    tile = tl.program_id(0).to(tl.int64) + tile0
    blocks = tile * TB + tl.arange(0, TB)                     # [TB] block ids of this tile
    cols = tl.arange(0, BC)
    changed = tl.zeros([TB], dtype=tl.int32)                  # 1 where some exponent differs
    for j in range(0, B, BC):
        offs = blocks[:, None] * B + j + cols[None, :]        # [TB, BC] value index (int64)
        inside = offs < n
        x = _ld(bits_ptr + offs, inside, EVEN).to(tl.int32)
        # Fields, all masked after shifting: the sign extension of 16-bit patterns never leaks.
        exp = (x >> MANT_BITS) & ((1 << EXP_BITS) - 1)
        sm = (x & ((1 << MANT_BITS) - 1)) | (((x >> (TOTAL_BITS - 1)) & 1) << MANT_BITS)
        # Outside the shard x = 0, so sm = 0: plane padding bits come out 0, as pack_bits pads.
        old = _ld(state_ptr + offs, inside, EVEN).to(tl.int32)
        diff = ((exp != old) & inside).to(tl.int32)
        changed = tl.maximum(changed, tl.max(diff, axis=1))
        # Each value's state byte is read and written by this program only.
        _st(state_ptr + offs, exp.to(tl.uint8), inside, EVEN)
        for k in tl.static_range(SM_BYTES):
            _st(out_ptr + off_signmant + offs * SM_BYTES + k, ((sm >> (8 * k)) & 0xFF).to(tl.uint8), inside, EVEN)
        if N_PLANES > 0:
            # Groups of 8 consecutive values make one plane byte: BC >= 8, or BC == B < 8 and the
            # chunk is TB * B contiguous values; either way row-major groups of 8 are consecutive.
            groups = tl.reshape(offs, [TB * BC // 8, 8])
            byte_idx = tl.min(groups, axis=1) // 8
            weights = (1 << tl.arange(0, 8))[None, :]
            for p in tl.static_range(N_PLANES):
                bit = (sm >> (8 * SM_BYTES + p)) & 1
                byte = tl.sum(tl.reshape(bit, [TB * BC // 8, 8]) * weights, axis=1)
                tl.store(out_ptr + off_planes + p * plane_bytes + byte_idx, byte.to(tl.uint8),
                         mask=byte_idx < plane_bytes)
    # TB is a multiple of 8: this tile owns bitmap bytes [tile * TB / 8, (tile + 1) * TB / 8).
    bm = tl.sum(tl.reshape(changed, [TB // 8, 8]) * (1 << tl.arange(0, 8))[None, :], axis=1)
    bm_idx = tile * (TB // 8) + tl.arange(0, TB // 8)
    tl.store(out_ptr + off_bitmap + bm_idx, bm.to(tl.uint8), mask=bm_idx * 8 < n_blocks)
    tl.store(counts_ptr + tile, tl.sum(changed, axis=0))


@triton.jit
def _encode_exps(state_ptr, out_ptr, first_ptr, n, n_blocks, off_bitmap, off_exps, slots,
                 B: tl.constexpr, TB: tl.constexpr, BC: tl.constexpr):
    tile = tl.program_id(0).to(tl.int64)
    blocks = tile * TB + tl.arange(0, TB)
    cols = tl.arange(0, BC)
    flag = _changed_flags(out_ptr, off_bitmap, blocks, n_blocks)
    # Slot of a changed block: changed blocks before its tile + changed blocks before it in the tile.
    slot = tl.load(first_ptr + tile) + (tl.cumsum(flag, axis=0) - flag).to(tl.int64)
    write = (flag != 0) & (slot < slots)                      # only the first `slots` fit
    for j in range(0, B, BC):
        offs = blocks[:, None] * B + j + cols[None, :]
        # state holds the new exponents; padding past the shard is sent as 0.
        e = tl.load(state_ptr + offs, mask=write[:, None] & (offs < n), other=0)
        tl.store(out_ptr + off_exps + slot[:, None] * B + j + cols[None, :], e, mask=write[:, None])


@triton.jit
def _row_bases(rows_ptr, offsets_ptr, n, BATCHED: tl.constexpr):
    """(payload byte offset, target value offset) of this program's row: ``program_id(1)`` indexes
    ``rows`` / ``offsets`` in a batched decode; (0, 0) otherwise."""
    if BATCHED:
        r = tl.program_id(1)
        # Payloads start 16-byte aligned (see Codec.decode_many): lets the sign|mantissa bytes vectorise.
        return tl.multiple_of(tl.load(offsets_ptr + r), 16), tl.load(rows_ptr + r) * n
    else:
        return tl.zeros([], tl.int64), tl.zeros([], tl.int64)


@triton.jit
def _count_changed(payload_ptr, counts_ptr, rows_ptr, offsets_ptr, n, n_blocks, n_tiles, off_bitmap,
                   TB: tl.constexpr, BATCHED: tl.constexpr):
    tile = tl.program_id(0).to(tl.int64)
    pbase, _ = _row_bases(rows_ptr, offsets_ptr, n, BATCHED)
    blocks = tile * TB + tl.arange(0, TB)
    flags = _changed_flags(payload_ptr + pbase, off_bitmap, blocks, n_blocks)
    tl.store(counts_ptr + tl.program_id(1).to(tl.int64) * n_tiles + tile, tl.sum(flags, axis=0))


@triton.jit
def _decode_values(payload_ptr, target_ptr, first_ptr, rows_ptr, offsets_ptr, n, n_blocks, n_tiles, capacity,
                   off_signmant, off_planes, plane_bytes, off_bitmap, off_exps, tile0,
                   B: tl.constexpr, TB: tl.constexpr, BC: tl.constexpr, TOTAL_BITS: tl.constexpr,
                   EXP_BITS: tl.constexpr, MANT_BITS: tl.constexpr, SM_BYTES: tl.constexpr,
                   N_PLANES: tl.constexpr, BATCHED: tl.constexpr, EVEN: tl.constexpr):
    tile = tl.program_id(0).to(tl.int64) + tile0
    pbase, tbase = _row_bases(rows_ptr, offsets_ptr, n, BATCHED)
    payload_ptr += pbase
    target_ptr += tbase
    if BATCHED:
        # Capacity of this row's payload: header word 3 (the payload's own length).
        capacity = tl.load((payload_ptr + 24).to(tl.pointer_type(tl.int64), bitcast=True))
    blocks = tile * TB + tl.arange(0, TB)
    cols = tl.arange(0, BC)
    flag = _changed_flags(payload_ptr, off_bitmap, blocks, n_blocks)
    slot = tl.load(first_ptr + tl.program_id(1).to(tl.int64) * n_tiles + tile) + \
        (tl.cumsum(flag, axis=0) - flag).to(tl.int64)
    sent = (flag != 0)[:, None]
    for j in range(0, B, BC):
        offs = blocks[:, None] * B + j + cols[None, :]
        inside = offs < n
        sm = tl.zeros([TB, BC], dtype=tl.int32)
        for k in tl.static_range(SM_BYTES):
            byte = _ld(payload_ptr + off_signmant + offs * SM_BYTES + k, inside, EVEN)
            sm = sm | (byte.to(tl.int32) << (8 * k))
        for p in tl.static_range(N_PLANES):
            byte = _ld(payload_ptr + off_planes + p * plane_bytes + offs // 8, inside, EVEN)
            sm = sm | (((byte.to(tl.int32) >> (offs % 8).to(tl.int32)) & 1) << (8 * SM_BYTES + p))
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


def _splits(n: int, tile_len: int, n_tiles: int, k: int | None = None):
    """(grid, first tile, EVEN) of the launches over a shard: full tiles unmasked, then the
    partial last tile (if any) masked. ``k``: rows of a batched decode (grid axis 1)."""
    full = n // tile_len
    parts = [(full, 0, True), (n_tiles - full, full, False)]
    return [((count,) if k is None else (count, k), tile0, even) for count, tile0, even in parts if count]


def _exclusive_cumsum(counts: torch.Tensor) -> torch.Tensor:
    """First slot of every tile (int64, on device)."""
    inclusive = torch.cumsum(counts, 0, dtype=torch.int64)
    return inclusive - counts


def _encode(*, layout: ExponentReuseLayout, shard_bits: torch.Tensor, state: torch.Tensor, out: torch.Tensor,
            tile_values: int = _TILE_VALUES) -> torch.Tensor:
    """:func:`encode_triton` with a chosen chunk size (tests use small ones for many tiles)."""
    n, B, nb = layout.numel, layout.block_size, layout.n_blocks
    if shard_bits.numel() != n or state.numel() != n or state.dtype != torch.uint8:
        raise ValueError(f"exponent_reuse: shard has {shard_bits.numel()} values and state {state.numel()} "
                         f"{state.dtype}; layout expects {n} values and uint8 state")
    if n == 0:
        return torch.tensor(layout.off_exps, dtype=torch.int64, device=out.device)
    tb, bc = _tile_shape(B, tile_values)
    n_tiles = -(-nb // tb)
    counts = torch.empty(n_tiles, dtype=torch.int32, device=out.device)
    for grid, tile0, even in _splits(n, tb * B, n_tiles):
        _encode_fields[grid](
            shard_bits, state, out, counts, n, nb, layout.off_signmant, layout.off_planes, layout.plane_bytes,
            layout.off_bitmap, tile0, B=B, TB=tb, BC=bc, **_fmt_args(layout), EVEN=even, num_warps=_NUM_WARPS)
    slots = layout.slots(out.numel())
    if slots > 0:
        first = _exclusive_cumsum(counts)
        _encode_exps[(n_tiles,)](state, out, first, n, nb, layout.off_bitmap, layout.off_exps, slots,
                                 B=B, TB=tb, BC=bc, num_warps=_NUM_WARPS)
    return layout.off_exps + counts.sum(dtype=torch.int64) * B


def _decode(*, layout: ExponentReuseLayout, payload: torch.Tensor, target_bits: torch.Tensor,
            tile_values: int = _TILE_VALUES) -> None:
    """:func:`decode_triton` with a chosen chunk size (tests use small ones for many tiles)."""
    n, B, nb = layout.numel, layout.block_size, layout.n_blocks
    if target_bits.numel() != n or not target_bits.is_contiguous():
        raise ValueError(f"exponent_reuse: target has {target_bits.numel()} values "
                         f"(contiguous={target_bits.is_contiguous()}); layout expects {n} contiguous")
    if n == 0:
        return
    tb, bc = _tile_shape(B, tile_values)
    n_tiles = -(-nb // tb)
    counts = torch.empty(n_tiles, dtype=torch.int32, device=payload.device)
    _count_changed[(n_tiles,)](payload, counts, counts, counts, n, nb, n_tiles, layout.off_bitmap, TB=tb, BATCHED=False)
    first = _exclusive_cumsum(counts)
    for grid, tile0, even in _splits(n, tb * B, n_tiles):
        _decode_values[grid](
            payload, target_bits, first, first, first, n, nb, n_tiles, payload.numel(), layout.off_signmant,
            layout.off_planes, layout.plane_bytes, layout.off_bitmap, layout.off_exps, tile0, B=B, TB=tb, BC=bc,
            **_fmt_args(layout), BATCHED=False, EVEN=even, num_warps=_NUM_WARPS)


@functools.lru_cache(maxsize=64)
def _many_scratch(n_tiles: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-tile counts, first slots) of a batched decode, ``[k, n_tiles]`` each, cached per shape."""
    return (torch.empty(k, n_tiles, dtype=torch.int32, device=device),
            torch.empty(k, n_tiles, dtype=torch.int64, device=device))


def _decode_many(*, layout: ExponentReuseLayout, payloads: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor,
                 targets_bits: torch.Tensor, tile_values: int = _TILE_VALUES) -> None:
    """:func:`decode_many_triton` with a chosen chunk size."""
    n, B, nb = layout.numel, layout.block_size, layout.n_blocks
    k = rows.numel()
    if targets_bits.dim() != 2 or targets_bits.shape[1] != n or not targets_bits.is_contiguous():
        raise ValueError(f"exponent_reuse: targets_bits must be a contiguous [world, {n}] tensor; "
                         f"got {tuple(targets_bits.shape)}")
    if offsets.numel() != k or rows.dtype != torch.int64 or offsets.dtype != torch.int64:
        raise ValueError("exponent_reuse: rows and offsets must be int64 tensors of the same length")
    if n == 0 or k == 0:
        return
    tb, bc = _tile_shape(B, tile_values)
    n_tiles = -(-nb // tb)
    counts, first = _many_scratch(n_tiles, k, payloads.device)
    _count_changed[(n_tiles, k)](payloads, counts, rows, offsets, n, nb, n_tiles, layout.off_bitmap, TB=tb,
                                 BATCHED=True)
    torch.cumsum(counts, 1, dtype=torch.int64, out=first)
    first -= counts
    for grid, tile0, even in _splits(n, tb * B, n_tiles, k):
        _decode_values[grid](
            payloads, targets_bits, first, rows, offsets, n, nb, n_tiles, 0, layout.off_signmant,
            layout.off_planes, layout.plane_bytes, layout.off_bitmap, layout.off_exps, tile0, B=B, TB=tb, BC=bc,
            **_fmt_args(layout), BATCHED=True, EVEN=even, num_warps=_NUM_WARPS)


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
    (``[world, n]``). Two launches and one cumsum whatever ``k``; no host reads; scratch cached
    per (tiles, k, device). Each payload's capacity comes from its own header."""
    _decode_many(layout=layout, payloads=payloads, rows=rows, offsets=offsets, targets_bits=targets_bits)
