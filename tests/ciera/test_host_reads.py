"""Between the size agreement and the end of ``wait()`` the compressed path makes no host read and
no allocation: every aten op the gather's own code issues there is watched by a dispatch mode.

The codec implementations behind ``Codec.decode_many``'s dispatch are outside the watch (the pure
torch references loop on the host by design; the Triton twins have their own contract and tests,
and the Triton interpreter converts tensors on the host itself). The guard is proven to bite: the
same run with one ``.item()``, ``.tolist()``, ``.cpu()`` or ``torch.empty`` inserted into the
gather's completion must fail.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from ciera import CieraAllGather, CieraConfig
from ciera.codecs import Codec, as_bits
from ciera.testing import run_on_ranks
from ciera.testing.trajectory import AdamTrajectory

pytestmark = pytest.mark.distributed


class HostSyncError(AssertionError):
    """A host read or an allocation on the watched path."""


class HostSyncGuard(TorchDispatchMode):
    """While active (and not :meth:`suspended`): any aten op that reads a value on the host
    (``_local_scalar_dense``: ``.item()``, ``int(t)``, ``bool(t)``) or returns a fresh tensor
    raises; so do ``Tensor.cpu``, ``.tolist``, ``.numpy`` (which bypass dispatch on CPU tensors).
    Collectives (``c10d``) are allowed."""

    def __init__(self):
        super().__init__()
        self._suspended = 0
        self.watched_ops = 0

    @contextlib.contextmanager
    def suspended(self):
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._suspended and func.namespace != "c10d":
            self.watched_ops += 1
            if func is torch.ops.aten._local_scalar_dense.default:
                raise HostSyncError(f"host read on the compressed path: {func}")
            returns = func._schema.returns
            if any(r.alias_info is None and "Tensor" in str(r.type) for r in returns):
                raise HostSyncError(f"allocation on the compressed path: {func}")
        return func(*args, **(kwargs or {}))

    def check_host_method(self, name):
        if not self._suspended and self in _active:
            raise HostSyncError(f"host read on the compressed path: Tensor.{name}()")


_active = []


@contextlib.contextmanager
def watching(guard: HostSyncGuard):
    """Activate ``guard`` and route the codec dispatch boundary and the host-only Tensor methods
    through it."""
    originals = {n: getattr(torch.Tensor, n) for n in ("cpu", "tolist", "numpy")}
    impl = Codec._decode_many_impl

    def wrap_method(name):
        def method(self, *a, **k):
            guard.check_host_method(name)
            return originals[name](self, *a, **k)
        return method

    def boundary(self, t):
        fn = impl(self, t)

        def call(**kw):
            with guard.suspended():
                return fn(**kw)
        return call

    try:
        for n in originals:
            setattr(torch.Tensor, n, wrap_method(n))
        Codec._decode_many_impl = boundary
        _active.append(guard)
        with guard:
            yield guard
    finally:
        _active.remove(guard)
        Codec._decode_many_impl = impl
        for n, f in originals.items():
            setattr(torch.Tensor, n, f)


INJECTIONS = {
    None: None,
    "item": lambda g: g._offsets[0].item(),
    "int": lambda g: int(g._offsets[0]),
    "tolist": lambda g: g._offsets.tolist(),
    "cpu": lambda g: g._offsets.cpu(),
    "alloc": lambda g: torch.empty(4, dtype=torch.uint8),
    "clone": lambda g: g._offsets.clone(),
}


def _run(rank, world, codec, inject, steps=8, shard=2048):
    buf = torch.zeros(shard * world, dtype=torch.bfloat16)
    ref = torch.zeros_like(buf)
    traj = AdamTrajectory(numel=shard, seed=rank)
    gather = CieraAllGather(buf, config=CieraConfig(codec=codec, selection="always"), name=f"{codec}")
    if inject is not None:
        original = gather._finish

        def finish(work, plan, launched):
            try:
                if not plan.raw:
                    INJECTIONS[inject](gather)  # the regression this test exists to catch
            finally:  # the collective completes either way: a gloo work left in flight aborts the
                original(work, plan, launched)  # process at exit ("terminate called ...")
        gather._finish = finish
    guard = HostSyncGuard()
    for _ in range(steps):
        x = traj.step()
        buf.view(world, -1)[rank].copy_(x)
        CieraAllGather.prepare_many([gather])  # the size agreement: host reads allowed up to here
        raw = gather.plan.raw
        try:
            with watching(guard):
                gather.start().wait()
        except HostSyncError as e:
            return str(e)
        assert raw or guard.watched_ops > 0, "the guard saw nothing: it would not catch a regression"
        dist.all_gather_into_tensor(ref, x)
        assert torch.equal(as_bits(buf), as_bits(ref))
    return gather.stats.compressed_gathers


def _worker(rank, world, cases):
    return [_run(rank, world, codec, inject) for codec, inject in cases]


def test_compressed_path_has_no_host_reads_and_no_allocations():
    cases = [("exponent_reuse", None), ("delta", None)] + [("delta", k) for k in INJECTIONS if k]
    results = run_on_ranks(_worker, world=2, args=(cases,))
    for rank_results in results:
        clean, rest = rank_results[:2], rank_results[2:]
        assert all(isinstance(n, int) and n >= 6 for n in clean), clean  # compressed gathers ran watched
        for (_, inject), err in zip(cases[2:], rest):
            assert isinstance(err, str) and ("host read" in err or "allocation" in err), (inject, err)


def _zero3_run(rank, world, cache, codec, steps=6, shard=2048):
    """ZeRO-3 (ciera.zero3): ``start()`` proposes and agrees (host reads allowed); the handle's
    ``wait()`` (decode, receiver cache, the sent copy) is watched, for fresh gathers and replays."""
    from ciera.zero3 import Zero3Gather

    g = Zero3Gather(config=CieraConfig(codec=codec, selection="always", cache=cache), name=f"z3-{cache}")
    traj = AdamTrajectory(numel=shard, seed=rank)
    ref = torch.empty(world * shard, dtype=torch.bfloat16)
    guard = HostSyncGuard()
    for step in range(steps):
        x = traj.step()
        if step:
            g.step()
        for _ in range(3):  # the forward's fresh gather, then replays
            out = g.allocate(numel=world * shard, dtype=torch.bfloat16, device=torch.device("cpu"))
            out.view(world, shard)[rank].copy_(x)
            handle = g.start(output=out, input=out.view(world, shard)[rank])
            try:
                with watching(guard):
                    handle.wait()
            except HostSyncError as e:
                return str(e)
            dist.all_gather_into_tensor(ref, x)
            assert torch.equal(as_bits(out), as_bits(ref))
    assert guard.watched_ops > 0, "the guard saw nothing: it would not catch a regression"
    return g.stats.compressed_gathers


def _zero3_worker(rank, world):
    return [_zero3_run(rank, world, cache, codec) for cache, codec in (("exponents", "exponent_reuse"),
                                                                      ("values", "delta"))]


def test_zero3_wait_has_no_host_reads_and_no_allocations():
    for rank_results in run_on_ranks(_zero3_worker, world=2):
        assert all(isinstance(n, int) and n >= 4 for n in rank_results), rank_results
