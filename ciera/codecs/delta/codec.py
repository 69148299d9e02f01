"""``delta``: lossless temporal delta of whole bit patterns, packed at widths the exponent predicts.

Every value's bit pattern is read as an unsigned ``W``-bit integer (``W`` = 16 for bf16/fp16, 32
for fp32). The sender sends ``z = zigzag((new - previous) mod 2^W)``; the receiver adds the
difference back to the previous value it already holds, modulo ``2^W``. The arithmetic is exact on
integers, so NaN payloads, infinities, signed zeros, subnormals and sign changes are just integers
and round-trip bit for bit. Unchanged values give ``z = 0``; a one-ulp step gives ``z`` = 1 or 2.

**Width from the previous exponent.** An optimizer step moves a weight by roughly the learning
rate in absolute terms, so the number of ulps it moves (the size of ``z``) is set by the weight's
magnitude: values near zero move by many ulps, large ones by 0-1. Both sides know every previous
value, so the payload carries one width per exponent value (a 256-entry table for bf16/fp32, 32
for fp16) and value ``i`` is packed in ``table[exponent(previous_i)]`` bits. The encoder picks each
entry as the width minimising ``N_e*w + E*x_e(w)`` bits over the ``N_e`` values of that exponent,
``x_e(w)`` of which need more than ``w`` bits: those become exceptions (patched frame of
reference), whose low ``w`` bits stay in place and whose high bits ``z >> w`` go in an exception
record of ``E = 8 (I + S)`` bits. Ties go to the smaller width. On our AdamW trajectories this
costs ~2.8 bits per bf16 value at lr 1e-4 (0.17 of raw), against ~4.3 bits (0.27, on a 2^16-value
shard) for one width per position block of 64 values chosen the same way.

**Layout.** Values form blocks of ``B = block_size`` (exception lists and the raw escape are per
block) and each block is cut into groups of ``G = min(B, 64)`` values, each one byte-aligned bit
stream (one GPU program per group). Payload sections after the 32-byte header::

    table   2^exp_bits bytes                     width of each previous-exponent value (0..W)
    counts  n_blocks x C bytes (16-aligned)      exceptions per block, little endian;
                                                 all ones (``raw_mark``): the block is raw
    data    16-aligned, blocks back to back, byte granular; block b holds
              groups  per group ceil(sum w_i / 8) bytes: z_i & (2^w_i - 1) LSB first, in order
              index   x_b x I bytes              in-block index of each exception, ascending
              high    x_b x S bytes              z >> w of each exception, little endian

``C`` = 1 byte when ``B < 255`` else 2; ``I`` = 1 byte when ``B <= 256`` else 2; ``S`` = bytes
of one value. A raw block packs every value at width ``W`` (its groups are the little-endian ``z``
values) and has no exceptions; the encoder makes a block raw when that is smaller, so no block
ever exceeds its raw size and ``max_bytes`` = fixed part + raw bytes. A trailing partial block
has width 0 past the end. Block and group offsets are exclusive prefix sums of sizes that both
sides compute from the table, the counts and the previous values; blocks that do not fit entirely
inside the capacity are not written (the header then reports overflow and the needed size).

Sender state: a copy of the previous bit patterns (the receivers' ``target``).

Why ``B = 128`` by default. Wire bytes / raw bytes on ``AdamTrajectory(numel=2**20, dtype=bf16)``
after 30 warmup steps, mean over the next 20 steps::

    block        32      64     128     256     512    1024
    lr 1e-4   0.1875  0.1764  0.1724  0.1724  0.1713  0.1704
    lr 3e-4   0.2507  0.2395  0.2356  0.2356  0.2374  0.2365

With widths from the table, a block only costs its count (C bytes) and the byte alignment of its
groups, so small blocks lose a little; past 128 the gain is under 1% and changes sign with the
learning rate. 128 and 256 cost the same per value (1-byte vs 2-byte counts); 128 keeps the raw
escape finer and halves the exception list each GPU program scans when decoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..base import HEADER_BYTES, align_up, decode_many_of
from ..formats import from_unsigned, to_unsigned
from ..patterns import DeltaShapeLayout, PatternStateCodec, bit_length, exponent_of, unzigzag_add, zigzag
from ..registry import CodecSpec, register_codec

GROUP = 64
"""Most values in one byte-aligned bit stream."""

@dataclass(frozen=True)
class DeltaLayout(DeltaShapeLayout):
    """Byte offsets, record sizes and the group structure of a delta payload for one shard shape."""

    @property
    def group_size(self) -> int:
        """``G``: values per byte-aligned bit stream."""
        return min(self.block_size, GROUP)

    @property
    def groups_per_block(self) -> int:
        return self.block_size // self.group_size

    @property
    def count_bytes(self) -> int:
        """``C``: bytes of one block's exception count (:attr:`raw_mark` flags a raw block)."""
        return 1 if self.block_size < 255 else 2

    @property
    def raw_mark(self) -> int:
        return (1 << (8 * self.count_bytes)) - 1

    @property
    def index_bytes(self) -> int:
        """``I``: bytes of one exception's in-block index."""
        return 1 if self.block_size <= 256 else 2

    @property
    def exception_bits(self) -> int:
        """``E``: bits of one exception record, the price the width choice weighs."""
        return 8 * (self.index_bytes + self.high_bytes)

    @property
    def off_table(self) -> int:
        return HEADER_BYTES

    @property
    def off_counts(self) -> int:
        return align_up(self.off_table + self.n_classes)

    @property
    def off_data(self) -> int:
        return align_up(self.off_counts + self.n_blocks * self.count_bytes)

    def group_valid(self, device) -> torch.Tensor:
        """Values of the shard in every group, ``[n_blocks, groups_per_block]`` int64."""
        G = self.group_size
        first = torch.arange(self.n_blocks * self.groups_per_block, dtype=torch.int64, device=device) * G
        return (self.numel - first).clamp(0, G).view(self.n_blocks, self.groups_per_block)


def choose_table(layout: DeltaLayout, hist: torch.Tensor) -> torch.Tensor:
    """Width per exponent class from ``hist[class * (W + 1) + bit length]`` counts (int64).

    Minimises ``N*w + E*x(w)`` per class; ties go to the smaller ``w`` (key ``cost*64 + w``)."""
    W = layout.width
    hist = hist.view(layout.n_classes, W + 1).to(torch.int64)
    above = hist.sum(1, keepdim=True) - torch.cumsum(hist, 1)  # above[:, w]: need more than w bits
    w = torch.arange(W + 1, dtype=torch.int64, device=hist.device)
    key = (hist.sum(1, keepdim=True) * w + layout.exception_bits * above) * 64 + w
    return key.argmin(1)


class BlockPlan(NamedTuple):
    """Where everything of every block and group goes (absolute payload offsets, int64)."""

    raw: torch.Tensor          # [nb] bool: block sent raw
    count: torch.Tensor        # [nb] exceptions (0 for raw blocks)
    group_start: torch.Tensor  # [nb, NG] first byte of each group's bit stream
    exc_start: torch.Tensor    # [nb] first byte of the block's exception indices
    block_end: torch.Tensor    # [nb] one past the block's last byte
    needed: torch.Tensor       # 0-d: bytes the whole payload needs


def plan_blocks(layout: DeltaLayout, group_bits: torch.Tensor, count: torch.Tensor,
                raw: torch.Tensor | None) -> BlockPlan:
    """Offsets from the table-mode bits of every group ``[nb, NG]`` and exceptions per block.

    ``raw=None`` (encoder): a block goes raw when its table-mode size exceeds its raw size.
    Otherwise (decoder) ``raw`` comes from the counts section."""
    S = layout.high_bytes
    valid = layout.group_valid(group_bits.device)
    group_bytes = (group_bits + 7) // 8
    exc_bytes = count * (layout.index_bytes + S)
    if raw is None:
        raw = group_bytes.sum(1) + exc_bytes > valid.sum(1) * S
    group_bytes = torch.where(raw[:, None], valid * S, group_bytes)
    exc_bytes = torch.where(raw, 0, exc_bytes)
    count = torch.where(raw, 0, count)
    seg = torch.cat([group_bytes, exc_bytes[:, None]], 1)  # [nb, NG + 1] in payload order
    ends = layout.off_data + torch.cumsum(seg.reshape(-1), 0).view(seg.shape)
    starts = ends - seg
    return BlockPlan(raw, count, starts[:, :-1].contiguous(), starts[:, -1].contiguous(), ends[:, -1].contiguous(),
                     ends[-1, -1] if seg.numel() else torch.tensor(layout.off_data, device=seg.device))


def count_field(layout: DeltaLayout, plan: BlockPlan) -> torch.Tensor:
    """Little-endian bytes of the counts section."""
    c = torch.where(plan.raw, layout.raw_mark, plan.count)
    return _le_bytes(c, layout.count_bytes).reshape(-1)


def read_counts(layout: DeltaLayout, payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw flag, exception count) of every block from the counts section."""
    nb, C = layout.n_blocks, layout.count_bytes
    c = _from_le_bytes(payload[layout.off_counts : layout.off_counts + nb * C].view(nb, C))
    raw = c == layout.raw_mark
    return raw, torch.where(raw, 0, c)


def _le_bytes(x: torch.Tensor, nbytes: int) -> torch.Tensor:
    """Little-endian bytes of non-negative integers: ``[..., nbytes]`` uint8."""
    shifts = 8 * torch.arange(nbytes, dtype=torch.int64, device=x.device)
    return ((x.to(torch.int64)[..., None] >> shifts) & 0xFF).to(torch.uint8)


def _from_le_bytes(b: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_le_bytes` along the last dimension (int64)."""
    shifts = 8 * torch.arange(b.shape[-1], dtype=torch.int64, device=b.device)
    return (b.to(torch.int64) << shifts).sum(-1)


def _grouped(layout: DeltaLayout, u: torch.Tensor) -> torch.Tensor:
    """``[n]`` -> ``[nb, NG, G]``, zero-padded (a copy only when the last block is partial)."""
    pad = layout.n_blocks * layout.block_size - layout.numel
    if pad:
        u = torch.cat([u, u.new_zeros(pad)])
    return u.view(layout.n_blocks, layout.groups_per_block, layout.group_size)


def _valid(layout: DeltaLayout, device) -> torch.Tensor | None:
    """``[nb, NG, G]`` mask of the shard's values; ``None`` when no block is partial."""
    size = layout.n_blocks * layout.block_size
    if size == layout.numel:
        return None
    return _grouped(layout, torch.ones(layout.numel, dtype=torch.bool, device=device))


def _value_widths(layout: DeltaLayout, table: torch.Tensor, e_prev: torch.Tensor, valid: torch.Tensor | None,
                  raw: torch.Tensor | None) -> torch.Tensor:
    """Width of every value: the table entry of its previous exponent, ``W`` in raw blocks,
    0 past the end of the shard."""
    w = table.to(e_prev.dtype)[e_prev]
    if raw is not None:
        w = torch.where(raw[:, None, None], layout.width, w)
    return w if valid is None else torch.where(valid, w, 0)


# -- reference ---------------------------------------------------------------------------------
def _keys(layout: DeltaLayout, shard_bits: torch.Tensor, state: torch.Tensor):
    """z, previous exponent and bit length of z of every value."""
    # int32 arithmetic for 16-bit patterns, int64 for 32-bit ones (from to_unsigned).
    u_old = to_unsigned(state)
    z = zigzag(layout.fmt, to_unsigned(shard_bits), u_old)
    return z, exponent_of(layout.fmt, u_old), bit_length(z, layout.width)


def histogram_reference(*, layout: DeltaLayout, shard_bits: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """The counts the width table is chosen from: ``hist[e * (W + 1) + L]`` (int64) = values whose
    previous exponent is ``e`` and whose ``z`` has bit length ``L``. Any number of values."""
    _, e_prev, bitlen = _keys(layout, shard_bits, state)
    W = layout.width
    return torch.bincount(e_prev * (W + 1) + bitlen, minlength=layout.n_classes * (W + 1))


def encode_reference(*, layout: DeltaLayout, shard_bits: torch.Tensor, state: torch.Tensor,
                     out: torch.Tensor) -> torch.Tensor:
    """Pure-torch encoder. Writes every section of ``out`` but the header (blocks that do not fit
    are skipped), updates ``state`` (previous bit patterns) and returns the bytes needed as a 0-d
    int64 tensor on ``out``'s device."""
    n, W = layout.numel, layout.width
    dev = out.device
    if n == 0:
        return torch.tensor(layout.off_data, dtype=torch.int64, device=dev)
    z, e_prev, bitlen = _keys(layout, shard_bits, state)
    hist = torch.bincount(e_prev * (W + 1) + bitlen, minlength=layout.n_classes * (W + 1))
    table = choose_table(layout, hist)
    z, e_prev, bitlen = _grouped(layout, z), _grouped(layout, e_prev), _grouped(layout, bitlen)
    valid = _valid(layout, dev)
    w = _value_widths(layout, table, e_prev, valid, None)
    exc = bitlen > w
    plan = plan_blocks(layout, w.sum(-1), exc.sum((1, 2)), None)
    out[layout.off_table : layout.off_table + layout.n_classes] = table.to(torch.uint8)
    out[layout.off_counts : layout.off_counts + layout.n_blocks * layout.count_bytes] = count_field(layout, plan)

    # Blocks fit as a prefix (block ends increase); only they are written.
    fits = plan.block_end <= out.numel()
    n_fit = int(fits.sum())
    if n_fit == 0:
        state.copy_(shard_bits)
        return plan.needed
    fit_end = int(plan.block_end[n_fit - 1])
    w = _value_widths(layout, table, e_prev, valid, plan.raw)[:n_fit]
    exc = (exc & ~plan.raw[:, None, None])[:n_fit]
    z = z[:n_fit]

    # Groups: value bits at 8*group_start + (exclusive prefix of widths), scattered bytewise.
    bitpos = 8 * plan.group_start[:n_fit, :, None] + torch.cumsum(w, -1) - w
    low = (z & ((1 << w) - 1)) << (bitpos & 7)
    at = (bitpos >> 3) - layout.off_data
    staging = torch.zeros(fit_end - layout.off_data + 8, dtype=torch.int64, device=dev)
    at, low = at.view(-1), low.view(-1)  # zero-width values add zeros inside the staging slack
    for t in range(W // 8 + 1):  # W + 7 bits span W/8 + 1 bytes
        staging.index_add_(0, at + t, (low >> (8 * t)) & 0xFF)
    out[layout.off_data : fit_end] = staging[: fit_end - layout.off_data].to(torch.uint8)

    if bool(exc.any()):
        I, S, G = layout.index_bytes, layout.high_bytes, layout.group_size
        rank = torch.cumsum(exc.view(n_fit, -1), 1).view(exc.shape) - 1
        b, g, j = torch.nonzero(exc, as_tuple=True)
        r, wj = rank[b, g, j], w[b, g, j]
        idx_at = plan.exc_start[b, None] + r[:, None] * I + torch.arange(I, device=dev)
        out[idx_at.reshape(-1)] = _le_bytes(g * G + j, I).reshape(-1)
        hi_at = plan.exc_start[b, None] + plan.count[b, None] * I + r[:, None] * S + torch.arange(S, device=dev)
        out[hi_at.reshape(-1)] = _le_bytes(z[b, g, j] >> wj, S).reshape(-1)
    state.copy_(shard_bits)
    return plan.needed


def decode_reference(*, layout: DeltaLayout, payload: torch.Tensor, target_bits: torch.Tensor) -> None:
    """Pure-torch decoder: ``target_bits`` (previous values) becomes the encoded shard."""
    n, W, fmt = layout.numel, layout.width, layout.fmt
    if n == 0:
        return
    dev = payload.device
    I, S = layout.index_bytes, layout.high_bytes
    table = payload[layout.off_table : layout.off_table + layout.n_classes].to(torch.int64)
    raw, count = read_counts(layout, payload)
    u_old = to_unsigned(target_bits)
    e_prev = _grouped(layout, exponent_of(fmt, u_old))
    valid = _valid(layout, dev)
    w = _value_widths(layout, table, e_prev, valid, None)
    plan = plan_blocks(layout, w.sum(-1), count, raw)
    w = _value_widths(layout, table, e_prev, valid, raw)

    bitpos = 8 * plan.group_start[:, :, None] + torch.cumsum(w, -1) - w
    at = bitpos >> 3
    last = payload.numel() - 1
    z = torch.zeros(w.shape, dtype=torch.int64, device=dev)
    for t in range(W // 8 + 1):
        z |= payload[torch.clamp(at + t, max=last)].to(torch.int64) << (8 * t)
    z = (z >> (bitpos & 7)) & ((1 << w) - 1)

    total = int(count.sum())
    if total:
        b = torch.repeat_interleave(torch.arange(layout.n_blocks, device=dev), count)
        r = torch.arange(total, device=dev) - (torch.cumsum(count, 0) - count)[b]
        j = _from_le_bytes(payload[plan.exc_start[b, None] + r[:, None] * I + torch.arange(I, device=dev)])
        hi_at = plan.exc_start[b, None] + count[b, None] * I + r[:, None] * S + torch.arange(S, device=dev)
        hi = _from_le_bytes(payload[hi_at])
        zb = z.view(layout.n_blocks, -1)
        wb = w.view(layout.n_blocks, -1)
        zb[b, j] |= hi << wb[b, j]
    u = unzigzag_add(fmt, u_old, z.view(-1)[:n])
    target_bits.copy_(from_unsigned(u, target_bits.dtype))


decode_many_reference = decode_many_of(decode_reference)
"""Pure-torch batched decoder (see Codec.decode_many): :func:`decode_reference` per payload."""


@register_codec
class DeltaCodec(PatternStateCodec):
    """Temporal delta, widths predicted by each value's previous exponent, exceptions per block.
    State: previous bit patterns."""

    spec = CodecSpec(
        name="delta", codec_id=2, reads_previous="values", auto=True, block_size_option="delta_block_size",
        native="ciera.codecs.delta.native", kernels="ciera.codecs.delta.kernels",
        summary="temporal delta of whole bit patterns at widths the previous exponent predicts: nearly as few "
                "bytes as delta_ans, faster")
    encode_reference = staticmethod(encode_reference)
    decode_reference = staticmethod(decode_reference)
    decode_many_reference = staticmethod(decode_many_reference)

    def __init__(self, *, dtype: torch.dtype, numel: int, backend: str = "auto", block_size: int = 128):
        super().__init__(dtype=dtype, numel=numel, backend=backend)
        if not 8 <= block_size <= 4096 or block_size & (block_size - 1):
            raise ValueError(f"delta: block_size={block_size} must be a power of two in [8, 4096]")
        self.block_size = block_size
        self.layout = DeltaLayout(self.fmt, numel, block_size)

    @property
    def fixed_bytes(self) -> int:
        return self.layout.off_data

    @property
    def max_bytes(self) -> int:
        return self.layout.off_data + self.raw_bytes


__all__ = [
    "GROUP", "BlockPlan", "DeltaCodec", "DeltaLayout", "choose_table", "count_field", "decode_many_reference",
    "decode_reference", "encode_reference", "histogram_reference", "plan_blocks", "read_counts",
]
