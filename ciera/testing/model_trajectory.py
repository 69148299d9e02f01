"""Real-layout trajectories: a tiny MoE trained with AdamW, its bf16 buffer sharded as Megatron does.

:class:`ciera.testing.trajectory.AdamTrajectory` gives every value the same statistics. A real bucket does
not: Megatron's distributed optimizer lays the parameters one after the other in a flat buffer
(reverse registration order, each start aligned to 64 values, the end padded to ``lcm(R, 128)``) and
gives rank ``r`` the ``r``-th contiguous equal shard, across parameter boundaries. So one rank's
shard can be all expert weights (few tokens each, slowly changing) while another's holds the output
layer, the router, the norms (values at exactly 1.0, on an exponent boundary) and attention.

:class:`ModelTrajectory` trains a small MoE language model (embedding, per layer RMSNorm, causal
attention, RMSNorm, top-k router, routed experts; final norm, output layer) on a seeded synthetic
token stream, in bf16 parameters with fp32 master weights under AdamW (no weight decay on norms,
gradients clipped at 1.0), and after each step yields every rank's (previous, new) shard of the
flat bf16 buffer. Gradients are taken at the bf16 parameters, as in Megatron, but with fp32
arithmetic (bf16 matrix products are slow on CPUs without bf16 units; the update statistics are
the same). It is deterministic for a given seed and machine, and a step of the default
shape takes about 0.1 s on one CPU thread.

All parameters share one buffer here (one bucket). Megatron keeps routed experts in a buffer of
their own; the single buffer is the more heterogeneous case, which is what per-rank sizes and the
entropy coders are measured against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

KINDS = ("embedding", "output", "attention", "norm", "router", "expert")
"""Parameter kinds of the layout, as :attr:`ParamSlot.kind` names them."""


@dataclass(frozen=True)
class MoEShape:
    """Size of the tiny MoE. The default has ~0.33M parameters, ~80% of them expert weights."""

    vocab: int = 256
    """Vocabulary size (embedding and output layer rows)."""
    hidden: int = 64
    """Model width."""
    layers: int = 2
    """Transformer layers."""
    heads: int = 4
    """Attention heads (``hidden`` must be a multiple)."""
    experts: int = 8
    """Routed experts per layer."""
    top_k: int = 2
    """Experts each token is routed to."""
    expert_hidden: int = 128
    """Width of each expert's FFN."""
    seq: int = 32
    """Tokens per sequence."""
    batch: int = 8
    """Sequences per step."""

    def __post_init__(self):
        if self.hidden % self.heads:
            raise ValueError(f"MoEShape: hidden {self.hidden} is not a multiple of heads {self.heads}")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"MoEShape: top_k {self.top_k} not in [1, experts {self.experts}]")


SHAPES = {
    "tiny": MoEShape(),
    "small": MoEShape(vocab=512, hidden=128, experts=16, expert_hidden=256),
    "medium": MoEShape(vocab=1024, hidden=256, layers=4, heads=8, experts=16, expert_hidden=512),
}
"""Named sizes for tools (``--model-shape``): ~0.33M, ~2.4M and ~18.6M parameters."""


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in the flat buffer."""

    name: str
    """Megatron-Core style name (``decoder.layers.0.mlp.router.weight``)."""
    kind: str
    """One of :data:`KINDS`."""
    start: int
    """First value in the buffer (a multiple of 64)."""
    numel: int
    """Values."""


class _Attention(nn.Module):
    def __init__(self, s: MoEShape):
        super().__init__()
        self.heads = s.heads
        self.linear_qkv = nn.Linear(s.hidden, 3 * s.hidden, bias=False)
        self.linear_proj = nn.Linear(s.hidden, s.hidden, bias=False)

    def forward(self, x):
        b, t, h = x.shape
        q, k, v = self.linear_qkv(x).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.linear_proj(y.transpose(1, 2).reshape(b, t, h))


class _Router(nn.Module):
    def __init__(self, s: MoEShape):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(s.experts, s.hidden))


class _Experts(nn.Module):
    def __init__(self, s: MoEShape):
        super().__init__()
        self.weight1 = nn.Parameter(torch.empty(s.experts, s.hidden, s.expert_hidden))
        self.weight2 = nn.Parameter(torch.empty(s.experts, s.expert_hidden, s.hidden))


class _MoE(nn.Module):
    def __init__(self, s: MoEShape):
        super().__init__()
        self.top_k = s.top_k
        self.router = _Router(s)
        self.experts = _Experts(s)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        gates, chosen = torch.topk(torch.softmax(flat @ self.router.weight.t(), dim=-1, dtype=torch.float32),
                                   self.top_k, dim=-1)
        gates = (gates / gates.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(flat)
        for e in range(self.experts.weight1.shape[0]):
            tok, slot = torch.nonzero(chosen == e, as_tuple=True)
            if tok.numel():
                y = F.gelu(flat[tok] @ self.experts.weight1[e]) @ self.experts.weight2[e]
                out = out.index_add(0, tok, y * gates[tok, slot, None])
        return out.view_as(x)


class _Layer(nn.Module):
    def __init__(self, s: MoEShape):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(s.hidden)
        self.self_attention = _Attention(s)
        self.pre_mlp_layernorm = nn.RMSNorm(s.hidden)
        self.mlp = _MoE(s)

    def forward(self, x):
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.pre_mlp_layernorm(x))


class TinyMoE(nn.Module):
    """The model :class:`ModelTrajectory` trains (parameter names follow Megatron-Core's GPTModel)."""

    def __init__(self, shape: MoEShape):
        super().__init__()
        self.embedding = nn.Module()
        self.embedding.word_embeddings = nn.Embedding(shape.vocab, shape.hidden)
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList(_Layer(shape) for _ in range(shape.layers))
        self.decoder.final_layernorm = nn.RMSNorm(shape.hidden)
        self.output_layer = nn.Linear(shape.hidden, shape.vocab, bias=False)

    def forward(self, tokens):
        x = self.embedding.word_embeddings(tokens)
        for layer in self.decoder.layers:
            x = layer(x)
        return self.output_layer(self.decoder.final_layernorm(x))


def param_kind(*, name: str) -> str:
    """The :data:`KINDS` entry of one of :class:`TinyMoE`'s parameter names."""
    for part, kind in (("layernorm", "norm"), ("experts", "expert"), ("router", "router"),
                       ("self_attention", "attention"), ("embedding", "embedding"), ("output_layer", "output")):
        if part in name:
            return kind
    raise ValueError(f"param_kind: no kind for parameter {name!r}")


def megatron_layout(*, sizes: list[tuple[str, int]], world: int) -> tuple[list[ParamSlot], int]:
    """Slots of parameters ``(name, numel)`` (in registration order) in a distributed-optimizer
    buffer of one bucket, and the buffer's padded length (a multiple of ``lcm(world, 128)``)."""
    slots, end = [], 0
    for name, numel in reversed(sizes):  # reverse: roughly the order backprop produces gradients
        start = -(-end // 64) * 64
        slots.append(ParamSlot(name=name, kind=param_kind(name=name), start=start, numel=numel))
        end = start + numel
    div = math.lcm(world, 128)
    return slots, -(-end // div) * div


class ModelTrajectory:
    """A :class:`TinyMoE` trained step by step; its flat bf16 buffer sharded over ``world`` ranks.

    :meth:`step` trains one step and returns the new flat buffer; :meth:`shard_pairs` yields, per
    step, every rank's ``(previous, new)`` shard. ``warmup`` steps are taken at construction (the
    first gathers of a run are raw anyway)."""

    def __init__(self, *, world: int, shape: MoEShape = MoEShape(), lr: float = 1e-4, weight_decay: float = 0.1,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, clip_grad: float = 1.0,
                 warmup: int = 0, seed: int = 0, dtype: torch.dtype = torch.bfloat16):
        if world < 1:
            raise ValueError(f"ModelTrajectory: world {world} < 1")
        self.world, self.shape, self.dtype, self.clip_grad = world, shape, dtype, clip_grad
        self.gen = torch.Generator().manual_seed(seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = TinyMoE(shape)
        named = list(model.named_parameters())
        out_std = 0.02 / math.sqrt(2 * shape.layers)  # Megatron's scaled init of output projections
        for name, p in named:
            if param_kind(name=name) == "norm":
                nn.init.ones_(p)
            else:
                std = out_std if ("linear_proj" in name or "weight2" in name) else 0.02
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=self.gen) * std)
        self.model = model  # holds the bf16 values, widened (exact): the arithmetic runs in fp32
        self.params = [p for _, p in named]
        with torch.no_grad():
            for p in self.params:
                p.copy_(p.to(dtype))
        self.masters = [p.detach().clone() for p in self.params]  # fp32 main params start at the bf16 values
        decay = [m for (n, _), m in zip(named, self.masters) if param_kind(name=n) != "norm"]
        no_decay = [m for (n, _), m in zip(named, self.masters) if param_kind(name=n) == "norm"]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                            {"params": no_decay, "weight_decay": 0.0}],
                                           lr=lr, betas=betas, eps=eps, foreach=False)
        self.slots, self.numel = megatron_layout(sizes=[(n, p.numel()) for n, p in named], world=world)
        self.shard_numel = self.numel // world
        # A fixed sparse bigram table: every token has four likely successors (learnable structure).
        self.successors = torch.randint(0, shape.vocab, (shape.vocab, 4), generator=self.gen)
        self.t = 0
        self.loss = float("nan")
        self._buffer = self._flat()
        for _ in range(warmup):
            self.step()

    def _flat(self) -> torch.Tensor:
        buf = torch.zeros(self.numel, dtype=self.dtype)
        by_name = dict(self.model.named_parameters())
        for s in self.slots:
            buf[s.start:s.start + s.numel] = by_name[s.name].detach().view(-1)  # exact: bf16 values
        return buf

    def _batch(self) -> torch.Tensor:
        s = self.shape
        tokens = torch.empty(s.batch, s.seq + 1, dtype=torch.int64)
        tokens[:, 0] = torch.randint(0, s.vocab, (s.batch,), generator=self.gen)
        pick = torch.randint(0, 4, (s.batch, s.seq), generator=self.gen)
        noise = torch.rand(s.batch, s.seq, generator=self.gen) < 0.1
        rand = torch.randint(0, s.vocab, (s.batch, s.seq), generator=self.gen)
        for i in range(s.seq):
            nxt = self.successors[tokens[:, i], pick[:, i]]
            tokens[:, i + 1] = torch.where(noise[:, i], rand[:, i], nxt)
        return tokens

    def current(self) -> torch.Tensor:
        """The flat buffer as gathered (a copy), without stepping."""
        return self._buffer.clone()

    def shards(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Rank ``r``'s shard of ``buffer`` at index ``r`` (views)."""
        return list(buffer.view(self.world, self.shard_numel))

    def step(self) -> torch.Tensor:
        """One training step; returns the new flat bf16 buffer (a fresh tensor). Runs on one thread:
        the operations are tiny, and more threads only contend (10-100x slower on a loaded machine)."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self._step()
        finally:
            torch.set_num_threads(threads)

    def _step(self) -> torch.Tensor:
        tokens = self._batch()
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        for p, m in zip(self.params, self.masters):
            m.grad = p.grad if p.grad is not None else torch.zeros_like(m)
            p.grad = None
        torch.nn.utils.clip_grad_norm_(self.masters, self.clip_grad, foreach=False)
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                p.copy_(m.to(self.dtype))  # the cast Megatron's _copy_main_params_to_model_params does
        self.t += 1
        self.loss = float(loss.detach())
        self._buffer = self._flat()
        return self._buffer.clone()

    def shard_pairs(self, *, steps: int) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
        """``steps`` training steps; after each, every rank's ``(previous, new)`` shard, in rank order."""
        for _ in range(steps):
            prev = self._buffer
            new = self.step()
            yield list(zip(self.shards(prev), self.shards(new)))

    def shard_kinds(self, rank: int) -> dict[str, int]:
        """Values of each kind in rank ``rank``'s shard (``padding``: alignment and end padding)."""
        lo, hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        out = {}
        for s in self.slots:
            n = max(0, min(hi, s.start + s.numel) - max(lo, s.start))
            if n:
                out[s.kind] = out.get(s.kind, 0) + n
        out["padding"] = self.shard_numel - sum(out.values())
        return {k: v for k, v in out.items() if v}

    def describe_shard(self, rank: int) -> str:
        """``expert 100% `` / ``output 40% attention 30% ...``: rank ``rank``'s shard by kind."""
        kinds = self.shard_kinds(rank)
        return " ".join(f"{k} {100 * v / self.shard_numel:.0f}%" for k, v in
                        sorted(kinds.items(), key=lambda kv: -kv[1]))
