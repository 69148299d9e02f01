"""The upstream flag table: every flag of Megatron-LM's ``megatron/training/arguments.py`` at the
release matching the installed megatron-core (``upstream_flags.json`` is core_v0.16.1's,
``upstream_flags_core_vX.Y.Z.json`` newer ones; regenerate with ``tools/dump_upstream_flags.py``).

The parser (:mod:`megatron.ciera.app.arguments`), the flag policy and the release probes
(:mod:`megatron.ciera.app.upstream_features`) read it from here; this module imports nothing of
the project, so each of them can.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

__all__ = ["table_path", "upstream_flags", "newer_release_flags", "option"]

_HERE = Path(__file__).parent


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in re.findall(r"\d+", text)[:3])


@functools.lru_cache(maxsize=None)
def table_path() -> Path:
    """The upstream flag table of the newest release not newer than the installed megatron-core
    (``upstream_flags.json`` is core_v0.16.1's; ``upstream_flags_core_vX.Y.Z.json`` newer ones)."""
    from importlib.metadata import version

    installed = _version(version("megatron-core"))
    best, best_version = _HERE / "upstream_flags.json", (0, 16, 1)
    for path in _HERE.glob("upstream_flags_core_v*.json"):
        v = _version(path.stem.rsplit("_v", 1)[1])
        if best_version < v <= installed:
            best, best_version = path, v
    return best


@functools.lru_cache(maxsize=None)
def upstream_flags() -> tuple[dict, ...]:
    """The upstream flag table (one dict per flag: options, dest, action, type, default, ...)."""
    return tuple(json.loads(table_path().read_text())["flags"])


def newer_release_flags(argv: list[str]) -> dict[str, str]:
    """Options of ``argv`` that the installed release's table lacks but a newer upstream table
    (``upstream_flags_core_v*.json``) has: ``{option: tag}`` (the oldest tag that has it)."""
    known = {o for flag in upstream_flags() for o in flag["options"]}
    newer = {}
    for path in sorted(_HERE.glob("upstream_flags_core_v*.json"), key=lambda p: _version(p.stem.rsplit("_v", 1)[1])):
        if path == table_path():
            continue
        tag = "core_v" + path.stem.rsplit("_v", 1)[1]
        for flag in json.loads(path.read_text())["flags"]:
            for option in flag["options"]:
                newer.setdefault(option, tag)
    return {o: newer[o] for o in dict.fromkeys(w.split("=", 1)[0] for w in argv)
            if o.startswith("--") and o not in known and o in newer}


def option(dest: str) -> str:
    """The first option string of the flag with this ``dest`` (``--`` + dashes for one not in the table)."""
    for flag in upstream_flags():
        if flag["dest"] == dest:
            return flag["options"][0]
    return "--" + dest.replace("_", "-")
