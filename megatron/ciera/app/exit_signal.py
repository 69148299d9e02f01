"""``--exit-signal-handler`` (Megatron-LM's flag): a signal (``--exit-signal``, SIGTERM by default:
what SLURM sends before a job's time limit or a preemption, and what torchrun forwards to every
rank's process group when it is itself terminated) ends training cleanly at the next iteration
boundary, after a checkpoint of that iteration.

As upstream's ``DistributedSignalHandler``: the handler only records the signal; the loop asks
every iteration, and the ranks agree (one small all-reduce), so that all of them save and stop at
the same iteration. The processes a rank started keep running through the signal (torchrun sends
it to the whole process group; a DataLoader worker would die of it): forked ones block it, and so
does the spawned persistent checkpoint worker (:func:`shielded`). The save has to finish within the
launcher's grace period (torchrun's ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, 30 s by default; SLURM's
``KillWait``, 30 s by default) before its SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

import torch
import torch.distributed as dist

__all__ = ["ExitSignal", "shielded"]

_WORKER_IGNORES_ENV = "CIERA_EXIT_SIGNAL"  # the signal number, while a handler is installed (shielded)


class ExitSignal:
    """The rank's handler of ``signum`` (installed by :meth:`install`; see the module)."""

    def __init__(self, signum: int):
        self.signum = int(signum)
        """The signal that asks for a checkpoint and a clean exit."""
        self.name = signal.Signals(self.signum).name
        """Its name, for the log line."""
        self.seen = threading.Event()
        """Set by the handler in this process."""

    @classmethod
    def install(cls, *, signum: int) -> "ExitSignal":
        """Record ``signum`` from now on in this process (and in the processes it forks)."""
        handler = cls(signum)
        signal.signal(handler.signum, handler._record)
        os.environ[_WORKER_IGNORES_ENV] = str(handler.signum)
        os.register_at_fork(after_in_child=handler._shield_child)
        return handler

    def _shield_child(self) -> None:
        """In a forked child: the signal stays pending, never delivered (it ends with its parent)."""
        signal.pthread_sigmask(signal.SIG_BLOCK, {self.signum})

    def _record(self, signum, frame) -> None:
        self.seen.set()

    def received(self) -> bool:
        """Collective: whether any rank has received the signal (the same answer on every rank)."""
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        flag = torch.tensor([int(self.seen.is_set())], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


@contextlib.contextmanager
def shielded():
    """Processes started inside the block, by fork + exec too (the spawned persistent checkpoint
    worker), never receive the rank's exit signal: it is blocked while they start, a mask they keep
    (the rank's final save at its exit signal still has its writer; the worker ends when the rank
    closes it, or with the rank's process group). A signal the rank receives meanwhile waits and is
    recorded after the block. A no-op without ``--exit-signal-handler``."""
    signum = os.environ.get(_WORKER_IGNORES_ENV, "")
    if not signum.isdigit():
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {int(signum)})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {int(signum)})
