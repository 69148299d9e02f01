"""Triton twins of :mod:`ciera.codecs.delta`: same signatures, same bytes.

One program per group of ``G`` values (a byte-aligned bit stream). Encoding runs three kernels
with torch glue between them (all on the device, no data-dependent host sync):

1. ``_class_keys``: ``exponent(previous) * (W + 1) + bit_length(z)`` per value; torch counts
   them (``index_add_``) and picks the width table (:func:`choose_table`).
2. ``_group_stats``: table-mode bits and exceptions per group; torch turns them into block and
   group offsets with one ``cumsum`` (:func:`plan_blocks`).
3. ``_pack``: every group writes its bit stream (each 32-bit output word assembled from the
   values that overlap it, no atomics) and its exception records, then updates the sender state.

Decoding: ``_group_bits`` (sizes from the previous values and the table), the same plan, then
``_unpack`` (a gather per value plus the block's exceptions, in place).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ciera.codecs.delta import (
    DeltaLayout, choose_table, count_field, plan_blocks, read_counts,
)


REPORT_LOOP_TRIPS = {"_unpack": 1}
"""Trips of each runtime loop, for tools/kernel_report.py: ``_unpack`` scans its block's exceptions
``G`` at a time, one trip while a block has fewer than ``G`` exceptions (the usual case)."""


@triton.jit
def _unsigned(x, W: tl.constexpr):
    return x.to(tl.int64) & ((1 << W) - 1)


@triton.jit
def _zigzag(u_new, u_old, W: tl.constexpr):
    d = (u_new - u_old) & ((1 << W) - 1)
    return ((d << 1) ^ -(d >> (W - 1))) & ((1 << W) - 1)


@triton.jit
def _bit_length(z, W: tl.constexpr):
    n = tl.zeros(z.shape, tl.int64)
    for i in tl.static_range(W):
        n += ((z >> i) != 0).to(tl.int64)
    return n


@triton.jit
def _class_keys(shard_ptr, state_ptr, key_ptr, n, W: tl.constexpr, MANT: tl.constexpr,
                EXPMASK: tl.constexpr, G: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * G + tl.arange(0, G)
    valid = offs < n
    u_new = _unsigned(tl.load(shard_ptr + offs, mask=valid, other=0), W)
    u_old = _unsigned(tl.load(state_ptr + offs, mask=valid, other=0), W)
    e = (u_old >> MANT) & EXPMASK
    key = e * (W + 1) + _bit_length(_zigzag(u_new, u_old, W), W)
    tl.store(key_ptr + offs, key, mask=valid)


@triton.jit
def _group_stats(shard_ptr, state_ptr, table_ptr, bits_ptr, exc_ptr, n, W: tl.constexpr,
                 MANT: tl.constexpr, EXPMASK: tl.constexpr, G: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * G + tl.arange(0, G)
    valid = offs < n
    u_new = _unsigned(tl.load(shard_ptr + offs, mask=valid, other=0), W)
    u_old = _unsigned(tl.load(state_ptr + offs, mask=valid, other=0), W)
    w = tl.load(table_ptr + ((u_old >> MANT) & EXPMASK), mask=valid, other=0).to(tl.int64)
    exc = _bit_length(_zigzag(u_new, u_old, W), W) > w
    tl.store(bits_ptr + pid, tl.sum(w, axis=0))
    tl.store(exc_ptr + pid, tl.sum(exc.to(tl.int64), axis=0))


@triton.jit
def _pack(shard_ptr, state_ptr, out_ptr, table_ptr, raw_ptr, gstart_ptr, gexc_pre_ptr, exc_start_ptr,
          count_ptr, block_end_ptr, n, capacity, W: tl.constexpr, MANT: tl.constexpr,
          EXPMASK: tl.constexpr, G: tl.constexpr, NG: tl.constexpr, I: tl.constexpr, S: tl.constexpr):
    pid = tl.program_id(0)
    blk = pid // NG
    j = tl.arange(0, G)
    offs = pid.to(tl.int64) * G + j
    valid = offs < n
    bits_new = tl.load(shard_ptr + offs, mask=valid, other=0)
    u_new = _unsigned(bits_new, W)
    u_old = _unsigned(tl.load(state_ptr + offs, mask=valid, other=0), W)
    fits = tl.load(block_end_ptr + blk) <= capacity
    if fits:
        raw = tl.load(raw_ptr + blk) != 0
        z = _zigzag(u_new, u_old, W)
        w = tl.load(table_ptr + ((u_old >> MANT) & EXPMASK), mask=valid, other=0).to(tl.int64)
        w = tl.where(raw, W, w)
        w = tl.where(valid, w, 0)
        exc = _bit_length(z, W) > w  # never in raw blocks: there w = W >= bit length
        low = z & ((tl.full(w.shape, 1, tl.int64) << w) - 1)
        o = tl.cumsum(w, axis=0) - w
        # Output word m of the group holds bits [32m, 32m + 32): OR of the overlapping values.
        NWORDS: tl.constexpr = G * W // 32
        m32 = tl.arange(0, NWORDS).to(tl.int64)[:, None] * 32
        shift = o[None, :] - m32
        overlap = (o[None, :] < m32 + 32) & (o[None, :] + w[None, :] > m32)
        part = tl.where(shift >= 0, low[None, :] << tl.maximum(shift, 0), low[None, :] >> tl.maximum(-shift, 0))
        word = tl.sum(tl.where(overlap, part & 0xFFFFFFFF, 0), axis=1)
        gbytes = (tl.sum(w, axis=0) + 7) // 8
        q = tl.arange(0, NWORDS)[:, None] * 4 + tl.arange(0, 4)[None, :]
        gstart = tl.load(gstart_ptr + pid)
        tl.store(out_ptr + gstart + q, ((word[:, None] >> (tl.arange(0, 4)[None, :] * 8)) & 0xFF).to(tl.uint8),
                 mask=q < gbytes)
        # Exceptions: rank in the block = exceptions of earlier groups + rank in this group.
        rank = tl.load(gexc_pre_ptr + pid) + tl.cumsum(exc.to(tl.int64), axis=0) - 1
        base = tl.load(exc_start_ptr + blk)
        jb = (pid % NG).to(tl.int64) * G + j
        for t in tl.static_range(I):
            tl.store(out_ptr + base + rank * I + t, ((jb >> (8 * t)) & 0xFF).to(tl.uint8), mask=exc)
        hi = z >> w
        hbase = base + tl.load(count_ptr + blk) * I
        for t in tl.static_range(S):
            tl.store(out_ptr + hbase + rank * S + t, ((hi >> (8 * t)) & 0xFF).to(tl.uint8), mask=exc)
    tl.store(state_ptr + offs, bits_new, mask=valid)


@triton.jit
def _row_bases(rows_ptr, offsets_ptr, n, BATCHED: tl.constexpr):
    """(payload byte offset, target value offset) of ``program_id(1)``'s row in a batched decode."""
    if BATCHED:
        r = tl.program_id(1)
        return tl.load(offsets_ptr + r), tl.load(rows_ptr + r) * n
    else:
        return tl.zeros([], tl.int64), tl.zeros([], tl.int64)


@triton.jit
def _group_bits(target_ptr, payload_ptr, bits_ptr, rows_ptr, offsets_ptr, n, n_groups, off_table,
                W: tl.constexpr, MANT: tl.constexpr, EXPMASK: tl.constexpr, G: tl.constexpr,
                BATCHED: tl.constexpr):
    pid = tl.program_id(0)
    pbase, tbase = _row_bases(rows_ptr, offsets_ptr, n, BATCHED)
    offs = pid.to(tl.int64) * G + tl.arange(0, G)
    valid = offs < n
    u_old = _unsigned(tl.load(target_ptr + tbase + offs, mask=valid, other=0), W)
    w = tl.load(payload_ptr + pbase + off_table + ((u_old >> MANT) & EXPMASK), mask=valid, other=0).to(tl.int64)
    tl.store(bits_ptr + tl.program_id(1).to(tl.int64) * n_groups + pid, tl.sum(w, axis=0))


@triton.jit
def _unpack(payload_ptr, target_ptr, raw_ptr, gstart_ptr, exc_start_ptr, count_ptr, rows_ptr, offsets_ptr,
            n, n_groups, off_table, plen, W: tl.constexpr, MANT: tl.constexpr, EXPMASK: tl.constexpr,
            G: tl.constexpr, NG: tl.constexpr, I: tl.constexpr, S: tl.constexpr, BATCHED: tl.constexpr):
    pid = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    pbase, tbase = _row_bases(rows_ptr, offsets_ptr, n, BATCHED)
    target_ptr += tbase
    # Plan offsets are relative to the row's payload start; gstart/exc_start/raw/count are [k, ...].
    gpid = row * n_groups + pid
    blk = pid // NG
    gblk = row * (n_groups // NG) + blk
    j = tl.arange(0, G)
    offs = pid.to(tl.int64) * G + j
    valid = offs < n
    u_old = _unsigned(tl.load(target_ptr + offs, mask=valid, other=0), W)
    raw = tl.load(raw_ptr + gblk) != 0
    w = tl.load(payload_ptr + pbase + off_table + ((u_old >> MANT) & EXPMASK), mask=valid, other=0).to(tl.int64)
    w = tl.where(raw, W, w)
    w = tl.where(valid, w, 0)
    bitpos = (pbase + tl.load(gstart_ptr + gpid)) * 8 + tl.cumsum(w, axis=0) - w
    at = bitpos >> 3
    z = tl.zeros([G], tl.int64)
    for t in tl.static_range(W // 8 + 1):
        byte = tl.load(payload_ptr + at + t, mask=valid & (at + t < plen), other=0)
        z |= byte.to(tl.int64) << (8 * t)
    z = (z >> (bitpos & 7)) & ((tl.full(w.shape, 1, tl.int64) << w) - 1)
    # Exceptions of the block that fall in this group, G records at a time.
    count = tl.load(count_ptr + gblk)
    base = pbase + tl.load(exc_start_ptr + gblk)
    jb = (pid % NG).to(tl.int64) * G + j
    for r0 in range(0, count, G):
        r = r0 + j
        live = r < count
        idx = tl.zeros([G], tl.int64)
        for t in tl.static_range(I):
            idx |= tl.load(payload_ptr + base + r * I + t, mask=live, other=0).to(tl.int64) << (8 * t)
        hi = tl.zeros([G], tl.int64)
        for t in tl.static_range(S):
            hi |= tl.load(payload_ptr + base + count * I + r * S + t, mask=live, other=0).to(tl.int64) << (8 * t)
        match = (jb[:, None] == idx[None, :]) & live[None, :]
        z |= tl.sum(tl.where(match, hi[None, :], 0), axis=1) << w
    u = (u_old + ((z >> 1) ^ -(z & 1))) & ((1 << W) - 1)
    u = tl.where(u >= (1 << (W - 1)), u - (1 << W), u)
    tl.store(target_ptr + offs, u.to(target_ptr.dtype.element_ty), mask=valid)


def _consts(layout: DeltaLayout) -> dict:
    fmt = layout.fmt
    return dict(W=layout.width, MANT=fmt.mant_bits, EXPMASK=(1 << fmt.exp_bits) - 1, G=layout.group_size)


def encode_triton(*, layout: DeltaLayout, shard_bits: torch.Tensor, state: torch.Tensor,
                  out: torch.Tensor) -> torch.Tensor:
    """Triton twin of :func:`ciera.codecs.delta.encode_reference`."""
    n, W, nb, NG = layout.numel, layout.width, layout.n_blocks, layout.groups_per_block
    dev = out.device
    if n == 0:
        return torch.tensor(layout.off_data, dtype=torch.int64, device=dev)
    c = _consts(layout)
    n_groups = nb * NG
    key = torch.full((n_groups * layout.group_size,), layout.n_classes * (W + 1), dtype=torch.int64, device=dev)
    _class_keys[(n_groups,)](shard_bits, state, key, n, **c)
    hist = torch.zeros(layout.n_classes * (W + 1) + 1, dtype=torch.int64, device=dev)
    hist.index_add_(0, key, torch.ones_like(key))
    table = choose_table(layout, hist[:-1])
    out[layout.off_table : layout.off_table + layout.n_classes] = table.to(torch.uint8)

    table32 = table.to(torch.int32)
    gbits = torch.empty(n_groups, dtype=torch.int64, device=dev)
    gexc = torch.empty(n_groups, dtype=torch.int64, device=dev)
    _group_stats[(n_groups,)](shard_bits, state, table32, gbits, gexc, n, **c)
    gexc = gexc.view(nb, NG)
    plan = plan_blocks(layout, gbits.view(nb, NG), gexc.sum(1), None)
    out[layout.off_counts : layout.off_counts + nb * layout.count_bytes] = count_field(layout, plan)
    gexc_pre = (torch.cumsum(gexc, 1) - gexc).contiguous()
    _pack[(n_groups,)](
        shard_bits, state, out, table32, plan.raw.to(torch.int32), plan.group_start, gexc_pre,
        plan.exc_start, plan.count, plan.block_end, n, out.numel(),
        NG=NG, I=layout.index_bytes, S=layout.high_bytes, **c)
    return plan.needed


def decode_triton(*, layout: DeltaLayout, payload: torch.Tensor, target_bits: torch.Tensor) -> None:
    """Triton twin of :func:`ciera.codecs.delta.decode_reference`."""
    n, nb, NG = layout.numel, layout.n_blocks, layout.groups_per_block
    if n == 0:
        return
    dev = payload.device
    c = _consts(layout)
    n_groups = nb * NG
    raw, count = read_counts(layout, payload)
    gbits = torch.empty(n_groups, dtype=torch.int64, device=dev)
    _group_bits[(n_groups,)](target_bits, payload, gbits, gbits, gbits, n, n_groups, layout.off_table,
                             BATCHED=False, **c)
    plan = plan_blocks(layout, gbits.view(nb, NG), count, raw)
    _unpack[(n_groups,)](
        payload, target_bits, raw.to(torch.int32), plan.group_start, plan.exc_start, plan.count, gbits, gbits,
        n, n_groups, layout.off_table, payload.numel(), NG=NG, I=layout.index_bytes, S=layout.high_bytes,
        BATCHED=False, **c)


@functools.lru_cache(maxsize=64)
def _many_scratch(layout: DeltaLayout, k: int, device: torch.device) -> dict:
    """Index and scratch tensors of a batched decode, cached per (layout, k, device)."""
    nb, C = layout.n_blocks, layout.count_bytes
    return dict(
        count_at=layout.off_counts + torch.arange(nb * C, dtype=torch.int64, device=device),
        gbits=torch.empty(k, nb * layout.groups_per_block, dtype=torch.int64, device=device),
        valid=layout.group_valid(device))


def _plan_many(layout: DeltaLayout, group_bits: torch.Tensor, count: torch.Tensor, raw: torch.Tensor,
               valid: torch.Tensor):
    """:func:`ciera.codecs.delta.plan_blocks` of ``k`` payloads at once (``[k, nb, NG]`` group
    bits, ``[k, nb]`` counts and raw flags); offsets relative to each payload's start."""
    S = layout.high_bytes
    group_bytes = torch.where(raw[..., None], valid * S, (group_bits + 7) // 8)
    count = torch.where(raw, 0, count)
    seg = torch.cat([group_bytes, (count * (layout.index_bytes + S))[..., None]], 2)  # [k, nb, NG + 1]
    ends = layout.off_data + torch.cumsum(seg.view(seg.shape[0], -1), 1).view(seg.shape)
    starts = ends - seg
    return count, starts[..., :-1].contiguous(), starts[..., -1].contiguous()


def decode_many_triton(*, layout: DeltaLayout, payloads: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor,
                       targets_bits: torch.Tensor) -> None:
    """Batched twin of :func:`decode_triton` (CONTRACT.md): payload ``i`` starts at byte ``offsets[i]``
    of ``payloads`` and decodes into row ``rows[i]`` of ``targets_bits`` (``[world, n]``).

    Two kernel launches (``_group_bits``, ``_unpack``, each over ``(groups, k)``) and a fixed
    sequence of batched torch ops for the block plan, whatever ``k``; no host reads; scratch
    cached per (layout, k, device)."""
    n, nb, NG = layout.numel, layout.n_blocks, layout.groups_per_block
    k = rows.numel()
    if targets_bits.dim() != 2 or targets_bits.shape[1] != n or not targets_bits.is_contiguous():
        raise ValueError(f"delta: targets_bits must be a contiguous [world, {n}] tensor; got {tuple(targets_bits.shape)}")
    if offsets.numel() != k or rows.dtype != torch.int64 or offsets.dtype != torch.int64:
        raise ValueError("delta: rows and offsets must be int64 tensors of the same length")
    if n == 0 or k == 0:
        return
    c = _consts(layout)
    n_groups = nb * NG
    scratch = _many_scratch(layout, k, payloads.device)
    cb = payloads[offsets[:, None] + scratch["count_at"]].view(k, nb, layout.count_bytes).to(torch.int64)
    cnt = (cb << (8 * torch.arange(layout.count_bytes, device=cb.device))).sum(-1)
    raw = cnt == layout.raw_mark
    gbits = scratch["gbits"]
    _group_bits[(n_groups, k)](targets_bits, payloads, gbits, rows, offsets, n, n_groups, layout.off_table,
                               BATCHED=True, **c)
    count, gstart, exc_start = _plan_many(layout, gbits.view(k, nb, NG), cnt, raw, scratch["valid"])
    _unpack[(n_groups, k)](
        payloads, targets_bits, raw.to(torch.int32), gstart, exc_start, count, rows, offsets,
        n, n_groups, layout.off_table, payloads.numel(), NG=NG, I=layout.index_bytes, S=layout.high_bytes,
        BATCHED=True, **c)
