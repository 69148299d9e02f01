"""The gather's phases (ciera.gather.Phase): every legal move works, every illegal one raises naming
the phase, and the branch that guards a codec mismatch raises its own error."""

import pytest
import torch

from ciera import CieraAllGather, CieraConfig
from ciera.agreement import Plan
from ciera.gather import _TRANSITIONS, Phase
from ciera.testing import run_on_ranks

pytestmark = pytest.mark.distributed


def test_transition_table_covers_every_phase_and_returns_to_idle():
    assert set(_TRANSITIONS) == set(Phase)
    for phase in Phase:  # every phase can get back to IDLE
        seen, todo = set(), [phase]
        while todo:
            p = todo.pop()
            seen.add(p)
            todo += [q for q in _TRANSITIONS[p] if q not in seen]
        assert Phase.IDLE in seen


def _walk(rank, world):
    buf = torch.randn(256 * world, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    g = CieraAllGather(buf, config=CieraConfig(codec="exponent_reuse", selection="always", warmup_gathers=1))
    seen = []

    def expect_error(call, match):
        with pytest.raises(RuntimeError, match=match):
            call()
        seen.append(match)

    assert g.phase is Phase.IDLE
    expect_error(lambda: g.apply(Plan(raw=True)), "apply\\(\\) is not allowed while the gather is idle")
    g.start().wait()  # idle -> proposed -> agreed -> in flight -> idle (warmup: raw)
    assert g.phase is Phase.IDLE
    buf.view(world, -1)[rank].mul_(1.01)  # mantissas change: compresses
    g.prepare()
    assert g.phase is Phase.AGREED and not g.plan.raw
    expect_error(lambda: CieraAllGather.prepare_many([g]), "already prepared")
    expect_error(lambda: g.propose(), "propose\\(\\) is not allowed while the gather is agreed")
    h = g.start()
    assert g.phase is Phase.IN_FLIGHT
    expect_error(lambda: g.start(), "previous gather is not waited on")
    expect_error(lambda: g.rebind(torch.zeros_like(buf)), "rebind\\(\\) called while a gather is in flight")
    h.wait()
    h.wait()  # idempotent
    assert g.phase is Phase.IDLE
    # agreed -> idle on invalidate(): the stale plan is dropped, the next gather is raw
    buf.view(world, -1)[rank].mul_(1.01)  # mantissas change: compresses
    g.prepare()
    g.invalidate()
    assert g.phase is Phase.IDLE and g.plan is None
    g.start().wait()
    # the "cannot happen" branch: a compressed plan for a codec this rank did not encode
    buf.view(world, -1)[rank].mul_(1.01)  # mantissas change: compresses
    g.propose()
    expect_error(lambda: g.apply(Plan(raw=False, codec_name="delta", size=64)),
                 "agreed codec delta but rank \\d proposed exponent_reuse")
    return seen


def test_every_illegal_move_raises_and_names_the_phase():
    for seen in run_on_ranks(_walk, world=2):
        assert len(seen) == 6
