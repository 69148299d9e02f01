"""``exponent_reuse``: CIERA's cross-iteration exponent reuse, lossless by exact comparison.

Every value's sign and mantissa are sent; its exponent is sent only when some exponent in its block
of ``B`` values differs from the sender's previous exponents. Receivers take unchanged exponents
from the previous values already in their gathered buffer. The paper detects changes by hashing
block exponents; we compare exactly (one byte per value of sender state), so a change can never be
missed.

Payload sections after the 32-byte header (each 16-byte aligned)::

    signmant  numel x (S // 8) bytes     S = 1 + mantissa bits: low bytes of sign|mantissa
    planes    (S % 8) x ceil(numel/8)    remaining high bits as bit planes (fp16 only: 3 planes)
    bitmap    ceil(n_blocks / 8)         bit b set: block b's exponents follow
    exps      K x B bytes                exponents of changed blocks in block order, K = slots

Ratio ceiling (no block changed): bf16 2x, fp16 ~1.45x, fp32 ~1.33x.

Why ``B = 8`` by default: exponent changes after warmup hit mostly small-magnitude values,
spread almost independently across a shard (block change rate ~ 1-(1-p)^B), so small blocks win.
Measured on a bf16 AdamW trajectory (``tools/bench_codec.py --sweep-block``, BENCHMARKS.md),
compression ratio at lr 1e-4 / 3e-4: B=4 1.86x / 1.75x, B=8 1.81x / 1.64x, B=64 1.31x / 1.09x,
B=512 (the paper's) 1.00x / 1.00x. B=4 is 3-7% better on the wire; B=8 keeps the bitmap at one
byte per 64 values and each changed block's exponents in one 8-byte word for the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import HEADER_BYTES, Codec, align_up, decode_many_of
from ..bitpack import pack_bits, unpack_bits
from ..formats import FloatFormat, as_bits
from ..registry import CodecSpec, register_codec


@dataclass(frozen=True)
class ExponentReuseLayout:
    """Byte offsets of an exponent-reuse payload for one shard shape."""

    fmt: FloatFormat
    numel: int
    block_size: int

    @property
    def n_blocks(self) -> int:
        return -(-self.numel // self.block_size)

    @property
    def sm_bytes(self) -> int:
        """Whole bytes of sign|mantissa per value."""
        return self.fmt.signmant_bits // 8

    @property
    def n_planes(self) -> int:
        return self.fmt.signmant_bits % 8

    @property
    def plane_bytes(self) -> int:
        return -(-self.numel // 8)

    @property
    def off_signmant(self) -> int:
        return HEADER_BYTES

    @property
    def off_planes(self) -> int:
        return align_up(self.off_signmant + self.numel * self.sm_bytes)

    @property
    def off_bitmap(self) -> int:
        return align_up(self.off_planes + self.n_planes * self.plane_bytes)

    @property
    def off_exps(self) -> int:
        return align_up(self.off_bitmap + -(-self.n_blocks // 8))

    def slots(self, capacity: int) -> int:
        """Changed blocks a payload of ``capacity`` bytes can carry."""
        return max(0, min(self.n_blocks, (capacity - self.off_exps) // self.block_size))


def split_fields(fmt: FloatFormat, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unsigned bit patterns -> (exponent field, sign|mantissa with the sign as the top bit)."""
    exp = (u >> fmt.mant_bits) & ((1 << fmt.exp_bits) - 1)
    sm = (u & ((1 << fmt.mant_bits) - 1)) | ((u >> (fmt.total_bits - 1)) << fmt.mant_bits)
    return exp, sm


def _native_fields(fmt: FloatFormat, bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(exponent as uint8, sign|mantissa) straight from signed bit patterns, in their own width.

    Only bitwise operations and masked arithmetic shifts: no widening copies, no overflow."""
    m = fmt.mant_bits
    sm = (bits & ((1 << m) - 1)) | ((bits < 0).to(bits.dtype) << m)
    return _exponents(fmt, bits), sm


def _exponents(fmt: FloatFormat, bits: torch.Tensor) -> torch.Tensor:
    """The exponent fields of signed bit patterns, as uint8 (the codec's state)."""
    return ((bits >> fmt.mant_bits) & ((1 << fmt.exp_bits) - 1)).to(torch.uint8)


def encode_reference(*, layout: ExponentReuseLayout, shard_bits: torch.Tensor, state: torch.Tensor,
                     out: torch.Tensor) -> torch.Tensor:
    """Pure-torch encoder. Writes every section of ``out`` but the header, updates ``state``
    (previous exponents, uint8) and returns the bytes needed as a 0-d int64 tensor."""
    fmt, n, B, nb = layout.fmt, layout.numel, layout.block_size, layout.n_blocks
    exp8, sm = _native_fields(fmt, shard_bits)
    if layout.sm_bytes:
        dst = out[layout.off_signmant : layout.off_signmant + n * layout.sm_bytes].view(n, layout.sm_bytes)
        for k in range(layout.sm_bytes):
            dst[:, k] = ((sm >> (8 * k)) & 0xFF).to(torch.uint8)
    for p in range(layout.n_planes):
        off = layout.off_planes + p * layout.plane_bytes
        out[off : off + layout.plane_bytes] = pack_bits((sm >> (8 * layout.sm_bytes + p)) & 1)

    diff = exp8 != state
    if n % B:
        diff = torch.cat([diff, diff.new_zeros(nb * B - n)])
    changed = diff.view(nb, B).any(1)
    out[layout.off_bitmap : layout.off_bitmap + -(-nb // 8)] = pack_bits(changed)

    idx = torch.nonzero(changed).squeeze(1)
    take = idx[: layout.slots(out.numel())]
    if take.numel():
        blocks = exp8 if n % B == 0 else torch.cat([exp8, exp8.new_zeros(nb * B - n)])
        out[layout.off_exps : layout.off_exps + take.numel() * B] = blocks.view(nb, B)[take].reshape(-1)
    state.copy_(exp8)
    return torch.tensor(layout.off_exps + idx.numel() * B, dtype=torch.int64, device=out.device)


def decode_reference(*, layout: ExponentReuseLayout, payload: torch.Tensor, target_bits: torch.Tensor) -> None:
    """Pure-torch decoder: ``target_bits`` (previous values) becomes the encoded shard.

    Keeps the previous exponent field of every value, replaces sign and mantissa, then patches the
    exponents of the changed blocks only."""
    fmt, n, B, nb = layout.fmt, layout.numel, layout.block_size, layout.n_blocks
    dtype, m = target_bits.dtype, fmt.mant_bits
    sm = torch.zeros(n, dtype=dtype, device=payload.device)
    if layout.sm_bytes:
        src = payload[layout.off_signmant : layout.off_signmant + n * layout.sm_bytes].view(n, layout.sm_bytes)
        for k in range(layout.sm_bytes):
            sm |= src[:, k].to(dtype) << (8 * k)
    for p in range(layout.n_planes):
        off = layout.off_planes + p * layout.plane_bytes
        sm |= unpack_bits(payload[off : off + layout.plane_bytes], n).to(dtype) << (8 * layout.sm_bytes + p)

    exp_field = ((1 << fmt.exp_bits) - 1) << m  # < 2**(total-1): a positive constant of the dtype
    sign_bit = torch.iinfo(dtype).min  # only the top bit set
    sign = -((sm >> m) & 1)  # all ones where the sign is set, else 0
    target_bits &= exp_field
    target_bits |= (sm & ((1 << m) - 1)) | (sign & sign_bit)

    changed = unpack_bits(payload[layout.off_bitmap : layout.off_bitmap + -(-nb // 8)], nb)
    idx = torch.nonzero(changed).squeeze(1)
    if idx.numel() > layout.slots(payload.numel()):
        raise ValueError(f"exponent_reuse: corrupt payload: {idx.numel()} changed blocks, room for "
                         f"{layout.slots(payload.numel())}")
    if idx.numel():
        sent = payload[layout.off_exps : layout.off_exps + idx.numel() * B].view(-1, B).to(dtype) << m
        full = target_bits if n % B == 0 else torch.cat([target_bits, target_bits.new_zeros(nb * B - n)])
        blocks = full.view(nb, B)
        blocks[idx] = (blocks[idx] & ~exp_field) | sent
        if n % B:
            target_bits.copy_(full[:n])


decode_many_reference = decode_many_of(decode_reference)
"""Pure-torch batched decoder (see Codec.decode_many): :func:`decode_reference` per payload."""


@register_codec
class ExponentReuseCodec(Codec):
    """Cross-iteration exponent reuse with exact change detection. State: previous exponents."""

    spec = CodecSpec(
        name="exponent_reuse", codec_id=1, reads_previous="exponents", auto=True, block_size_option="block_size",
        native="ciera.codecs.exponent_reuse.native", kernels="ciera.codecs.exponent_reuse.kernels",
        summary="resends the exponents of changed blocks only: encodes fastest, at most 2x on bf16")
    encode_reference = staticmethod(encode_reference)
    decode_reference = staticmethod(decode_reference)
    decode_many_reference = staticmethod(decode_many_reference)

    def __init__(self, *, dtype: torch.dtype, numel: int, backend: str = "auto", block_size: int = 8):
        super().__init__(dtype=dtype, numel=numel, backend=backend)
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"exponent_reuse: block_size={block_size} must be a power of two >= 1")
        self.block_size = block_size
        self.layout = ExponentReuseLayout(self.fmt, numel, block_size)

    @property
    def fixed_bytes(self) -> int:
        return self.layout.off_exps

    @property
    def max_bytes(self) -> int:
        return self.layout.off_exps + self.layout.n_blocks * self.block_size

    def new_state(self, *, shard: torch.Tensor) -> torch.Tensor:
        state = torch.empty(self.numel, dtype=torch.uint8, device=shard.device)
        self.reset_state(state=state, shard=shard)
        return state

    def reset_state(self, *, state: torch.Tensor, shard: torch.Tensor) -> None:
        self._check_shard(shard)
        state.copy_(_exponents(self.fmt, as_bits(shard)))  # the sign|mantissa half is not needed

    def _check_state(self, state) -> None:
        if state is None or state.dtype != torch.uint8 or state.numel() != self.numel:
            raise ValueError(f"exponent_reuse: state must be the uint8 exponents of {self.numel} values "
                             "(from new_state)")


__all__ = [
    "ExponentReuseCodec", "ExponentReuseLayout", "decode_many_reference", "decode_reference", "encode_reference",
    "split_fields",
]
