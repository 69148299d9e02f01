"""Start-up failures are clear and end the job: ranks launched with different flags fail naming
the flag; a stopped rank ends the job with a timeout error (--distributed-timeout-minutes)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ciera.testing import free_port

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[4]
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
        "--use-distributed-optimizer", "--bf16", "--lr", "1e-3", "--mock-data", "--eval-iters", "0", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "127", "--micro-batch-size", "1", "--device", "cpu", "--train-iters", "2"]


def _launch(flags, per_rank="", nproc=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), str(Path(__file__).with_name("per_rank_pretrain.py")),
           *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PER_RANK_FLAGS=per_rank,
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def test_ranks_with_different_flags_fail_naming_them():
    proc = _launch(TINY, per_rank="1:--train-iters 3 --ciera-allgather")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "ranks were launched with different arguments" in out
    assert "--train-iters: rank 1 has 3, rank 0 has 2" in out
    assert "--ciera-allgather: rank 1 has True, rank 0 has False" in out


@pytest.mark.slow
def test_stopped_rank_ends_the_job_with_a_timeout():
    """Rank 1 stops itself (SIGSTOP) after start-up; rank 0's next collective times out after
    --distributed-timeout-minutes 1 and the launcher ends the job."""
    proc = _launch([*TINY, "--train-iters", "50", "--distributed-timeout-minutes", "1", "--log-interval", "1"])
    start, stopped, pids = time.time(), False, {}
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("per_rank_pretrain: rank "):
            _, _, rank, _, pid = line.split()
            pids[rank] = int(pid)
        if not stopped and " iteration        1/" in line:
            os.kill(pids["1"], signal.SIGSTOP)
            stopped = True
        if time.time() - start > 400:
            break
    proc.wait(timeout=120)
    for pid in pids.values():  # a stopped process ignores the launcher's SIGTERM
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    out = "".join(lines)
    assert stopped and proc.returncode != 0, out[-3000:]
    assert time.time() - start < 400
    assert "timed out" in out.lower() or "timeout" in out.lower(), out[-3000:]


def _tiny_gpt2_bpe(folder: Path) -> tuple[str, str]:
    """A GPT-2 byte-level BPE vocabulary (the 256 byte symbols, two merges, <|endoftext|>) and its
    merges file, in the vocab.json / merges.txt formats Megatron-LM's --vocab-file / --merge-file take."""
    import json

    # GPT-2's byte alphabet: printable Latin-1 bytes stand for themselves, the others (space
    # included: 'Ġ') for the code points from 256 up, in byte order.
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    others = iter(range(256, 512))
    symbols = [chr(b) if b in printable else chr(next(others)) for b in range(256)]
    assert symbols[ord(" ")] == "Ġ"
    merges = [("Ġ", "t"), ("h", "e")]
    vocab = {s: i for i, s in enumerate(symbols + ["".join(m) for m in merges] + ["<|endoftext|>"])}
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return str(folder / "vocab.json"), str(folder / "merges.txt")


def _gpt2_bpe_flags(tmp_path) -> list[str]:
    """TINY with --tokenizer-type GPT2BPETokenizer on two files, checked in process: the tokenizer
    is built from them (vocabulary size, end-of-document id, BPE merges applied)."""
    pytest.importorskip("transformers")
    from megatron.ciera.app import arguments, data

    vocab, merges = _tiny_gpt2_bpe(tmp_path)
    flags = [f for f in TINY if f not in ("NullTokenizer", "--vocab-size", "127")]
    at = flags.index("--tokenizer-type") + 1
    flags = [*flags[:at], "GPT2BPETokenizer", *flags[at:], "--vocab-file", vocab, "--merge-file", merges]
    tok = data.build_tokenizer(arguments.parse_args(flags))
    assert tok.vocab_size == 256 + 2 + 1 and tok.eod == 258
    assert tok._tok(" the")["input_ids"] == [256, 257]  # Ġ t -> Ġt, h e -> he
    return flags


def test_gpt2_bpe_tokenizer_from_vocab_and_merge_files(tmp_path):
    """--tokenizer-type GPT2BPETokenizer --vocab-file --merge-file builds the tokenizer from the two
    files (the run that trains with it: the slow test below)."""
    _gpt2_bpe_flags(tmp_path)


@pytest.mark.slow  # a launch; the tokenizer itself is checked by default (above)
def test_gpt2_bpe_tokenizer_trains(tmp_path):
    from megatron.ciera.app.launch import run_pretrain

    result = run_pretrain(_gpt2_bpe_flags(tmp_path), nproc=1, timeout=300)
    assert result.returncode == 0, result.output[-3000:]
    assert sorted(result.losses) == [1, 2] and result.sha256
