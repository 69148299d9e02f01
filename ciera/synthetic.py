"""A synthetic parameter shard from one gather to the next, for timing codecs on realistic changes.

fp32 master weights updated by AdamW on noisy gradients with a persistent component, cast to the
gathered dtype after every step, as Megatron's distributed optimizer does.
:func:`ciera.measure.measure_codec_speed` times the codecs on it; the tests, benchmarks and tools use
it through :mod:`ciera.testing.trajectory`, next to its adversarial steps.
"""

from __future__ import annotations

import torch

__all__ = ["AdamTrajectory"]


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
