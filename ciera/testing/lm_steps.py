"""The training steps of the ZeRO-3 bit-exactness checks: a language model trained with
micro-batches of random tokens, and the sha256 of its full parameters."""

from __future__ import annotations

import hashlib

import torch


def train_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, steps: int, micro_batches: int,
                vocab: int, batch: int, seq: int, generator: torch.Generator,
                device: torch.device | None = None) -> list[float]:
    """``steps`` optimizer steps of ``micro_batches`` next-token losses each, over ``batch`` random
    sequences of ``seq + 1`` tokens below ``vocab`` drawn from ``generator`` (on the host, then moved
    to ``device``). Gradients accumulate over the micro-batches (each loss unscaled). Returns every
    micro-batch's loss, in order."""
    losses = []
    for _ in range(steps):
        for _ in range(micro_batches):
            tokens = torch.randint(0, vocab, (batch, seq + 1), generator=generator)
            if device is not None:
                tokens = tokens.to(device)
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
            loss.backward()
            losses.append(loss.detach().float().item())
        optimizer.step()
        optimizer.zero_grad()
    return losses


def full_params_sha256(model: torch.nn.Module) -> str:
    """sha256 over every parameter's full bytes (a sharded DTensor gathered first: a collective),
    in name order; equal on every rank."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        h.update(name.encode())
        h.update(full.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
