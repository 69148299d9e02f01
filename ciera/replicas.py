"""Replica checks: do all ranks hold the same gathered buffer? A salted 64-bit hash per shard, and
one all-gather of the ``world`` x ``world`` table of them (``CieraConfig.verify_interval``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .codecs.formats import as_bits
from .comm import all_gather_into
from .errors import CieraVerifyError

__all__ = ["shard_hashes", "verify_replicas"]

_MIX = (-0x40A7B892E31B1A47, -0x6B2FB644ECCEEE15)  # splitmix64 finalizer constants (as int64)
_CHUNK = 1 << 20


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 (wrapping; logical shifts by masking): a bijection whose
    every output bit depends on every input bit."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _MIX[0]
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _MIX[1]
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def shard_hashes(buffer: torch.Tensor, world: int, *, salt: int = 0) -> torch.Tensor:
    """A 64-bit hash of each of ``world`` shards' bit patterns: ``[world]`` int64.

    ``sum_i mix(bits_i * a + i * b + c)`` with odd multipliers ``a, b`` and offset ``c`` drawn from
    ``salt``: any change to a shard changes its hash except with probability ~2^-64 per check
    (unlike a linear checksum, where +1, -2, +1 on neighbouring values cancels). Equal on every
    device for equal buffers and salts; the work is elementwise plus one sum per chunk."""
    gen = torch.Generator().manual_seed(0xC1E7A + salt)
    a, b, c = (int(v) | 1 for v in torch.randint(-(1 << 62), 1 << 62, (3,), generator=gen))
    shards = as_bits(buffer).view(world, -1)
    n = shards.shape[1]
    out = torch.zeros(world, dtype=torch.int64, device=buffer.device)
    for lo in range(0, n, _CHUNK):
        v = shards[:, lo : lo + _CHUNK].to(torch.int64)
        pos = torch.arange(lo, lo + v.shape[1], dtype=torch.int64, device=buffer.device)
        out += _mix64(v * a + pos * b + c).sum(1)
    return out


def verify_replicas(buffer: torch.Tensor, *, group=None, name: str = "bucket", salt: int = 0) -> None:
    """Check that every rank of ``group`` holds the same ``buffer``; raise :class:`CieraVerifyError`
    naming the bucket, the shard (its owner rank) and the ranks that disagree. Every rank reads the
    same gathered table, so every rank raises together."""
    world = dist.get_world_size(group)
    mine = shard_hashes(buffer, world, salt=salt)
    everyone = torch.empty(world * world, dtype=torch.int64, device=buffer.device)
    all_gather_into(everyone, mine, group=group)
    table = everyone.view(world, world).cpu()
    for shard in range(world):
        bad = [r for r in range(world) if table[r, shard] != table[shard, shard]]
        if bad:
            raise CieraVerifyError(
                f"{name}: shard {shard} (owned by rank {shard}) differs from its owner's values on "
                f"ranks {bad}: a receiver's cache was stale (a write to the buffer outside the gather "
                f"without invalidate()?) or a codec is broken"
            )
