"""exponent_reuse specifics: what goes on the wire, and block-size handling."""

import pytest
import torch

from ciera.codecs import HEADER_BYTES, make_codec
from ciera.codecs.exponent_reuse import ExponentReuseLayout
from ciera.codecs.formats import float_format


def needed(codec, prev, new):
    state = codec.new_state(shard=prev)
    out = torch.zeros(codec.clamp_capacity(codec.max_bytes), dtype=torch.uint8)
    codec.encode(shard=new, state=state, out=out)
    return int(out[:HEADER_BYTES].view(torch.int64)[2])


@pytest.mark.parametrize("dtype,sm_bytes,planes", [(torch.bfloat16, 1, 0), (torch.float16, 1, 3), (torch.float32, 3, 0)])
def test_layout_sections(dtype, sm_bytes, planes):
    lay = ExponentReuseLayout(float_format(dtype), 1000, 8)
    assert (lay.sm_bytes, lay.n_planes, lay.n_blocks) == (sm_bytes, planes, 125)
    assert lay.off_signmant == HEADER_BYTES
    assert lay.off_planes >= lay.off_signmant + 1000 * sm_bytes
    assert all(o % 16 == 0 for o in (lay.off_planes, lay.off_bitmap, lay.off_exps))


def test_unchanged_exponents_send_no_exponent_bytes():
    x = torch.randn(4096).to(torch.bfloat16)
    codec = make_codec("exponent_reuse", dtype=torch.bfloat16, numel=4096, block_size=8)
    # Flip only mantissa bits: exponents untouched.
    y = (x.view(torch.int16) ^ 1).view(torch.bfloat16)
    assert needed(codec, x, y) == codec.fixed_bytes
    assert codec.fixed_bytes < 0.52 * 2 * 4096 + 128  # ~1 byte/value + bitmap


@pytest.mark.parametrize("block", [1, 4, 8, 64, 512])
def test_one_changed_exponent_costs_one_block(block):
    n = 4096
    x = torch.full((n,), 1.5, dtype=torch.bfloat16)
    y = x.clone()
    y[1234] = 3.0  # exponent +1
    codec = make_codec("exponent_reuse", dtype=torch.bfloat16, numel=n, block_size=block)
    assert needed(codec, x, y) == codec.fixed_bytes + block


def test_state_tracks_last_encode():
    codec = make_codec("exponent_reuse", dtype=torch.bfloat16, numel=16)
    a = torch.ones(16, dtype=torch.bfloat16)
    b = a * 4
    state = codec.new_state(shard=a)
    out = torch.zeros(codec.clamp_capacity(codec.max_bytes), dtype=torch.uint8)
    codec.encode(shard=b, state=state, out=out)
    codec.encode(shard=b, state=state, out=out)  # second encode of the same values: nothing changed
    assert int(out[:HEADER_BYTES].view(torch.int64)[2]) == codec.fixed_bytes


def test_bad_block_size():
    with pytest.raises(ValueError, match="power of two"):
        make_codec("exponent_reuse", dtype=torch.bfloat16, numel=16, block_size=6)


def test_capacity_must_be_aligned_and_cover_fixed_part():
    codec = make_codec("exponent_reuse", dtype=torch.bfloat16, numel=100)
    x = torch.zeros(100, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="capacity"):
        codec.encode(shard=x, state=codec.new_state(shard=x), out=torch.zeros(codec.fixed_bytes - 16, dtype=torch.uint8))
