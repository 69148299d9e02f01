"""The commands of README.md and docs/*.md work as written, and print what the pages say they print.

Fenced blocks, by their language:

* ``bash``: run. Each runs in bash with ``set -euo pipefail`` and must exit 0. The README's quick
  start runs first (its first command, ``make demo``, alone: it must print at most 40 lines and end
  with ``bit-identical: yes``); every other block runs after its ``source .venv/bin/activate``, as
  the README says. The blocks run in a scratch directory whose entries link to this checkout's (so
  ``outputs/`` lands in the scratch directory), with the ``.venv`` that ``make demo`` / ``make
  setup`` built (brought up to date in the checkout first by ``make setup-demo``).
* ``text`` right after a ``bash`` block: what that block prints. Each line must match a line of
  its output, in order; ``...`` inside a line stands for any text, a line of only ``...`` is
  skipped.
* ``sh``: shown, not run. Every command in them must be one :data:`NOT_RUN` names, with why.

One substitution, stated here: a ``torchrun ... pretrain_gpt.py`` command without ``--device cpu``
is meant for a GPU node, so its flags go through ``pretrain_gpt.py``'s parser and validation for
that node (world size from ``--nproc-per-node``, CUDA, no transformer-engine) instead of training.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
ACTIVATE = "source .venv/bin/activate"
GPU_LAUNCH = re.compile(r"torchrun --nproc-per-node (\d+) pretrain_gpt\.py")
VALIDATE_FOR_GPU_NODE = (
    "python -c 'import sys; from megatron.ciera.app.arguments import parse_args; "
    "parse_args(sys.argv[2:], world_size=int(sys.argv[1]), device=\"cuda\", te_available=False); "
    "print(\"valid for a GPU node\")' \\1")
DEMO_MAX_LINES = 40

# Commands the pages show but no test runs, each with the reason.
NOT_RUN = {
    r"make (demo|setup|setup312)\b": "set-up: `make demo` runs first in this test; the others build environments",
    r"make (test|test-all|test-latest)\b|\.venv/bin/python -m pytest ": "the test suites themselves (CI runs them)",
    r"sudo |make (demo-cluster|bench-cluster)\b": "root: the testbed's network namespaces (tests/tools/testbed)",
    r"pip install ": "installs into the reader's own environment (a GPU cluster's torch)",
    r"(NNODES=\d+ )?sbatch |examples/\w+/train_\w+\.sh\s*(#|$)": "GPU nodes or SLURM (DRY_RUN checked by test_launch_scripts)",
    r"python tools/preprocess_data\.py --input corpus\.jsonl|DATA_PATH=data/corpus": "the reader's own corpus",
}


@dataclass(frozen=True)
class Block:
    page: Path
    lang: str
    body: str
    sample: str | None = None  # the ``text`` block right after a ``bash`` block


def blocks(page: Path) -> list[Block]:
    """The fenced ``bash``, ``sh`` and ``text`` blocks of ``page``; a ``text`` block that follows a
    ``bash`` block (blank lines and one line of prose between them allowed) is its sample."""
    found: list[Block] = []
    lines = page.read_text().splitlines()
    i, last_bash_end = 0, None
    while i < len(lines):
        m = re.match(r"^```(\w+)\s*$", lines[i])
        if not m:
            i += 1
            continue
        lang, j = m.group(1), i + 1
        while not lines[j].startswith("```"):
            j += 1
        body = "\n".join(lines[i + 1:j])
        if lang == "text" and last_bash_end is not None and found and found[-1].lang == "bash" \
                and sum(1 for line in lines[last_bash_end + 1:i] if line.strip()) <= 1:
            prev = found.pop()
            found.append(Block(prev.page, prev.lang, prev.body, body))
        elif lang in ("bash", "sh"):
            found.append(Block(page, lang, body))
        last_bash_end = j if lang == "bash" else None
        i = j + 1
    return found


def commands(body: str) -> list[str]:
    """One string per command: continuation lines joined, comments and blank lines dropped."""
    out, parts = [], []
    for line in body.splitlines():
        text = line.strip()
        parts.append(text.rstrip("\\").strip())
        if not text.endswith("\\"):
            cmd = " ".join(p for p in parts if p)
            if cmd and not cmd.startswith("#"):
                out.append(cmd)
            parts = []
    return out


def sample_matches(sample: str, output: str) -> str | None:
    """None when every sample line matches an output line, in order; else the first that does not."""
    out = output.splitlines()
    k = 0
    for line in sample.splitlines():
        if not line.strip() or line.strip() == "...":
            continue
        pattern = re.compile(".*".join(re.escape(part) for part in line.strip().split("...")))
        while k < len(out) and not pattern.fullmatch(out[k].strip()):
            k += 1
        if k == len(out):
            return line
        k += 1
    return None


def all_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks(page)]


def test_pages_have_blocks_and_the_quick_start_comes_first():
    quick = blocks(README)
    runnable = [b for b in quick if b.lang == "bash"]
    assert len(runnable) == 1, "README runs one block: the quick start"
    first = runnable[0].body.splitlines()
    assert first[0].startswith("make demo") and first[1] == ACTIVATE, first[:2]
    assert runnable[0].sample and "bit-identical: yes" in runnable[0].sample
    assert any(GPU_LAUNCH.search(b.body) and "--device cpu" not in b.body for b in all_blocks())


def test_commands_not_run_are_named_with_a_reason():
    for b in all_blocks():
        if b.lang == "sh":
            for cmd in commands(b.body):
                assert any(re.match(p, cmd) for p in NOT_RUN), f"{b.page.name}: {cmd!r} is shown but not run"


def test_readme_is_a_front_page_linking_every_doc():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    for page in PAGES[1:]:
        assert f"docs/{page.name}" in text, f"README does not link docs/{page.name}"


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of ``page``."""
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in page.read_text().splitlines() if line.startswith("#")}


def test_relative_links_and_anchors_resolve():
    bad = []
    for page in [*PAGES, ROOT / "BENCHMARKS.md"]:
        prose = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in _anchors(dest)):
                bad.append(f"{page.name}: {target}")
    assert not bad, bad


def test_flag_defaults_in_the_docs_are_the_help_ones():
    """docs/flags.md's defaults (`default `X``) are those --help prints, which quote CieraConfig."""
    from megatron.ciera.app import arguments

    helps = {o: a.help for a in arguments.build_parser()._actions for o in a.option_strings}
    rows = [line for line in (ROOT / "docs" / "flags.md").read_text().splitlines() if line.startswith("| `--ciera-")]
    checked = 0
    for row in rows:
        flag = re.match(r"\| `(--ciera-[a-z-]+)", row).group(1)
        for value in re.findall(r"default:? `([^`]+)`", row):
            assert f"default {value}" in helps[flag] or f"default: {value}" in helps[flag], (flag, value, helps[flag])
            checked += 1
    assert checked >= 7, rows


def test_sample_matching_is_not_vacuous():
    assert sample_matches("a ... c\n...\nd", "x\na b c\nd") is None
    assert sample_matches("a ... c\nd", "d\na b c") == "d"  # order matters
    assert sample_matches("ratio (1.60x)", "ratio (1.61x)") == "ratio (1.60x)"


@pytest.mark.slow  # 3-5 minutes on 2 vCPUs (make demo's two runs, a few short trainings): .ci/run runs it
@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "activate").exists(), reason="no .venv: run make demo or make setup")
def test_page_commands_exit_zero_and_print_their_samples(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    # `make demo`'s set-up in the checkout itself (a no-op when .venv is current), so that in the
    # scratch directory, where .venv is a link, make finds its stamps current.
    setup = subprocess.run(["make", "-s", "setup-demo"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert setup.returncode == 0, setup.stdout[-3000:] + setup.stderr[-3000:]
    cwd = tmp_path / "checkout"
    cwd.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in ("outputs", ".git"):
            (cwd / entry.name).symlink_to(entry)

    def run(script: str, label: str) -> str:
        res = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env,
                             capture_output=True, text=True, timeout=900)
        output = res.stdout + res.stderr
        assert res.returncode == 0, f"{label}:\n{script}\n--- exit {res.returncode}\n{output[-6000:]}"
        return output

    demo = run("make demo", "make demo")
    lines = demo.rstrip("\n").splitlines()
    assert len(lines) <= DEMO_MAX_LINES and lines[-1] == "bit-identical: yes", demo
    for b in all_blocks():
        if b.lang != "bash":
            continue
        body = b.body
        if b.page == README:
            body = "\n".join(line for line in body.splitlines() if not line.startswith("make demo"))
            output = demo + run(body, "README quick start")
        else:
            script = f"{ACTIVATE}\n{body}"
            if "--device cpu" not in script:
                script = GPU_LAUNCH.sub(VALIDATE_FOR_GPU_NODE, script)
            output = run(script, b.page.name)
        if b.sample is not None:
            missing = sample_matches(b.sample, output)
            assert missing is None, f"{b.page.name}: the sample line {missing!r} is not in the output:\n{output[-6000:]}"
