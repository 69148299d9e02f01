#!/usr/bin/env python
"""Run a Python script as ``__main__`` after moving this process's session to a scheduler priority.

torchrun starts every worker in a session of its own, so a testbed host's
:attr:`~tools.testbed.netns.TestbedConfig.autogroup_nice` would not reach the ranks; torchrun runs
this instead of the script when the testbed sets one (``TESTBED_AUTOGROUP_NICE``):

    python tools/testbed/autogroup_exec.py SCRIPT [ARGS...]

Processes the script forks (DataLoader workers) stay in the session and share its priority.
"""

from __future__ import annotations

import os
import runpy
import sys

ENV = "TESTBED_AUTOGROUP_NICE"


def set_autogroup_nice(value: str | None) -> None:
    """Write ``value`` to ``/proc/self/autogroup`` (no-op when None or empty). A kernel without
    autogroup scheduling has no such file, and one booted with it off refuses the write (the
    session stays in the root group): neither is an error, the priority just does not apply."""
    if not value:
        return
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(int(value)))
    except OSError:
        pass


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: autogroup_exec.py SCRIPT [ARGS...]")
    set_autogroup_nice(os.environ.get(ENV))
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
