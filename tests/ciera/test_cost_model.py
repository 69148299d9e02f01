"""ciera.cost_model: link models, decide() with hysteresis, Ewma, fitting, rank-identical measurement."""

import dataclasses
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ciera.codecs import make_codec
from ciera.cost_model import (
    CodecEstimate, CodecSpeed, Decision, Ewma, LinkModel, agreement_time, decide, fit_latency_bandwidth,
    predict_compressed,
)
from ciera.measure import agree, measure_codec_speed, measure_link
from ciera.testing import free_port

GB = 1e9
FAST_NVLINK = LinkModel(bandwidth_bytes_per_s=300 * GB, latency_s=5e-6)
SLOW_ETH = LinkModel(bandwidth_bytes_per_s=1 * GB, latency_s=50e-6)


def er(ratio, enc=50 * GB, dec=50 * GB, name="exponent_reuse"):
    return CodecEstimate(name, wire_ratio=ratio, speed=CodecSpeed(encode_bytes_per_s=enc, decode_bytes_per_s=dec))


# -- links ---------------------------------------------------------------------------------------
def test_ring_time_by_hand():
    link = LinkModel(bandwidth_bytes_per_s=1e9, latency_s=1e-5)
    # 3 steps of (10 us + 1 MB / 1 GB/s = 1 ms)
    assert link.allgather_time(bytes_per_rank=1e6, world=4) == pytest.approx(3 * (1e-5 + 1e-3))
    assert link.allgather_time(bytes_per_rank=1e6, world=1) == 0.0


def test_validation_messages_show_numbers():
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s=0"):
        LinkModel(bandwidth_bytes_per_s=0)
    with pytest.raises(ValueError, match="wire_ratio=0"):
        er(0.0)
    with pytest.raises(ValueError, match="baseline"):
        er(0.5, name="raw")
    with pytest.raises(ValueError, match="world=0"):
        decide(raw_bytes_per_rank=1, world=0, link=FAST_NVLINK, candidates=[])


# -- decide ----------------------------------------------------------------------------------------
def test_fast_link_slow_codec_goes_raw():
    d = decide(raw_bytes_per_rank=16 << 20, world=8, link=FAST_NVLINK, candidates=[er(0.55, enc=5 * GB, dec=5 * GB)])
    assert isinstance(d, Decision) and d.choice == "raw" and not d.compress
    assert d.times["exponent_reuse"] > d.times["raw"]
    assert d.raw_s == d.predicted_s


def test_slow_link_low_change_rate_compresses():
    d = decide(raw_bytes_per_rank=16 << 20, world=8, link=SLOW_ETH, candidates=[er(0.55)])
    assert d.choice == "exponent_reuse" and d.compress
    p = d.predictions[1]
    # evidence: the breakdown adds up, and the bytes are carried
    assert p.total_s == pytest.approx(p.encode_s + p.comm_s + p.decode_s)
    assert p.wire_bytes_per_rank == pytest.approx(0.55 * (16 << 20))
    assert p.decode_s == pytest.approx(7 * (16 << 20) / (50 * GB))
    assert d.raw_bytes_per_rank == 16 << 20 and d.world == 8


def test_high_change_rate_goes_raw_even_on_slow_link():
    # a payload nearly as large as the shard cannot pay for its encode and decode
    d = decide(raw_bytes_per_rank=16 << 20, world=8, link=SLOW_ETH, candidates=[er(0.99, enc=2 * GB, dec=2 * GB)])
    assert d.choice == "raw"


def test_best_of_several_candidates_and_ties_to_raw():
    cands = [er(0.7, name="exponent_reuse"), er(0.4, name="delta")]
    d = decide(raw_bytes_per_rank=1 << 22, world=4, link=SLOW_ETH, candidates=cands)
    assert d.choice == "delta" and [p.name for p in d.predictions] == ["raw", "exponent_reuse", "delta"]
    # world 1: nothing moves, everything costs 0 -> raw
    assert decide(raw_bytes_per_rank=1 << 22, world=1, link=SLOW_ETH, candidates=cands).choice == "raw"
    with pytest.raises(ValueError, match="duplicate"):
        decide(raw_bytes_per_rank=1, world=2, link=SLOW_ETH, candidates=[er(0.5), er(0.6)])


def test_overlapped_encode_removes_encode_from_critical_path():
    c = er(0.6, enc=1 * GB, dec=100 * GB)
    a = decide(raw_bytes_per_rank=8 << 20, world=4, link=SLOW_ETH, candidates=[c])
    b = decide(raw_bytes_per_rank=8 << 20, world=4, link=SLOW_ETH, candidates=[c], overlapped_encode=True)
    assert b.times["exponent_reuse"] == pytest.approx(a.times["exponent_reuse"] - (8 << 20) / GB)


def _break_even_ratio(link, raw, world, speed):
    """wire_ratio at which the compressed prediction equals raw (bisection on a monotone function)."""
    lo, hi = 0.0, 1.0
    raw_t = link.allgather_time(bytes_per_rank=raw, world=world)
    for _ in range(60):
        mid = (lo + hi) / 2
        t = predict_compressed(raw_bytes_per_rank=raw, world=world, link=link,
                               estimate=CodecEstimate("x", wire_ratio=max(mid, 1e-9), speed=speed)).total_s
        lo, hi = (mid, hi) if t < raw_t else (lo, mid)
    return lo


def test_hysteresis_prevents_flapping():
    speed = CodecSpeed(encode_bytes_per_s=20 * GB, decode_bytes_per_s=20 * GB)
    raw, world = 4 << 20, 8
    r0 = _break_even_ratio(SLOW_ETH, raw, world, speed)
    # the measured ratio wobbles +-2% around break-even
    wobble = [r0 * (1 + 0.02 * (-1) ** i) for i in range(20)]
    current, switches_h, switches_0, cur0 = None, 0, 0, None
    for r in wobble:
        c = [CodecEstimate("exponent_reuse", wire_ratio=r, speed=speed)]
        d = decide(raw_bytes_per_rank=raw, world=world, link=SLOW_ETH, candidates=c, current=current, hysteresis=0.1)
        switches_h += current is not None and d.choice != current
        current = d.choice
        d0 = decide(raw_bytes_per_rank=raw, world=world, link=SLOW_ETH, candidates=c, current=cur0, hysteresis=0.0)
        switches_0 += cur0 is not None and d0.choice != cur0
        cur0 = d0.choice
    assert switches_h == 0
    assert switches_0 >= 10  # without hysteresis it flaps on every wobble
    # a clear win still switches, and the reason explains a kept decision
    clear = [CodecEstimate("exponent_reuse", wire_ratio=r0 * 0.5, speed=speed)]
    assert decide(raw_bytes_per_rank=raw, world=world, link=SLOW_ETH, candidates=clear, current="raw").choice \
        == "exponent_reuse"
    kept = decide(raw_bytes_per_rank=raw, world=world, link=SLOW_ETH, current="raw", hysteresis=0.1,
                  candidates=[CodecEstimate("exponent_reuse", wire_ratio=r0 * 0.98, speed=speed)])
    assert kept.choice == "raw" and kept.reason.startswith("keep raw")


def test_unknown_current_is_ignored():
    d = decide(raw_bytes_per_rank=16 << 20, world=8, link=SLOW_ETH, candidates=[er(0.55)], current="gone")
    assert d.choice == "exponent_reuse"


def test_decision_is_frozen_and_deterministic():
    kw = dict(raw_bytes_per_rank=1 << 20, world=4, link=SLOW_ETH, candidates=[er(0.5), er(0.45, name="delta")])
    a, b = decide(**kw), decide(**kw)
    assert a == b
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.choice = "raw"


def test_uses_codec_size_accounting():
    # an exponent_reuse payload can never be smaller than its fixed part: sign|mantissa + bitmap
    codec = make_codec("exponent_reuse", dtype=torch.bfloat16, numel=1 << 20)
    floor = codec.fixed_bytes / codec.raw_bytes
    assert 0.5 < floor < 0.52
    d = decide(raw_bytes_per_rank=codec.raw_bytes, world=8, link=SLOW_ETH, candidates=[er(floor)])
    assert d.predictions[1].wire_bytes_per_rank == pytest.approx(codec.fixed_bytes)


# -- Ewma and fitting ------------------------------------------------------------------------------
def test_ewma():
    e = Ewma(alpha=0.5)
    assert e.value is None and e.get(3.0) == 3.0
    e = e.update(4.0)
    assert e.value == 4.0 and e.count == 1
    e = e.update(2.0).update(2.0)
    assert e.value == pytest.approx(2.5) and e.count == 3
    with pytest.raises(ValueError, match="alpha=0"):
        Ewma(alpha=0.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.value = 1.0


def test_fit_recovers_model():
    truth = LinkModel(bandwidth_bytes_per_s=2e9, latency_s=3e-5)
    sizes = [1 << 12, 1 << 16, 1 << 20, 1 << 22]
    times = [truth.allgather_time(bytes_per_rank=s, world=4) for s in sizes]
    fit = fit_latency_bandwidth(sizes=sizes, times=times, world=4)
    assert fit.bandwidth_bytes_per_s == pytest.approx(2e9, rel=1e-9)
    assert fit.latency_s == pytest.approx(3e-5, rel=1e-6)
    # noise that makes the intercept negative: latency clamps to 0, bandwidth stays positive
    fit = fit_latency_bandwidth(sizes=[1, 2, 3], times=[0.0, 1e-9, 5e-9], world=2)
    assert fit.latency_s == 0.0 and fit.bandwidth_bytes_per_s > 0


def test_measure_codec_speed_smoke():
    codec = make_codec("exponent_reuse", dtype=torch.bfloat16, numel=1 << 14, backend="torch")
    s = measure_codec_speed(codec=codec, repeats=1)
    assert s.encode_bytes_per_s > 0 and s.decode_bytes_per_s > 0 and math.isfinite(s.encode_bytes_per_s)


# -- rank-identical decisions on gloo ------------------------------------------------------------------
def _worker(rank, world, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        link = measure_link(sizes=(1 << 10, 1 << 14, 1 << 17), repeats=2)
        codec = make_codec("exponent_reuse", dtype=torch.bfloat16, numel=1 << 12, backend="torch")
        speed = measure_codec_speed(codec=codec, repeats=1, seed=rank)  # deliberately rank-dependent
        enc_s, dec_s = agree(values=[1 / speed.encode_bytes_per_s, 1 / speed.decode_bytes_per_s])
        speed = CodecSpeed(encode_bytes_per_s=1 / enc_s, decode_bytes_per_s=1 / dec_s)
        ratio = agree(values=[0.55 + 0.01 * rank])[0]
        d = decide(raw_bytes_per_rank=codec.raw_bytes, world=world, link=link,
                   candidates=[CodecEstimate("exponent_reuse", wire_ratio=ratio, speed=speed)])
        q.put((rank, link, d))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_decisions_identical_across_gloo_ranks():
    world = 2
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    out = [q.get(timeout=60) for _ in range(world)]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    (_, link0, d0), (_, link1, d1) = sorted(out, key=lambda x: x[0])
    assert link0 == link1 and d0 == d1
    assert d0.predictions[1].wire_bytes_per_rank == pytest.approx(0.56 * d0.raw_bytes_per_rank)


# -- the size agreement ----------------------------------------------------------------------------
def test_agreement_is_charged_per_bucket_and_shared():
    one = agreement_time(link=SLOW_ETH, world=8)
    assert one == pytest.approx(SLOW_ETH.allgather_time(bytes_per_rank=24, world=8))
    # 10 buckets share one collective of 240 B per rank: each pays a tenth of it
    assert agreement_time(link=SLOW_ETH, world=8, buckets=10) == pytest.approx(
        SLOW_ETH.allgather_time(bytes_per_rank=240, world=8) / 10)
    plain = predict_compressed(raw_bytes_per_rank=1 << 20, world=8, link=SLOW_ETH, estimate=er(0.5))
    charged = predict_compressed(raw_bytes_per_rank=1 << 20, world=8, link=SLOW_ETH, estimate=er(0.5),
                                 agreement_s=one)
    assert charged.total_s == pytest.approx(plain.total_s + one) and charged.comm_s == pytest.approx(plain.comm_s + one)


def test_agreement_cost_tips_a_tiny_bucket_to_raw():
    """A bucket so small that its payload saving is below the agreement's latency goes raw."""
    small = dict(raw_bytes_per_rank=4096, world=8, link=SLOW_ETH, candidates=[er(0.5, enc=1e15, dec=1e15)])
    assert decide(**small).choice == "exponent_reuse"
    assert decide(**small, agreement_s=agreement_time(link=SLOW_ETH, world=8)).choice == "raw"


def test_step_shape_counts_a_steps_gathers_and_what_replays_cost():
    from ciera.cost_model import StepShape, predict_compressed, predict_raw

    link = LinkModel(bandwidth_bytes_per_s=1e8, latency_s=1e-4)
    est = CodecEstimate(name="delta", wire_ratio=0.2,
                        speed=CodecSpeed(encode_bytes_per_s=1e9, decode_bytes_per_s=2e9))
    kw = dict(raw_bytes_per_rank=4e6, world=4, link=link)
    one = predict_compressed(**kw, estimate=est)
    raw4 = predict_raw(**kw, shape=StepShape(gathers=4))
    assert raw4.total_s == pytest.approx(4 * predict_raw(**kw).total_s)
    # values cache: replays send nothing, raw or compressed, so four gathers cost one fresh gather
    # and its one agreement (replays reuse the plan)
    vals = predict_compressed(**kw, estimate=est, shape=StepShape(gathers=4, replays_send=False), agreement_s=1e-5)
    assert vals.total_s == pytest.approx(one.total_s + 1e-5)
    assert predict_raw(**kw, shape=StepShape(gathers=4, replays_send=False)).total_s == pytest.approx(
        predict_raw(**kw).total_s)
    # exponent cache: every gather sends and decodes, the encode happens once, plus the cache passes
    exps = predict_compressed(**kw, estimate=est, shape=StepShape(gathers=4, cache_passes=2))
    dec1 = 3 * 4e6 / 2e9
    assert exps.total_s == pytest.approx(one.encode_s + 4 * (one.comm_s + dec1) + 4 * 2 * 4 * 4e6 / 2e9)
    with pytest.raises(ValueError, match="gathers=0"):
        StepShape(gathers=0)
