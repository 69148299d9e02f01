"""Ending a rank's process after a run that succeeded, without the gloo backend's exit-time abort."""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn


def end_process(code: int = 0) -> NoReturn:
    """End this process with ``code``: run the ``atexit`` handlers, flush stdout and stderr, then
    ``os._exit`` without finalizing the interpreter. Call it last, after the closing barrier and
    ``destroy_process_group``.

    Why not a plain return: torch's gloo backend keeps its worker threads while any object still
    holds the group (FSDP2's device mesh, Megatron-Core's parallel state), past
    ``destroy_process_group``. Such a worker may drop the last reference to a finished collective
    only after the main thread has returned (a barrier keeps every collective still in flight when
    it was posted). When that collective holds a tensor whose Python object has already died, the
    drop needs the GIL. Once the interpreter is finalizing the worker cannot take it, and the C++
    runtime aborts the process ("terminate called without an active exception") after a run that
    succeeded. Without finalization there is nothing left for the worker to race."""
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # closed or gone: nothing left to say
                pass
        os._exit(code)
