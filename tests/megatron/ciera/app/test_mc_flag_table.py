"""The upstream flag table the parser reads (megatron.ciera.app.flag_table) against the installed
megatron-core's own parser."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.ciera.app import flag_table
from megatron.ciera.app.upstream_features import features


def test_flag_table_is_the_installed_release_s(tmp_path):
    """The table the parser reads (flag_table.table_path: the newest recorded release not newer
    than the installed one) lists exactly the flags of the installed megatron-core's own parser.
    Releases from 0.17 on ship megatron/training, so this dumps it (tools/dump_upstream_flags.py,
    run in its own process) and compares; 0.19.2's is core_v0.19.0's table flag for flag."""
    if not features().ships_training:
        pytest.skip("the installed megatron-core (0.16.x) ships no megatron/training; its table was dumped "
                    "from the core_v0.16.1 checkout")
    spec = importlib.util.find_spec("megatron.training")  # its location, without importing the training stack
    site = Path(next(iter(spec.submodule_search_locations))).parents[1]
    out = tmp_path / "flags.json"
    root = Path(__file__).resolve().parents[4]
    r = subprocess.run([sys.executable, str(root / "tools" / "dump_upstream_flags.py"), str(site), "installed", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    dumped = json.loads(out.read_text())["flags"]
    assert dumped == list(flag_table.upstream_flags()), (
        f"megatron-core's parser differs from {flag_table.table_path().name}: record a table for this release "
        "with tools/dump_upstream_flags.py")
