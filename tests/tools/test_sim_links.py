"""tools/sim/links.py: the two-level cluster link by hand, and ranks sharing a host's cores."""

import dataclasses

import pytest

from ciera.cost_model import CodecEstimate, CodecSpeed, LinkModel, predict_compressed
from tools.sim.links import HostShare, TwoLevelLink


def test_two_level_link():
    intra = LinkModel(bandwidth_bytes_per_s=100e9, latency_s=1e-6)
    inter = LinkModel(bandwidth_bytes_per_s=10e9, latency_s=1e-5)
    ring = TwoLevelLink(intra=intra, inter=inter, gpus_per_node=4)
    hier = dataclasses.replace(ring, algorithm="hierarchical")
    b = 1e6
    # inside one node both are the intra ring
    assert ring.allgather_time(bytes_per_rank=b, world=4) == hier.allgather_time(bytes_per_rank=b, world=4) \
        == pytest.approx(intra.allgather_time(bytes_per_rank=b, world=4))
    # flat ring over 8 ranks: 7 steps paced by the inter link
    assert ring.allgather_time(bytes_per_rank=b, world=8) == pytest.approx(7 * (1e-5 + b / 10e9))
    # hierarchical: 1 inter step of b with 4 local ranks sharing the one NIC, then 3 intra steps of 2b
    assert hier.allgather_time(bytes_per_rank=b, world=8) == pytest.approx((1e-5 + 4 * b / 10e9) + 3 * (1e-6 + 2 * b / 100e9))
    # one NIC per GPU: ring channels cross nodes in parallel; local ranks no longer share a port
    ring4 = dataclasses.replace(ring, nics_per_node=4)
    assert ring4.allgather_time(bytes_per_rank=b, world=8) == pytest.approx(7 * (1e-5 + b / 40e9))
    hier4 = dataclasses.replace(hier, nics_per_node=4)
    assert hier4.allgather_time(bytes_per_rank=b, world=8) == pytest.approx((1e-5 + b / 10e9) + 3 * (1e-6 + 2 * b / 100e9))
    with pytest.raises(ValueError, match="nics_per_node=5"):
        dataclasses.replace(ring, nics_per_node=5)
    with pytest.raises(ValueError, match="multiple of gpus_per_node"):
        ring.allgather_time(bytes_per_rank=b, world=6)
    with pytest.raises(ValueError, match="algorithm"):
        TwoLevelLink(intra=intra, inter=inter, gpus_per_node=4, algorithm="tree")


def test_host_share_scales_codec_phases_only():
    """Ranks sharing cores: both codec phases take ranks/cores x the single-core time; the link and
    the agreement given are untouched; no sharing (ranks <= cores) changes nothing."""
    link = LinkModel(bandwidth_bytes_per_s=100e6, latency_s=1e-3)
    est = CodecEstimate("delta", wire_ratio=0.25, speed=CodecSpeed(encode_bytes_per_s=1e9, decode_bytes_per_s=2e9))
    kw = dict(raw_bytes_per_rank=4e6, world=4, link=link, estimate=est, agreement_s=2e-3)
    alone = predict_compressed(**kw)
    shared = predict_compressed(**kw, codec_slowdown=HostShare(cores=2, ranks=4).slowdown)
    assert HostShare(cores=2, ranks=4).slowdown == 2.0 and HostShare(cores=2, ranks=2).slowdown == 1.0
    assert shared.encode_s == pytest.approx(2 * alone.encode_s) == pytest.approx(2 * 4e6 / 1e9)
    assert shared.decode_s == pytest.approx(2 * alone.decode_s) == pytest.approx(2 * 3 * 4e6 / 2e9)
    assert shared.comm_s == alone.comm_s == pytest.approx(3 * (1e-3 + 1e6 / 100e6) + 2e-3)
    assert shared.total_s == pytest.approx(shared.encode_s + shared.comm_s + shared.decode_s)
    assert predict_compressed(**kw, codec_slowdown=HostShare(cores=2, ranks=2).slowdown) == alone
    with pytest.raises(ValueError, match="cores"):
        HostShare(cores=0, ranks=2)
    with pytest.raises(ValueError, match="ranks"):
        HostShare(cores=2, ranks=0)
    with pytest.raises(ValueError, match="codec_slowdown"):
        predict_compressed(**kw, codec_slowdown=0.5)
