#!/usr/bin/env python
"""The native C codecs alone: each library call timed through ctypes, nothing else in between.

``tools/bench_codec.py`` measures what a user calls (``Codec.encode`` on tensors, beside clone()
and the peers). This times only the C library's entry points on the same kind of shard (an AdamW
trajectory, cast to bf16 after every step): ``ciera_encode`` / ``ciera_decode`` (header written
and checked in C, as ``Codec`` calls them) and delta's ``ciera_delta_histogram`` (its first pass),
each the best of ``--repeats`` calls after an untimed reset of the state or target, beside a
``memmove`` of the shard's bytes in the same loop, and torch's ``copy_`` of them at each thread
count (how far the machine's memory lets a copy scale: the codecs' own 2-thread speed-up is
bounded by it where they run at memory speed). Every decode is checked bit for bit.

For a before/after of a C change, ``--library`` times another build of the library (for example
an older commit's, built with ``python setup.py build_ext --inplace`` in a worktree); entry points
that build lacks are skipped. ``--cpu`` pins the process (the figures of a VM's vCPUs can differ).

    python tools/bench_native.py                         # 4M values, 1 and 2 threads
    python tools/bench_native.py --library OLD.so --cpu 1
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

import torch

from ciera import native
from ciera.codecs import as_bits, make_codec
from ciera.testing.trajectory import AdamTrajectory


def load_library(path: str | None) -> ctypes.CDLL:
    """The package's library (checked as ``Codec`` loads it), or the build at ``path``."""
    if path is None:
        lib = native.library()
        if lib is None:
            raise SystemExit(f"bench_native: {native.unavailable_reason()}")
        return lib
    return native.load_build(path)


def best_of(fn, reset, repeats: int) -> float:
    """Best wall time of ``repeats`` calls of ``fn``, each after an untimed ``reset``."""
    best = float("inf")
    for _ in range(repeats):
        reset()
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def bench(*, lib, name: str, prev: torch.Tensor, new: torch.Tensor, threads: int, repeats: int) -> list[tuple]:
    """(call, threads, seconds) rows for one codec at one thread count."""
    codec = make_codec(name, dtype=new.dtype, numel=new.numel(), backend="native")
    c_layout = native.c_layout(codec)  # kept alive while the library reads it
    layout = ctypes.addressof(c_layout)
    state, fresh = codec.new_state(shard=prev), codec.new_state(shard=prev)
    out = torch.empty(codec.clamp_capacity(codec.max_bytes), dtype=torch.uint8)
    pb, nb = as_bits(prev), as_bits(new)
    target = pb.clone()
    nbytes = state.numel() * state.element_size()
    needed = []

    def encode():
        needed.append(lib.ciera_encode(codec.codec_id, layout, nb.data_ptr(), state.data_ptr(), out.data_ptr(),
                                       out.numel(), threads))

    rows = [("encode", threads, best_of(encode, lambda: ctypes.memmove(state.data_ptr(), fresh.data_ptr(), nbytes),
                                        repeats))]
    native.raise_for(name, min(needed))
    length = max(needed)
    rows.append(("decode", threads, best_of(
        lambda: native.raise_for(name, lib.ciera_decode(codec.codec_id, layout, out.data_ptr(), length,
                                                        target.data_ptr(), threads)),
        lambda: ctypes.memmove(target.data_ptr(), pb.data_ptr(), target.numel() * 2), repeats)))
    if not torch.equal(target, nb):
        raise AssertionError(f"{name}: decode is not bit-exact ({threads} threads)")
    if name == "delta" and threads == 1 and hasattr(lib, "ciera_delta_histogram"):
        hist = torch.empty(codec.layout.n_classes * (codec.layout.width + 1), dtype=torch.int64)
        rows.append(("histogram pass", 1, best_of(
            lambda: lib.ciera_delta_histogram(layout, nb.data_ptr(), pb.data_ptr(), 0, nb.numel(), hist.data_ptr()),
            lambda: None, repeats)))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=1 << 22, help="values per shard (default 4M)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=30, help="AdamW steps before the measured pair")
    p.add_argument("--repeats", type=int, default=60, help="calls per figure; the best counts")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--codecs", nargs="+", default=["exponent_reuse", "delta"])
    p.add_argument("--library", default=None, help="another build of the library to time")
    p.add_argument("--cpu", type=int, nargs="+", default=None, help="pin the process to these CPUs")
    a = p.parse_args(argv)
    if a.cpu is not None:
        os.sched_setaffinity(0, set(a.cpu))
    lib = load_library(a.library)
    traj = AdamTrajectory(numel=a.numel, dtype=torch.bfloat16, lr=a.lr, seed=0)
    for _ in range(a.warmup):
        traj.step()
    prev = traj.current()
    new = traj.step()
    src, dst = as_bits(new), torch.empty_like(as_bits(new))
    nbytes = src.numel() * 2
    copy = best_of(lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes), lambda: None, a.repeats)
    print(f"library: {a.library or 'ciera/native (this checkout)'}; {a.numel} bf16 values, lr {a.lr:g}; "
          f"best of {a.repeats}; CPUs {sorted(os.sched_getaffinity(0))}")
    print("| codec | call | threads | ms | GB/s of values | x memmove |")
    print("|---|---|---|---|---|---|")
    print(f"| - | memmove | 1 | {copy * 1e3:.3f} | {nbytes / copy / 1e9:.2f} | 1.000 |")
    before = torch.get_num_threads()
    for k in a.threads:  # what the machine's memory gives a copy at each thread count, for the codecs' speed-ups
        torch.set_num_threads(k)
        sec = best_of(lambda: dst.copy_(src), lambda: None, a.repeats)
        print(f"| - | copy_ (torch) | {k} | {sec * 1e3:.3f} | {nbytes / sec / 1e9:.2f} | {copy / sec:.3f} |")
    torch.set_num_threads(before)
    for name in a.codecs:
        for k in a.threads:
            for call, threads, sec in bench(lib=lib, name=name, prev=prev, new=new, threads=k, repeats=a.repeats):
                print(f"| {name} | {call} | {threads} | {sec * 1e3:.3f} | {nbytes / sec / 1e9:.2f} | {copy / sec:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
