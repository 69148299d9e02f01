"""The selector's schedule and start-up rules, as pure functions of its inputs (the collective
``agree`` is the identity here: one rank's figures are everyone's)."""

import logging
from types import SimpleNamespace

import pytest
import torch

import ciera.selection as selection
from ciera import CieraConfig
from ciera.cost_model import LinkModel
from ciera.stats import GatherStats

RAW_B = 8 << 20  # an 8 MiB shard per rank, world 2 (the testbed's gather)
LINK = LinkModel(bandwidth_bytes_per_s=320e6, latency_s=0.0)  # raw: 26.2 ms


@pytest.fixture(autouse=True)
def _no_collective(monkeypatch):
    monkeypatch.setattr(selection.cm, "agree", lambda *, values, group=None, device=None: list(values))


def _selector(*, enc_s: float, dec_s: float, wire_ratio: float = 0.177, config=None):
    """One delta candidate whose start-up probe says ``enc_s`` / ``dec_s`` per shard."""
    codec = SimpleNamespace(raw_bytes=RAW_B)
    sel = selection.Selector(codecs={"delta": codec}, config=config or CieraConfig(selection="auto"),
                             world=2, group=None, device="cpu", link=LINK,
                             speeds={"delta": (enc_s / RAW_B, dec_s / RAW_B)}, name="b0")
    return sel, (lambda name, prev: int(wire_ratio * RAW_B))


def _run(sel, probe, gathers: int, real_enc_s: float, real_dec_s: float):
    """Drive ``gathers`` gathers; a compressed gather costs the real codec seconds given."""
    stats, current, modes = GatherStats(codec="raw"), None, []
    shard = torch.zeros(4)
    for i in range(gathers):
        sw = sel.before_gather(i, warmup_left=0, shard=shard, current=current, probe=probe,
                               stats=lambda: GatherStats(**{**stats.__dict__}))
        if sw is not None:
            current = sw.codec
        if current is not None:
            stats.compressed_gathers += 1
            stats.encode_s += real_enc_s
            stats.decode_s += real_dec_s
        modes.append(current)
    return modes


def test_first_decision_needs_the_margin_and_says_raw(caplog):
    """delta predicted 6% faster than raw on the start-up probe alone (the 2x1 10 Gbit/s testbed's
    case, where it then ran 40% slower): not enough to leave raw; the log says raw and why."""
    sel, probe = _selector(enc_s=0.0105, dec_s=0.0085)  # 19.0 ms + wire 4.6 ms = 23.6 < 26.2 ms raw
    with caplog.at_level(logging.INFO, logger="ciera.selection"):
        modes = _run(sel, probe, 6, 0.0, 0.0)
    assert sel.decision.times["delta"] < sel.decision.raw_s  # it was predicted faster...
    assert modes == [None] * 6  # ...but not by the hysteresis margin
    assert [r.getMessage() for r in caplog.records] == [f"b0: selection -> raw ({sel.decision.reason})"]
    assert "keep raw: delta" in sel.decision.reason


def test_compressing_on_the_probe_is_rechecked_soon_on_real_timings(caplog):
    """The probe says delta is twice as fast; the real gathers say it is slower than raw: the
    early re-check (EARLY_RECHECK gathers later, not reevaluate_interval) goes back to raw, the
    real timings replacing the probe's."""
    sel, probe = _selector(enc_s=0.004, dec_s=0.003)  # 7 + 4.6 ms vs raw 26.2 ms
    with caplog.at_level(logging.INFO, logger="ciera.selection"):
        modes = _run(sel, probe, 12, real_enc_s=0.018, real_dec_s=0.013)
    first = CieraConfig().warmup_gathers
    recheck = first + selection.EARLY_RECHECK
    assert CieraConfig().reevaluate_interval > selection.EARLY_RECHECK
    assert modes[:first] == [None] * first and set(modes[first:recheck]) == {"delta"}
    assert modes[recheck:] == [None] * (len(modes) - recheck), modes
    enc, dec = sel.speeds["delta"]
    assert enc.value == pytest.approx(0.018 / RAW_B) and dec.value == pytest.approx(0.013 / RAW_B)
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2 and msgs[0].startswith("b0: selection -> delta (") and \
        msgs[1].startswith("b0: selection -> raw (raw "), msgs


def test_a_codec_that_really_wins_keeps_the_long_interval():
    """Real timings as good as the probe: still delta after the early re-check, and the decision
    after that comes reevaluate_interval gathers later."""
    sel, probe = _selector(enc_s=0.004, dec_s=0.003)
    modes = _run(sel, probe, 12, real_enc_s=0.004, real_dec_s=0.003)
    first = CieraConfig().warmup_gathers
    assert set(modes[first:]) == {"delta"} and sel.decisions == 2
    assert sel.decide_at == first + selection.EARLY_RECHECK + CieraConfig().reevaluate_interval


def test_codec_auto_under_always_still_picks_a_codec_first():
    """selection='always', codec='auto': no raw incumbent at the first decision."""
    sel, probe = _selector(enc_s=0.0105, dec_s=0.0085, config=CieraConfig(selection="always", codec="auto"))
    modes = _run(sel, probe, 4, 0.0, 0.0)
    assert modes[CieraConfig().warmup_gathers:] == ["delta"] * (4 - CieraConfig().warmup_gathers)


def _decision_gathers(sel, probe, gathers: int) -> list[int]:
    before = []
    for i in range(gathers):
        n = sel.decisions
        sel.before_gather(i, warmup_left=0, shard=torch.zeros(4), current=None, probe=probe,
                          stats=lambda: GatherStats(codec="raw"))
        if sel.decisions > n:
            before.append(i)
    return before


def test_raw_that_wins_outright_backs_off_its_rechecks():
    """On a link where the codec work alone exceeds the raw gather (one host's memcpy), each
    re-decision doubles the interval up to MAX_BACKOFF x reevaluate_interval, so the probes' cost
    (a shard copy and one encode per candidate) fades; a near miss keeps the plain interval."""
    cfg = CieraConfig(selection="auto", reevaluate_interval=4)
    sel, probe = _selector(enc_s=0.020, dec_s=0.015, config=cfg)  # 35 ms of codec work vs 26.2 ms raw
    at = _decision_gathers(sel, probe, 2 + 4 * (2 + 4 + 8 + 16 + 16 + 16))
    w = cfg.warmup_gathers
    assert at == [w, w + 8, w + 24, w + 56, w + 120, w + 184, w + 248], at
    assert sel.backoff == selection.MAX_BACKOFF == 16 and sel.decision.choice == "raw"

    near, probe = _selector(enc_s=0.012, dec_s=0.010, config=cfg)  # 22 ms + wire: loses, not outright
    at = _decision_gathers(near, probe, 2 + 4 * 5)
    assert near.decision.choice == "raw" and near.backoff == 1
    assert at == [w + 4 * k for k in range(6)], at
