"""The watchdog of a rank: a daemon thread that ends the rank, in one line, when waiting can only
end badly (:class:`Watchdog`).

1. It publishes the rank's collective sequence number of every process group, its host, pid and a
   heartbeat to the rendezvous store (every second).
2. It ends the rank when one of its child processes dies by a fatal signal (a dead checkpoint
   writer would otherwise leave the rank waiting on it forever); the line says what the child was
   (DataLoader worker, checkpoint writer: :func:`megatron.ciera.app.failfast.name_process`) and where
   the training loop was (:attr:`Watchdog.phase`, e.g. "iteration 5's forward-backward").
3. It ends the rank when the main thread has waited on communication for the distributed timeout
   while peers of that group never entered the collective; the line names the collective (the
   ``torch.distributed`` call and its caller), the group (name, description, ranks) and the ranks
   that did not arrive. The backend's own timeout error is turned into the same line by
   :meth:`Watchdog.stall` (``failfast.exit_on_error``). A silent (stopped or hung) peer on this host
   is sent SIGTERM + SIGCONT, so that it ends with the job.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
import traceback

from .failfast import CHILD_NAMES, ExitGate, describe_wait, exit_now

_STORE_PREFIX = "ciera/watchdog/"
# A child killed by one of these died by accident or by force; SIGTERM / SIGINT are how parents
# (DataLoader shutdown, megatron-core's abort) end children on purpose.
_FATAL_CHILD_SIGNALS = frozenset({signal.SIGKILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL,
                                  signal.SIGFPE})


def _children() -> list[int]:
    """Pids of this process's children (every thread's), zombies included (Linux ``/proc``)."""
    out = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                out += [int(p) for p in f.read().split()]
        except OSError:
            continue
    return out


def _killed_child() -> tuple[int, int] | None:
    """(pid, signal) of a child that died by a fatal signal and is not yet reaped (peeked with
    ``WNOWAIT``: whoever owns the child still reaps it)."""
    flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
    for pid in _children():
        try:
            info = os.waitid(os.P_PID, pid, flags)
        except (ChildProcessError, OSError):
            continue
        if info is not None and info.si_code in (os.CLD_KILLED, os.CLD_DUMPED) and info.si_status in _FATAL_CHILD_SIGNALS:
            return pid, info.si_status
    return None


def _child_name(pid: int) -> str:
    """What child ``pid`` is (its process name, set when it was started), else "child process"."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
    except OSError:
        return "child process"
    return CHILD_NAMES.get(comm, "child process")


def _blocking(frame) -> bool:
    """Whether the main thread's innermost frame waits on communication: a ``torch.distributed``
    function, or a line calling ``.wait(`` (a collective's handle) or ``synchronize(``."""
    import linecache

    path = frame.f_code.co_filename
    if f"{os.sep}torch{os.sep}distributed{os.sep}" in path:
        return True
    line = linecache.getline(path, frame.f_lineno)
    return ".wait(" in line or "synchronize(" in line


def _walk(frame):
    """(frame, line) pairs from the outermost caller to ``frame``."""
    out = []
    while frame is not None:
        out.append((frame, frame.f_lineno))
        frame = frame.f_back
    return out[::-1]


class Watchdog:
    """Per-rank daemon thread (see the module docstring). ``timeout_s``: the distributed
    timeout; a stall is declared after it (plus ``grace_s``, so that the backend's own timeout
    error, which :func:`megatron.ciera.app.failfast.exit_on_error` turns into the same line, normally comes first)."""

    def __init__(self, *, timeout_s: float, period_s: float = 1.0, grace_s: float = 5.0):
        import torch.distributed as dist

        self.timeout_s, self.period_s, self.grace_s = timeout_s, period_s, grace_s
        self.rank = dist.get_rank()
        self.gate = ExitGate.new()
        self.store = dist.distributed_c10d._get_default_store()
        self.main_thread = threading.main_thread()
        self._stop = threading.Event()
        self._seen: dict[str, tuple[int, float]] = {}  # group -> (own sequence number, since when)
        self._checked: dict[str, int] = {}  # group -> the number last found not stalled
        self._top: tuple = (None, time.time())  # (main thread's innermost frame and line, since when)
        self._silent: dict[int, dict] = {}  # rank -> its last published state, for silent peers
        self._thread = threading.Thread(target=self._run, name="ciera-watchdog", daemon=True)
        self.phase: str | None = None
        """Where the training loop is (set by the loop; ``None`` outside it)."""

    def start(self) -> "Watchdog":
        self._publish()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Disarm (the run ends normally): no more checks of children or collectives."""
        self._stop.set()
        self._thread.join(timeout=5 * self.period_s)

    # -- publication -------------------------------------------------------------------------
    @staticmethod
    def _groups() -> dict[str, object]:
        import torch.distributed as dist

        return {name: pg for pg, name in list(dist.distributed_c10d._world.pg_names.items())}

    def _sequences(self) -> dict[str, int]:
        out = {}
        for name, pg in self._groups().items():
            try:
                out[name] = int(pg._get_sequence_number_for_group())
            except (RuntimeError, AttributeError):
                continue
        return out

    def _publish(self) -> None:
        state = {"t": time.time(), "seq": self._sequences(), "host": socket.gethostname(), "pid": os.getpid()}
        self.store.set(f"{_STORE_PREFIX}{self.rank}", json.dumps(state))

    def _peer(self, rank: int) -> dict | None:
        key = f"{_STORE_PREFIX}{rank}"
        try:
            if not self.store.check([key]):
                return None
            return json.loads(self.store.get(key))
        except (RuntimeError, ValueError):
            return None

    # -- the report ----------------------------------------------------------------------------
    def _behind(self, name: str, pg, own: int, now: float) -> list[str]:
        """The members of group ``name`` that have not entered this rank's collective ``own``
        (or entered it and then fell silent), read from the store."""
        import torch.distributed as dist

        out = []
        for r in dist.get_process_group_ranks(pg):
            if r == self.rank:
                continue
            peer = self._peer(r)
            if peer is None:
                out.append(f"rank {r} (never heard from)")
                continue
            seq = peer["seq"].get(name, 0)
            silent = max(0.0, now - peer["t"])
            if silent > 3 * self.period_s + 2:
                self._silent[r] = peer
            if seq < own:
                out.append(f"rank {r} (its last word: collective {seq} of the group, {silent:.0f} s ago)")
            elif silent > 3 * self.period_s + 2:
                out.append(f"rank {r} (entered it, then silent for {silent:.0f} s: stopped or hung)")
        return out

    def _stalled_groups(self, now: float, names=None) -> list[tuple[str, object, int, list[str]]]:
        mine = self._sequences()
        out = []
        for name, pg in self._groups().items():
            own = mine.get(name, 0)
            if own == 0 or (names is not None and name not in names):
                continue
            behind = self._behind(name, pg, own, now)
            if behind:
                out.append((name, pg, own, behind))
        return out

    def _line(self, groups, where: str, waited: float | None, backend: str = "") -> str:
        import torch.distributed as dist

        name, pg, own, behind = groups[0]
        desc = getattr(pg, "group_desc", "") or ""
        label = f"group {name}" + (f" {desc}" if desc and desc != "undefined" else "")
        waited_text = f" after {waited:.0f} s" if waited is not None else ""
        tail = f" [{backend}]" if backend else ""
        return (f"rank {self.rank}: stalled{waited_text} in {where}, collective {own} of {label} "
                f"(ranks {dist.get_process_group_ranks(pg)}): did not arrive: {', '.join(behind)}{tail}")

    def stall(self, exc: BaseException) -> str | None:
        """For the main thread's error path: the one-line stall report if ``exc`` is a
        distributed timeout and peers are behind on one of this rank's groups, else ``None``."""
        text = str(exc)
        if "timed out" not in text.lower() and "timeout" not in text.lower():
            return None
        groups = self._stalled_groups(time.time())
        if not groups:
            return None
        frames = list(traceback.walk_tb(exc.__traceback__))
        last = text.strip().splitlines()[-1] if text.strip() else ""
        line = self._line(groups, describe_wait(frames), self.timeout_s, backend=last[-160:])
        return line + self._end_silent_local_peers()

    def _end_silent_local_peers(self) -> str:
        """SIGTERM, then SIGCONT, to the silent peers on this host (checked to be that rank of this
        job): a stopped process acts on no signal but SIGKILL until continued, and torchrun waits 30 s
        before its SIGKILL. A hung one takes the SIGTERM as the launcher's own. Returns a note."""
        ended = []
        for rank, peer in sorted(self._silent.items()):
            pid = peer.get("pid")
            if peer.get("host") != socket.gethostname() or not isinstance(pid, int):
                continue
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
            except OSError:
                continue
            run_id = os.environ.get("TORCHELASTIC_RUN_ID", "").encode()
            if env.get(b"RANK") != str(rank).encode() or env.get(b"TORCHELASTIC_RUN_ID", b"") != run_id:
                continue
            try:
                os.kill(pid, signal.SIGTERM)
                os.kill(pid, signal.SIGCONT)
                ended.append(str(rank))
            except OSError:
                continue
        return f"; ended rank {', '.join(ended)} on this host (SIGTERM + SIGCONT)" if ended else ""

    # -- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self._publish()
            except Exception:  # noqa: BLE001 - the store went away: the job is ending anyway
                return
            killed = _killed_child()
            if killed is not None and not self._stop.is_set():
                pid, sig = killed
                where = (f"during {self.phase}" if self.phase else
                         f"while this rank was in {describe_wait(_walk(sys._current_frames().get(self.main_thread.ident)))}")
                exit_now(f"rank {self.rank}: its {_child_name(pid)} (pid {pid}) was killed by {signal.Signals(sig).name} "
                         f"{where}; ending this rank now (the launcher ends the others)", gate=self.gate)
            self._check_stall()

    def _check_stall(self) -> None:
        """A stall: the main thread has waited on the same line -- a ``torch.distributed`` call
        or a ``.wait()`` -- for the timeout (plus grace) while a group's sequence number stayed
        put, and peers of that group are behind. Each (group, number) is read from the store
        once, so an idle group costs nothing."""
        now = time.time()
        frame = sys._current_frames().get(self.main_thread.ident)
        top = (id(frame), frame.f_lineno if frame is not None else None)
        if top != self._top[0]:
            self._top = (top, now)
        mine = self._sequences()
        self._seen = {n: (s, t) if s == mine.get(n) else (mine[n], now)
                      for n, (s, t) in self._seen.items() if n in mine}
        for name, seq in mine.items():
            self._seen.setdefault(name, (seq, now))
        limit = self.timeout_s + self.grace_s
        if frame is None or now - self._top[1] < limit or not _blocking(frame):
            return
        due = {n for n, (s, t) in self._seen.items() if now - t >= limit and self._checked.get(n) != s}
        if not due:
            return
        groups = self._stalled_groups(now, names=due)
        self._checked.update({n: self._seen[n][0] for n in due})
        if groups and not self._stop.is_set():
            line = self._line(groups, describe_wait(_walk(frame)), now - self._top[1])
            exit_now(line + self._end_silent_local_peers(), gate=self.gate)
