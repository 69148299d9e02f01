"""The gather's CUDA stream policy, checked on CPU: ``ciera.gather``'s device branch runs on CPU
tensors under a recording fake of ``torch.cuda`` (:mod:`fake_streams`), on two gloo ranks, and
every cross-stream use must be ordered by a recorded wait and kept alive by ``record_stream``.

Scenarios: ``zero1`` (the distributed optimizer: prepare, start and wait on the default stream),
``split`` (prepared after the optimizer step on the default stream, launched on another), ``fsdp2``
(prepared and launched on FSDP2's all-gather stream, waited on the default one)."""

import os

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

pytestmark = pytest.mark.distributed

SHARD, STEPS = 2048, 12
REGROW = (5, 8)
SCENARIOS = ("zero1", "fsdp2")


def _policy_worker(rank, world, cases):
    os.environ["CIERA_NATIVE"] = "0"  # the C codecs' reads and writes are invisible to the recorder
    import ciera.agreement as agreement_mod
    import ciera.gather as gather_mod
    from ciera import CieraAllGather, CieraConfig
    from ciera.codecs import as_bits
    from ciera.native import _lib
    from ciera.testing.trajectory import AdamTrajectory
    from fake_streams import StreamRecorder

    _lib._load.cache_clear()
    results = {}
    for scenario, broken in cases:
        mp = pytest.MonkeyPatch()
        gather_mod.side_stream.cache_clear()
        try:
            rec = StreamRecorder(mp)
            mp.setattr(gather_mod, "_uses_streams", lambda device: True)
            if broken:  # the policy's two orderings removed: the recorder must see it
                mp.setattr(CieraAllGather, "_order_launch", lambda self: None)
                mp.setattr(CieraAllGather, "_order_release", lambda self: None)
            for mod, name in ((gather_mod, "all_gather_into"), (gather_mod, "all_gather_uneven"),
                              (agreement_mod, "all_gather_into")):
                real = getattr(mod, name)
                mp.setattr(mod, name, lambda out, inp, *a, _real=real, _name=name, **k: rec.collective(
                    lambda: _real(out, inp, *a, **k), reads=[inp], writes=[out], name=_name))
            results[scenario, broken] = _run(rec, rank, world, scenario, CieraAllGather, CieraConfig, as_bits,
                                     AdamTrajectory)
        finally:
            mp.undo()
            gather_mod.side_stream.cache_clear()
    return results


def _run(rec, rank, world, scenario, CieraAllGather, CieraConfig, as_bits, AdamTrajectory):
    traj = AdamTrajectory(numel=SHARD, dtype=torch.bfloat16, lr=1e-4, seed=rank)
    grown, mismatches = set(), 0
    with rec:
        buf = torch.zeros(SHARD * world, dtype=torch.bfloat16)
        gather = CieraAllGather(buf, config=CieraConfig(codec="exponent_reuse", selection="always"), name="b0")
        for t, label in ((buf, "bucket"), (gather._send, "send"), (gather._needed, "needed"),
                         (gather._offsets, "offsets"), (gather._rows, "rows")):
            rec.label(t, label)
        ag = torch.cuda.Stream()  # FSDP2's all-gather stream, or any launch stream
        for step in range(STEPS):
            x = traj.step()
            buf.view(world, -1)[rank].copy_(x)  # the optimizer, on the default stream
            if scenario != "zero1":  # the caller orders its launch stream after the shard's writer
                ag.wait_stream(rec.default)  # (FSDP2's copy-in does), as for a plain all-gather
            if scenario == "fsdp2":
                with torch.cuda.stream(ag):
                    handle = gather.start()
            elif scenario == "split":  # prepared after that: the launch must wait for the encode itself
                gather.prepare()
                with torch.cuda.stream(ag):
                    handle = gather.start()
            else:
                handle = gather.start()
            handle.wait()
            if gather._recv.numel():
                rec.label(gather._recv, f"recv#{len(grown)}")
                grown.add(gather._recv.data_ptr())
            if step in REGROW:  # the next agreement replaces the receive buffer, as a growth does
                gather._recv = gather._recv[:0]
            if isinstance(gather._state, torch.Tensor):
                rec.label(gather._state, "sender state")
            with _disable_current_modes():
                ref = torch.empty_like(buf)
                dist.all_gather_into_tensor(ref, x)
                mismatches += not torch.equal(as_bits(buf), as_bits(ref))
        compressed = gather.stats.compressed_gathers
    return {"violations": rec.violations, "unrecorded": rec.unrecorded(), "recv_sizes": sorted(grown),
            "mismatches": mismatches, "compressed": compressed}


CASES = tuple((s, False) for s in (*SCENARIOS, "split")) + (("split", True), ("fsdp2", True))


@pytest.fixture(scope="module")
def recorded():
    """Every case on two ranks, in one spawn: ``[rank]{(scenario, broken): result}``."""
    from ciera.testing import run_on_ranks

    return run_on_ranks(_policy_worker, world=2, args=(CASES,), timeout_s=120)


def test_every_cross_stream_use_is_ordered_and_kept_alive(recorded):
    for rank, by_case in enumerate(recorded):
        for scenario in SCENARIOS:
            r = by_case[scenario, False]
            assert r["mismatches"] == 0 and r["compressed"] >= STEPS // 2, (scenario, r["compressed"])
            assert len(r["recv_sizes"]) == 1 + len(REGROW), f"{scenario}: receive buffers {r['recv_sizes']}"
            assert r["violations"] == [], (scenario, rank, r["violations"][:5])
            assert r["unrecorded"] == [], (scenario, rank, r["unrecorded"])


def test_a_launch_on_another_stream_waits_for_a_raw_agreement(recorded):
    for by_case in recorded:
        assert by_case["split", False]["violations"] == []


def test_the_recorder_sees_a_gather_without_the_policy(recorded):
    """The same runs with the launch and decode orderings removed: the recorder must object (the
    send buffer read on the launch stream before its encode is waited for; a receive buffer used
    on the decode stream without record_stream)."""
    split, fsdp2 = recorded[0]["split", True], recorded[0]["fsdp2", True]
    assert any("reads send" in v for v in split["violations"]), split["violations"]
    assert any(u.startswith("recv#") for u in fsdp2["unrecorded"]), fsdp2["unrecorded"]
