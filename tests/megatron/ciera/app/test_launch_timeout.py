"""megatron.ciera.app.launch: a launch that does not end in time is killed whole (its children too)
and the error names what was awaited, the last output and where each process waited."""

import os
import sys
import time

import pytest

from megatron.ciera.app import launch


def test_a_hung_launch_is_named_and_killed_whole():
    script = ("import subprocess, sys, time; "
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
              "print('child', child.pid, flush=True); time.sleep(600)")
    with pytest.raises(launch.LaunchTimeout) as caught:
        launch._run_or_explain([sys.executable, "-c", script], env=dict(os.environ), timeout=3, what="a sleeper")
    text = str(caught.value)
    assert text.startswith("a sleeper did not end within 3 s (waited for the launcher to exit)")
    child = int(text.split("child ", 1)[1].split()[0])  # its last output
    assert f"pid {child} " in text  # where the grandchild waited, too
    deadline = time.time() + 10
    while os.path.exists(f"/proc/{child}") and time.time() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{child}") or open(f"/proc/{child}/stat").read().split(")")[1].split()[0] == "Z"
