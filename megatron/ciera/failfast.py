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
* :class:`explain_save_errors`: a full disk during a save becomes one line naming the path and the
  bytes free.
* :mod:`megatron.ciera.watchdog` (the stall report, a dead child) ends a rank through
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
    if os.environ.get(_KILL_FORKED_ENV):
        os.kill(os.getpid(), signal.SIGKILL)


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
    os.register_at_fork(after_in_child=die_with_parent)
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
        print(message, file=sys.stderr, flush=True)
    _flush()
    os._exit(code)


def exit_on_error(exc: BaseException, *, watchdog=None) -> None:
    """The error path of a rank (never returns): report ``exc`` once and leave at once.

    A ``SystemExit`` carrying a message (the repo's clear errors) prints just that message; a
    distributed timeout prints the watchdog's one line (collective, group, missing ranks) when it
    can name them (``watchdog``: the rank's :class:`megatron.ciera.watchdog.Watchdog`); a lost
    peer one line; anything else its traceback under a header naming the rank."""
    rank = _rank()
    who = f"rank {rank}" if rank is not None else "this process"
    if isinstance(exc, SystemExit):
        message = "" if exc.code is None or isinstance(exc.code, int) else str(exc.code)
    else:
        stall = watchdog.stall(exc) if watchdog is not None else None
        lost = next((m for m in _PEER_LOST if m in str(exc)), None)
        if stall is not None:
            message = stall
        elif lost is not None:  # a consequence: the peer that failed printed the cause
            where = describe_wait(list(traceback.walk_tb(exc.__traceback__)))
            message = (f"{who}: a peer went away during {where} ({lost}): ending this rank; "
                       "the cause is the failing rank's own error")
        else:
            message = (f"{who}: {type(exc).__name__} (ending this rank now; the launcher ends the others):\n"
                       + "".join(traceback.format_exception(exc)).rstrip())
    exit_now(message, code=_exit_code(exc), gate=watchdog.gate if watchdog is not None else None)


# ---------------------------------------------------------------------------------------------
# a failed save, explained

# How a full disk shows through the writers: the OS's errno, or torch's zip writer noticing that a
# write came up short ("unexpected pos", with the errno lost).
_DISK_FULL_SIGNS = ("No space left on device", "unexpected pos", "Disk quota exceeded")
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
    signs = any(sign in str(e) for e in chain for sign in _DISK_FULL_SIGNS)
    probe = path
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    try:
        free = shutil.disk_usage(probe or ".").free
    except OSError:
        free = None
    if not (errnos & {errno.ENOSPC, errno.EDQUOT} or (signs and free is not None and free < _LOW_SPACE_BYTES)):
        return None
    left = f"{free} bytes free" if free is not None else "free space unknown"
    return (f"saving a checkpoint under {path} failed: the disk is full ({left} on {probe}); the previous "
            f"checkpoint is intact. Free space there or choose another --save ({type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''})")


class explain_save_errors:
    """Context manager around a checkpoint save: a full disk becomes one ``SystemExit`` line
    (:func:`disk_full_message`); anything else passes unchanged."""

    def __init__(self, path: str | None):
        self.path = path

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is not None and self.path and isinstance(exc, Exception):
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
    once (SIGKILL) -- the ``kill-writer`` fault, a checkpoint writer dying mid-save."""

    def __init__(self, active: bool):
        self.active = active

    def __enter__(self):
        if self.active:
            os.environ[_KILL_FORKED_ENV] = "1"
        return self

    def __exit__(self, *exc):
        os.environ.pop(_KILL_FORKED_ENV, None)
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
    for anchor in (f"{os.sep}site-packages{os.sep}", f"{os.sep}megatron{os.sep}ciera{os.sep}"):
        if anchor in path:
            return path.split(anchor, 1)[1] if "site-packages" in anchor else "megatron/ciera/" + path.split(anchor, 1)[1]
    return os.path.basename(path)
