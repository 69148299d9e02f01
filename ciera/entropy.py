"""Order-0 entropies of a shard's change from one gather to the next: what a coder of the change can reach.

The change of a value is the arithmetic difference of its bit patterns, ``d = (new - prev) mod 2^W``
(``W`` = 16 for bf16/fp16, 32 for fp32). Two bounds, in bits per value, for a coder that codes each
value's change on its own (no context beyond what is named):

* ``order0``: ``H(d)``, one code for every value;
* ``given_exponent``: ``H(d | e)``, a code chosen by the previous value's exponent field ``e``
  (small values move by more units of their last place than large ones under the same update).

A fixed-size header and block metadata come on top; a codec's bits per value below ``given_exponent``
exploits more context (neighbours, time), above it is the price of its simpler code.
"""

from __future__ import annotations

import torch

from .codecs.exponent_reuse import split_fields
from .codecs.formats import as_bits, float_format, to_unsigned


def _histogram(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.unique(keys.to(torch.int64), return_counts=True)


def _entropy(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Entropy (bits per item) of the sum of sparse histograms ``(keys, counts)``; 0.0 when empty."""
    parts = [p for p in parts if p[0].numel()]
    if not parts:
        return 0.0
    keys, inverse = torch.unique(torch.cat([k for k, _ in parts]), return_inverse=True)
    counts = torch.zeros(keys.numel(), dtype=torch.float64).scatter_add_(
        0, inverse, torch.cat([c for _, c in parts]).to(torch.float64))
    p = counts / counts.sum()
    return max(0.0, float(-(p * torch.log2(p)).sum()))


class ChangeEntropy:
    """Histograms of the change, accumulated over shards and steps (:meth:`add`), pooled across
    accumulators with :meth:`merge`; the entropies are those of the pooled distribution."""

    def __init__(self):
        self.values = 0
        """Values added."""
        self._delta: list = []
        self._exp: list = []
        self._joint: list = []

    def add(self, *, prev: torch.Tensor, new: torch.Tensor) -> "ChangeEntropy":
        """Count the change of every value from ``prev`` to ``new`` (same shape and float dtype)."""
        if prev.shape != new.shape or prev.dtype != new.dtype:
            raise ValueError(f"ChangeEntropy.add: prev {tuple(prev.shape)} {prev.dtype} vs new "
                             f"{tuple(new.shape)} {new.dtype}")
        fmt = float_format(new.dtype)
        u_prev = to_unsigned(as_bits(prev.detach().reshape(-1).cpu()))
        u_new = to_unsigned(as_bits(new.detach().reshape(-1).cpu()))
        delta = (u_new - u_prev) & ((1 << fmt.total_bits) - 1)
        exp, _ = split_fields(fmt, u_prev)
        self.values += delta.numel()
        self._delta.append(_histogram(delta))
        self._exp.append(_histogram(exp))
        self._joint.append(_histogram((exp.to(torch.int64) << fmt.total_bits) | delta))
        return self

    def merge(self, other: "ChangeEntropy") -> "ChangeEntropy":
        """Add ``other``'s counts to this one's (e.g. every rank's shard into one figure)."""
        self.values += other.values
        self._delta += other._delta
        self._exp += other._exp
        self._joint += other._joint
        return self

    @property
    def order0(self) -> float:
        """``H(d)``: bits per value of the best code of the change alone."""
        return _entropy(self._delta)

    @property
    def given_exponent(self) -> float:
        """``H(d | e) = H(e, d) - H(e)``: bits per value with one code per previous exponent."""
        return max(0.0, _entropy(self._joint) - _entropy(self._exp))
