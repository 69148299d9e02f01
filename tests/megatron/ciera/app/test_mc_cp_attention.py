"""megatron.ciera.app.cp_attention: the context-parallel local attention equals upstream's attention
over the whole sequence.

The layout functions for CP 1-4, then on 2 gloo ranks: megatron-core's own batch slicing gives
each rank the positions they assume, and the module equals upstream's ``DotProductAttention`` on
the full sequence: output, and the gradients of Q, K and V (the reduce-scatter of the gathered
K/V), with GQA.
"""

import pytest
import torch

from megatron.ciera.app import cp_attention


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_layout_functions_invert_the_load_balanced_chunks(cp):
    """Rank r holds chunks r and 2cp-1-r (megatron-core's layout; checked against its own slicing
    on real CP ranks below): positions, the causal mask rows, and the gathered K/V put back in
    sequence order."""
    chunk = 3
    seq = torch.arange(2 * cp * chunk)
    pieces = seq.view(2 * cp, chunk)
    locals_ = [torch.cat([pieces[r], pieces[2 * cp - 1 - r]]) for r in range(cp)]
    for r, local in enumerate(locals_):
        assert torch.equal(cp_attention.query_positions(chunk=chunk, cp_rank=r, cp_size=cp), local)
        full = torch.ones(seq.numel(), seq.numel(), dtype=torch.bool).triu(1)
        assert torch.equal(cp_attention.causal_mask(chunk=chunk, cp_rank=r, cp_size=cp)[0, 0], full[local])
    gathered = torch.cat(locals_)  # all_gather's rank order
    assert torch.equal(cp_attention.sequence_order(gathered, cp_size=cp), seq)
    # trailing dimensions ride along (K/V are [s, b, heads, dim])
    wide = torch.stack([gathered, -gathered], dim=1).view(-1, 2, 1)
    assert torch.equal(cp_attention.sequence_order(wide, cp_size=cp)[:, 0, 0], seq)


def _attention_on_rank(rank, world):
    import copy

    from megatron.ciera.binding import cpu_compat
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    cpu_compat.enable()
    parallel_state.initialize_model_parallel(context_parallel_size=world)
    tensor_parallel.model_parallel_cuda_manual_seed(1)  # the dropout RNG fork (p = 0 here)
    try:
        heads, groups, dim, seq, batch = 4, 2, 8, 16, 2
        config = TransformerConfig(num_layers=1, hidden_size=heads * dim, num_attention_heads=heads,
                                   num_query_groups=groups, context_parallel_size=world, attention_dropout=0.0,
                                   use_cpu_initialization=True, masked_softmax_fusion=False)
        torch.manual_seed(0)  # the same full-sequence tensors on every rank
        q, k, v = (torch.randn(seq, batch, n, dim, dtype=torch.float64) for n in (heads, groups, groups))
        grad_out = torch.randn(seq, batch, heads * dim, dtype=torch.float64)

        full_config = copy.copy(config)
        full_config.context_parallel_size = 1
        ref = DotProductAttention(full_config, 1, AttnMaskType.causal, "self")
        fq, fk, fv = (t.clone().requires_grad_() for t in (q, k, v))
        ref_out = ref(fq, fk, fv, None)
        ref_out.backward(grad_out)

        mine = cp_attention.ContextParallelDotProductAttention(config, 1, AttnMaskType.causal, "self")
        pos = cp_attention.query_positions(chunk=seq // (2 * world), cp_rank=rank, cp_size=world)
        # megatron-core's own batch slicing ([b, s] layout) gives this rank the same positions
        sliced = cp_attention.batch_on_this_cp_rank({"tokens": torch.arange(seq).view(1, seq)})["tokens"]
        assert torch.equal(sliced.view(-1), pos), (sliced, pos)
        lq, lk, lv = (t[pos].clone().requires_grad_() for t in (q, k, v))
        out = mine(lq, lk, lv, None)
        out.backward(grad_out[pos])
        errors = {name: (a - b[pos]).abs().max().item() for name, a, b in (
            ("out", out, ref_out), ("dq", lq.grad, fq.grad), ("dk", lk.grad, fk.grad), ("dv", lv.grad, fv.grad))}
        return errors, tuple(out.shape)
    finally:
        parallel_state.destroy_model_parallel()
        cpu_compat.disable()


@pytest.mark.distributed
def test_two_rank_attention_equals_full_sequence_attention_and_its_gradients():
    from ciera.testing import run_on_ranks

    for errors, shape in run_on_ranks(_attention_on_rank, world=2):
        assert shape == (8, 2, 32)
        assert max(errors.values()) < 1e-12, errors
