"""Write the facts of Megatron-LM's command line (every flag's name, dest, type, default, nargs,
choices) to ``megatron/ciera/app/upstream_flags.json``, the table ``megatron.ciera.app.arguments`` builds
its parser from.

Run once per upstream release against a checkout of NVIDIA/Megatron-LM at the tag that matches the
installed megatron-core (the table in the repo: tag ``core_v0.16.1``):

    git -C Megatron-LM archive core_v0.16.1 megatron | tar -x -C /tmp/up016
    python tools/dump_upstream_flags.py /tmp/up016 core_v0.16.1
    python3.12 tools/dump_upstream_flags.py /tmp/up019 core_v0.19.0 megatron/ciera/app/upstream_flags_core_v0.19.0.json

(0.17+ needs Python 3.12 and that megatron-core installed: ``make setup312``'s ``.venv312``. From
0.17 on the wheel ships ``megatron/training`` itself, so its site-packages directory also serves as
the checkout; ``tests/megatron/ciera/app/test_mc_flag_table.py`` dumps it that way and compares with the table.)

Only upstream's parser is executed (``add_megatron_arguments`` on a fresh ArgumentParser); no code
of it is copied. Types are recorded by name (int/float/str/bool) or ``"custom"`` for upstream's
own converters, which :mod:`megatron.ciera.app.arguments` provides itself.
"""

import argparse
import json
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _plain(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return repr(value)


def _action_kind(action) -> str:
    return type(action).__name__.lstrip("_").replace("Action", "").lower() or "store"


class _Stub(types.ModuleType):
    """Stand-in module: every attribute is a callable, subclassable stand-in."""

    __path__ = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {"__init__": lambda self, *a, **k: None, "__call__": lambda self, *a, **k: None})


def _import_parser_builder(checkout: str):
    """upstream's ``add_megatron_arguments`` from the checkout's ``megatron/training`` (the rest of
    ``megatron``, i.e. ``megatron.core``, is the installed one: the matching release); third-party
    modules its package imports but the parser does not need (tokenizer libraries) are replaced by
    empty stand-ins."""
    for _ in range(50):
        # the package without its __init__ (which imports the whole training stack)
        package = types.ModuleType("megatron.training")
        package.__path__ = [str(Path(checkout) / "megatron" / "training")]
        sys.modules["megatron.training"] = package
        for name in ("get_args", "get_timers", "get_adlr_autoresume", "get_tokenizer", "print_rank_0",
                     "get_one_logger", "get_wandb_writer", "get_tensorboard_writer"):
            setattr(package, name, lambda *a, **k: None)
        try:
            from megatron.training.arguments import add_megatron_arguments
            return add_megatron_arguments
        except ModuleNotFoundError as exc:
            if exc.name.startswith("megatron"):
                raise
            for name in list(sys.modules):
                if name.startswith("megatron.training."):
                    del sys.modules[name]
            parts = exc.name.split(".")
            for i in range(1, len(parts) + 1):
                sys.modules.setdefault(".".join(parts[:i]), _Stub(".".join(parts[:i])))
    raise RuntimeError("could not import upstream's arguments module")


def main(checkout: str, tag: str, out: str | None = None) -> None:
    add_megatron_arguments = _import_parser_builder(checkout)

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    flags = []
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        typ = action.type
        type_name = None if typ is None else typ.__name__ if typ in (int, float, str, bool) else "custom"
        flags.append({
            "options": list(action.option_strings),
            "dest": action.dest,
            "action": _action_kind(action),
            "type": type_name,
            "default": _plain(action.default),
            "const": _plain(action.const),
            "nargs": action.nargs,
            "choices": _plain(list(action.choices)) if action.choices is not None else None,
        })
    out = Path(out) if out else ROOT / "megatron" / "ciera" / "app" / "upstream_flags.json"
    out.write_text(json.dumps({"source": f"NVIDIA/Megatron-LM {tag} megatron/training/arguments.py "
                                         "(add_megatron_arguments)", "flags": flags}, indent=0) + "\n")
    print(f"{len(flags)} flags -> {out}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
