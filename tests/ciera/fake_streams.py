"""A recording fake of CUDA streams for CPU tests: the gather's device branch runs on CPU tensors
while every tensor access is attributed to the fake stream current at the time.

:class:`StreamRecorder` replaces ``torch.cuda.Stream``, ``Event``, ``current_stream``, ``stream``
and ``Tensor.record_stream`` and watches every aten op (a ``TorchDispatchMode``: the schema says
which arguments an op writes). Each stream keeps a vector clock; an event snapshots its stream's
clock and ``wait_event`` merges it, so "ordered before" is exactly what the recorded waits
establish (host syncs are not credited). It reports:

* a read of a storage whose last write, on another stream, is not ordered before it (and a write
  not ordered after the other streams' earlier reads and writes);
* a storage named with :meth:`StreamRecorder.label` used on a stream other than the one it was
  allocated on, without ``record_stream`` for that stream (on CUDA the caching allocator could
  hand its memory out while that stream still uses it).

Collectives are opaque to the dispatch mode: wrap them with :meth:`StreamRecorder.collective`.
"""

from __future__ import annotations

import contextlib
import itertools

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes


class FakeStream:
    _ids = itertools.count()

    def __init__(self, recorder: "StreamRecorder", name: str | None = None, **_):
        self.recorder = recorder
        self.name = name or f"stream{next(FakeStream._ids)}"
        self.clock: dict[str, int] = {self.name: 0}

    def tick(self) -> int:
        self.clock[self.name] += 1
        return self.clock[self.name]

    def wait_event(self, event: "FakeEvent") -> None:
        for k, v in event.snapshot.items():
            self.clock[k] = max(self.clock.get(k, 0), v)

    def wait_stream(self, other: "FakeStream") -> None:
        event = FakeEvent(self.recorder)
        event.record(other)
        self.wait_event(event)

    def synchronize(self) -> None:
        pass

    def __repr__(self):
        return self.name


class FakeEvent:
    def __init__(self, recorder: "StreamRecorder", **_):
        self.recorder, self.snapshot = recorder, {}

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.recorder.current
        self.snapshot = dict(stream.clock)

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, stream: FakeStream | None = None) -> None:
        (stream or self.recorder.current).wait_event(self)


class _Storage:
    """What the recorder knows of one storage: where it was allocated, its last write, the reads
    since, and the streams ``record_stream`` named."""

    def __init__(self, label: str, stream: FakeStream):
        self.label, self.alloc, self.named = label, stream, False
        self.last_write: tuple[FakeStream, int] | None = None
        self.reads: list[tuple[FakeStream, int]] = []
        self.used_on: set[str] = set()
        self.recorded: set[str] = set()


class StreamRecorder(TorchDispatchMode):
    """Install with ``with StreamRecorder(monkeypatch) as rec:``; read :attr:`violations`."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.default = FakeStream(self, "default")
        self.current = self.default
        self.violations: list[str] = []
        self._live: dict[int, _Storage] = {}
        self._retired: list[_Storage] = []
        self.labels: dict[int, str] = {}
        rec = self
        monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: FakeStream(rec, **{k_: v for k_, v in k.items()
                                                                                   if k_ == "name"}))
        monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: FakeEvent(rec))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: rec.current)
        monkeypatch.setattr(torch.cuda, "stream", self.stream)
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: rec.record_stream(t, s))

    # -- the fake torch.cuda ------------------------------------------------------------------
    @contextlib.contextmanager
    def stream(self, stream: FakeStream):
        before, self.current = self.current, stream
        try:
            yield stream
        finally:
            self.current = before

    def record_stream(self, t: torch.Tensor, stream: FakeStream) -> None:
        info = self._info(t, allocating=False)
        if info is not None:
            info.recorded.add(stream.name)

    def label(self, t: torch.Tensor, name: str) -> None:
        """Name ``t``'s storage in the violations."""
        info = self._info(t, allocating=False)
        if info is not None:
            info.label, info.named = name, True

    # -- accesses --------------------------------------------------------------------------------
    @staticmethod
    def _key(t: torch.Tensor) -> int | None:
        s = t.untyped_storage()
        return s.data_ptr() if s.nbytes() else None

    def _info(self, t: torch.Tensor, *, allocating: bool, what: str = "?") -> _Storage | None:
        key = self._key(t)
        if key is None:
            return None
        info = self._live.get(key)
        if info is None or allocating:
            if info is not None:
                self._retired.append(info)
            info = self._live[key] = _Storage(what, self.default if info is None and not allocating
                                              else self.current)
        return info

    def _before(self, access: tuple[FakeStream, int] | None, stream: FakeStream) -> bool:
        if access is None:
            return True
        other, pos = access
        return other is stream or stream.clock.get(other.name, 0) >= pos

    def access(self, t: torch.Tensor, *, write: bool, what: str, fresh: bool = False) -> None:
        stream = self.current
        info = self._info(t, allocating=fresh, what=what)
        if info is None:
            return
        pos = stream.tick()
        if not self._before(info.last_write, stream):
            self.violations.append(f"{what} on {stream} {'writes' if write else 'reads'} {info.label}, last "
                                   f"written on {info.last_write[0]} with no wait on that write")
        if write:
            late = [r for r in info.reads if not self._before(r, stream)]
            if late:
                self.violations.append(f"{what} on {stream} writes {info.label}, read on {late[0][0]} "
                                       f"with no wait on that read")
            info.last_write, info.reads = (stream, pos), []
        else:
            info.reads.append((stream, pos))
        info.used_on.add(stream.name)

    def collective(self, fn, *, reads, writes, name: str):
        """Run the real collective ``fn()`` unrecorded as one op on the current stream reading
        ``reads`` and writing ``writes``; a returned work's ``wait()`` makes the stream current
        then wait for it (as a CUDA collective's work does)."""
        for t in reads:
            self.access(t, write=False, what=name)
        for t in writes:
            self.access(t, write=True, what=name)
        done = FakeEvent(self)
        done.record(self.current)
        with _disable_current_modes():
            work = fn()
        if work is None:
            return None
        rec = self

        class Work:
            def wait(self_inner):
                with _disable_current_modes():
                    work.wait()
                rec.current.wait_event(done)
                for t in writes:  # a ring's later steps land at wait()
                    rec.access(t, write=True, what=f"{name}.wait")

        return Work()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        inputs = set()
        for arg, value in zip(schema.arguments, list(args) + [kwargs.get(a.name) for a in
                                                               schema.arguments[len(args):]]):
            for t in (value if isinstance(value, (list, tuple)) else [value]):
                if isinstance(t, torch.Tensor):
                    write = arg.alias_info is not None and arg.alias_info.is_write
                    self.access(t, write=write, what=str(func))
                    if self._key(t) is not None:
                        inputs.add(self._key(t))
        for t in (out if isinstance(out, (list, tuple)) else [out]):
            if isinstance(t, torch.Tensor) and self._key(t) is not None and self._key(t) not in inputs:
                self.access(t, write=True, what=str(func), fresh=True)
        return out

    # -- the verdict -----------------------------------------------------------------------------
    def unrecorded(self) -> list[str]:
        """Named storages (:meth:`label`) used on a stream other than their allocation's without
        ``record_stream`` there."""
        bad = []
        for info in self._retired + list(self._live.values()):
            if not info.named:
                continue
            missing = info.used_on - {info.alloc.name} - info.recorded
            if missing:
                bad.append(f"{info.label} (allocated on {info.alloc}) used on {sorted(missing)} without record_stream")
        return bad
