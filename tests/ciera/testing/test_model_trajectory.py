"""ciera.testing.model_trajectory: a tiny MoE's bf16 buffer laid out and sharded as Megatron's distributed
optimizer does, trained deterministically."""

import math

import pytest
import torch

from ciera.codecs import as_bits
from ciera.testing.model_trajectory import MoEShape, ModelTrajectory, megatron_layout

SMALL = MoEShape(vocab=64, hidden=32, heads=2, experts=4, expert_hidden=32, seq=8, batch=2)


def test_layout_follows_the_distributed_optimizer():
    sizes = [("embedding.word_embeddings.weight", 100), ("decoder.final_layernorm.weight", 30),
             ("output_layer.weight", 65)]
    slots, numel = megatron_layout(sizes=sizes, world=3)
    assert [s.name for s in slots] == ["output_layer.weight", "decoder.final_layernorm.weight",
                                       "embedding.word_embeddings.weight"]  # reverse registration order
    assert [s.start for s in slots] == [0, 128, 192]  # each start aligned to 64 values
    assert numel == 384 and numel % math.lcm(3, 128) == 0  # 292 values padded to lcm(R, 128)


def test_shards_cover_the_buffer_and_mix_kinds():
    traj = ModelTrajectory(world=4, shape=SMALL, seed=1)
    assert traj.numel == 4 * traj.shard_numel
    kinds = [traj.shard_kinds(r) for r in range(4)]
    assert all(sum(k.values()) == traj.shard_numel for k in kinds)
    assert sum(k.get("expert", 0) for k in kinds) == sum(s.numel for s in traj.slots if s.kind == "expert")
    assert len({tuple(sorted(k)) for k in kinds}) > 1, kinds  # ranks hold different kinds


def test_steps_are_deterministic_and_pairs_chain():
    a = ModelTrajectory(world=2, shape=SMALL, lr=3e-4, seed=7, warmup=2)
    b = ModelTrajectory(world=2, shape=SMALL, lr=3e-4, seed=7)
    for _ in range(2):
        b.step()
    assert torch.equal(as_bits(a.current()), as_bits(b.current()))
    first = a.current()
    steps = list(a.shard_pairs(steps=3))
    assert torch.equal(as_bits(torch.cat([p for p, _ in steps[0]])), as_bits(first))
    for before, after in zip(steps, steps[1:]):
        assert all(torch.equal(as_bits(n), as_bits(p)) for (_, n), (p, _) in zip(before, after))
    changed = [(as_bits(p) != as_bits(n)).float().mean().item() for p, n in steps[-1]]
    assert all(0.0 < c < 1.0 for c in changed), changed
    assert steps[-1][0][1].dtype == torch.bfloat16


def test_masters_are_fp32_and_parameters_their_bf16_cast():
    traj = ModelTrajectory(world=2, shape=SMALL, lr=1e-3, warmup=3)
    for p, m in zip(traj.params, traj.masters):
        assert m.dtype == torch.float32
        assert torch.equal(p.detach(), m.to(torch.bfloat16).float())
    assert not any(torch.equal(p.detach(), m) for p, m in zip(traj.params, traj.masters) if p.numel() > 64)


def test_bad_shapes_and_worlds_are_refused_with_the_numbers():
    with pytest.raises(ValueError, match="hidden 30 is not a multiple of heads 4"):
        MoEShape(hidden=30)
    with pytest.raises(ValueError, match="top_k 3 not in"):
        MoEShape(experts=2, top_k=3)
    with pytest.raises(ValueError, match="world 0"):
        ModelTrajectory(world=0, shape=SMALL)
