"""What the codecs of whole-bit-pattern differences (``delta``, ``delta_ans``) share: the shard
shape's layout base, the zigzag arithmetic on unsigned patterns, and the sender state (a copy of the
previous bit patterns, which is what every receiver holds)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Codec
from .formats import FloatFormat, as_bits


@dataclass(frozen=True)
class DeltaShapeLayout:
    """What ``delta`` and ``delta_ans`` payloads share for one shard shape: values of one format
    coded as zigzagged differences of whole bit patterns, in the context of each previous value's
    exponent, in blocks of ``block_size`` values (a trailing block may be partial)."""

    fmt: FloatFormat
    """Float format of the shard's values."""
    numel: int
    """Values of the shard."""
    block_size: int
    """``B``: values per block, the unit of the raw escape."""

    @property
    def width(self) -> int:
        """``W``: bits of one value's pattern, the widest difference ``z`` a value can need."""
        return self.fmt.total_bits

    @property
    def n_classes(self) -> int:
        """Contexts: one per exponent field value of the previous value (width tables in ``delta``,
        frequency tables in ``delta_ans``)."""
        return 1 << self.fmt.exp_bits

    @property
    def high_bytes(self) -> int:
        """``S``: bytes of one value's pattern (a raw block's values; ``delta``'s exception highs)."""
        return self.fmt.itemsize

    @property
    def n_blocks(self) -> int:
        """Blocks of the shard, the last one possibly partial."""
        return -(-self.numel // self.block_size)




# -- the arithmetic both sides share -------------------------------------------------------------
def zigzag(fmt: FloatFormat, u_new: torch.Tensor, u_old: torch.Tensor) -> torch.Tensor:
    """``zigzag((u_new - u_old) mod 2^W)`` of unsigned patterns (from :func:`to_unsigned`)."""
    W = fmt.total_bits
    mask = (1 << W) - 1
    d = (u_new - u_old) & mask
    return ((d << 1) ^ -(d >> (W - 1))) & mask


def unzigzag_add(fmt: FloatFormat, u_old: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`zigzag`: ``(u_old + unzigzag(z)) mod 2^W``."""
    mask = (1 << fmt.total_bits) - 1
    return (u_old + ((z >> 1) ^ -(z & 1))) & mask


def exponent_of(fmt: FloatFormat, u: torch.Tensor) -> torch.Tensor:
    """Exponent field of unsigned patterns: the width-table class."""
    return (u >> fmt.mant_bits) & ((1 << fmt.exp_bits) - 1)


def bit_length(z: torch.Tensor, width: int) -> torch.Tensor:
    """Bits needed by integers in [0, 2^width) (0 for 0), in ``z``'s dtype. ``frexp`` is exact on
    integers the float type holds exactly: float32 below 2^24, float64 below 2^53."""
    return torch.frexp(z.to(torch.float32 if width <= 24 else torch.float64))[1].to(z.dtype)




class PatternStateCodec(Codec):
    """A codec whose sender state is the previous bit patterns of the shard (the receivers' target)."""

    def new_state(self, *, shard: torch.Tensor) -> torch.Tensor:
        self._check_shard(shard)
        return as_bits(shard).clone()

    def reset_state(self, *, state: torch.Tensor, shard: torch.Tensor) -> None:
        self._check_shard(shard)
        state.copy_(as_bits(shard))

    def _check_state(self, state) -> None:
        if state is None or state.dtype != self.fmt.bits_dtype or state.numel() != self.numel:
            raise ValueError(f"{self.name}: state must be the {self.fmt.bits_dtype} bit patterns of {self.numel} "
                             "values (from new_state)")
