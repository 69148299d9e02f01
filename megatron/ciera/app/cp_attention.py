"""Context-parallel core attention for the ``local`` transformer implementation.

Megatron-Core's local ``DotProductAttention`` refuses ``context_parallel_size > 1`` (only
transformer-engine's attention splits the sequence). This module is the all-gather-KV form of
context parallelism on top of it, for runs without TE (CPU, or ``--transformer-impl local``):

* each CP rank holds two of the sequence's ``2 * cp`` equal chunks, ``r`` and ``2 * cp - 1 - r``
  (the load-balanced layout of megatron-core's ``get_batch_on_this_cp_rank``; RoPE is sliced the
  same way by megatron-core's ``RotaryEmbedding``);
* K and V are all-gathered over the CP group along the sequence with megatron-core's own
  ``gather_from_sequence_parallel_region`` (its backward reduce-scatters their gradients, so each
  rank's K/V get the gradient of every query that attended to them), then put in sequence order;
* the causal mask is built from the global positions of this rank's query chunks against every
  key position, so each query sees exactly the keys it sees without CP;
* the rest (scaling, softmax, dropout, GQA, the probabilities times V) is upstream's
  ``DotProductAttention.forward`` unchanged, with ``sq = s / cp`` and ``sk = s``.

The loss needs no change: each rank's loss is over its own tokens and DDP averages gradients over
the data-and-context-parallel group, as with TE's CP attention. :func:`megatron.ciera.app.model.layer_spec`
is the one place that puts this class into the spec.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import Tensor

from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import is_layer_window_attention

from .upstream_features import features

__all__ = ["ContextParallelDotProductAttention", "batch_on_this_cp_rank", "query_positions", "sequence_order",
           "causal_mask"]


def batch_on_this_cp_rank(batch: dict, cp_group=None) -> dict:
    """This CP rank's two sequence chunks of every tensor in ``batch``, by megatron-core's own
    slicing (version isolation: 0.19.x adds ``is_hybrid_cp``, and without a group it would slice
    over the whole world, so the CP group is always passed)."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    group = cp_group if cp_group is not None else parallel_state.get_context_parallel_group()
    if features().cp_slicer_takes_is_hybrid_cp:
        return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=group)
    return get_batch_on_this_cp_rank(batch, cp_group=group)


def query_positions(*, chunk: int, cp_rank: int, cp_size: int, device=None) -> Tensor:
    """Global positions of the ``2 * chunk`` tokens CP rank ``cp_rank`` holds, in its local order:
    chunk ``cp_rank`` then chunk ``2 * cp_size - 1 - cp_rank``."""
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second_start = (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([first, torch.arange(second_start, second_start + chunk, device=device)])


def sequence_order(gathered: Tensor, *, cp_size: int) -> Tensor:
    """The all-gathered ``[cp * 2 * chunk, ...]`` tensor (rank order: rank ``j`` contributes chunks
    ``j`` and ``2 * cp - 1 - j``) as ``[2 * cp * chunk, ...]`` in sequence order. Views and one
    concatenation on the device; differentiable."""
    rest = gathered.shape[1:]
    g = gathered.view(cp_size, 2, gathered.shape[0] // (2 * cp_size), *rest)
    first = g[:, 0].reshape(-1, *rest)                # chunks 0 .. cp-1 from ranks 0 .. cp-1
    second = g[:, 1].flip(0).reshape(-1, *rest)       # chunks cp .. 2cp-1 from ranks cp-1 .. 0
    return torch.cat([first, second])


def causal_mask(*, chunk: int, cp_rank: int, cp_size: int, device=None) -> Tensor:
    """``[1, 1, 2 * chunk, 2 * cp * chunk]`` bool, True where a local query must not see a key
    (key position after the query's global position), for keys in sequence order."""
    q = query_positions(chunk=chunk, cp_rank=cp_rank, cp_size=cp_size, device=device)
    k = torch.arange(2 * cp_size * chunk, device=device)
    return (k[None, :] > q[:, None]).view(1, 1, q.numel(), k.numel())


class ContextParallelDotProductAttention(DotProductAttention):
    """``DotProductAttention`` over a context-parallel group (all-gather-KV form); same
    constructor and ``forward`` as upstream's, so the layer spec can name it in its place.

    ``cp_comm_type`` is accepted for the spec's sake: this class always all-gathers K/V
    (validation reports or rejects another value). Sliding-window attention and packed
    sequences are refused here (upstream's local attention builds a window mask that assumes
    ``sq == sk``; packed sequences need TE)."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise ValueError("--window-size with --context-parallel-size > 1 needs transformer-engine's attention")
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask, AttnMaskType.padding):
            raise ValueError(f"context-parallel local attention: attention mask type {attn_mask_type.name} "
                             "is not supported (causal, padding or no_mask)")
        # Upstream's constructor asserts CP == 1; everything it reads from the config is
        # per-rank-shape independent of CP, so it sees a shallow copy with CP 1.
        per_rank_view = copy.copy(config)
        per_rank_view.context_parallel_size = 1
        # The mask is always given (built here), so the softmax applies it as an arbitrary mask.
        super().__init__(per_rank_view, layer_number, AttnMaskType.arbitrary, attention_type,
                         attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        self.config = config
        self.cp_mask_type = attn_mask_type
        cp = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        self.cp_group = cp if cp is not None else parallel_state.get_context_parallel_group()

    def _gather(self, tensor: Tensor, cp_size: int) -> Tensor:
        """[s/cp, b, g, h] this rank's chunks -> [s, b, g, h] in sequence order (backward:
        reduce-scatter)."""
        gathered = gather_from_sequence_parallel_region(tensor, tensor_parallel_output_grad=True,
                                                        group=self.cp_group)
        return sequence_order(gathered, cp_size=cp_size)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type: Optional[AttnMaskType] = None, attention_bias: Optional[Tensor] = None,
                packed_seq_params=None):
        """Upstream's forward with K/V of the whole sequence and the global causal mask.
        ``attention_mask`` (optional, True = masked) holds this rank's query rows against the
        whole sequence in order, as ``get_batch_on_this_cp_rank`` slices it."""
        if packed_seq_params is not None:
            raise ValueError("packed sequences with --context-parallel-size > 1 need transformer-engine's attention")
        cp_size = self.cp_group.size()
        if query.size(0) % 2:
            raise ValueError(f"context-parallel attention: {query.size(0)} local tokens is not two equal chunks")
        chunk = query.size(0) // 2
        key, value = self._gather(key, cp_size), self._gather(value, cp_size)
        mask = None
        if self.cp_mask_type == AttnMaskType.causal:
            mask = causal_mask(chunk=chunk, cp_rank=self.cp_group.rank(), cp_size=cp_size, device=query.device)
        if attention_mask is not None:
            mask = attention_mask if mask is None else (mask | attention_mask.bool())
        return super().forward(query, key, value, mask, attention_bias=attention_bias)
