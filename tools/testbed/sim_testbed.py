"""The simulator's cost model fed one testbed configuration, for predicted-vs-measured tables.

Inputs are measured independently of the times being predicted:

* the **link**: preferably :class:`MeasuredLink`, gloo's all-gather timed on the testbed's host
  pair by ``link_probe.py`` (:func:`probe_gloo`: single gathers per size after an idle link,
  medians) with the shaper's burst (:func:`shaper_burst`); else gloo's fitted link
  (``measure_link``) or the TCP probes (``probe_link``, ``probe_duplex``, ``probe_latency``) and
  the layout (ranks of one host share its link, as :class:`tools.sim.links.TwoLevelLink` with
  one NIC per node models it; ranks on one host talk over loopback at ``LOOPBACK_BYTES_PER_S``);
* the **codec speeds**: encode and decode seconds, from the codec's own timers (the gather
  benchmark's slowest rank; a training run's ``ciera-encode`` / ``ciera-decode`` timers);
* the **payload sizes**: the wire bytes the gathers sent, and the training buckets' sizes the
  runs' selection lines name.

Predicted per gather, with ``ciera.cost_model`` (the functions the gather's ``auto`` uses):
plain = ``link.allgather_time``; codec = encode + size agreement + ``allgather_time(wire)`` +
decode (synchronous: the gather bench waits on each gather). Training: the measured baseline
iteration minus its param gathers (measured by its ``params-all-gather`` timer in synchronous runs,
predicted otherwise) plus the predicted CIERA gathers of the same bytes,
both bucket group by bucket group as Megatron's synchronous gather runs them (:func:`raw_sequence`,
:func:`compressed_sequence`): the serial timeline (``overlap_comm=False`` in
``tools/sim/timeline.py``), which applies on this CPU testbed to overlapped runs too (their
forward-backward grows by the whole gather: nothing hides).
"""

from __future__ import annotations

import bisect
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ciera.cost_model import CodecEstimate, CodecSpeed, LinkModel, agreement_time, predict_compressed, predict_raw
from tools.sim.links import HostShare, TwoLevelLink

LOOPBACK_BYTES_PER_S = 2e9
"""Ranks on one host exchange through loopback TCP; far faster than any shaped link here."""

PROBE_SIZES = (4096, 65536, 262144, 524288, 1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20)
"""Bytes per rank of the single gathers ``probe_gloo`` times (the link curve's points)."""


@dataclass(frozen=True)
class MeasuredLink:
    """gloo's all-gather on a shaped testbed link as measured: the median seconds of one gather
    per bytes per rank (``probe_gloo``: single gathers on the host pair itself, rotated, medians),
    joined by straight lines. Duck-types :class:`ciera.cost_model.LinkModel` for the prediction
    functions.

    Why not latency + bytes / bandwidth: through a ``tbf`` the cost per byte grows with the
    transfer. The shaper's burst (256 KiB at 1 Gbit/s) lets a short gather pass at line rate; a
    long one fills the shaper's queue, loses segments (the probe counts thousands of fast
    retransmits) and settles at ~70% of the one-way TCP rate. One affine fit is off by 20-50% at
    one end or the other; the curve is exact at its points."""

    points: tuple[tuple[float, float], ...]
    """(bytes per rank, seconds), sorted by bytes, at least two; each a median single gather
    after an idle link (the shaper's burst full)."""

    world: int = 2
    """Ranks of the probe: its gathers took ``world - 1`` ring steps."""

    burst_bytes: float = 0.0
    """The shaper's burst (``tbf burst``): bytes an idle link passes at line rate."""

    refill_s: float = 0.0
    """Seconds of idle link that refill the burst (``burst_bytes`` at the shaped rate)."""

    def __post_init__(self):
        if len(self.points) < 2 or any(b <= a for (a, _), (b, _) in zip(self.points, self.points[1:])):
            raise ValueError(f"MeasuredLink: need >= 2 points with increasing bytes, got {self.points}")
        if self.world < 2 or any(t <= 0 for _, t in self.points):
            raise ValueError(f"MeasuredLink: world={self.world} must be >= 2 and every time > 0")

    def step_time(self, nbytes: float) -> float:
        """Seconds of one ring step of ``nbytes``: linear between the points; below the first, its
        time scaled down to no less than half of it (a gather's fixed cost); above the last, the
        last segment's slope."""
        pts, steps = self.points, self.world - 1
        if nbytes <= pts[0][0]:
            return max(pts[0][1] / 2, pts[0][1] * nbytes / pts[0][0]) / steps
        i = min(max(bisect.bisect_left([b for b, _ in pts], nbytes), 1), len(pts) - 1)
        (b0, t0), (b1, t1) = pts[i - 1], pts[i]
        return (t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)) / steps

    def allgather_time(self, *, bytes_per_rank: float, world: int) -> float:
        """Flat ring of ``world - 1`` steps of ``bytes_per_rank`` each, on an idle link."""
        return (world - 1) * self.step_time(bytes_per_rank)

    def sequence_time(self, *, bytes_per_rank: list[float], gaps_s: list[float], world: int) -> float:
        """Link seconds of gathers one after the other, gather i of ``bytes_per_rank[i]`` after
        ``gaps_s[i]`` seconds with the link idle. A gather right after another finds the burst
        spent: it costs its fixed cost (the smallest point's time) plus what its bytes add to a
        transfer already past the burst, ``step(b + burst) - step(burst)``; an idle gap refills the
        burst in proportion (``gap / refill_s``, full at ``refill_s``), and the gather costs that
        share of its idle-link time and the rest of its spent-burst time."""
        total, fixed = 0.0, self.points[0][1] / (self.world - 1)
        for b, gap in zip(bytes_per_rank, gaps_s, strict=True):
            idle = self.step_time(b)
            full = 1.0 if self.refill_s <= 0 else min(1.0, max(0.0, gap) / self.refill_s)
            spent = fixed + self.step_time(b + self.burst_bytes) - self.step_time(self.burst_bytes)
            total += full * idle + (1.0 - full) * spent
        return (world - 1) * total

    @classmethod
    def from_probe(cls, probe: dict, *, rate: str | None = None) -> "MeasuredLink":
        """From ``link_probe.py``'s JSON: its single-gather cases, those after an idle wait
        (``idle``) where it has them, else the back-to-back ones (``sync``); the burst from the
        testbed's shaping ``rate`` (:func:`shaper_burst`)."""
        singles = [c for c in probe["cases"].values() if len(c["bytes_per_rank"]) == 1]
        kind = "idle" if any(c["pattern"] == "idle" for c in singles) else "sync"
        pts = sorted((c["bytes_per_rank"][0], c["median_s"]) for c in singles if c["pattern"] == kind)
        burst, refill = shaper_burst(rate) if rate else (0.0, 0.0)
        return cls(points=tuple(pts), world=probe.get("world", 2), burst_bytes=burst, refill_s=refill)


def shaper_burst(rate: str) -> tuple[float, float]:
    """(burst bytes, refill seconds) of the testbed's ``tbf`` at ``rate`` (``netns._shape``: burst
    ``max(256 KiB, 2 ms at the rate)``)."""
    from tools.testbed.netns import parse_rate

    bytes_per_s = parse_rate(rate) / 8
    burst = max(256 * 1024, int(bytes_per_s * 0.002))
    return float(burst), burst / bytes_per_s


def probe_cases(sizes=PROBE_SIZES) -> list[str]:
    """``link_probe.py --case`` arguments: one single gather per size, each after an idle wait
    (``--idle``: longer than the shaper's refill) so that each finds the burst full."""
    return [f"one_{b}:idle:{b}" for b in sizes]


def probe_gloo(tb, *, nproc: int, sizes=PROBE_SIZES, reps: int = 15, timeout: float = 300) -> dict:
    """gloo's all-gather timed on the testbed itself (``link_probe.py`` under torchrun on every
    host; the same launch as the runs it predicts): medians per size, and TCP retransmit counts."""
    from tools.testbed.testbed import torchrun_command

    root = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "probe.json"
        script = [str(root / "tools/testbed/link_probe.py"), "--reps", str(reps), "--idle", "0.01", "--out", str(out)]
        for c in probe_cases(sizes):
            script += ["--case", c]
        cmds = [torchrun_command(tb, i, nproc_per_node=nproc, port=29410, script=script) for i in range(tb.hosts)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        codes = tb.run_all(cmds, timeout=timeout, env=env, log_dir=Path(tmp))
        if any(codes):
            logs = [(Path(tmp) / f"host{i}.log").read_text(errors="replace")[-2000:] for i in range(tb.hosts)]
            raise RuntimeError(f"link probe failed {codes}: {logs}")
        return json.loads(out.read_text())


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

    Preferred: :class:`MeasuredLink`, gloo's all-gather timed on this testbed's host pair at the
    sizes that matter (``cfg['gloo_probe']``, :func:`probe_gloo`). Next: gloo's own all-gather fitted at smaller sizes than the timed gathers
    (``gather.gloo_link``, :func:`ciera.measure.measure_link`, what ``auto`` measures at run
    time): a flat ring of ``world - 1`` steps whose per-byte cost includes what TCP probes miss
    (gloo moves one stream per peer in chunks and pays its own copies; on this testbed a single
    gloo gather reaches ~65-75% of the TCP probe's rate).

    Otherwise, from the TCP probes: gloo's all-gather is one flat ring over every rank (ranks fill
    hosts in order), each step paced by the host link, which carries data both ways at once: the
    duplex probe's rate when measured (``link_duplex_bytes_per_s``), else the one-way stream's."""
    if cfg.get("gloo_probe"):
        return MeasuredLink.from_probe(cfg["gloo_probe"], rate=cfg.get("rate"))
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
                                  agreement_s=agree, codec_slowdown=host.slowdown if shared else 1.0).total_s

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
                # the slowest rank's codec times where recorded: the collective waits for it
                speeds[name] = codec_speed(shard_bytes=shard, world=world,
                                           encode_ms=s.get("encode_ms_max", s["encode_ms"]),
                                           decode_ms=s.get("decode_ms_max", s["decode_ms"]))
            est = CodecEstimate(name, wire_ratio=s["wire_bytes"] / s["raw_bytes"], speed=speeds[name])
            out["gather"][m] = compressed(shard=shard, world=world, est=est) * 1e3
    if is_zero3(cfg):
        out["train"] = predict_zero3_train(cfg, link)
        return out
    world = cfg["hosts"] * cfg["nproc"]
    gathers = cfg.get("model", {}).get("iters", 0) + 1
    out["train_gather"] = {}  # one iteration's param gathers (Megatron's params-all-gather timer, sync)
    it_shard = iteration_bytes_per_rank(cfg)

    def raw_iteration(shard):  # each bucket group its own gather, one after the other
        return raw_sequence(link, world=world, buckets=train_bucket_bytes(cfg, shard))
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
        shard = t["raw_mb"] * 1e6 / gathers / world  # each rank's bytes of one iteration's buckets
        own = run_codec_speed(t, shard_bytes=shard, world=world)
        name = t["mode"] if t["mode"] in speeds else (g["modes"].get("auto", {}).get("codec") if g else None)
        if own is None and name not in speeds:
            continue
        scale = shared and own is None  # single-core speeds: x the share; the run's own timers have it
        est = CodecEstimate(t["mode"], wire_ratio=t["wire_mb"] / t["raw_mb"], speed=own or speeds[name])
        buckets = train_bucket_bytes(cfg, shard)
        # serial (Megatron's synchronous gather; on this CPU testbed the overlapped one hides
        # nothing either): every bucket encoded, ONE size agreement, then each bucket group
        # gathered in turn and decoded as it completes; synchronous runs of a binding that starts
        # every group at once decode while the next payloads cross
        agree = agreement_time(link=link, world=world, buckets=len(buckets)) * len(buckets) * (
            host.slowdown if scale else 1.0)
        waves = 0 if t["overlap"] else int(cfg.get("sync_waves", 0))
        c_s = compressed_sequence(link, world=world, buckets=buckets, estimate=est, host=host if scale else None,
                                  waves=waves, agreement_s=agree) + (0.0 if waves else agree)
        # the baseline's own gathers: its params-all-gather timer where it has one (synchronous
        # runs; measured in the same invocation, so it carries the link as it was then), else
        # predicted
        timed = None if t["overlap"] else (base.get("timers_ms") or {}).get("params-all-gather")
        out["train"][key] = base["ms"] + c_s * 1e3 - (timed if timed else raw_iteration(shard) * 1e3)
        out["train_gather"][key] = c_s * 1e3
    return out


ZERO3_FLAGS = ("optim_grads_params", "--use-torch-fsdp2")


def is_zero3(cfg: dict) -> bool:
    """Whether the configuration's training runs are ZeRO-3 (Megatron-FSDP ``optim_grads_params`` or
    FSDP2): every unit gathered in each forward and backward, the caches of :mod:`ciera.zero3`."""
    flags = str(cfg.get("model", {}).get("extra_flags", ""))
    return any(f in flags for f in ZERO3_FLAGS)


def predict_zero3_train(cfg: dict, link) -> dict[str, float]:
    """ZeRO-3 training (ms per iteration): the measured baseline, less the link time of what its
    gathers bring each rank in one iteration, plus the link time of what CIERA's bring (the run's
    wire bytes: the fresh payloads; replays of the values cache send nothing) and the run's own codec
    time (its ``ciera-encode`` + ``ciera-decode`` timers, slowest rank; none without
    ``--timing-log-level 1``). The gathers sit on the critical path (on this CPU testbed prefetch
    hides nothing). ``cache-two-level``: its wire bytes cross hosts in a group of one rank per
    host; the raw gather within the host is left out (loopback)."""
    out: dict[str, float] = {}
    iters = max(1, cfg.get("model", {}).get("iters", 1))
    world = cfg["hosts"] * cfg["nproc"]
    base = next((b for b in cfg.get("train", []) if b["mode"] == "baseline"), None)
    if not base or not base.get("ms"):
        return out
    raw_mb = next((t["raw_mb"] for t in cfg["train"] if t.get("raw_mb") and t["mode"] != "cache-two-level"), None)
    for t in cfg["train"]:
        key = f"{t['mode']}:{'overlap' if t['overlap'] else 'sync'}"
        if t["mode"] == "baseline":
            out[key] = base["ms"]
            continue
        tm = t.get("timers_ms") or {}
        if raw_mb is None or not t.get("wire_mb") or "ciera-encode" not in tm:
            continue
        raw_s = link.allgather_time(bytes_per_rank=raw_mb * 1e6 / iters / world, world=world)
        two = t["mode"] == "cache-two-level"
        group, across = (cfg["hosts"], getattr(link, "inter", link)) if two else (world, link)
        wire_s = across.allgather_time(bytes_per_rank=t["wire_mb"] * 1e6 / iters / group, world=group)
        out[key] = base["ms"] - raw_s * 1e3 + wire_s * 1e3 + tm["ciera-encode"] + tm.get("ciera-decode", 0.0)
    return out


def raw_sequence(link, *, world: int, buckets: list[float]) -> float:
    """Seconds of Megatron's synchronous gather of ``buckets`` (bytes per rank): one gather per
    bucket group, each started as the previous one ends (on a :class:`MeasuredLink`: the first
    after the optimizer step's idle link, the rest back to back)."""
    if isinstance(link, MeasuredLink):
        return link.sequence_time(bytes_per_rank=buckets, gaps_s=[float("inf")] + [0.0] * (len(buckets) - 1),
                                  world=world)
    return sum(predict_raw(raw_bytes_per_rank=b, world=world, link=link).total_s for b in buckets)


def compressed_sequence(link, *, world: int, buckets: list[float], estimate: CodecEstimate,
                        host: HostShare | None = None, waves: int = 0, agreement_s: float = 0.0) -> float:
    """Seconds of CIERA's synchronous gather of ``buckets`` (raw bytes per rank): the codec work
    of ``predict_compressed`` per bucket, the payloads on ``link``.

    ``waves=0`` (the binding before launch-ahead), size agreement excluded: every bucket encoded,
    then each bucket group gathered in turn and decoded as it completes; on a
    :class:`MeasuredLink` the link sits idle during the encode before the first payload and
    during each decode before the next.

    ``waves >= 1`` (``megatron.ciera.binding.bucket_group._Binding.launch``), ``agreement_s`` per
    agreement included: the buckets are prepared in ``waves`` equal waves. A wave is encoded by
    the host, agreed (after the previous wave's payloads have crossed: one collective queue per
    group) and launched; its payloads cross back to back while the host encodes the next wave.
    Once every wave is launched the host decodes each bucket in order, as soon as its payload has
    arrived."""
    per = [predict_compressed(raw_bytes_per_rank=b, world=world, link=link, estimate=estimate,
                               codec_slowdown=1.0 if host is None else host.slowdown)
           for b in buckets]
    wire = [b * estimate.wire_ratio for b in buckets]
    if waves <= 0:
        if not isinstance(link, MeasuredLink):
            return sum(p.total_s for p in per)
        gaps = [float("inf")] + [p.decode_s for p in per[:-1]]
        return sum(p.encode_s + p.decode_s for p in per) + link.sequence_time(bytes_per_rank=wire, gaps_s=gaps,
                                                                              world=world)
    size = -(-len(per) // min(waves, len(per)))
    host_t = link_t = 0.0  # when the host / the link is next free
    arrived, sent, gaps = [], [], []
    for w in range(0, len(per), size):
        host_t += sum(p.encode_s for p in per[w: w + size])
        start = max(host_t, link_t) + agreement_s  # the agreement queues behind the last payloads
        host_t = start
        for k in range(w, min(w + size, len(per))):
            gaps.append(float("inf") if not sent else start - link_t if k == w else 0.0)
            sent.append(wire[k])
            link_t = max(link_t, start) + _next_transfer(link, world=world, sent=sent, gaps=gaps, per=per, k=k)
            arrived.append(link_t)
    for p, t in zip(per, arrived):
        host_t = max(host_t, t) + p.decode_s
    return host_t


def _next_transfer(link, *, world: int, sent: list[float], gaps: list[float], per, k: int) -> float:
    """Seconds the k-th payload of a sequence adds on the link: on a :class:`MeasuredLink` what it
    adds to the sequence so far (the burst spent by the payloads before it, refilled by a gap);
    else its own collective."""
    if not isinstance(link, MeasuredLink):
        return per[k].comm_s
    before = link.sequence_time(bytes_per_rank=sent[:-1], gaps_s=gaps[:-1], world=world) if len(sent) > 1 else 0.0
    return link.sequence_time(bytes_per_rank=sent, gaps_s=gaps, world=world) - before


def run_codec_speed(t: dict, *, shard_bytes: float, world: int) -> CodecSpeed | None:
    """The codec's speed in one training run, from its own timers (``ciera-encode`` and
    ``ciera-decode``: the slowest rank's ms per iteration, ``--timing-log-level`` >= 1) over the
    iteration's ``shard_bytes`` per rank; None without them."""
    tm = t.get("timers_ms") or {}
    enc, dec = tm.get("ciera-encode"), tm.get("ciera-decode")
    if not enc or not dec:
        return None
    return codec_speed(shard_bytes=shard_bytes, world=world, encode_ms=enc, decode_ms=dec)


BUCKET_BYTES = re.compile(r"CIERA (\S+): selection -> .*\((\d+) B/rank")


def train_bucket_bytes(cfg: dict, shard: float) -> list[float]:
    """Each bucket group's raw bytes per rank of one iteration, summing to ``shard``: the sizes the
    runs' selection lines name (``... (2097152 B/rank, world 2)``), the rest split equally over the
    buckets they do not name; without any, ``train_buckets`` equal ones."""
    nb = train_buckets(cfg)
    named: dict[str, int] = {}
    for t in cfg.get("train", []):
        for line in t.get("log_lines", []):
            if m := BUCKET_BYTES.search(line):
                named.setdefault(m.group(1), int(m.group(2)))
    known = list(named.values())[:nb]
    rest = shard - sum(known)
    if len(known) >= nb or rest <= 0:
        return [shard / nb] * nb
    return [float(b) for b in known] + [rest / (nb - len(known))] * (nb - len(known))


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
    measured = [c.get("gloo_probe") or c.get("gather") for c in (cfg, ref)]  # a gloo link for both
    if base is None or shard is None or not all(measured):
        return None
    world = cfg["hosts"] * cfg["nproc"]

    def comm(c):  # bucket by bucket, as the iteration gathers and reduce-scatters them
        return 2 * raw_sequence(link_for(c), world=world, buckets=train_bucket_bytes(ref, shard)) * 1e3

    return base + comm(cfg) - comm(ref)
