"""``--async-save``: megatron-core writes a checkpoint's tensors in a background process while
training goes on; the checkpoint is published (checksums, rename, tracker) only once every rank's
write is finished.

The background writer is megatron-core's, chosen as Megatron-LM chooses it:

* ``--use-persistent-ckpt-worker``: one long-lived worker process per rank
  (``AsyncCallsQueue(persistent=True)``: megatron-core's ``PersistentAsyncCaller``), started at
  the first save (on megatron-core 0.19, at start-up with ``--async-ckpt-cpu-priority`` /
  ``--async-ckpt-io-priority``, as Megatron-LM's ``init_persistent_async_worker``);
* otherwise a process forked per save (``TemporalAsyncCaller``). Megatron-LM 0.19 no longer saves
  asynchronously without the persistent worker (it warns and saves synchronously): where the
  flag table is 0.19's (it has ``--async-strategy``), so does this entry point.
* ``--async-strategy`` (0.19): ``mcore`` is megatron-core's own writer. ``nvrx`` (upstream's
  default) is nvidia-resiliency-ext's writer of the same ``torch_dist`` files, and
  ``--async-ckpt-use-cpu-shm`` a staging mode of it: this entry point writes with ``mcore``
  either way (the publication below is built on megatron-core's queue), so the checkpoint's files
  and values are those upstream writes, and the start-up log says which writer runs.

What megatron-core leaves out, done here (:class:`AsyncSaves`):

* a writer that ended without finishing (killed by a signal) is not taken for a finished one:
  each rank's writer leaves a mark beside the ``.incomplete`` folder when its write returned, and
  nothing is published unless every rank's mark is there (:func:`mark_path`);
* a persistent worker that died is noticed before the next save is handed to it and while a save
  is awaited (megatron-core would wait for it forever): every rank raises, naming the ranks;
* a save is published at the first iteration after its writes are done on every rank
  (:meth:`AsyncSaves.finalize`: each iteration one small all-reduce of every rank's "my mark is
  there" flag, as Megatron-LM's ``maybe_finalize_async_save(blocking=False)``), not once
  megatron-core sees the writer processes gone (which trails the write by iterations); and before
  the next save starts, at exit and at an exit signal (blocking). So after any crash the newest
  checkpoint whose writes completed an iteration before is the published one.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import multiprocessing
import multiprocessing.queues
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from megatron.ciera.app import exit_signal, failfast
from megatron.ciera.app.checkpoint_publish import INCOMPLETE, iteration_dir, print0

__all__ = ["WRITER_DONE", "check_args", "async_queue", "AsyncSaves", "mark_path", "save_kwargs"]

WRITER_DONE = ".writer-done."
"""Infix of the mark a rank's background writer leaves beside ``iter_N.incomplete`` when its
write returned (``iter_N.incomplete.writer-done.R``; removed before publication, and with the
folder's other leftovers at the next start)."""

_POLL_S = 0.05  # between two checks of a blocking finalisation


def check_args(args: argparse.Namespace, err: Callable[[str], None]) -> None:
    """Settle the ``--async-*`` flags under ``--async-save`` (inert without it, as upstream): nvrx
    and its CPU-shm staging become megatron-core's own writer (``args`` is updated; the requested
    writer is kept in ``args.async_writer_requested`` for the start-up line). ``err`` is for
    combinations this entry point cannot honour (none today)."""
    if not args.async_save:
        return
    if hasattr(args, "async_strategy") and not getattr(args, "use_persistent_ckpt_worker", False):
        return  # 0.19: saved synchronously (async_queue says so), upstream's strategy then mcore
    # nvrx and its CPU-shm staging write the same files as mcore: written with mcore (async_queue
    # says so at start-up); the requested writer is kept for that line.
    # 0.16's table has no --async-strategy: megatron-core's writer is the only one.
    if getattr(args, "async_strategy", "mcore") == "nvrx" or getattr(args, "async_ckpt_use_cpu_shm", False):
        args.async_writer_requested = "nvrx" + (" with --async-ckpt-use-cpu-shm" if args.async_ckpt_use_cpu_shm else "")
        args.async_strategy, args.async_ckpt_use_cpu_shm = "mcore", False


def save_kwargs(args: argparse.Namespace | None, *, asynchronous: bool) -> dict:
    """Keyword arguments of ``dist_checkpointing.save`` this megatron-core takes: the async
    strategy (0.19: its default is nvrx, so always named) and ``--verify-integrity``."""
    from megatron.core import dist_checkpointing

    params = inspect.signature(dist_checkpointing.save).parameters
    out = {}
    if "async_strategy" in params:
        # megatron-core's own writer, the only one here: check_args rewrote nvrx (and its CPU-shm
        # staging) to it, and a synchronous save takes no other.
        out["async_strategy"] = "mcore"
    if getattr(args, "verify_integrity", False):
        out["verify_integrity"] = True
    if asynchronous:
        out["async_sharded_save"] = True
    return out


def async_queue(args: argparse.Namespace) -> "AsyncSaves | None":
    """Collective: the queue of asynchronous saves under ``--async-save`` (``None`` without it,
    and on megatron-core 0.19 without ``--use-persistent-ckpt-worker``, as Megatron-LM)."""
    if not getattr(args, "async_save", False):
        return None
    persistent = bool(getattr(args, "use_persistent_ckpt_worker", False))
    if hasattr(args, "async_strategy") and not persistent:
        print0("WARNING: --async-save is not supported without --use-persistent-ckpt-worker (as Megatron-LM "
               "0.19): saving synchronously")
        args.async_save, args.async_strategy = False, "mcore"
        return None
    # megatron-core's writer calls psutil before anything it guards: without it the writer dies,
    # and the save waits for it forever
    if importlib.util.find_spec("psutil") is None:
        raise SystemExit("--async-save needs psutil (megatron-core's background checkpoint writer uses it): "
                         "pip install psutil, or save without --async-save")
    if getattr(args, "async_writer_requested", None):
        print0(f"--async-save: --async-strategy {args.async_writer_requested} written by megatron-core's own writer "
               "(mcore): the same torch_dist files")
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    queue = AsyncCallsQueue(persistent=persistent)
    if persistent:
        _start_worker(queue, cpu_priority=getattr(args, "async_ckpt_cpu_priority", 10),
                      io_priority=getattr(args, "async_ckpt_io_priority", None))
    return AsyncSaves(queue, persistent=persistent)


class _WatchedJoinableQueue(multiprocessing.queues.JoinableQueue):
    """megatron-core's queue to the persistent worker, whose ``join`` (the trainer waiting for the
    worker to take the tensors of a save) raises once the worker is gone instead of waiting forever."""

    worker = None  # the process that serves this queue (set in the trainer; not sent to the worker)

    def join(self):
        with self._cond:
            while not self._unfinished_tasks._semlock._is_zero():
                if not self._cond.wait(timeout=1.0) and self.worker is not None and not self.worker.is_alive():
                    raise RuntimeError(f"the persistent checkpoint worker (pid {self.worker.pid}) ended with exit "
                                       f"code {self.worker.exitcode} before taking the save")


def _worker_loop(*loop_args):
    """megatron-core's persistent worker loop; on a machine without CUDA with the CPU shims (the
    loop selects a CUDA device first)."""
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    from megatron.ciera.app import failfast
    from megatron.ciera.binding import cpu_compat

    failfast.name_process("ckpt-writer")  # the watchdog's name for it, should it be killed
    with cpu_compat.enabled(not torch.cuda.is_available()):
        PersistentAsyncCaller.async_loop(*loop_args)


def _start_worker(queue, *, cpu_priority: int, io_priority: int | None) -> None:
    """Start megatron-core's persistent worker of this rank now (megatron-core 0.19's warm-up does
    the same; 0.16 would start it at the first save) as megatron-core does, with megatron-core's
    loop (:func:`_worker_loop`) and queues, the one the trainer waits on being watched
    (:class:`_WatchedJoinableQueue`)."""
    from megatron.core.dist_checkpointing.strategies import async_utils

    ctx = multiprocessing.get_context("spawn")
    level = async_utils.logger.getEffectiveLevel()
    watched = _WatchedJoinableQueue(ctx=ctx)
    caller_cls = async_utils.PersistentAsyncCaller
    if hasattr(caller_cls, "_persistent_process"):  # megatron-core 0.19: one worker per process
        if caller_cls._persistent_process is not None:
            return
        caller_cls._persistent_queue, caller_cls._persistent_preload_q = ctx.JoinableQueue(), watched
        caller_cls._persistent_comp_q = ctx.Queue()
        process = ctx.Process(target=_worker_loop, daemon=True, args=(
            dist.get_rank(), caller_cls._persistent_queue, watched, caller_cls._persistent_comp_q, level,
            cpu_priority, io_priority))
        caller_cls._persistent_process = process
    else:  # megatron-core 0.16: the queue's caller owns it
        caller = queue._get_async_caller()
        caller.preload_q = watched
        process = ctx.Process(target=_worker_loop, args=(dist.get_rank(), caller.queue, watched, caller.comp_q, level))
        caller.process = process
    watched.worker = process
    with exit_signal.shielded():  # the rank's final save at its exit signal still has this writer
        process.start()


def mark_path(partial: str, rank: int) -> str:
    """Where rank ``rank``'s writer marks a finished write of the ``partial`` folder."""
    return f"{partial}{WRITER_DONE}{rank}"


class _Marking:
    """``fn`` then an empty file at ``path`` (picklable: the persistent worker receives it)."""

    def __init__(self, fn, path: str):
        self.fn, self.path = fn, path

    def __call__(self, *args, **kwargs):
        out = self.fn(*args, **kwargs)
        with open(self.path, "w"):
            pass
        return out


def _nothing() -> None:
    """The background write of a rank with nothing to write."""


def _device():
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def _ranks_with(*flags: bool) -> list[list[int]] | list[int]:
    """Collective, one all-reduce: for each of ``flags``, the ranks where it holds (one flag: its
    list of ranks)."""
    table = torch.zeros(len(flags), dist.get_world_size(), dtype=torch.int32, device=_device())
    table[:, dist.get_rank()] = torch.tensor([int(f) for f in flags], dtype=torch.int32)
    dist.all_reduce(table)
    out = [[r for r, f in enumerate(row) if f] for row in table.tolist()]
    return out[0] if len(flags) == 1 else out


@dataclass(frozen=True)
class _Pending:
    """This rank's side of a scheduled save."""

    iteration: int
    """The checkpoint's iteration."""
    mark: str
    """The file this rank's writer leaves when its write returned (:func:`mark_path`)."""
    process: object
    """The writer process forked for this save (``None``: the persistent worker, or none)."""
    needed: int | None
    """About how many bytes the checkpoint takes, all ranks together (named on a full disk)."""

    def settled(self) -> bool:
        """The write returned (the mark is there) or the writer ended without it."""
        return os.path.exists(self.mark) or (self.process is not None and not self.process.is_alive())


class AsyncSaves:
    """megatron-core's ``AsyncCallsQueue``, with each save published only when every rank's write
    is finished and a dead persistent worker reported instead of awaited."""

    def __init__(self, queue, *, persistent: bool):
        self.queue = queue
        """megatron-core's queue."""
        self.persistent = persistent
        """Whether the writer is the persistent worker process."""
        self.pending: list[_Pending] = []
        """The scheduled saves not yet finalised, oldest first (at most one: a save waits for the
        one before it)."""

    def worker(self):
        """The persistent worker process (``None`` before it started, or without one)."""
        if not self.persistent:
            return None
        from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

        # megatron-core 0.16: the queue's caller owns it; 0.19: one per process, a class attribute
        caller = getattr(self.queue, "persistent_caller", None)
        return getattr(caller, "process", None) or getattr(PersistentAsyncCaller, "_persistent_process", None)

    def _check_worker(self, when: str) -> None:
        """Collective: raise on every rank if a rank's persistent worker is gone."""
        if not self.persistent:
            return
        process = self.worker()
        dead = _ranks_with(process is not None and not process.is_alive())
        if dead:
            raise RuntimeError(f"the persistent checkpoint worker of rank(s) {dead} is gone ({when}); the latest "
                               "published checkpoint is still the one before")

    def schedule(self, request, *, root: str, iteration: int, publish: Callable[[], None],
                 needed: int | None = None) -> None:
        """Collective: hand ``request`` (from ``dist_checkpointing.save(..., async_sharded_save=True)``
        into ``iter_N.incomplete``) to the writer; at its finalisation, once every rank's writer
        marked its write done, megatron-core's own finalisation, then ``publish()``."""
        self.finalize(blocking=True)  # the previous save is published before this one starts
        self._check_worker(f"before the save of iteration {iteration}")
        partial = iteration_dir(root, iteration) + INCOMPLETE
        done = mark_path(partial, dist.get_rank())
        if request.async_fn is not None:
            request = request._replace(async_fn=_Marking(request.async_fn, done))
        elif self.persistent:  # nothing to write, but a started worker is awaited: it marks at once
            request = request._replace(async_fn=_Marking(_nothing, done), async_fn_args=())
        else:  # nothing of this rank's to write in the background
            open(done, "w").close()
        # the marks are checked before megatron-core's finalisation (which would fail on a killed
        # writer's missing results, naming no cause), the checkpoint published after it
        request = request._replace(finalize_fns=[lambda: _check_written(root=root, iteration=iteration, done=done),
                                                 *request.finalize_fns, publish])
        self.queue.schedule_async_request(request)
        calls = getattr(self.queue, "async_calls", None)
        caller = calls[-1].async_caller if calls else None
        process = None if self.persistent else getattr(caller, "process", None)
        self.pending.append(_Pending(iteration=iteration, mark=done, process=process, needed=needed))

    def finalize(self, *, blocking: bool) -> None:
        """Collective, every iteration, and ``blocking`` before the next save, at exit and at an
        exit signal: publish the oldest save once every rank's write is done. Not blocking, one
        all-reduce of every rank's (worker gone, write not settled) flags decides, so a save
        whose writes are done is published at the first call after; ``blocking`` waits for every
        pending save, checking the persistent workers while it waits."""
        while self.pending:  # the same count on every rank
            dead, busy = _ranks_with(self._worker_dead(), not self.pending[0].settled())
            if dead:
                raise RuntimeError(f"the persistent checkpoint worker of rank(s) {dead} is gone (while the save of "
                                   f"iteration {self.pending[0].iteration} was awaited); the latest published "
                                   "checkpoint is still the one before")
            if busy:
                if not blocking:
                    return
                time.sleep(_POLL_S)
                continue
            # every rank's write returned (or its writer ended): megatron-core's finalisation of the
            # oldest call (joins the writer, gathers its results), then the marks' check, then publish
            with failfast.noting_bytes_needed(self.pending.pop(0).needed):
                self.queue.maybe_finalize_async_calls(blocking=True)

    def _worker_dead(self) -> bool:
        process = self.worker()
        return process is not None and not process.is_alive()

    def close(self) -> None:
        """Collective: every save finished, the persistent worker stopped."""
        self.finalize(blocking=True)
        worker = self.worker()
        self.queue.close(abort=worker is not None and not worker.is_alive())  # (a dead one cannot be told)


def _check_written(*, root: str, iteration: int, done: str) -> None:
    """Collective: raise on every rank, naming the ranks, unless every rank's background writer
    finished its write (the previous checkpoint then stays the latest; the ``.incomplete`` folder
    is removed by the next run); the marks are removed."""
    lost = _ranks_with(not os.path.exists(done))
    if lost:
        raise RuntimeError(f"checkpoint iteration {iteration}: the background writer of rank(s) {lost} ended "
                           f"before finishing its write (killed?); it is not published, and the latest "
                           f"checkpoint in {root} is still the previous one")
    os.remove(done)
