"""ciera.integrations.torchtitan: torchtitan's own trainer and entry point (``python -m
torchtitan.train``), 2 gloo ranks, FSDP2, with and without ``--ciera.enable``: the same losses and
bit-identical final parameters (torchtitan's own last-step checkpoint), the gathers compressed.

CPU needs the test-only shim ``torchtitan_cpu.py`` beside this file (see its docstring). Skipped
when torchtitan is not installed (``.ci/run`` installs it; see examples/torchtitan/README.md)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
SHIM = Path(__file__).resolve().parent / "torchtitan_cpu.py"
# torchtitan's metrics line, colours stripped: "step:  2  loss:  8.07218  grad_norm:  1.0421 ..."
METRICS = re.compile(r"step:\s+(\d+)\s+loss:\s+(\S+)\s+grad_norm:\s+(\S+)")
CIERA = re.compile(r"ciera: step (\d+): (\d+) gathers \((\d+) compressed, (\d+) raw, (\d+) replays; "
                   r"codec (\w+)\), (\d+) bytes received for (\d+) raw")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
TIMEOUT_S = 400  # one llama3 debug run takes ~25 s on 2 idle vCPUs, the MoE one ~45 s


def _needs_torchtitan():
    pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e '.[torchtitan]')")


def test_import_ciera_needs_no_torchtitan():
    """The binding imports without torchtitan; asking it for a trainer names what is missing."""
    code = ("import sys; sys.modules['torchtitan'] = None\n"
            "import ciera, ciera.integrations.torchtitan as t\n"
            "job = t.CieraJobConfig(enable=True, cache='values')\n"
            "assert job.ciera_config().cache == 'values'\n"
            "try:\n    t.CieraTrainer\nexcept ImportError as e:\n    print('needs', e.name)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "needs torchtitan" in out.stdout


def test_job_config_refuses_unknown_values():
    from ciera.integrations.torchtitan import CieraJobConfig

    with pytest.raises(ValueError, match=r"--ciera\.cache 'all'"):
        CieraJobConfig(cache="all")
    with pytest.raises(ValueError, match=r"--ciera\.codec"):
        CieraJobConfig(codec="zstd")


def test_job_config_flags_parse_through_torchtitans_manager():
    """``--module ciera.integrations.torchtitan --config llama3_debugmodel --ciera.*``: torchtitan's
    own config function, every field kept, the ``ciera`` section from the command line."""
    _needs_torchtitan()
    sys.path.insert(0, str(SHIM.parent))
    try:
        import torchtitan_cpu  # noqa: F401  (the datasets stub, when that package is absent)
    finally:
        sys.path.remove(str(SHIM.parent))
    from torchtitan.config import ConfigManager
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    import ciera.integrations.torchtitan as titan

    config = ConfigManager().parse_args(["--module", "ciera.integrations.torchtitan", "--config", "llama3_debugmodel",
                                         "--ciera.enable", "--ciera.cache", "values", "--training.steps", "7"])
    assert type(config).__qualname__.endswith("CieraTrainer.Config") and config._owner is titan.CieraTrainer
    assert config.ciera == titan.CieraJobConfig(enable=True, cache="values")
    assert config.training.steps == 7
    base = llama3_debugmodel()
    assert config.model_spec.name == base.model_spec.name and config.optimizer == base.optimizer
    off = ConfigManager().parse_args(["--module", "ciera.integrations.torchtitan", "--config", "llama3_debugmodel"])
    assert off.ciera.enable is False
    with pytest.raises(AttributeError, match="no_such_config"):
        titan.llama3_no_such_config


def _train(dump: Path, config: str, *extra: str) -> str:
    """rank 0's log of one launch of torchtitan's entry point through the CPU shim."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([str(SHIM.parent), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--tee", "3", str(SHIM),
           "--module", "torchtitan_cpu", "--config", config, "--dump_folder", str(dump),
           "--checkpoint.enable", "--checkpoint.interval", "3", "--checkpoint.last_save_model_only", *extra]
    proc = subprocess.Popen(cmd, cwd=dump.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the launch did not end within {TIMEOUT_S} s:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-4000:]
    return ANSI.sub("", "\n".join(line for line in out.splitlines() if line.startswith("[default0]")))


def _final_params(dump: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(dump / "checkpoint" / "step-3", dump / "final.pt")
    return torch.load(dump / "final.pt", weights_only=True)


def _identical_with_and_without_ciera(tmp_path: Path, config: str) -> None:
    _needs_torchtitan()
    plain = _train(tmp_path / "plain", config)
    with_ciera = _train(tmp_path / "ciera", config, "--ciera.enable", "--ciera.selection", "always")
    losses = METRICS.findall(plain)
    assert [s for s, _, _ in losses] == ["1", "2", "3"], plain[-3000:]
    assert METRICS.findall(with_ciera) == losses
    assert not CIERA.search(plain)
    stats = CIERA.findall(with_ciera)
    assert [s[0] for s in stats] == ["1", "2", "3"], with_ciera[-3000:]
    step, gathers, compressed, raw, replays, codec, wire, raw_bytes = stats[-1]
    assert int(compressed) > 0 and codec != "raw" and int(wire) < int(raw_bytes), stats
    p0, p1 = _final_params(tmp_path / "plain"), _final_params(tmp_path / "ciera")
    assert p0.keys() == p1.keys() and len(p0) > 0
    for name in p0:
        assert torch.equal(p0[name], p1[name]), name
    # The runs trained: the final parameters are not the initial ones (the same seed initialises both).
    assert losses[0][1] != losses[-1][1]


@pytest.mark.distributed
def test_torchtitan_llama3_debugmodel_identical_with_ciera(tmp_path):
    _identical_with_and_without_ciera(tmp_path, "llama3_debugmodel")


@pytest.mark.distributed
@pytest.mark.slow
def test_torchtitan_deepseek_v3_moe_debugmodel_identical_with_ciera(tmp_path):
    _identical_with_and_without_ciera(tmp_path, "deepseek_v3_debugmodel")
