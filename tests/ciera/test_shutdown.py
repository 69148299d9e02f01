"""ciera.shutdown.end_process: the exit code given, atexit handlers run, buffered output flushed,
no interpreter finalization (an object's finalizer left for it never runs)."""

import subprocess
import sys

SCRIPT = """
import atexit, sys
from ciera.shutdown import end_process

class Finalized:
    def __del__(self):
        print("finalized", flush=True)

keep = Finalized()  # a module global: only interpreter finalization would collect it
atexit.register(lambda: print("atexit ran", end=" "))
sys.stdout.write("buffered, no newline ")
sys.stderr.write("err tail")
end_process(3)
print("never")
"""


def test_end_process_exits_with_code_after_atexit_and_flush():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3
    assert proc.stdout == "buffered, no newline atexit ran "
    assert proc.stderr.endswith("err tail")
