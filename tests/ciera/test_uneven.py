"""Per-rank payload sizes (ciera.comm.all_gather_uneven, Plan.sizes) on skewed layouts: one rank's
shard changes a lot (router, norms), the others' little (experts). Bit for bit against the plain
all-gather after every gather; the wire within 2% of the sum of the payloads."""

import pytest
import torch
import torch.distributed as dist

from ciera import CieraAllGather, CieraConfig
from ciera.codecs import as_bits
from ciera.comm import all_gather_uneven
from ciera.testing import run_on_ranks
from ciera.testing.trajectory import AdamTrajectory, adversarial_step

pytestmark = pytest.mark.distributed


def _ring_worker(rank, world):
    sizes = [(7 * r + 3) % 11 for r in range(world)]  # a zero size among them at some worlds
    out = torch.full((sum(sizes),), -1, dtype=torch.int32)
    all_gather_uneven(out, torch.full((sizes[rank],), rank, dtype=torch.int32), sizes=sizes).wait()
    return out.tolist() == [r for r in range(world) for _ in range(sizes[r])]


def _neighbours_worker(rank, world):
    """Off NCCL the blocks travel a ring: a rank sends only to the next rank and receives only from
    the previous one, ``world - 1`` steps, the first posted before ``wait()``."""
    posted = []
    real = dist.batch_isend_irecv

    def record(ops):
        posted.append(sorted(("send" if op.op is dist.isend else "recv", op.peer) for op in ops))
        return real(ops)

    dist.batch_isend_irecv = record
    try:
        sizes = [3 + r for r in range(world)]
        out = torch.full((sum(sizes),), -1, dtype=torch.int32)
        work = all_gather_uneven(out, torch.full((sizes[rank],), rank, dtype=torch.int32), sizes=sizes)
        before = len(posted)
        work.wait()
    finally:
        dist.batch_isend_irecv = real
    ok = out.tolist() == [r for r in range(world) for _ in range(sizes[r])]
    ring = [("recv", (rank - 1) % world), ("send", (rank + 1) % world)]
    return ok and before == 1 and posted == [ring] * (world - 1)


@pytest.mark.parametrize("world", [2, 4])
def test_uneven_all_gather_is_a_ring_off_nccl(world):
    assert all(run_on_ranks(_neighbours_worker, world=world))


@pytest.mark.parametrize("world", [2, 3, 5])
def test_uneven_all_gather_places_every_block(world):
    assert all(run_on_ranks(_ring_worker, world=world))



def _in_flight_worker(rank, world):
    """Two gathers in flight at once (waited in reverse order), then one on a subgroup whose
    group ranks differ from the global ones: every block in place, the works asynchronous."""
    outs, works = [], []
    for salt in (1, 2):
        sizes = [(5 * r + salt) % 7 for r in range(world)]
        out = torch.full((sum(sizes),), -1, dtype=torch.int32)
        works.append(all_gather_uneven(out, torch.full((sizes[rank],), 10 * salt + rank, dtype=torch.int32),
                                       sizes=sizes))
        outs.append((out, sizes, salt))
    for w in reversed(works):
        w.wait()
    ok = all(out.tolist() == [10 * salt + r for r in range(world) for _ in range(sizes[r])] for out, sizes, salt in outs)
    members = list(range(1, world))
    sub = dist.new_group(ranks=members)
    if rank in members:
        me = members.index(rank)
        sizes = [3 + 2 * i for i in range(len(members))]
        out = torch.full((sum(sizes),), -1, dtype=torch.int32)
        all_gather_uneven(out, torch.full((sizes[me],), rank, dtype=torch.int32), sizes=sizes, group=sub).wait()
        ok = ok and out.tolist() == [m for i, m in enumerate(members) for _ in range(sizes[i])]
    return ok


@pytest.mark.parametrize("world", [3, 4])
def test_uneven_all_gathers_in_flight_together_and_on_a_subgroup(world):
    assert all(run_on_ranks(_in_flight_worker, world=world))

def _skewed_worker(rank, world, codec, steps):
    n = 2048
    busy = rank == world - 1  # router and norms: a high learning rate, every few steps adversarial
    traj = AdamTrajectory(numel=n, lr=3e-3 if busy else 1e-5, seed=rank)
    gen = torch.Generator().manual_seed(rank)
    buf = torch.zeros(world * n, dtype=torch.bfloat16)
    ref = torch.empty_like(buf)
    g = CieraAllGather(buf, config=CieraConfig(codec=codec, selection="always"), name=f"skewed-{codec}")
    uneven = 0
    for step in range(steps):
        x = traj.step()
        if busy and step % 4 == 3:
            x = adversarial_step(x, kind="sign_flip", gen=gen, fraction=0.1)
        buf.view(world, n)[rank].copy_(x)
        g.prepare()
        uneven += bool(g.plan.sizes)
        g.start().wait()
        dist.all_gather_into_tensor(ref, x)
        assert torch.equal(as_bits(buf), as_bits(ref)), f"rank {rank} step {step}"
    return g.stats, uneven


@pytest.mark.parametrize("world", [4, 8, pytest.param(16, marks=pytest.mark.slow)])
def test_skewed_layouts_send_the_sum_of_the_payloads(world):
    steps = 12
    results = run_on_ranks(_skewed_worker, world=world, args=("delta", steps))
    for s, uneven in results:
        assert uneven >= steps - 2, "per-rank sizes chosen after warmup"
        compressed_wire = s.wire_bytes - s.raw_gathers * s.raw_bytes // s.gathers
        assert s.payload_bytes <= compressed_wire <= 1.02 * s.payload_bytes, s
    assert len({(s.wire_bytes, s.payload_bytes) for s, _ in results}) == 1, "ranks diverged"
