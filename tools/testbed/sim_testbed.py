"""The simulator's cost model fed one testbed configuration, for predicted-vs-measured tables.

Inputs are measured independently of the times being predicted:

* the **link**: ``link_probe_bytes_per_s``, a one-stream TCP transfer between two testbed hosts
  (``probe_link``), ``link_latency_s``, half a small-message TCP round trip (``probe_latency``), and the layout (hosts x ranks per host: ranks of one host share its link, as
  :class:`ciera.cost_model.TwoLevelLink` with one NIC per node models it; ranks on one host talk over
  loopback at ``LOOPBACK_BYTES_PER_S``);
* the **codec speeds**: each codec's encode and decode seconds per gather, as the CIERA gathers
  measured them (their own timers, not the gather's wall time);
* the **payload sizes**: the wire bytes the gathers sent.

Predicted per gather, with ``ciera.cost_model`` (the functions the gather's ``auto`` uses):
plain = ``link.allgather_time``; codec = encode + ``allgather_time(wire)`` + decode (synchronous:
the gather bench waits on each gather). Training, synchronous gather: baseline iteration minus the
predicted plain gathers plus the predicted CIERA gathers of the same bytes (the timeline that
applies when nothing overlaps on a CPU host: ``overlap_comm=False`` in ``tools/sim/timeline.py``).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import os
import re

from ciera.cost_model import (
    CodecEstimate, CodecSpeed, HostShare, LinkModel, TwoLevelLink, agreement_time, predict_compressed, predict_raw,
)

LOOPBACK_BYTES_PER_S = 2e9
"""Ranks on one host exchange through loopback TCP; far faster than any shaped link here."""


def probe_link(tb, *, nbytes: int = 32 << 20, port: int = 29502, timeout: float = 120) -> float:
    """Bytes per second of one TCP stream from host 1 to host 0 over the shaped link."""
    server = ("import socket,time;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
              f"s.bind(('{tb.addr(0)}',{port}));s.listen(1);c,_=s.accept();n=0;t=None\n"
              "while True:\n b=c.recv(1<<20)\n if not b: break\n t=t or time.perf_counter();n+=len(b)\n"
              "print(n/(time.perf_counter()-t))")
    client = (f"import socket,time\nfor _ in range(100):\n try: c=socket.create_connection(('{tb.addr(0)}',{port})); break\n"
              f" except OSError: time.sleep(0.1)\nc.sendall(bytes({nbytes}));c.close()")
    srv = tb.popen(0, [sys.executable, "-c", server], stdout=subprocess.PIPE, text=True)
    tb.run(1, [sys.executable, "-c", client], timeout=timeout)
    out, _ = srv.communicate(timeout=timeout)
    return float(out.strip())


_DUPLEX = """
import socket, sys, threading, time
me, peer, n, port = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); srv.bind((me, port)); srv.listen(1)
def send():
    for _ in range(200):
        try:
            c = socket.create_connection((peer, port)); break
        except OSError:
            time.sleep(0.05)
    c.sendall(bytes(n)); c.shutdown(socket.SHUT_WR); c.recv(1); c.close()
t = threading.Thread(target=send); t.start()
conn, _ = srv.accept(); got = 0; t0 = None
while got < n:
    b = conn.recv(1 << 20)
    if not b: break
    t0 = t0 or time.perf_counter(); got += len(b)
dt = time.perf_counter() - t0; conn.sendall(b"k"); t.join()
print(got / dt)
"""


def probe_duplex(tb, *, nbytes: int = 32 << 20, port: int = 29504, timeout: float = 120) -> float:
    """Bytes per second each way while hosts 0 and 1 send to each other at once (what a 2-host
    all-gather does): the lower of the two receive rates."""
    with tempfile.TemporaryDirectory() as tmp:
        cmds = [[sys.executable, "-c", _DUPLEX, tb.addr(i), tb.addr(1 - i), str(nbytes), str(port)] for i in (0, 1)]
        codes = tb.run_all(cmds, timeout=timeout, log_dir=Path(tmp))
        outs = [(Path(tmp) / f"host{i}.log").read_text() for i in (0, 1)]
    if any(codes):
        raise RuntimeError(f"duplex probe failed {codes}: {outs}")
    return min(float(o.split()[-1]) for o in outs)


def probe_latency(tb, *, rounds: int = 200, port: int = 29503, timeout: float = 60) -> float:
    """Seconds of one one-way small message between hosts 0 and 1 (median TCP ping-pong / 2)."""
    server = ("import socket;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
              f"s.bind(('{tb.addr(0)}',{port}));s.listen(1);c,_=s.accept();"
              "c.setsockopt(socket.IPPROTO_TCP,socket.TCP_NODELAY,1)\n"
              "while True:\n b=c.recv(1)\n if not b: break\n c.sendall(b)")
    client = ("import socket,time,statistics\n"
              f"for _ in range(100):\n try: c=socket.create_connection(('{tb.addr(0)}',{port})); break\n"
              " except OSError: time.sleep(0.1)\nc.setsockopt(socket.IPPROTO_TCP,socket.TCP_NODELAY,1);r=[]\n"
              f"for _ in range({rounds}):\n t=time.perf_counter();c.sendall(b'x');c.recv(1);r.append(time.perf_counter()-t)\n"
              "print(statistics.median(r)/2)")
    srv = tb.popen(0, [sys.executable, "-c", server], stdout=subprocess.DEVNULL)
    try:
        res = tb.run(1, [sys.executable, "-c", client], timeout=timeout)
    finally:
        srv.wait(timeout=timeout)
    return float(res.stdout.strip())


def link_for(cfg: dict) -> LinkModel | TwoLevelLink:
    """The link the predictions use.

    Preferred: gloo's own all-gather fitted at smaller sizes than the timed gathers
    (``gather.gloo_link``, :func:`ciera.cost_model.measure_link`, what ``auto`` measures at run
    time): a flat ring of ``world - 1`` steps whose per-byte cost includes what TCP probes miss
    (gloo moves one stream per peer in chunks and pays its own copies; on this testbed a single
    gloo gather reaches ~65-75% of the TCP probe's rate).

    Otherwise, from the TCP probes: gloo's all-gather is one flat ring over every rank (ranks fill
    hosts in order), each step paced by the host link, which carries data both ways at once: the
    duplex probe's rate when measured (``link_duplex_bytes_per_s``), else the one-way stream's."""
    fit = (cfg.get("gather") or {}).get("gloo_link")
    if fit:
        return LinkModel(fit["bandwidth_bytes_per_s"], fit["latency_s"])
    bw = cfg.get("link_duplex_bytes_per_s") or cfg["link_probe_bytes_per_s"]
    return TwoLevelLink(intra=LinkModel(LOOPBACK_BYTES_PER_S), inter=LinkModel(bw, cfg.get("link_latency_s", 0.0)),
                        gpus_per_node=cfg["nproc"], nics_per_node=1, algorithm="ring")


def codec_speed(*, shard_bytes: float, world: int, encode_ms: float, decode_ms: float) -> CodecSpeed:
    """Bytes of raw shard per second from one gather's encode (own shard) and decode (world - 1 shards)."""
    return CodecSpeed(encode_bytes_per_s=shard_bytes / max(encode_ms, 1e-6) * 1e3,
                      decode_bytes_per_s=(world - 1) * shard_bytes / max(decode_ms, 1e-6) * 1e3)


def host_share(cfg: dict) -> HostShare:
    """Every testbed host is a namespace of this one machine: all ``hosts x nproc`` ranks share
    its cores (``cfg['cores']``, recorded by bench_cluster; else this machine's)."""
    return HostShare(cores=float(cfg.get("cores") or os.cpu_count() or 1), ranks=cfg["hosts"] * cfg["nproc"])


def single_core_speeds(cfgs: list[dict]) -> dict[str, dict[str, CodecSpeed]]:
    """Per rate, per codec: the codec's single-core speed, from the configurations whose ranks do
    not share cores (``HostShare.slowdown == 1``: each rank's timers are its own core's)."""
    out: dict[str, dict[str, CodecSpeed]] = {}
    for c in cfgs:
        g = c.get("gather")
        if not g or host_share(c).slowdown > 1:
            continue
        shard = g["numel"] // g["world"] * 2
        for m, s in g["modes"].items():
            if m != "auto" and s["raw_gathers"] < s["gathers"]:
                out.setdefault(c["rate"], {})[m] = codec_speed(
                    shard_bytes=shard, world=g["world"], encode_ms=s["encode_ms"], decode_ms=s["decode_ms"])
    return out


def predict(cfg: dict, *, single_core: dict[str, CodecSpeed] | None = None) -> dict:
    """Predicted gather and training times (ms) for one bench_cluster configuration.

    Gathers: encode, the size agreement, the link, decode in series (the serial timeline,
    ``overlap_comm=False`` in ``tools/sim/timeline.py``). Where the ranks share the machine's
    cores (:func:`host_share`, 4 ranks on 2 cores) and ``single_core`` speeds are given (per
    codec, from a configuration whose ranks do not share cores): the codec phases take
    ``HostShare.slowdown`` x the single-core time, and so does each latency-bound step of the size
    agreement (it runs right after the encode, while the cores are busy: each step waits for its
    receiver to be scheduled). Otherwise the codec speeds are this configuration's own timers.
    Training (synchronous and overlapped alike): the measured baseline minus the predicted plain
    gathers of one iteration plus the predicted CIERA gathers of the same bytes; ``auto`` is
    predicted with the codec its gather benchmark ended with."""
    out: dict = {"gather": {}, "train": {}}
    if "link_probe_bytes_per_s" not in cfg:
        return out
    link = link_for(cfg)
    g = cfg.get("gather")
    host = host_share(cfg)
    shared = host.slowdown > 1 and bool(single_core)
    speeds: dict[str, CodecSpeed] = {}

    def compressed(*, shard, world, est, buckets=1):
        agree = agreement_time(link=link, world=world, buckets=buckets) * buckets
        if shared:
            agree *= host.slowdown
        return predict_compressed(raw_bytes_per_rank=shard, world=world, link=link, estimate=est,
                                  agreement_s=agree, host=host if shared else None).total_s

    if g:
        world = g["world"]
        shard = g["numel"] // world * 2  # bf16 bytes per rank
        plain = predict_raw(raw_bytes_per_rank=shard, world=world, link=link).total_s
        out["gather"]["plain_ms"] = plain * 1e3
        for m, s in g["modes"].items():
            if s["raw_gathers"] == s["gathers"]:  # auto that sent raw throughout: a plain gather
                out["gather"][m] = plain * 1e3
                continue
            name = s["codec"] if m == "auto" else m
            if shared and name in single_core:
                speeds[name] = single_core[name]
            elif shared:
                continue  # no single-core figure for this codec: no prediction
            else:
                speeds[name] = codec_speed(shard_bytes=shard, world=world, encode_ms=s["encode_ms"],
                                           decode_ms=s["decode_ms"])
            est = CodecEstimate(name, wire_ratio=s["wire_bytes"] / s["raw_bytes"], speed=speeds[name])
            out["gather"][m] = compressed(shard=shard, world=world, est=est) * 1e3
    world = cfg["hosts"] * cfg["nproc"]
    gathers = cfg.get("model", {}).get("iters", 0) + 1
    out["train_gather"] = {}  # one iteration's param gathers (Megatron's params-all-gather timer, sync)
    it_shard = iteration_bytes_per_rank(cfg)
    nb = train_buckets(cfg)  # each bucket group is its own gather: its own ring steps

    def raw_iteration(shard):
        return nb * predict_raw(raw_bytes_per_rank=shard / nb, world=world, link=link).total_s
    for t in cfg.get("train", []):
        base = next((b for b in cfg["train"] if b["mode"] == "baseline" and b["overlap"] == t["overlap"]), None)
        if not base or not base["ms"]:
            continue
        key = f"{t['mode']}:{'overlap' if t['overlap'] else 'sync'}"
        if t["mode"] == "baseline" or not t["raw_mb"] or t["wire_mb"] >= t["raw_mb"]:
            out["train"][key] = base["ms"]  # nothing compressed: the baseline's gathers
            if it_shard:
                out["train_gather"][key] = raw_iteration(it_shard) * 1e3
            continue
        name = t["mode"] if t["mode"] in speeds else (g["modes"].get("auto", {}).get("codec") if g else None)
        if name not in speeds:
            continue
        shard = t["raw_mb"] * 1e6 / gathers / world  # each rank's bytes of one iteration's buckets
        raw_s = raw_iteration(shard)
        est = CodecEstimate(name, wire_ratio=t["wire_mb"] / t["raw_mb"], speed=speeds[name])
        # one size agreement per step, shared by the buckets; each bucket's payload its own gather
        agree = agreement_time(link=link, world=world, buckets=nb) * nb * (host.slowdown if shared else 1.0)
        c_s = nb * predict_compressed(raw_bytes_per_rank=shard / nb, world=world, link=link, estimate=est,
                                      host=host if shared else None).total_s + agree
        out["train"][key] = base["ms"] + (c_s - raw_s) * 1e3
        out["train_gather"][key] = c_s * 1e3
    return out


BUCKETS = re.compile(r"CIERA all-gather on (\d+) bucket group")


def train_buckets(cfg: dict) -> int:
    """Bucket groups of the training runs (their install line; ``cfg['train_buckets']`` if set)."""
    if cfg.get("train_buckets"):
        return int(cfg["train_buckets"])
    for t in cfg.get("train", []):
        for line in t.get("log_lines", []):
            if m := BUCKETS.search(line):
                return int(m.group(1))
    return 1


def iteration_bytes_per_rank(cfg: dict) -> float | None:
    """Raw bytes of one iteration's param buckets per rank (from any CIERA run's byte count)."""
    world = cfg["hosts"] * cfg["nproc"]
    gathers = cfg.get("model", {}).get("iters", 0) + 1
    mb = next((t["raw_mb"] for t in cfg.get("train", []) if t.get("raw_mb")), None)
    return None if mb is None else mb * 1e6 / gathers / world


def predict_baseline(cfg: dict, ref: dict, *, overlap: bool) -> float | None:
    """Megatron's iteration time at ``cfg``'s link predicted from its time at ``ref``'s (same layout
    and model, another rate): ``ref`` + the change in the param all-gather's and the grad
    reduce-scatter's predicted times (equal bytes here: bf16 grads; the ring reduce-scatter moves
    what the all-gather does), each on its own configuration's measured gloo link."""
    base = next((b["ms"] for b in ref.get("train", []) if b["mode"] == "baseline" and b["overlap"] == overlap), None)
    shard = iteration_bytes_per_rank(ref) or iteration_bytes_per_rank(cfg)
    if base is None or shard is None or not cfg.get("gather") or not ref.get("gather"):
        return None
    world = cfg["hosts"] * cfg["nproc"]

    def comm(c):
        return 2 * predict_raw(raw_bytes_per_rank=shard, world=world, link=link_for(c)).total_s * 1e3

    return base + comm(cfg) - comm(ref)
