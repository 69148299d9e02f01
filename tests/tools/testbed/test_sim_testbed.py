"""tools/testbed/sim_testbed.py and bench_cluster's report on constructed measurements (no testbed)."""

import pytest

from tools.testbed.bench_cluster import report
from tools.testbed.sim_testbed import link_for, predict


def _cfg():
    mode = dict(ms=20.0, raw_bytes=8 << 20, wire_bytes=4 << 20, gathers=4, raw_gathers=0, overflows=0,
                encode_ms=5.0, decode_ms=5.0, codec="exponent_reuse")
    auto = dict(mode, ms=10.6, wire_bytes=8 << 20, raw_gathers=4, encode_ms=0.0, decode_ms=0.0, codec="raw")
    return {"layout": "2x1", "hosts": 2, "nproc": 1, "rate": "1gbit", "link_probe_bytes_per_s": 1e8,
            "link_latency_s": 0.0, "model": {"iters": 9},
            "gather": {"world": 2, "numel": 1 << 20, "plain_ms": 10.5, "bit_exact_steps": 8, "steps": 4,
                       "modes": {"exponent_reuse": mode, "auto": auto}},
            "train": [
                {"mode": "baseline", "overlap": False, "ms": 100.0, "sha256": "a" * 64, "losses": ["1", "0x1p0"],
                 "raw_mb": None, "wire_mb": None},
                # 10 gathers of a 2 MB bucket: 1 MB per rank per iteration, half of it on the wire
                {"mode": "exponent_reuse", "overlap": False, "ms": 105.0, "sha256": "a" * 64,
                 "losses": ["1", "0x1p0"], "raw_mb": 20.0, "wire_mb": 10.0},
                {"mode": "delta", "overlap": False, "ms": 99.0, "sha256": "b" * 64, "losses": ["1", "0x1p0"],
                 "raw_mb": 20.0, "wire_mb": 5.0},
            ]}


def test_gather_prediction_hand_computed():
    sim = predict(_cfg())
    shard = (1 << 20) // 2 * 2  # bf16 bytes per rank
    assert sim["gather"]["plain_ms"] == pytest.approx(shard / 1e8 * 1e3)
    # encode 5 ms + half the bytes on the link + the 24-byte size agreement + decode 5 ms (speeds
    # derived from those timers)
    assert sim["gather"]["exponent_reuse"] == pytest.approx(5 + shard / 2 / 1e8 * 1e3 + 24 / 1e8 * 1e3 + 5)
    assert sim["gather"]["auto"] == sim["gather"]["plain_ms"]  # auto sent raw throughout


def test_sync_training_prediction_hand_computed():
    sim = predict(_cfg())
    shard = 20e6 / 10 / 2
    raw_ms = shard / 1e8 * 1e3
    # the codec's speeds (bytes/s) from the gather bench, applied to the training bucket
    enc_ms = shard / ((1 << 20) / 5e-3) * 1e3
    dec_ms = shard / ((1 << 20) / 5e-3) * 1e3
    agree_ms = 24 / 1e8 * 1e3
    assert sim["train"]["exponent_reuse:sync"] == pytest.approx(100 - raw_ms + enc_ms + raw_ms / 2 + agree_ms + dec_ms)
    assert "delta:sync" not in sim["train"]  # no codec speeds measured for it
    # with the baseline's own params-all-gather timer, that measured figure is taken out instead of
    # the predicted raw gathers (the link as it was during the runs, not at the probe)
    cfg = _cfg()
    cfg["train"][0]["timers_ms"] = {"params-all-gather": 14.0}
    timed = predict(cfg)
    assert timed["train"]["exponent_reuse:sync"] == pytest.approx(sim["train"]["exponent_reuse:sync"] + raw_ms - 14.0)


def test_report_flags_a_mismatch():
    cfg = _cfg()
    cfg["sim"] = predict(cfg)
    md = report([cfg], {"date": "d", "machine": "m", "command": "c"})
    rows = {line.split("|")[4].strip(): line for line in md.splitlines() if line.startswith("| 2x1 | 1gbit | sync")}
    assert rows["exponent_reuse"].rstrip().endswith("| yes | 104.5 |"), rows["exponent_reuse"]
    assert "| NO |" in rows["delta"]
    assert "0.95x" in rows["exponent_reuse"]


def test_baseline_predicted_from_another_rate_and_collated(tmp_path):
    """The baseline at a slow link = the baseline at a fast one + the change in the predicted
    all-gather and reduce-scatter (same bytes) on each configuration's fitted gloo link; collate
    joins a gather-only and a training-only run of one configuration into one report."""
    import json

    from tools.testbed.collate import main as collate
    from tools.testbed.sim_testbed import predict_baseline

    slow, fast = _cfg(), _cfg()
    slow["gather"]["gloo_link"] = {"bandwidth_bytes_per_s": 1e8, "latency_s": 0.0}
    fast["gather"]["gloo_link"] = {"bandwidth_bytes_per_s": 1e9, "latency_s": 0.0}
    fast["rate"] = "10gbit"
    shard = 20e6 / 10 / 2
    want = 100 + 2 * (shard / 1e8 - shard / 1e9) * 1e3
    assert predict_baseline(slow, fast, overlap=False) == pytest.approx(want)
    assert predict_baseline(slow, fast, overlap=True) is None  # no overlapped baseline measured

    files = []
    for i, (cfg, part) in enumerate([(slow, "gather"), (slow, "train"), (fast, "train"), (fast, "gather")]):
        r = {k: v for k, v in cfg.items() if k not in ("gather", "train")}
        r.update({"gathers": [cfg["gather"]], "train": []} if part == "gather" else {"train": cfg["train"]})
        f = tmp_path / f"{i}.json"
        f.write_text(json.dumps({"meta": {"date": "d", "machine": "m", "command": f"c{i}"}, "results": [r]}))
        files.append(f)
    assert collate([*map(str, files), "--out-dir", str(tmp_path / "out")]) == 1  # delta's sha256 differs: NO
    md = (tmp_path / "out" / "bench_cluster.md").read_text()
    assert f"| train sync baseline (from the baseline at 10gbit) | 100.0 | {want:.1f} |" in md
    assert (tmp_path / "out" / "bench_cluster.png").stat().st_size > 0


def test_ranks_sharing_cores_use_single_core_speeds_times_the_share():
    """2 hosts x 2 ranks on a 2-core machine: the codec phases and the agreement's steps take
    ranks/cores = 2x, from the single-core speeds of a configuration whose ranks had a core each;
    the sync params-all-gather prediction is one iteration's buckets, each its own gather."""
    from ciera.cost_model import CodecSpeed
    from tools.testbed.sim_testbed import single_core_speeds

    one = _cfg() | {"cores": 2}
    four = _cfg() | {"cores": 2, "nproc": 2, "layout": "2x2"}
    four["gather"] = dict(four["gather"], world=4)
    four["train"] = [dict(t, log_lines=["CIERA all-gather on 2 bucket group(s): ..."]) for t in four["train"]]
    single = single_core_speeds([one, four])["1gbit"]
    assert set(single) == {"exponent_reuse"}  # from the 2x1 configuration only (auto sent raw)
    sim = predict(four, single_core=single)
    shard = (1 << 20) // 4 * 2
    sp: CodecSpeed = single["exponent_reuse"]
    codec_ms = 2 * (shard / sp.encode_bytes_per_s + 3 * shard / sp.decode_bytes_per_s) * 1e3
    link_ms = 3 * shard / 2 / 1e8 * 1e3  # flat ring of 4, half the bytes (TCP-probe link, no latency)
    agree_ms = 2 * 3 * 24 / 1e8 * 1e3
    assert sim["gather"]["exponent_reuse"] == pytest.approx(codec_ms + link_ms + agree_ms)
    assert predict(four)["gather"]["exponent_reuse"] != pytest.approx(sim["gather"]["exponent_reuse"])
    it = 20e6 / 10 / 4  # bytes per rank per iteration, in 2 buckets
    assert sim["train_gather"]["baseline:sync"] == pytest.approx(2 * 3 * it / 2 / 1e8 * 1e3)


def _probe(points, kind="idle"):
    return {"world": 2, "cases": {f"c{b}": {"pattern": kind, "bytes_per_rank": [b], "median_s": t}
                                  for b, t in points}
            | {"seq": {"pattern": "sync", "bytes_per_rank": [1, 2], "median_s": 9.0}}}


def test_measured_link_interpolates_between_probed_sizes():
    from tools.testbed.sim_testbed import MeasuredLink

    link = MeasuredLink(points=((1000, 0.002), (3000, 0.004), (5000, 0.010)))
    assert link.allgather_time(bytes_per_rank=2000, world=2) == pytest.approx(0.003)
    assert link.allgather_time(bytes_per_rank=3000, world=2) == pytest.approx(0.004)
    assert link.allgather_time(bytes_per_rank=7000, world=2) == pytest.approx(0.016)  # last slope
    assert link.allgather_time(bytes_per_rank=400, world=2) == pytest.approx(0.001)  # half the first: floor
    assert link.allgather_time(bytes_per_rank=2000, world=4) == pytest.approx(3 * 0.003)  # ring steps
    with pytest.raises(ValueError, match="increasing"):
        MeasuredLink(points=((2, 1.0), (1, 2.0)))
    with pytest.raises(ValueError, match="world"):
        MeasuredLink(points=((1, 1.0), (2, 2.0)), world=1)


def test_back_to_back_gathers_find_the_shapers_burst_spent():
    """After an idle gap >= refill a gather costs its idle-link time; right after another, its
    fixed cost + what its bytes add past the burst; a shorter gap refills in proportion."""
    from tools.testbed.sim_testbed import MeasuredLink

    pts = ((100, 0.001), (1000, 0.002), (2000, 0.012), (4000, 0.032))
    link = MeasuredLink(points=pts, burst_bytes=1000, refill_s=0.002)
    idle = link.step_time(2000)
    spent = 0.001 + link.step_time(3000) - link.step_time(1000)  # 1 + 22 - 2 ms
    assert spent == pytest.approx(0.021)
    inf = float("inf")
    assert link.sequence_time(bytes_per_rank=[2000], gaps_s=[inf], world=2) == pytest.approx(idle)
    assert link.sequence_time(bytes_per_rank=[2000, 2000], gaps_s=[inf, 0.0], world=2) == pytest.approx(idle + spent)
    half = link.sequence_time(bytes_per_rank=[2000, 2000], gaps_s=[inf, 0.001], world=2)
    assert half == pytest.approx(idle + 0.5 * idle + 0.5 * spent)
    no_burst = MeasuredLink(points=pts)
    assert no_burst.sequence_time(bytes_per_rank=[2000, 2000], gaps_s=[inf, 0.0], world=2) == pytest.approx(2 * idle)


def test_measured_link_from_probe_prefers_idle_singles_and_the_testbeds_burst():
    from tools.testbed.sim_testbed import MeasuredLink, shaper_burst

    both = _probe([(1000, 0.002), (3000, 0.004)])
    both["cases"] |= {"s1000": {"pattern": "sync", "bytes_per_rank": [1000], "median_s": 0.5},
                      "s3000": {"pattern": "sync", "bytes_per_rank": [3000], "median_s": 0.9}}
    link = MeasuredLink.from_probe(both, rate="1gbit")
    assert link.points == ((1000, 0.002), (3000, 0.004))  # the multi-gather case is no point
    assert (link.burst_bytes, link.refill_s) == (262144.0, pytest.approx(262144 / 125e6))
    assert MeasuredLink.from_probe(_probe([(1000, 0.5), (2000, 0.9)], kind="sync")).points == ((1000, 0.5), (2000, 0.9))
    assert shaper_burst("10gbit") == (2.5e6, pytest.approx(0.002))


def test_training_prediction_from_the_probe_the_runs_timers_and_bucket_sizes():
    """Megatron's synchronous gather: bucket groups back to back on the probed link; CIERA: the
    run's own codec timers, one size agreement, each payload gathered after the previous decode."""
    from ciera.cost_model import CodecEstimate
    from tools.testbed.sim_testbed import MeasuredLink, codec_speed, compressed_sequence, raw_sequence

    cfg = _cfg()
    del cfg["gather"]
    cfg["gloo_probe"] = _probe([(16, 1e-4), (1 << 20, 0.01), (4 << 20, 0.05)])
    it = 20e6 / 10 / 2  # 1 MB per rank per iteration
    for t in cfg["train"][1:]:
        t["timers_ms"] = {"params-all-gather": 9.0, "ciera-encode": 2.0, "ciera-decode": 1.0}
        t["log_lines"] = ["CIERA all-gather on 3 bucket group(s): ...",
                          "CIERA dense0.bucket0: selection -> delta (delta 9.0 us vs raw 18.0 us (400000 B/rank, world 2))"]
    sim = predict(cfg)
    link = MeasuredLink.from_probe(cfg["gloo_probe"], rate="1gbit")
    buckets = [400000.0, 300000.0, 300000.0]  # the named one, the rest split equally
    raw = raw_sequence(link, world=2, buckets=buckets)
    assert raw == pytest.approx(link.sequence_time(bytes_per_rank=buckets, gaps_s=[float("inf"), 0, 0], world=2))
    assert sim["train_gather"]["baseline:sync"] == pytest.approx(raw * 1e3)
    est = CodecEstimate("exponent_reuse", wire_ratio=0.5,
                        speed=codec_speed(shard_bytes=it, world=2, encode_ms=2.0, decode_ms=1.0))
    agree = 3 * link.allgather_time(bytes_per_rank=24 * 3, world=2) / 3
    c = compressed_sequence(link, world=2, buckets=buckets, estimate=est) + agree
    wire = link.sequence_time(bytes_per_rank=[b / 2 for b in buckets],
                              gaps_s=[float("inf"), 0.4e-3, 0.3e-3], world=2)  # each decode, 1 ms in all
    assert c == pytest.approx(2e-3 + 1e-3 + wire + agree)
    assert sim["train_gather"]["exponent_reuse:sync"] == pytest.approx(c * 1e3)
    assert sim["train"]["exponent_reuse:sync"] == pytest.approx(100 + (c - raw) * 1e3)
    assert "delta:sync" in sim["train"]  # its own timers: predicted without a gather benchmark


def test_collate_pools_invocations_and_attaches_a_probe(tmp_path):
    import json

    from tools.testbed.collate import attach_probes, pool_train

    cfg = _cfg()
    a, b = (dict(cfg["train"][0], ms=x, ms_runs=[x, x + 2], timers_ms={"params-all-gather": x})
            for x in (100.0, 110.0))
    cfg["train"] = [a, b]
    pool_train(cfg)
    (t,) = cfg["train"]
    assert t["ms_runs"] == [100.0, 102.0, 110.0, 112.0] and t["ms"] == 106.0
    assert t["timers_ms"] == {"params-all-gather": 105.0}
    f = tmp_path / "p.json"
    f.write_text(json.dumps(_probe([(1, 1.0), (2, 2.0)])))
    attach_probes([cfg], [f"2x1@1gbit={f}"])
    assert cfg["gloo_probe"]["world"] == 2
    with pytest.raises(SystemExit, match="no run"):
        attach_probes([cfg], [f"2x2@1gbit={f}"])


def test_link_probe_cases_parse_and_refuse_an_unknown_pattern():
    from tools.testbed.link_probe import parse_case
    from tools.testbed.sim_testbed import probe_cases

    assert parse_case("plain:sync:10,20") == ("plain", "sync", [10, 20])
    with pytest.raises(ValueError, match="pattern"):
        parse_case("x:ring:10")
    assert all(parse_case(c)[1] == "idle" for c in probe_cases())


def test_gathers_started_at_once_in_waves_overlap_encode_decode_and_the_wire():
    """waves >= 1 (the binding's synchronous launch): each wave encoded, agreed after the previous
    wave's payloads, its payloads back to back while the host encodes the next wave; decodes after
    the last launch, each once its payload is in. Never slower than the serial timeline; equal to
    it when the codec is free."""
    from ciera.cost_model import CodecEstimate, CodecSpeed, LinkModel
    from tools.testbed.sim_testbed import compressed_sequence

    link = LinkModel(bandwidth_bytes_per_s=1e8, latency_s=0.0)
    buckets = [1e6] * 4  # 5 ms of wire each at wire ratio 0.5
    est = CodecEstimate("delta", wire_ratio=0.5, speed=CodecSpeed(encode_bytes_per_s=1e9, decode_bytes_per_s=5e8))
    serial = compressed_sequence(link, world=2, buckets=buckets, estimate=est) + 1e-3
    one = compressed_sequence(link, world=2, buckets=buckets, estimate=est, waves=1, agreement_s=1e-3)
    two = compressed_sequence(link, world=2, buckets=buckets, estimate=est, waves=2, agreement_s=1e-3)
    assert serial == pytest.approx(4e-3 + 1e-3 + 4 * 5e-3 + 4 * 2e-3)  # encode, agree, wire, decode in turn
    assert one == pytest.approx(4e-3 + 1e-3 + 4 * 5e-3 + 2e-3)  # only the last decode is exposed
    # wave 2 encoded (2 ms) during wave 1's 10 ms of wire, agreed after it; the decodes of wave 1
    # (after both launches) overlap wave 2's wire
    assert two == pytest.approx(2e-3 + 1e-3 + 10e-3 + 1e-3 + 10e-3 + 2e-3)
    assert two < one < serial
    free = CodecEstimate("delta", wire_ratio=0.5, speed=CodecSpeed(encode_bytes_per_s=1e30, decode_bytes_per_s=1e30))
    assert compressed_sequence(link, world=2, buckets=buckets, estimate=free, waves=1, agreement_s=1e-3) == \
        pytest.approx(compressed_sequence(link, world=2, buckets=buckets, estimate=free) + 1e-3)


def test_zero3_training_prediction_hand_computed():
    """ZeRO-3 (Megatron-FSDP optim_grads_params): the baseline less its gathers' link time plus the
    CIERA run's wire bytes on the link and its own codec timers; two-level's wire crosses hosts in
    a group of one rank per host."""
    cfg = _cfg()
    cfg.pop("gather")
    cfg["model"] = {"iters": 10, "extra_flags": "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params"}
    cfg["train"] = [
        {"mode": "baseline", "overlap": False, "ms": 100.0, "raw_mb": None, "wire_mb": None, "timers_ms": {}},
        {"mode": "default", "overlap": False, "ms": 80.0, "raw_mb": 40.0, "wire_mb": 4.0,
         "timers_ms": {"ciera-encode": 2.0, "ciera-decode": 1.0}},
        {"mode": "cache-values", "overlap": False, "ms": 80.0, "raw_mb": 40.0, "wire_mb": 4.0, "timers_ms": {}},
    ]
    sim = predict(cfg)["train"]
    raw_ms = 40e6 / 10 / 2 / 1e8 * 1e3  # each rank's shard of one iteration's gathers, on a ring of 2
    wire_ms = 4e6 / 10 / 2 / 1e8 * 1e3
    assert sim["default:sync"] == pytest.approx(100 - raw_ms + wire_ms + 2.0 + 1.0)
    assert "cache-values:sync" not in sim  # no codec timers (--timing-log-level 0): no prediction
    cfg["hosts"], cfg["nproc"], cfg["layout"] = 2, 2, "2x2"
    cfg["train"][2].update(mode="cache-two-level", timers_ms={"ciera-encode": 2.0, "ciera-decode": 1.0})
    sim = predict(cfg)["train"]
    link = link_for(cfg)  # 4 ranks on 2 hosts: the raw gather's ring crosses the host link
    raw_s = link.allgather_time(bytes_per_rank=40e6 / 10 / 4, world=4)
    assert sim["cache-two-level:sync"] == pytest.approx(100 - raw_s * 1e3 + wire_ms + 3.0)
