"""The gather on a real layout: a tiny MoE's bucket (ciera.testing.model_trajectory) sharded over R ranks as
the distributed optimizer shards it, one rank's shard all experts and another's output layer,
attention and embeddings. Every registered codec the config accepts, bit for bit against the
trained buffer after every gather; the compressed gathers' wire within 2% of the payloads' sum."""

import pytest
import torch

from ciera import CieraAllGather, CieraConfig
from ciera.codecs import as_bits, available_codecs
from ciera.config import CODECS
from ciera.testing.model_trajectory import ModelTrajectory, MoEShape
from ciera.testing import run_on_ranks

pytestmark = pytest.mark.distributed

CODEC_NAMES = [c for c in available_codecs() if c in CODECS and c != "raw"]
SHAPE = MoEShape(vocab=128, hidden=32, heads=2, experts=8, expert_hidden=64, seq=16, batch=4)
"""~81k parameters, 80% in experts: at 4 ranks one shard is all experts."""


def _worker(rank, world, buffers, codecs):
    out = {}
    for codec in codecs:
        buf = torch.zeros_like(buffers[0])
        g = CieraAllGather(buf, config=CieraConfig(codec=codec, selection="always"), name=f"model-{codec}")
        equal = uneven = 0
        for step, flat in enumerate(buffers):
            buf.view(world, -1)[rank].copy_(flat.view(world, -1)[rank])
            handle = g.start()
            if not g.plan.raw:
                equal += world * g.plan.size
                uneven += bool(g.plan.sizes)
            handle.wait()
            assert torch.equal(as_bits(buf), as_bits(flat)), f"{codec}: rank {rank} step {step}"
        out[codec] = (g.stats, equal, uneven)
    return out


@pytest.mark.parametrize("world", [4, pytest.param(8, marks=pytest.mark.slow),
                                   pytest.param(16, marks=pytest.mark.slow)])
def test_real_layout_sends_the_sum_of_the_payloads_bit_exact(world):
    traj = ModelTrajectory(world=world, shape=SHAPE, lr=3e-4, warmup=4, seed=world)
    kinds = [set(traj.shard_kinds(r)) for r in range(world)]
    assert {"expert"} in [k - {"norm", "padding"} for k in kinds], "a shard of experts alone"
    assert any(k & {"attention", "embedding", "output"} for k in kinds), kinds
    buffers = [traj.current()] + [traj.step() for _ in range(5)]
    results = run_on_ranks(_worker, world=world, args=(buffers, CODEC_NAMES))
    for codec in CODEC_NAMES:
        (s, equal, uneven), *others = [r[codec] for r in results]
        assert all(o[0].wire_bytes == s.wire_bytes and o[0].payload_bytes == s.payload_bytes for o in others)
        assert s.compressed_gathers == len(buffers) - 1 and s.raw_gathers == 1, s  # the first gather is raw
        compressed_wire = s.wire_bytes - s.raw_bytes // s.gathers
        assert s.payload_bytes <= compressed_wire <= 1.02 * s.payload_bytes, (codec, s)
        assert compressed_wire <= equal, (codec, compressed_wire, equal)
