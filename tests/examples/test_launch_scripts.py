"""examples/<model>/ launch scripts: every printed command (DRY_RUN=1) is one shell-quoted line
that pretrain_gpt's own parser accepts, baseline and CIERA commands differ only by
--ciera-allgather, and the SLURM wrapper starts one torchrun per node pointed at the first host."""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
MODELS = ("olmoe", "deepseek", "qwen2", "minicpm", "mixtral", "scout")
# Published depth and routed experts (examples/README.md, shared reference table).
FULL_LAYERS = {"olmoe": 16, "deepseek": 28, "qwen2": 28, "minicpm": 40, "mixtral": 32, "scout": 48}
EXPERTS = {"olmoe": 64, "deepseek": 64, "qwen2": 64, "minicpm": 8, "mixtral": 8, "scout": 16}

# Variables a developer's shell may carry that would change what the scripts print.
_SCRIPT_ENV = (
    "FULL_DEPTH CIERA TINY DRY_RUN DATA_PATH TOKENIZER TOKENIZER_MODEL VOCAB_SIZE CHECKPOINT_DIR "
    "SAVE_INTERVAL NNODES GPUS_PER_NODE NODE_RANK MASTER_ADDR MASTER_PORT TP PP EP MICRO_BATCH "
    "GLOBAL_BATCH TRAIN_ITERS NUM_LAYERS SEQ_LENGTH LR WEIGHT_DECAY SEED LOG_INTERVAL SPLIT "
    "TENSORBOARD_DIR CIERA_CODEC CIERA_BLOCK_SIZE CIERA_WARMUP_ITERS CIERA_SELECTION "
    "CIERA_VERIFY_INTERVAL TORCHRUN CIERA_ROOT"
).split()


def _clean_env(**overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _SCRIPT_ENV and not k.startswith("SLURM_")}
    env["PYTHON"] = sys.executable
    env.update(overrides)
    return env


def dry_run(script: Path, *args: str, **env: str) -> str:
    """The one line a script prints with DRY_RUN=1."""
    proc = subprocess.run(
        ["bash", str(script), *args],
        env=_clean_env(DRY_RUN="1", **env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout
    return lines[0]


def split_command(line: str) -> tuple[list[str], list[str]]:
    """(launcher words, pretrain_gpt arguments) of a printed torchrun command."""
    words = shlex.split(line)
    at = next(i for i, w in enumerate(words) if w.endswith("pretrain_gpt.py"))
    assert Path(words[at]) == ROOT / "pretrain_gpt.py"
    return words[:at], words[at + 1 :]


def world_size(launcher: list[str]) -> int:
    def value(flag: str) -> int:
        return int(launcher[launcher.index(flag) + 1])

    return value("--nproc-per-node") * value("--nnodes")


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def train_script(model: str) -> Path:
    return EXAMPLES / model / f"train_{model}.sh"


def _parse(argv: list[str], world: int, monkeypatch):
    from megatron.ciera.app import arguments

    monkeypatch.setenv("WORLD_SIZE", str(world))
    try:
        return arguments.parse_args(argv)
    except SystemExit as exc:  # argparse's usage error: make the rejected command visible
        pytest.fail(f"pretrain_gpt's parser rejected (exit {exc.code}):\n{shlex.join(argv)}")


VARIANTS = {
    "default": {},
    "full_depth": {"FULL_DEPTH": "1"},
    "tiny": {"TINY": "1"},
}


@pytest.mark.parametrize("ciera", ["0", "1"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("model", MODELS)
def test_dry_run_is_accepted_by_pretrain_gpt_parser(model, variant, ciera, monkeypatch):
    line = dry_run(train_script(model), CIERA=ciera, **VARIANTS[variant])
    launcher, argv = split_command(line)
    args = _parse(argv, world_size(launcher), monkeypatch)
    assert args.ciera_allgather == (ciera == "1")
    assert args.use_distributed_optimizer and args.overlap_grad_reduce and args.overlap_param_gather
    assert args.bf16 and args.optimizer == "adam"
    if variant == "tiny":
        assert world_size(launcher) == 2
        assert args.device == "cpu" and args.mock_data
        assert (args.hidden_size, args.ffn_hidden_size, args.num_layers, args.seq_length) == (64, 128, 2, 64)
        assert args.num_experts == min(EXPERTS[model], 16)
        assert args.train_iters == 10
    else:
        assert world_size(launcher) == 8
        assert args.num_layers == (FULL_LAYERS[model] if variant == "full_depth" else 4)
        assert args.seq_length == 1024 and args.lr == pytest.approx(1e-4)
        assert args.num_experts == EXPERTS[model]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("model", MODELS)
def test_baseline_and_ciera_differ_only_by_the_switch(model, variant):
    base = shlex.split(dry_run(train_script(model), CIERA="0", **VARIANTS[variant]))
    ciera = shlex.split(dry_run(train_script(model), CIERA="1", **VARIANTS[variant]))
    assert "--ciera-allgather" not in base
    ciera.remove("--ciera-allgather")
    assert ciera == base


@pytest.mark.parametrize("model", MODELS)
def test_tiny_keeps_the_layout(model):
    full = split_command(dry_run(train_script(model)))[1]
    tiny = split_command(dry_run(train_script(model), TINY="1"))[1]
    for switch in ("--group-query-attention", "--untie-embeddings-and-output-weights", "--swiglu"):
        assert (switch in full) == (switch in tiny), switch
    for flag in ("--moe-shared-expert-intermediate-size", "--moe-layer-freq"):
        assert (flag in full) == (flag in tiny), flag
    assert flag_value(full, "--moe-router-topk") == flag_value(tiny, "--moe-router-topk")
    non_model = {"--num-layers", "--hidden-size", "--ffn-hidden-size", "--moe-ffn-hidden-size",
                 "--num-attention-heads", "--num-query-groups", "--num-experts", "--seq-length",
                 "--max-position-embeddings", "--moe-shared-expert-intermediate-size", "--moe-layer-freq",
                 "--vocab-size", "--micro-batch-size", "--global-batch-size", "--train-iters",
                 "--log-interval", "--ciera-warmup-iters", "--device"}
    assert {w for w in full if w.startswith("--")} - non_model == {w for w in tiny if w.startswith("--")} - non_model


def test_deepseek_first_layer_is_dense():
    for env, layers in (({}, 4), ({"FULL_DEPTH": "1"}, 28), ({"TINY": "1"}, 2)):
        argv = split_command(dry_run(train_script("deepseek"), **env))[1]
        pattern = flag_value(argv, "--moe-layer-freq")
        assert eval(pattern, {"__builtins__": {}}) == [0] + [1] * (layers - 1)


def test_environment_reaches_the_command(monkeypatch, tmp_path):
    ckpt = tmp_path / "ckpt dir"  # a space, to check the quoting
    line = dry_run(
        train_script("mixtral"),
        "--log-interval", "5", "--tensorboard-dir", str(tmp_path / "tb's"),
        DATA_PATH="0.7 /d/a_text_document 0.3 /d/b_text_document",
        TOKENIZER="byte", VOCAB_SIZE="261",  # VOCAB_SIZE wins over the probe (test_byte_vocab_... runs it)
        CHECKPOINT_DIR=str(ckpt),
        NNODES="1", GPUS_PER_NODE="4", EP="4", MICRO_BATCH="2", GLOBAL_BATCH="16", TRAIN_ITERS="7",
        CIERA_CODEC="exponent_reuse", CIERA_BLOCK_SIZE="64", CIERA_WARMUP_ITERS="30",
    )
    launcher, argv = split_command(line)
    assert world_size(launcher) == 4
    args = _parse(argv, 4, monkeypatch)
    assert args.data_path == ["0.7", "/d/a_text_document", "0.3", "/d/b_text_document"]
    assert (args.tokenizer_type, args.vocab_size) == ("NullTokenizer", 261)
    assert args.save == args.load == str(ckpt)
    assert args.tensorboard_dir == str(tmp_path / "tb's")
    assert args.log_interval == 5  # "$@" comes last and wins
    assert (args.expert_model_parallel_size, args.micro_batch_size, args.global_batch_size) == (4, 2, 16)
    assert args.train_iters == 7
    assert (args.ciera_codec, args.ciera_block_size, args.ciera_warmup_iters) == ("exponent_reuse", 64, 30)


def test_byte_vocab_matches_preprocess_tool():
    """TOKENIZER=byte puts the installed NullTokenizer's EOD on the byte corpus's EOD (260 on
    megatron-core 0.16, 261 on 0.19), as the tool's hint does."""
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    from tools import preprocess_data

    argv = split_command(dry_run(train_script("olmoe"), TOKENIZER="byte"))[1]
    vocab = int(flag_value(argv, "--vocab-size"))
    assert vocab == preprocess_data.byte_train_vocab_size()
    assert NullTokenizer(vocab).eod == preprocess_data.BYTE_EOD == 260


def test_byte_vocab_probe_failure_is_an_error():
    """An interpreter that cannot answer stops the script with a message naming the way out."""
    proc = subprocess.run(["bash", str(train_script("olmoe"))], capture_output=True, text=True, timeout=60,
                          env=_clean_env(DRY_RUN="1", TOKENIZER="byte", PYTHON="/nonexistent/python"))
    assert proc.returncode == 2 and proc.stdout == ""
    assert "set PYTHON to the interpreter that trains, or VOCAB_SIZE (260 on megatron-core 0.16-0.17" in proc.stderr


@pytest.mark.parametrize("model", ["olmoe", "minicpm"])
def test_mock_vocab_pads_to_the_model_rows_on_this_release(model):
    """Without TOKENIZER the model gets the published vocabulary's padded rows whatever NullTokenizer
    adds for its EOD (minicpm's 122753 = 959 x 128 + 1 is the case where N - 1 would fall short)."""
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    from megatron.ciera.app.data import padded_vocab_size

    script = train_script(model)
    published = int(next(line.split("=")[1] for line in script.read_text().splitlines()
                         if line.startswith("MODEL_VOCAB=")))
    for tp in ("1", "2"):
        argv = split_command(dry_run(script, TP=tp, NNODES="1", GPUS_PER_NODE="8"))[1]
        ids = NullTokenizer(int(flag_value(argv, "--vocab-size"))).vocab_size
        pad = 128 * int(tp)
        assert padded_vocab_size(ids, pad) == padded_vocab_size(published, pad)


@pytest.mark.parametrize(
    "env, message",
    [
        ({"GPUS_PER_NODE": "6", "EP": "4"}, "is not divisible by EP(4)"),
        ({"GLOBAL_BATCH": "12"}, "GLOBAL_BATCH(12) is not a multiple of MICRO_BATCH(1) * DP(8) = 8"),
        ({"CIERA": "yes"}, "CIERA must be 0 or 1"),
        ({"NNODES": "2", "MASTER_ADDR": "n0", "EP": "16"}, "experts(8) is not divisible by EP(16)"),
    ],
)
def test_bad_geometry_fails_with_the_arithmetic(env, message):
    proc = subprocess.run(
        ["bash", str(train_script("mixtral"))], env=_clean_env(DRY_RUN="1", **env),
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert message in proc.stderr


def test_quoting_round_trips_odd_arguments():
    odd = ["plain", "with space", "it's", 'dq"', "$HOME", "a;b", "", "*", "~", "--x=a b", "é"]
    argv = split_command(dry_run(train_script("olmoe"), *odd))[1]
    assert argv[-len(odd):] == odd
    # Control characters use bash's $'...' form: check by letting bash itself read the line back.
    odd += ["tab\there", "new\nline"]
    line = dry_run(train_script("olmoe"), *odd)
    assert "\n" not in line
    proc = subprocess.run(["bash", "-c", 'eval "set -- $1"; printf "%s\\0" "$@"', "_", line],
                          capture_output=True, text=True, timeout=30, check=True)
    assert proc.stdout.split("\0")[-len(odd) - 1 : -1] == odd


def _fake_slurm(tmp_path: Path) -> dict[str, str]:
    """A PATH with an `scontrol` that expands the node list, and a job's SLURM variables."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] || exit 1\nprintf "gpu-a17\\ngpu-a18\\n"\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    return {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "gpu-a[17-18]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NNODES": "2",
        "SLURM_JOB_ID": "4242",
        "SLURM_GPUS_ON_NODE": "8",
        "SLURM_SUBMIT_DIR": str(ROOT),
    }


@pytest.mark.parametrize("model", MODELS)
def test_sbatch_runs_one_torchrun_per_node(model, tmp_path, monkeypatch):
    slurm = _fake_slurm(tmp_path)
    line = dry_run(EXAMPLES / model / f"{model}.sbatch", "--log-interval", "3", **slurm)
    words = shlex.split(line)
    assert words[0] == "srun"
    assert words[words.index("--nodes") + 1] == "2" and words[words.index("--ntasks-per-node") + 1] == "1"
    script = EXAMPLES / model / f"train_{model}.sh"
    at = words.index(str(script))
    assert words[at + 1 :] == ["--log-interval", "3"]

    # What srun then runs on the second node (srun exports the job's environment plus these).
    node_env = dict(slurm, NNODES="2", GPUS_PER_NODE="8", MASTER_ADDR="gpu-a17",
                    MASTER_PORT=str(20000 + 4242), SLURM_NODEID="1")
    launcher, argv = split_command(dry_run(script, "--log-interval", "3", **node_env))
    assert launcher[launcher.index("--nnodes") + 1] == "2"
    assert launcher[launcher.index("--node-rank") + 1] == "1"
    assert launcher[launcher.index("--master-addr") + 1] == "gpu-a17"
    assert launcher[launcher.index("--master-port") + 1] == "24242"
    args = _parse(argv, world_size(launcher), monkeypatch)
    assert args.global_batch_size == 16 and args.log_interval == 3


def test_sbatch_headers_and_exports(tmp_path):
    slurm = _fake_slurm(tmp_path)
    for model in MODELS:
        text = (EXAMPLES / model / f"{model}.sbatch").read_text()
        for directive in ("#SBATCH --nodes=", "#SBATCH --gpus-per-node=", "#SBATCH --ntasks-per-node=1"):
            assert directive in text, (model, directive)
    # The sbatch exports the rendezvous for srun's tasks: check by letting "srun" print them.
    fake_srun = tmp_path / "bin" / "srun"
    fake_srun.write_text('#!/bin/sh\necho "$MASTER_ADDR $MASTER_PORT $NNODES $GPUS_PER_NODE"\n')
    fake_srun.chmod(0o755)
    proc = subprocess.run(["bash", str(EXAMPLES / "olmoe" / "olmoe.sbatch")], env=_clean_env(**slurm),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["gpu-a17", "24242", "2", "8"]


def test_sbatch_outside_slurm_explains():
    proc = subprocess.run(["bash", str(EXAMPLES / "olmoe" / "olmoe.sbatch")], env=_clean_env(DRY_RUN="1"),
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "SLURM_JOB_NODELIST is not set" in proc.stderr


def _all_scripts() -> list[Path]:
    return [EXAMPLES / "common.sh"] + sorted(EXAMPLES.glob("*/*.sh")) + sorted(EXAMPLES.glob("*/*.sbatch"))


def test_scripts_parse_and_are_strict():
    scripts = _all_scripts()
    assert len(scripts) == 1 + 2 * len(MODELS)
    for script in scripts:
        subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
        if script.name != "common.sh":
            assert "set -euo pipefail" in script.read_text(), script
            assert os.access(script, os.X_OK), f"{script} is not executable"


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_shellcheck_clean():
    proc = subprocess.run(["shellcheck", "-x", *map(str, _all_scripts())], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
