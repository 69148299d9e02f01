"""The README's quick-start and training commands work as written, after its first command.

Every fenced ``bash`` block of the README's "Quick start" and "Training with Megatron" sections
(subsections included) runs in bash with ``set -euo pipefail`` and must exit 0. The blocks run in a
scratch directory whose entries link to this checkout's (so ``outputs/`` lands in the scratch
directory), with the ``.venv`` that ``make demo`` / ``make setup`` built (brought up to date in the
checkout first by ``make setup-demo``, the set-up ``make demo`` runs). Blocks after the quick
start run after its ``source .venv/bin/activate``, as the README says. One substitution, stated
here: a ``torchrun ... pretrain_gpt.py`` command without ``--device cpu`` is meant for a GPU node,
so its flags go through ``pretrain_gpt.py``'s parser and validation for that node (world size from
``--nproc-per-node``, CUDA, no transformer-engine) instead of training.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SECTIONS = ("Quick start", "Training with Megatron")
ACTIVATE = "source .venv/bin/activate"
GPU_LAUNCH = re.compile(r"torchrun --nproc-per-node (\d+) pretrain_gpt\.py")
VALIDATE_FOR_GPU_NODE = (
    "python -c 'import sys; from megatron.ciera.arguments import parse_args; "
    "parse_args(sys.argv[2:], world_size=int(sys.argv[1]), device=\"cuda\", te_available=False); "
    "print(\"valid for a GPU node\")' \\1")


def readme_blocks(text: str) -> list[tuple[str, str]]:
    """(section, block) for every ```bash block under a '## ' heading in SECTIONS."""
    blocks, section, block = [], None, None
    for line in text.splitlines():
        if block is not None:
            if line.startswith("```"):
                if section in SECTIONS:
                    blocks.append((section, "\n".join(block)))
                block = None
            else:
                block.append(line)
        elif line.startswith("```bash"):
            block = []
        elif line.startswith("## "):
            section = line[3:].strip()
    return blocks


def shadow_checkout(tmp: Path) -> Path:
    """A directory whose entries link to the checkout's, for commands that write relative paths."""
    for entry in ROOT.iterdir():
        if entry.name not in ("outputs", ".git"):
            (tmp / entry.name).symlink_to(entry)
    return tmp


def test_readme_blocks_are_found_and_the_quick_start_activates_the_venv():
    blocks = readme_blocks(README.read_text())
    sections = [s for s, _ in blocks]
    assert sections.count("Quick start") == 1 and "Training with Megatron" in sections, sections
    quick = blocks[0][1].splitlines()
    assert quick[0].startswith("make demo") and quick[1] == ACTIVATE, quick[:2]
    assert any(GPU_LAUNCH.search(b) and "--device cpu" not in b for _, b in blocks)  # the substitution applies


@pytest.mark.slow  # about 1-2 minutes (make demo's two runs, three short trainings): .ci/run runs it
@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "activate").exists(), reason="no .venv: run make demo or make setup")
def test_readme_commands_exit_zero(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    # `make demo`'s set-up in the checkout itself (a no-op when .venv is current), so that in the
    # scratch directory, where .venv is a link, make finds its stamps current.
    setup = subprocess.run(["make", "-s", "setup-demo"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert setup.returncode == 0, setup.stdout[-3000:] + setup.stderr[-3000:]
    cwd = shadow_checkout(tmp_path)
    for section, block in readme_blocks(README.read_text()):
        script = block if section == "Quick start" else f"{ACTIVATE}\n{block}"
        if "--device cpu" not in script:
            script = GPU_LAUNCH.sub(VALIDATE_FOR_GPU_NODE, script)
        res = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env,
                             capture_output=True, text=True, timeout=900)
        assert res.returncode == 0, f"{section}:\n{block}\n--- exit {res.returncode}\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
