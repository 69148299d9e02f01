"""Synthetic parameter trajectories: what a shard looks like from one gather to the next.

Tests, benchmarks and tools need the same realistic input: fp32 master weights updated by AdamW on
noisy gradients with a persistent component, cast to the gathered dtype after every step, as
Megatron's distributed optimizer does. Adversarial trajectories (every exponent changing, bursts
of NaN/Inf, sign flips, zeros, a shard replaced wholesale) exercise the corners of the codecs.
"""

from __future__ import annotations

import torch


class AdamTrajectory:
    """fp32 masters under AdamW; :meth:`step` returns the new low-precision parameters.

    Initialisation mixes the populations a transformer has: normal weights (``init_std``), a slice
    of norm weights at exactly 1.0 (on an exponent boundary), and a slice of zero-initialised
    values (biases, zero-init output projections).
    """

    def __init__(
        self,
        *,
        numel: int,
        dtype: torch.dtype = torch.bfloat16,
        lr: float = 1e-4,
        init_std: float = 0.02,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        signal: float = 0.3,
        seed: int = 0,
        device: str | torch.device = "cpu",
    ):
        self.numel, self.dtype, self.lr = numel, dtype, lr
        self.betas, self.eps, self.weight_decay, self.signal = betas, eps, weight_decay, signal
        self.gen = torch.Generator(device="cpu").manual_seed(seed)
        self.device = torch.device(device)
        master = torch.randn(numel, generator=self.gen) * init_std
        n_norm, n_zero = numel // 64, numel // 128
        master[:n_norm] = 1.0
        master[n_norm : n_norm + n_zero] = 0.0
        self.master = master.to(self.device)
        self.direction = torch.randn(numel, generator=self.gen).to(self.device)
        self.m = torch.zeros_like(self.master)
        self.v = torch.zeros_like(self.master)
        self.t = 0

    def current(self) -> torch.Tensor:
        """The parameters as gathered (cast of the masters), without stepping."""
        return self.master.to(self.dtype)

    def step(self) -> torch.Tensor:
        """One AdamW step on a fresh gradient; returns the cast parameters."""
        self.t += 1
        noise = torch.randn(self.numel, generator=self.gen).to(self.device)
        grad = self.signal * self.direction + noise
        b1, b2 = self.betas
        self.m.mul_(b1).add_(grad, alpha=1 - b1)
        self.v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        m_hat = self.m / (1 - b1**self.t)
        v_hat = self.v / (1 - b2**self.t)
        self.master.mul_(1 - self.lr * self.weight_decay)
        self.master.addcdiv_(m_hat, v_hat.sqrt().add_(self.eps), value=-self.lr)
        return self.current()


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
