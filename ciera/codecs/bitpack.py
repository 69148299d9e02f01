"""Packing booleans eight to a byte (LSB first), in pure torch."""

from __future__ import annotations

import torch


def _weights(device) -> torch.Tensor:
    return torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)


def pack_bits(flags: torch.Tensor) -> torch.Tensor:
    """bool/0-1 tensor of n entries -> uint8 tensor of ceil(n/8) bytes; bit i%8 of byte i//8."""
    n = flags.numel()
    padded = torch.zeros(((n + 7) // 8) * 8, dtype=torch.uint8, device=flags.device)
    padded[:n] = flags.reshape(-1).to(torch.uint8)
    return (padded.view(-1, 8) * _weights(flags.device)).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` flags as a bool tensor."""
    bits = (packed.reshape(-1, 1) & _weights(packed.device)) != 0
    return bits.reshape(-1)[:n]
