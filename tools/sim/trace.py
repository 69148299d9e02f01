"""Trace and cluster files of the scaling simulator: frozen dataclasses, JSON in and out.

The schema is documented in ``tools/sim/README.md``; :func:`load_trace` and :func:`load_cluster`
validate a file and say which field is wrong.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ciera.cost_model import CodecSpeed, LinkModel

from .links import TwoLevelLink

TRACE_SCHEMA = "ciera-sim-trace/1"
CLUSTER_SCHEMA = "ciera-sim-cluster/1"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
KINDS = ("dense", "expert")


@dataclass(frozen=True)
class CodecTrace:
    """What one codec did on one bucket."""

    wire_ratio: float
    """Payload bytes each rank sends / raw bytes of its shard (capacity headroom included)."""

    encode_bytes_per_s: float
    """Raw shard bytes encoded per second on the target device."""

    decode_bytes_per_s: float
    """Raw shard bytes decoded per second on the target device."""

    def speed(self) -> CodecSpeed:
        return CodecSpeed(encode_bytes_per_s=self.encode_bytes_per_s, decode_bytes_per_s=self.decode_bytes_per_s)


@dataclass(frozen=True)
class BucketTrace:
    """One bucket: a contiguous group of parameters gathered together, in forward order."""

    name: str
    """Free text, e.g. ``layer0.experts``."""

    numel: int
    """Parameters in the whole (unsharded) bucket; each of P ranks holds ceil(numel / P)."""

    dtype: str
    """Gathered dtype: ``bfloat16``, ``float16`` or ``float32``."""

    kind: str
    """``dense`` or ``expert``."""

    compute_s: float
    """Forward compute that needs this bucket (its layers), seconds per iteration on one GPU."""

    codecs: dict[str, CodecTrace] = field(default_factory=dict)
    """Codec name -> measured behaviour on this bucket."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class Trace:
    """One model's iteration as the simulator sees it."""

    name: str
    """Model or run name."""

    iteration_compute_s: float
    """Forward + backward + optimizer compute of one iteration on one GPU, all-gathers excluded."""

    buckets: tuple[BucketTrace, ...]
    """Buckets in the order the forward pass needs them."""

    meta: dict = field(default_factory=dict)
    """Provenance: how the numbers were obtained (free form)."""

    @property
    def forward_s(self) -> float:
        return sum(b.compute_s for b in self.buckets)

    def codec_names(self) -> list[str]:
        names = []
        for b in self.buckets:
            names += [n for n in b.codecs if n not in names]
        return names


@dataclass(frozen=True)
class Cluster:
    """Nodes of identical GPUs: a fast link inside a node, a slower one between nodes."""

    name: str
    gpus_per_node: int
    intra: LinkModel
    inter: LinkModel
    algorithm: str = "ring"
    nics_per_node: int = 1
    meta: dict = field(default_factory=dict)

    def link(self, *, algorithm: str | None = None) -> TwoLevelLink:
        return TwoLevelLink(intra=self.intra, inter=self.inter, gpus_per_node=self.gpus_per_node,
                            nics_per_node=self.nics_per_node, algorithm=algorithm or self.algorithm)


def _need(d: dict, key: str, where: str):
    if key not in d:
        raise ValueError(f"{where}: missing field {key!r} (have {sorted(d)})")
    return d[key]


def trace_from_dict(d: dict) -> Trace:
    if d.get("schema") != TRACE_SCHEMA:
        raise ValueError(f"trace: schema={d.get('schema')!r}; expected {TRACE_SCHEMA!r}")
    buckets = []
    for i, b in enumerate(_need(d, "buckets", "trace")):
        where = f"trace bucket {i} ({b.get('name', '?')})"
        codecs = {}
        for cname, c in b.get("codecs", {}).items():
            ct = CodecTrace(wire_ratio=float(_need(c, "wire_ratio", f"{where} codec {cname}")),
                            encode_bytes_per_s=float(_need(c, "encode_bytes_per_s", f"{where} codec {cname}")),
                            decode_bytes_per_s=float(_need(c, "decode_bytes_per_s", f"{where} codec {cname}")))
            if not (ct.wire_ratio > 0 and ct.encode_bytes_per_s > 0 and ct.decode_bytes_per_s > 0):
                raise ValueError(f"{where} codec {cname}: every figure must be > 0; got {ct}")
            codecs[cname] = ct
        bt = BucketTrace(name=str(_need(b, "name", where)), numel=int(_need(b, "numel", where)),
                         dtype=str(_need(b, "dtype", where)), kind=str(_need(b, "kind", where)),
                         compute_s=float(_need(b, "compute_s", where)), codecs=codecs)
        if bt.dtype not in DTYPES or bt.kind not in KINDS or bt.numel < 1 or bt.compute_s < 0:
            raise ValueError(f"{where}: dtype in {sorted(DTYPES)}, kind in {KINDS}, numel >= 1, compute_s >= 0; "
                             f"got dtype={bt.dtype!r} kind={bt.kind!r} numel={bt.numel} compute_s={bt.compute_s}")
        buckets.append(bt)
    t = Trace(name=str(_need(d, "name", "trace")), iteration_compute_s=float(_need(d, "iteration_compute_s", "trace")),
              buckets=tuple(buckets), meta=dict(d.get("meta", {})))
    if t.iteration_compute_s < t.forward_s:
        raise ValueError(f"trace {t.name}: iteration_compute_s={t.iteration_compute_s} < sum of bucket "
                         f"compute_s={t.forward_s} (forward is part of the iteration)")
    return t


def trace_to_dict(t: Trace) -> dict:
    return {"schema": TRACE_SCHEMA, "name": t.name, "iteration_compute_s": t.iteration_compute_s,
            "meta": t.meta, "buckets": [asdict(b) for b in t.buckets]}


def cluster_from_dict(d: dict) -> Cluster:
    if d.get("schema") != CLUSTER_SCHEMA:
        raise ValueError(f"cluster: schema={d.get('schema')!r}; expected {CLUSTER_SCHEMA!r}")
    c = Cluster(
        name=str(_need(d, "name", "cluster")), gpus_per_node=int(_need(d, "gpus_per_node", "cluster")),
        intra=LinkModel(bandwidth_bytes_per_s=float(_need(d, "intra_bandwidth_bytes_per_s", "cluster")),
                        latency_s=float(_need(d, "intra_latency_s", "cluster"))),
        inter=LinkModel(bandwidth_bytes_per_s=float(_need(d, "inter_bandwidth_bytes_per_s", "cluster")),
                        latency_s=float(_need(d, "inter_latency_s", "cluster"))),
        algorithm=str(d.get("algorithm", "ring")), nics_per_node=int(d.get("inter_nics_per_node", 1)), meta=dict(d.get("meta", {})))
    c.link()  # validates gpus_per_node and algorithm
    return c


def cluster_to_dict(c: Cluster) -> dict:
    return {"schema": CLUSTER_SCHEMA, "name": c.name, "gpus_per_node": c.gpus_per_node,
            "intra_bandwidth_bytes_per_s": c.intra.bandwidth_bytes_per_s, "intra_latency_s": c.intra.latency_s,
            "inter_bandwidth_bytes_per_s": c.inter.bandwidth_bytes_per_s, "inter_latency_s": c.inter.latency_s,
            "inter_nics_per_node": c.nics_per_node, "algorithm": c.algorithm, "meta": c.meta}


def load_trace(path: str | Path) -> Trace:
    return trace_from_dict(json.loads(Path(path).read_text()))


def load_cluster(path: str | Path) -> Cluster:
    return cluster_from_dict(json.loads(Path(path).read_text()))


def save_json(obj: dict, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=1, sort_keys=False) + "\n")
