"""Turn Megatron-LM's own launch configurations into the flag-set fixtures that
``tests/megatron/ciera/app/test_mc_upstream_replay.py`` replays (test data, one file per command).

    python tools/extract_upstream_commands.py /path/to/Megatron-LM core_v0.19.0 NAME...

NAME is a functional test case (``tests/functional_tests/test_cases/<model>/<case>``: its
``model_config.yaml`` MODEL_ARGS) or an example script (``examples/.../*.sh``: its bash arrays).
``true`` values become bare flags, ``"[a b]"`` lists become values, ``false`` ones are dropped (as upstream's test runner does);
``${VAR}`` / ``$VAR`` placeholders become ``/data/VAR``. Each fixture starts with a comment naming
the repository, tag and path it came from.
"""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

OUT = Path(__file__).resolve().parents[1] / "tests" / "megatron" / "upstream_commands"


def _subst(text: str) -> str:
    return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", r"/data/\1", text)


def _from_yaml(text: str) -> list[str]:
    flags = []
    for key, value in (yaml.safe_load(text).get("MODEL_ARGS") or {}).items():
        if value is True or value == "true":
            flags.append(key)
        elif value is False or value == "false" or value is None:
            continue
        else:  # "[a b c]" is a list of values, as upstream's test runner reads it
            text = _subst(str(value))
            if text.startswith("[") and text.endswith("]"):
                text = text[1:-1]
            # values pass two shells in upstream's runner (yaml -> bash array -> torchrun)
            flags += [key, *(w for word in shlex.split(text) for w in shlex.split(word))]
    return flags


def _from_shell(text: str) -> list[str]:
    flags = []
    for body in re.findall(r"^[A-Z_]+_ARGS=\(\s*(.*?)^\)", text, re.M | re.S):
        if "--nproc_per_node" in body:
            continue
        flags += shlex.split(_subst(body.replace("\\\n", "\n")), comments=True)
    return flags


def main(repo: str, tag: str, names: list[str]) -> None:
    OUT.mkdir(exist_ok=True)
    for name in names:
        path = name if name.endswith(".sh") else f"tests/functional_tests/test_cases/{name}/model_config.yaml"
        text = subprocess.run(["git", "-C", repo, "show", f"{tag}:{path}"], check=True,
                              capture_output=True, text=True).stdout
        flags = _from_shell(text) if path.endswith(".sh") else _from_yaml(text)
        stem = Path(name).stem if name.endswith(".sh") else name.split("/")[-1]
        lines = [f"# source: github.com/NVIDIA/Megatron-LM@{tag} {path}"]
        i = 0
        while i < len(flags):  # one flag and its values per line
            j = i + 1
            while j < len(flags) and not flags[j].startswith("--"):
                j += 1
            lines.append(shlex.join(flags[i:j]))
            i = j
        (OUT / f"{stem}.txt").write_text("\n".join(lines) + "\n")
        print(stem, len(flags))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
