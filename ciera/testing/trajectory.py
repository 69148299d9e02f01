"""Synthetic parameter trajectories: what a shard looks like from one gather to the next.

Tests, benchmarks and tools need the same realistic input: :class:`AdamTrajectory` (fp32 master
weights under AdamW, cast to the gathered dtype after every step; it lives in the library,
:mod:`ciera.synthetic`, which times codecs on it). Adversarial steps (every exponent changing, bursts
of NaN/Inf, sign flips, zeros, a shard replaced wholesale) exercise the corners of the codecs.
"""

from __future__ import annotations

import torch

from ciera.synthetic import AdamTrajectory

__all__ = ["AdamTrajectory", "adversarial_step"]


def adversarial_step(
    x: torch.Tensor, *, kind: str, gen: torch.Generator, fraction: float = 0.01
) -> torch.Tensor:
    """A new version of ``x`` (same dtype) that stresses the codecs.

    ``kind``: ``all_exponents`` (every value rescaled by a power of two), ``nan_inf`` (a burst of
    NaNs with payloads and +-Inf), ``sign_flip``, ``zeros`` (+-0.0 and subnormals),
    ``replace`` (a completely new shard), ``same`` (no change).
    """
    from ciera.codecs.formats import as_bits

    y = x.clone()
    n = x.numel()
    if n == 0 or kind == "same":
        return y
    pick = torch.rand(n, generator=gen) < fraction
    if kind == "all_exponents":
        return (x.float() * 2.0 ** torch.randint(-3, 4, (n,), generator=gen).float()).to(x.dtype)
    if kind == "replace":
        return (torch.randn(n, generator=gen) * 10.0 ** torch.randint(-6, 3, (n,), generator=gen).float()).to(x.dtype)
    if kind == "sign_flip":
        y[pick] = -y[pick]
        return y
    if kind == "zeros":
        tiny = torch.finfo(x.dtype).tiny
        subnormal = torch.tensor([0.0, -0.0, tiny / 4, -tiny / 2], dtype=torch.float32).to(x.dtype)
        y[pick] = subnormal[torch.randint(0, 4, (int(pick.sum()),), generator=gen)]
        return y
    if kind == "nan_inf":
        bits = as_bits(y)
        specials = torch.tensor([float("inf"), float("-inf"), float("nan")], dtype=torch.float32).to(x.dtype)
        y[pick] = specials[torch.randint(0, 3, (int(pick.sum()),), generator=gen)]
        # NaNs with distinct payloads: set random low mantissa bits on the NaNs.
        nan = torch.isnan(y)
        payload = torch.randint(1, 1 << 6, (int(nan.sum()),), generator=gen).to(bits.dtype)
        bits[nan] = bits[nan] | payload
        return y
    raise ValueError(f"unknown adversarial kind {kind!r}")
