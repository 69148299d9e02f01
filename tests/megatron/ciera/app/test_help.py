"""``pretrain_gpt.py --help``: every ``--ciera-*`` flag explained, without the training stack."""

import subprocess
import sys
from pathlib import Path

from megatron.ciera.app import arguments

ROOT = Path(__file__).resolve().parents[4]


def _ciera_actions():
    parser = arguments.build_parser()
    return [a for a in parser._actions if any(o.startswith("--ciera-") for o in a.option_strings)]


def test_every_ciera_flag_has_help_naming_its_default():
    actions = _ciera_actions()
    assert len(actions) >= 9
    for action in actions:
        text = action.help or ""
        assert len(text) > 40, (action.option_strings, text)
        assert "default" in text, (action.option_strings, text)


def test_help_quotes_the_library_defaults():
    from ciera.config import CieraConfig

    d = CieraConfig()
    helps = {a.option_strings[0]: a.help for a in _ciera_actions()}
    assert f"default {d.codec}" in helps["--ciera-codec"]
    assert f"default {d.block_size}" in helps["--ciera-block-size"]
    assert f"default {d.selection}" in helps["--ciera-selection"]
    assert f"default {d.warmup_gathers}" in helps["--ciera-warmup-iters"]
    assert f"default {d.verify_interval}" in helps["--ciera-verify-interval"]


def test_help_prints_every_ciera_flag_without_importing_megatron_core():
    probe = ("import runpy, sys, io, contextlib\n"
             "sys.argv = ['pretrain_gpt.py', '--help']\n"
             "out = io.StringIO()\n"
             "with contextlib.redirect_stdout(out):\n"
             "    runpy.run_path('pretrain_gpt.py', run_name='__main__')\n"
             "print(out.getvalue())\n"
             "print('MEGATRON_CORE_IMPORTED' if 'megatron.core' in sys.modules else 'MEGATRON_CORE_ABSENT')\n")
    res = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    for action in _ciera_actions():
        assert action.option_strings[0] in res.stdout
    assert "CIERA and this entry point" in res.stdout
    assert res.stdout.rstrip().endswith("MEGATRON_CORE_ABSENT"), res.stdout[-500:]


def test_ciera_allgather_help_names_every_engine_it_binds_to():
    helps = {a.option_strings[0]: a.help for a in _ciera_actions()}
    text = helps["--ciera-allgather"]
    for flag in ("--use-distributed-optimizer", "--use-megatron-fsdp", "--use-torch-fsdp2"):
        assert flag in text, text
    assert "Needs" not in text
