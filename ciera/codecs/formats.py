"""Bit-level facts about the float formats CIERA gathers, and exact views of their bit patterns."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FloatFormat:
    """Field widths of an IEEE-style binary float format."""

    dtype: torch.dtype
    """The float dtype."""
    bits_dtype: torch.dtype
    """Signed integer dtype of the same width, used to view the bit patterns."""
    exp_bits: int
    """Width of the exponent field."""
    mant_bits: int
    """Width of the mantissa (fraction) field."""

    @property
    def total_bits(self) -> int:
        return 1 + self.exp_bits + self.mant_bits

    @property
    def itemsize(self) -> int:
        return self.total_bits // 8

    @property
    def signmant_bits(self) -> int:
        """Sign plus mantissa: what exponent reuse sends for every value."""
        return 1 + self.mant_bits


FORMATS = {
    torch.bfloat16: FloatFormat(torch.bfloat16, torch.int16, 8, 7),
    torch.float16: FloatFormat(torch.float16, torch.int16, 5, 10),
    torch.float32: FloatFormat(torch.float32, torch.int32, 8, 23),
}


def float_format(dtype: torch.dtype) -> FloatFormat:
    """The format of ``dtype``; a clear error for anything CIERA does not gather."""
    try:
        return FORMATS[dtype]
    except KeyError:
        supported = ", ".join(str(d) for d in FORMATS)
        raise TypeError(f"CIERA gathers {supported} buffers; got {dtype}") from None


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """View ``t`` as signed integers of the same width (no copy)."""
    return t.view(float_format(t.dtype).bits_dtype)


def to_unsigned(bits: torch.Tensor) -> torch.Tensor:
    """Bit patterns as non-negative integers in a wider dtype (int32 for 16-bit, int64 for 32-bit)."""
    if bits.dtype == torch.int16:
        return bits.to(torch.int32) & 0xFFFF
    if bits.dtype == torch.int32:
        return bits.to(torch.int64) & 0xFFFFFFFF
    raise TypeError(f"expected int16 or int32 bit patterns, got {bits.dtype}")


def from_unsigned(u: torch.Tensor, bits_dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`to_unsigned`: wrap non-negative integers back into ``bits_dtype``."""
    width = 16 if bits_dtype == torch.int16 else 32
    u = torch.where(u >= (1 << (width - 1)), u - (1 << width), u)
    return u.to(bits_dtype)
