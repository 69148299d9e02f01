"""The cost model's raw-vs-codec decision on this machine's measured inputs (pure function tests).

Figures are the ones recorded in ``tools/testbed/results/`` (``bench_cluster.md``,
``link_probe_2x1_1gbit.json``; 2026-12-01 run with the native codecs): gloo's link as ``measure_link`` fitted it on the testbed (2 hosts x 1 rank) and on
one host, and the codec speeds and wire ratios the gathers' own timers measured (bf16, lr 1e-4,
an 8 MiB shard per rank). ``decide`` must keep raw where the link is a memcpy and compress where
the testbed's link is slow, picking the codec the measured gathers found fastest.
"""

import pytest

from ciera.cost_model import CodecEstimate, CodecSpeed, LinkModel, decide

SHARD = 8 << 20  # bytes per rank of the measured gathers (4M bf16 values)
WORLD = 2

# codec -> (wire/raw, encode s, decode s) for one 8 MiB shard (gather timers, testbed 2x1 at 1 Gbit/s)
MEASURED = {"exponent_reuse": (0.562, 3.8e-3, 4.3e-3), "delta": (0.177, 21.4e-3, 10.2e-3)}

LINKS = {
    # name: (bytes/s, latency s, expected choice)
    "one host, memcpy (copy bandwidth)": (13.2e9, 0.0, "raw"),
    "1 Gbit/s testbed, gloo fit": (105.8e6, 1.6e-3, "delta"),
}


def _candidates(scale: float = 1.0):
    return [CodecEstimate(name, wire_ratio=w,
                          speed=CodecSpeed(encode_bytes_per_s=SHARD / (e * scale),
                                           decode_bytes_per_s=SHARD / (d * scale)))
            for name, (w, e, d) in MEASURED.items()]


@pytest.mark.parametrize("name", list(LINKS))
def test_measured_inputs_pick_what_the_measurement_found(name):
    bw, lat, want = LINKS[name]
    d = decide(raw_bytes_per_rank=SHARD, world=WORLD, link=LinkModel(bw, lat), candidates=_candidates())
    assert d.choice == want, d.reason
    assert d.reason.startswith(want)  # the log line names the choice and the times behind it


def test_memcpy_link_stays_raw_even_with_codecs_4x_faster():
    d = decide(raw_bytes_per_rank=SHARD, world=8, link=LinkModel(13.2e9), candidates=_candidates(0.25))
    assert d.choice == "raw", d.reason


def test_slow_link_compresses_even_with_codecs_4x_slower():
    """At 1 Gbit/s exponent_reuse still pays with codecs 4x slower than measured (heavy load)."""
    d = decide(raw_bytes_per_rank=SHARD, world=WORLD, link=LinkModel(105.8e6, 1.6e-3), candidates=_candidates(4.0))
    assert d.choice == "exponent_reuse", d.reason


def test_break_even_link_rate_between_testbed_rates():
    """With the measured codecs, compression stops paying between 1 and 10 Gbit/s: the
    break-even rate (exponent_reuse: link time saved = encode + decode) is ~0.5 GB/s."""
    wire, enc, dec = MEASURED["exponent_reuse"]
    break_even = SHARD * (1 - wire) / (enc + dec)
    assert 0.3e9 < break_even < 0.8e9
    fast = decide(raw_bytes_per_rank=SHARD, world=WORLD, link=LinkModel(break_even * 1.5), candidates=_candidates())
    slow = decide(raw_bytes_per_rank=SHARD, world=WORLD, link=LinkModel(break_even / 1.5), candidates=_candidates())
    assert fast.choice == "raw" and slow.choice != "raw"


def test_raw_decision_says_what_compression_would_cost():
    d = decide(raw_bytes_per_rank=SHARD, world=WORLD, link=LinkModel(13.2e9), candidates=_candidates())
    assert d.choice == "raw"
    assert "compressing is not faster: exponent_reuse" in d.reason and "delta" in d.reason, d.reason
