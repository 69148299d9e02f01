"""ciera.entropy: order-0 entropies of the change, on distributions whose entropy is known."""

import math

import pytest
import torch

from ciera.entropy import ChangeEntropy


def _bf16(bits):
    return torch.tensor(bits, dtype=torch.int16).view(torch.bfloat16)


def test_unchanged_shard_has_zero_entropy():
    x = torch.randn(1000).to(torch.bfloat16)
    h = ChangeEntropy().add(prev=x, new=x.clone())
    assert h.values == 1000 and h.order0 == 0.0 and h.given_exponent == 0.0


def test_uniform_change_over_four_steps_is_two_bits():
    prev = torch.full((4096,), 0x3F80, dtype=torch.int16)  # 1.0
    new = prev + torch.arange(4096, dtype=torch.int16) % 4  # +0..3 units in the last place
    h = ChangeEntropy().add(prev=prev.view(torch.bfloat16), new=new.view(torch.bfloat16))
    assert h.order0 == pytest.approx(2.0) and h.given_exponent == pytest.approx(2.0)


def test_change_determined_by_the_exponent_costs_nothing_given_it():
    # half the values at 1.0 (exponent 127) move by +1 ulp, half at 2.0 (exponent 128) by -1 (mod 2^16)
    prev = _bf16([0x3F80] * 512 + [0x4000] * 512)
    new = _bf16([0x3F81] * 512 + [0x3FFF] * 512)
    h = ChangeEntropy().add(prev=prev, new=new)
    assert h.order0 == pytest.approx(1.0) and h.given_exponent == pytest.approx(0.0, abs=1e-12)


def test_merge_pools_the_histograms():
    a = ChangeEntropy().add(prev=_bf16([0x3F80] * 8), new=_bf16([0x3F81] * 8))
    b = ChangeEntropy().add(prev=_bf16([0x3F80] * 8), new=_bf16([0x3F82] * 8))
    assert a.order0 == 0.0 and b.order0 == 0.0
    pooled = a.merge(b)
    assert pooled.values == 16 and pooled.order0 == pytest.approx(math.log2(2))


def test_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match="prev"):
        ChangeEntropy().add(prev=torch.zeros(3, dtype=torch.bfloat16), new=torch.zeros(4, dtype=torch.bfloat16))
