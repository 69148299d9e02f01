"""Codec.decode_many: several payloads, rows and offsets on the device, bit-identical to decode()
on each payload; payload lengths come from the headers (exact-size payloads, any padding)."""

import pytest
import torch

from ciera.codecs import HEADER_BYTES, as_bits, make_codec
from ciera.codecs.base import align_up
from ciera.testing.trajectory import AdamTrajectory, adversarial_step


@pytest.mark.parametrize("name", ["exponent_reuse", "delta"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("numel", [1, 130, 1031])
def test_decode_many_matches_decode_per_payload(name, dtype, numel):
    world = 4
    codec = make_codec(name, dtype=dtype, numel=numel, backend="torch")
    gen = torch.Generator().manual_seed(numel)
    prev = [AdamTrajectory(numel=numel, dtype=dtype, seed=r).current().clone() for r in range(world)]
    new = [AdamTrajectory(numel=numel, dtype=dtype, seed=r).step().clone() for r in range(world)]
    new[1] = adversarial_step(new[1], kind="nan_inf", gen=gen, fraction=0.3)
    cap = codec.clamp_capacity(codec.max_bytes)
    payloads = []
    for r in range(world):
        out = torch.zeros(cap, dtype=torch.uint8)
        codec.encode(shard=new[r], state=codec.new_state(shard=prev[r]), out=out)
        payloads.append(out[: int(out[:HEADER_BYTES].view(torch.int64)[2])])
    size = align_up(max(p.numel() for p in payloads))  # the agreed size: exact, no capacity window
    flat = torch.full((world * size,), 0xA5, dtype=torch.uint8)  # padding must not matter
    for r, p in enumerate(payloads):
        flat[r * size : r * size + p.numel()] = p
    targets = torch.stack(prev).view(-1).clone().view(world, numel)
    expected = targets.clone()
    rows = torch.tensor([3, 0, 1])  # any subset, any order (the receiver skips its own row 2)
    for r in rows.tolist():
        codec.decode(payload=flat[r * size : (r + 1) * size], target=expected[r])
    codec.decode_many(payloads=flat, rows=rows, offsets=rows * size, targets=targets)
    assert torch.equal(as_bits(targets), as_bits(expected))
    for r in rows.tolist():
        assert torch.equal(as_bits(targets[r]), as_bits(new[r].contiguous()))
    assert torch.equal(as_bits(targets[2]), as_bits(prev[2]))


def test_decode_many_rejects_bad_arguments():
    codec = make_codec("delta", dtype=torch.bfloat16, numel=8, backend="torch")
    flat = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="targets"):
        codec.decode_many(payloads=flat, rows=torch.tensor([0]), offsets=torch.tensor([0]),
                          targets=torch.zeros(16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="rows and offsets"):
        codec.decode_many(payloads=flat, rows=torch.tensor([0]), offsets=torch.tensor([0, 1]),
                          targets=torch.zeros(2, 8, dtype=torch.bfloat16))
