"""Fail fast, say why, leave nothing behind: how a rank ends when something goes wrong.

* :func:`exit_on_error`: the rank that raised prints its error (first, once) and leaves with
  ``os._exit`` at once -- no collective, no barrier, no wait on its peers, no interpreter
  teardown (which would join forked writers). torchrun sees the non-zero exit and ends the
  other ranks within its monitor interval (0.1 s).
* :func:`guard_children`: every process this rank forks (DataLoader workers, checkpoint
  writers and their own children) is killed when its parent dies (Linux ``PR_SET_PDEATHSIG``),
  so no orphan outlives its rank.
  Under torchrun a sentinel process also ends the rank's whole process group when the rank dies,
  reaching what fork hooks cannot (processes started by fork + exec, as ``multiprocessing``'s
  spawn: megatron-core's checkpoint results Manager).
* :class:`explain_save_errors`: a full disk during a save becomes one line naming the path, the
  bytes the checkpoint needs and the bytes free.
* :func:`usage_error`: an argument error is printed once (rank 0) with a one-line usage hint.
* Every rank that fails writes its message to torch's elastic error file, so the launcher's
  summary names the cause; an error every rank raises alike is printed once for the job, naming
  the ranks (:func:`exit_on_error`).
* :mod:`megatron.ciera.app.watchdog` (the stall report, a dead child) ends a rank through
  :func:`exit_now` too; :func:`exit_on_error` asks it to describe a distributed timeout.
* :class:`FaultPlan`: ``CIERA_FAULT_INJECT=KIND:RANK:ITERATION`` makes one rank fail on purpose
  (tests): ``raise`` (an exception after that iteration's step), ``kill-writer`` (every process
  that rank forks for that iteration's checkpoint save kills itself with SIGKILL), ``stop``
  (the rank stops itself with SIGSTOP: a stalled peer).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass

FAULT_ENV = "CIERA_FAULT_INJECT"
_KILL_FORKED_ENV = "CIERA_FAULT_KILL_FORKED"  # set only around an injected save (see FaultPlan)
_FORKED = "forked"  # _KILL_FORKED_ENV's value once a process was forked inside the block
_ERROR_KEY = "ciera/error/"  # rendezvous-store keys of the errors being reported (exit_on_error)
_PR_SET_NAME = 15
# What a rank's forked child is, from where it was forked (the caller's file), as the watchdog names it.
_CHILD_ROLES = ((f"torch{os.sep}utils{os.sep}data{os.sep}", "dl-worker"), ("dist_checkpointing", "ckpt-writer"))
CHILD_NAMES = {"dl-worker": "DataLoader worker", "ckpt-writer": "checkpoint writer"}
"""Process names (``/proc/PID/comm``) :func:`name_process` gives a rank's children, and what they are."""
_PR_SET_PDEATHSIG = 1
# Backend errors that only say a peer's process ended (its own report names the cause).
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


# ---------------------------------------------------------------------------------------------
# children die with their parent

def die_with_parent() -> None:
    """In a forked child: be killed (SIGKILL) when the parent dies (Linux; a no-op elsewhere).
    A parent that died while the signal was being set (the child re-parented): exit at once."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            _libc().prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            return
    if os.getppid() != parent:
        os._exit(1)
    frame = sys._getframe(1)
    while frame is not None:
        role = next((r for anchor, r in _CHILD_ROLES if anchor in frame.f_code.co_filename), None)
        if role is not None:
            name_process(role)
            break
        frame = frame.f_back
    if os.environ.get(_KILL_FORKED_ENV):
        os.kill(os.getpid(), signal.SIGKILL)


def name_process(name: str) -> None:
    """Set this process's name (``/proc/self/comm``; a key of :data:`CHILD_NAMES`), which the
    watchdog reads to say what a dead child was (Linux; a no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        try:
            _libc().prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
        except (OSError, AttributeError):
            pass


def _note_fork() -> None:
    """Before a fork: the ``kill-writer`` fault (if armed) has a process to fire in."""
    if os.environ.get(_KILL_FORKED_ENV):
        os.environ[_KILL_FORKED_ENV] = _FORKED


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _start_sentinel() -> None:
    """Fork a sentinel that, when this process dies (however: SIGKILL too), kills this
    process's whole process group with SIGKILL. That reaches what :func:`die_with_parent` cannot:
    processes started by fork + exec (``multiprocessing`` spawn: megatron-core's checkpoint
    results Manager, the resource tracker), which run no at-fork hook. Only for a process that
    leads its own process group under torchrun (which starts every rank in a new session): the
    group is then this rank and its descendants, nothing of the caller's shell."""
    parent = os.getpid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    pid = os.fork()
    if pid:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
        return
    try:  # the sentinel: holds no file open, waits for its parent's death, then ends the group
        # (not ended by the launcher's SIGTERM to the group, which a rank may outlive: --exit-signal-handler)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _libc().prctl(_PR_SET_PDEATHSIG, int(signal.SIGUSR1), 0, 0, 0)
        os.closerange(0, 65536)
        if os.getppid() == parent:
            signal.sigwait({signal.SIGUSR1})
        os.killpg(0, signal.SIGKILL)
    finally:
        os._exit(0)


def guard_children() -> None:
    """Every process forked from now on (by any thread of any module) dies with its parent, and
    under torchrun a sentinel ends every process of the rank's process group when the rank dies
    (:func:`_start_sentinel`). Idempotent per process (a marker in the environment, per pid)."""
    marker = f"CIERA_CHILD_GUARD_{os.getpid()}"
    if os.environ.get(marker):
        return
    os.environ[marker] = "1"
    os.register_at_fork(before=_note_fork, after_in_child=die_with_parent)
    if (sys.platform.startswith("linux") and "TORCHELASTIC_RUN_ID" in os.environ
            and os.getpgid(0) == os.getpid()):
        _start_sentinel()


# ---------------------------------------------------------------------------------------------
# the error path

def _rank() -> int | None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    rank = os.environ.get("RANK")
    return int(rank) if rank is not None and rank.isdigit() else None


def _exit_code(exc: BaseException) -> int:
    if isinstance(exc, SystemExit):
        code = exc.code
        return code if isinstance(code, int) and code != 0 else 1
    return 130 if isinstance(exc, KeyboardInterrupt) else 1


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


@dataclass(frozen=True)
class ExitGate:
    """Who reports first: the main thread's error path or the watchdog thread. The first
    :meth:`claim` wins and its caller prints and exits; later claims return ``False`` and their
    caller only waits for the exit already under way."""

    lock: threading.Lock
    """Held by the first claimant, never released: the process is about to end."""

    @classmethod
    def new(cls) -> "ExitGate":
        return cls(threading.Lock())

    def claim(self) -> bool:
        return self.lock.acquire(blocking=False)


def exit_now(message: str, *, code: int = 1, gate: ExitGate | None = None) -> None:
    """Print ``message`` to stderr and end this process at once with ``code`` (never returns).
    With ``gate``: only the first caller prints; a later one waits for that caller's exit."""
    if gate is not None and not gate.claim():
        while True:
            time.sleep(60)
    _flush()
    if message:
        record_error(message)
        print(message, file=sys.stderr, flush=True)
    _flush()
    os._exit(code)


def record_error(message: str) -> None:
    """Write ``message`` to torch's elastic error file of this rank (``TORCHELASTIC_ERROR_FILE``,
    set by torchrun; the format of ``torch.distributed.elastic``'s ``ErrorHandler``), so that the
    launcher's failure summary shows it instead of "To enable traceback see ...". A no-op outside
    torchrun or when the file cannot be written."""
    import json

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or not message:
        return
    data = {"message": {"message": message.splitlines()[0],
                        "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass


def _store():
    """The job's rendezvous store (``None`` before the process group exists)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


def _report_once(message: str, rank: int) -> str | None:
    """For an error that every rank may raise alike (a ``SystemExit`` message): the line this rank
    prints, ``None`` when another rank prints it. The first rank to report it (a counter in the
    rendezvous store, keyed by the message with its numbers blanked) waits up to a second for the
    others and prints it once, naming the ranks that raised it; the others wait (up to 3 s) until
    it is printed, so that the launcher, which ends the job when the first rank exits, ends no
    rank before. Without a store the message is printed as it is."""
    import datetime
    import hashlib
    import re

    store = _store()
    if store is None:
        return message
    key = _ERROR_KEY + hashlib.sha256(re.sub(r"\d+", "#", message).encode()).hexdigest()[:16]
    try:
        store.set_timeout(datetime.timedelta(seconds=3))
        store.set(f"{key}/rank{rank}", "")
        first = store.add(key, 1) == 1
        if not first:
            store.wait([f"{key}/done"], datetime.timedelta(seconds=3))
            return None
        world = int(os.environ.get("WORLD_SIZE", "1"))
        deadline = time.time() + 1.0
        while store.add(key, 0) < world and time.time() < deadline:
            time.sleep(0.05)
        ranks = [r for r in range(world) if store.check([f"{key}/rank{r}"])]
    except Exception:  # noqa: BLE001 - the store is gone or slow: say it as it is
        return message
    if len(ranks) <= 1:
        return message
    who = f"ranks {_ranges(ranks)}" if len(ranks) < world else "every rank"
    own = f"rank {rank}: "
    return f"{who}: {message[len(own):]}" if message.startswith(own) else f"{message} [{who}]"


def _ranges(ranks: list[int]) -> str:
    """``0-3, 5``: ranks as ranges."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)


def _mark_reported(message: str) -> None:
    import hashlib
    import re

    store = _store()
    if store is not None:
        try:
            store.set(_ERROR_KEY + hashlib.sha256(re.sub(r"\d+", "#", message).encode()).hexdigest()[:16] + "/done", "")
        except Exception:  # noqa: BLE001 - the store is gone: nobody waits
            pass


def usage_error(message: str, *, prog: str = "pretrain_gpt.py") -> None:
    """An argument error (never returns; ``SystemExit(2)``, argparse's status): the message once,
    on rank 0 (every rank parses the same command line), with a one-line usage hint instead of
    argparse's usage of every flag; every rank's elastic error file names it."""
    text = f"{prog}: error: {message}"
    record_error(text)
    if _rank() in (0, None):
        print(f"{text}\n(usage: {prog} [Megatron-LM flags] [--ciera-* flags]; python {prog} --help lists them)",
              file=sys.stderr, flush=True)
    raise SystemExit(2)


def exit_on_error(exc: BaseException, *, watchdog=None) -> None:
    """The error path of a rank (never returns): report ``exc`` once and leave at once.

    A ``SystemExit`` carrying a message (the repo's clear errors) prints just that message, once
    for the job when several ranks raise it (:func:`_report_once`); a distributed timeout prints
    the watchdog's one line (collective, group, missing ranks) when it can name them
    (``watchdog``: the rank's :class:`megatron.ciera.app.watchdog.Watchdog`); a lost peer one line;
    anything else its traceback under a header naming the rank. The message goes to the rank's
    elastic error file too (:func:`record_error`)."""
    try:  # ending anyway: torch's DataLoader SIGCHLD handler must not raise in the middle of the report
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    except ValueError:  # not the main thread
        pass
    rank = _rank()
    who = f"rank {rank}" if rank is not None else "this process"
    if isinstance(exc, SystemExit):
        message = "" if exc.code is None or isinstance(exc.code, int) else str(exc.code)
        if message:
            _exit_reported_once(message, rank=rank, code=_exit_code(exc), watchdog=watchdog)
    else:
        stall = watchdog.stall(exc) if watchdog is not None else None
        lost = next((m for m in _PEER_LOST if m in str(exc)), None)
        worker = _dataloader_worker_error(exc)
        if stall is not None:
            message = stall
        elif worker is not None:  # torch's DataLoader noticed its dead worker before the watchdog did
            phase = getattr(watchdog, "phase", None)
            message = (f"{who}: its DataLoader worker {worker}" + (f" during {phase}" if phase else "")
                       + "; ending this rank now (the launcher ends the others)")
        elif lost is not None:  # a consequence: the peer that failed printed the cause
            where = describe_wait(list(traceback.walk_tb(exc.__traceback__)))
            _exit_reported_once(f"{who}: a peer went away during {where} ({lost}): ending this rank; the cause is "
                                "the failing rank's own error", rank=rank, code=_exit_code(exc), watchdog=watchdog)
        else:
            message = (f"{who}: {type(exc).__name__} (ending this rank now; the launcher ends the others):\n"
                       + "".join(traceback.format_exception(exc)).rstrip())
    exit_now(message, code=_exit_code(exc), gate=watchdog.gate if watchdog is not None else None)


def _dataloader_worker_error(exc: BaseException) -> str | None:
    """What torch's DataLoader said of a dead worker (``(pid 123) is killed by signal: Killed``),
    if ``exc`` or an exception it was raised from says it; else ``None``."""
    import re

    seen = exc
    for _ in range(20):
        if seen is None:
            return None
        found = re.search(r"DataLoader worker (\(pids?\(?s?\)? [^)]*\)[^\n.]*)", str(seen))
        if found:
            return found.group(1).strip()
        in_loader = any(f"torch{os.sep}utils{os.sep}data{os.sep}" in frame.f_code.co_filename
                        for frame, _ in traceback.walk_tb(seen.__traceback__))
        if in_loader and any(m in str(seen) for m in _PEER_LOST):  # the pipe from a worker that died
            return f"died ({type(seen).__name__}: {str(seen).strip()[:120]} from its pipe)"
        seen = seen.__cause__ or seen.__context__
    return None


def _exit_reported_once(message: str, *, rank: int | None, code: int, watchdog) -> None:
    """End this rank (never returns) with ``message``, printed once for every rank that reports
    the same (:func:`_report_once`); the launcher's SIGTERM waits until it is said."""
    record_error(message)
    if watchdog is not None and not watchdog.gate.claim():
        _wait_forever()
    try:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # ending anyway: say it first (the launcher's SIGKILL stays)
    except ValueError:  # not the main thread
        pass
    line = _report_once(message, rank if rank is not None else 0)
    if line is not None:
        _flush()
        print(line, file=sys.stderr, flush=True)
        _mark_reported(message)
    _flush()
    os._exit(code)


def _wait_forever() -> None:
    """Another thread of this rank is already reporting and ending it."""
    while True:
        time.sleep(60)


# ---------------------------------------------------------------------------------------------
# a failed save, explained

# How a full disk shows through the writers: the OS's errno, or torch's zip writer noticing that a
# write came up short ("unexpected pos", with the errno lost).
_DISK_FULL_SIGNS = ("No space left on device", "unexpected pos", "Disk quota exceeded")
# How the ranks whose own write did not fail see a full disk on another (megatron-core gathers the
# writers' failures): counted as a full disk only while the file system is short of space too.
_PEER_FAILED_SIGNS = ("Worker failure", "CheckpointException")
NEEDED_ATTR = "ciera_bytes_needed"
"""Attribute a failed save's exception carries: the bytes the whole checkpoint needs (all ranks)."""
_LOW_SPACE_BYTES = 64 << 20


def disk_full_message(exc: BaseException, path: str) -> str | None:
    """One line naming ``path`` and the bytes free there if ``exc`` (or an exception it was
    raised from) is a full disk: ``ENOSPC`` / ``EDQUOT``, or a writer error while the file system
    holding ``path`` has under 64 MiB left. ``None`` otherwise."""
    import errno
    import shutil

    chain, seen = [], exc
    while seen is not None and len(chain) < 20:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    errnos = {getattr(e, "errno", None) for e in chain}
    needed = next((getattr(e, NEEDED_ATTR) for e in chain if getattr(e, NEEDED_ATTR, None)), None)
    signs = any(sign in f"{type(e).__name__}: {e}" for e in chain for sign in (*_DISK_FULL_SIGNS, *_PEER_FAILED_SIGNS))
    probe = path
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    try:
        free = shutil.disk_usage(probe or ".").free
    except OSError:
        free = None
    short = free is not None and (free < _LOW_SPACE_BYTES or (needed is not None and free < needed))
    if not (errnos & {errno.ENOSPC, errno.EDQUOT} or (signs and short)):
        return None
    left = f"{free} bytes free" if free is not None else "free space unknown"
    need = f"the checkpoint needs about {needed} bytes, " if needed else ""
    return (f"saving a checkpoint under {path} failed: the disk is full ({need}{left} on {probe}); the previous checkpoint is intact. Free space there or choose another --save")


class noting_bytes_needed:
    """Context manager around a checkpoint write: an exception leaving it carries ``needed``, the
    bytes the checkpoint takes (:data:`NEEDED_ATTR`), for :func:`disk_full_message`."""

    def __init__(self, needed: int | None):
        self.needed = needed

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is not None and self.needed and not getattr(exc, NEEDED_ATTR, None):
            try:
                setattr(exc, NEEDED_ATTR, self.needed)
            except AttributeError:
                pass
        return False


class explain_save_errors:
    """Context manager around a checkpoint save: a full disk becomes one ``SystemExit`` line
    (:func:`disk_full_message`); anything else passes unchanged."""

    def __init__(self, path: str | None):
        self.path = path

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        # (torch's CheckpointException, which megatron-core raises for a failed write, is a BaseException)
        if exc is not None and self.path and not isinstance(exc, (SystemExit, KeyboardInterrupt, GeneratorExit)):
            message = disk_full_message(exc, self.path)
            if message is not None:
                raise SystemExit(message) from exc
        return False


# ---------------------------------------------------------------------------------------------
# fault injection (tests)

@dataclass(frozen=True)
class FaultPlan:
    """One injected fault, from ``CIERA_FAULT_INJECT=KIND:RANK:ITERATION`` (see the module)."""

    kind: str
    """``raise``, ``kill-writer`` or ``stop``."""
    rank: int
    """The global rank that fails."""
    iteration: int
    """The iteration after whose step (``raise``, ``stop``) or at whose save (``kill-writer``) it fails."""

    KINDS = ("raise", "kill-writer", "stop")

    @classmethod
    def from_env(cls, environ=os.environ) -> "FaultPlan | None":
        text = environ.get(FAULT_ENV, "")
        if not text:
            return None
        parts = text.split(":")
        if len(parts) != 3 or parts[0] not in cls.KINDS or not all(p.isdigit() for p in parts[1:]):
            raise SystemExit(f"{FAULT_ENV}={text!r}: expected KIND:RANK:ITERATION with KIND one of {cls.KINDS}")
        return cls(parts[0], int(parts[1]), int(parts[2]))

    def fires(self, kind: str, *, rank: int, iteration: int) -> bool:
        return (self.kind, self.rank, self.iteration) == (kind, rank, iteration)

    def text(self) -> str:
        return f"{FAULT_ENV}={self.kind}:{self.rank}:{self.iteration}"

    def warn_if_unreachable(self, *, rank: int, world_size: int, args) -> None:
        """At start-up (rank 0 says it): a fault whose rank does not exist, or a ``kill-writer``
        at an iteration that saves no checkpoint, cannot fire."""
        why = None
        if self.rank >= world_size:
            why = f"there is no rank {self.rank} (world size {world_size})"
        elif self.kind == "kill-writer":
            save_interval, train_iters = getattr(args, "save_interval", None), getattr(args, "train_iters", None)
            if not getattr(args, "save", None):
                why = "no --save: no checkpoint is written"
            elif not ((save_interval and self.iteration % save_interval == 0) or self.iteration == train_iters):
                why = f"no checkpoint is saved at iteration {self.iteration} (--save-interval {save_interval})"
        if why and rank == 0:
            print(f"WARNING: {self.text()}: {why}; the injected fault cannot fire", flush=True)


def inject_after_step(plan: FaultPlan | None, *, rank: int, iteration: int) -> None:
    """The ``raise`` and ``stop`` faults (a no-op without a plan)."""
    if plan is None:
        return
    if plan.fires("raise", rank=rank, iteration=iteration):
        raise RuntimeError(f"{FAULT_ENV}: fault injected on rank {rank} after iteration {iteration}")
    if plan.fires("stop", rank=rank, iteration=iteration):
        print(f"{FAULT_ENV}: rank {rank} stops itself (SIGSTOP) after iteration {iteration}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)


class kill_forked_children:
    """Context manager: with ``active``, every process forked inside the block kills itself at
    once (SIGKILL) -- the ``kill-writer`` fault, a checkpoint writer dying mid-save. A block that
    forked nothing (a rank with nothing to write in the background, or megatron-core writing with
    threads) says that the fault (``plan``) could not fire, unless ``spawned`` (the persistent
    worker, killed by the caller)."""

    def __init__(self, active: bool, *, plan: FaultPlan | None = None, spawned: bool = False):
        self.active, self.plan, self.spawned = active, plan, spawned
        self.forked = False
        """Whether a process was forked inside the (active) block."""

    def __enter__(self):
        if self.active:
            os.environ[_KILL_FORKED_ENV] = "1"
        return self

    def __exit__(self, kind, exc, tb):
        self.forked = os.environ.pop(_KILL_FORKED_ENV, None) == _FORKED
        if self.active and not self.forked and not self.spawned and kind is None:
            what = self.plan.text() if self.plan is not None else FAULT_ENV
            print(f"WARNING: {what}: this rank forked no checkpoint writer for this save (nothing of its own to "
                  "write in a background process); the injected fault cannot fire", flush=True)
        return False


# ---------------------------------------------------------------------------------------------
# where a rank waits

def describe_wait(frames) -> str:
    """Where the rank waits: the innermost ``torch.distributed`` call (``all_reduce``, ...)
    and the caller outside torch, from ``frames`` (outermost first)."""
    import sysconfig

    stdlib = sysconfig.get_paths()["stdlib"]
    call = caller = None
    for frame, lineno in frames:
        path = frame.f_code.co_filename
        in_torch = f"{os.sep}torch{os.sep}" in path
        if in_torch and path.endswith("distributed_c10d.py"):
            call = call or frame.f_code.co_name.lstrip("_")
        elif not in_torch and call is None and not path.startswith(stdlib) and not path.startswith("<"):
            caller = f"{frame.f_code.co_name} ({_short(path)}:{lineno})"
    if call:
        return f"{call} called from {caller}" if caller else call
    return caller or "an unknown place"


def _short(path: str) -> str:
    """``path`` as a reader finds it: below site-packages, else relative to this checkout's root
    (which holds ``megatron/ciera``), else as the interpreter was given it."""
    site = f"{os.sep}site-packages{os.sep}"
    if site in path:
        return path.split(site, 1)[1]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))) + os.sep
    return path[len(root):] if path.startswith(root) else path
