"""Measurements for the cost model: link and codec speeds timed on the real group and device.

Each figure is MAX-reduced across the group (:func:`agree`: the slowest rank paces a collective),
so every rank derives the same :class:`ciera.cost_model.LinkModel` and
:class:`ciera.cost_model.CodecSpeed` from it and :func:`ciera.cost_model.decide` takes the same
decision everywhere. The model itself (:mod:`ciera.cost_model`) is pure.
"""

from __future__ import annotations

import math
import time
from typing import Sequence

import torch
import torch.distributed as dist

from .comm import all_gather_into
from .cost_model import CodecSpeed, LinkModel, fit_latency_bandwidth
from .synthetic import AdamTrajectory

__all__ = ["DEFAULT_LINK_SIZES", "agree", "measure_codec_speed", "measure_link", "measure_link_times", "synchronize"]


def synchronize(device) -> None:
    """Wait for the work queued on ``device`` (a CUDA device; a no-op elsewhere), so that a host
    clock read next covers it."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def agree(*, values: Sequence[float], group=None, device=None) -> list[float]:
    """MAX-reduce ``values`` over ``group`` so every rank holds the same numbers.

    Timings differ slightly per rank; taking the maximum (the slowest rank paces a collective)
    makes every derived decision identical everywhere. ``device`` defaults to CPU on gloo and to
    the current CUDA device otherwise.
    """
    if device is None:
        device = "cpu" if dist.get_backend(group) == "gloo" else torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [float(v) for v in t.cpu().tolist()]


DEFAULT_LINK_SIZES = (1 << 14, 1 << 17, 1 << 20, 1 << 22)


def measure_link_times(*, group=None, device="cpu", sizes: Sequence[int] = DEFAULT_LINK_SIZES, repeats: int = 3,
                       warmup: int = 1) -> list[float]:
    """Seconds of one ``all_gather_into_tensor`` of each of ``sizes`` bytes per rank on ``group``.

    Collective: every rank of ``group`` must call it with equal arguments. Each figure is the
    fastest of ``repeats`` runs on this rank, then MAX-reduced across the group, so every rank
    holds the same list. A group of one rank returns zeros (nothing is sent).
    """
    world = dist.get_world_size(group)
    if world == 1:
        return [0.0] * len(sizes)
    times = []
    for size in sizes:
        src = torch.zeros(int(size), dtype=torch.uint8, device=device)
        dst = torch.empty(int(size) * world, dtype=torch.uint8, device=device)
        best = math.inf
        for i in range(warmup + repeats):
            dist.barrier(group=group)
            synchronize(device)
            t0 = time.perf_counter()
            all_gather_into(dst, src, group=group)
            synchronize(device)
            if i >= warmup:
                best = min(best, time.perf_counter() - t0)
        times.append(best)
    return agree(values=times, group=group, device=device if torch.device(device).type == "cuda" else "cpu")


def measure_link(*, group=None, device="cpu", sizes: Sequence[int] = DEFAULT_LINK_SIZES, repeats: int = 3,
                 warmup: int = 1) -> LinkModel:
    """Time ``all_gather_into_tensor`` of ``sizes`` bytes per rank on ``group`` and fit a
    :class:`LinkModel` (:func:`measure_link_times`, then :func:`fit_latency_bandwidth`): collective,
    and identical on every rank."""
    world = dist.get_world_size(group)
    if world == 1:
        return LinkModel(bandwidth_bytes_per_s=1e30, latency_s=0.0)
    times = measure_link_times(group=group, device=device, sizes=sizes, repeats=repeats, warmup=warmup)
    return fit_latency_bandwidth(sizes=sizes, times=times, world=world)


def measure_codec_speed(*, codec, device="cpu", repeats: int = 3, warmup_steps: int = 3, lr: float = 1e-4,
                        seed: int = 0) -> CodecSpeed:
    """Time ``codec`` (a :class:`ciera.codecs.Codec`) encoding and decoding a synthetic shard.

    The shard follows an :class:`ciera.synthetic.AdamTrajectory` for ``warmup_steps`` steps, so the
    codec sees a realistic change between the previous and new values. Local only: reduce the two
    throughputs with :func:`agree` (as seconds, or negate rates) to make them rank-identical.
    """
    n = codec.numel
    traj = AdamTrajectory(numel=n, dtype=codec.dtype, lr=lr, seed=seed, device=device)
    for _ in range(warmup_steps):
        traj.step()
    prev = traj.current().clone()
    new = traj.step().contiguous()
    state = codec.new_state(shard=prev)
    out = torch.empty(codec.clamp_capacity(codec.max_bytes), dtype=torch.uint8, device=device)
    enc = dec = math.inf
    for _ in range(repeats + 1):
        codec.reset_state(state=state, shard=prev)
        synchronize(device)
        t0 = time.perf_counter()
        codec.encode(shard=new, state=state, out=out)
        synchronize(device)
        enc = min(enc, time.perf_counter() - t0)
        target = prev.clone()
        synchronize(device)
        t0 = time.perf_counter()
        codec.decode(payload=out, target=target)
        synchronize(device)
        dec = min(dec, time.perf_counter() - t0)
    raw = max(codec.raw_bytes, 1)
    return CodecSpeed(encode_bytes_per_s=raw / max(enc, 1e-9), decode_bytes_per_s=raw / max(dec, 1e-9))
