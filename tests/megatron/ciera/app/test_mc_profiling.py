"""--profile / --use-pytorch-profiler: upstream's step window, trace location and rank choice."""

import gzip
import json
from pathlib import Path

import pytest

from megatron.ciera.app import arguments, flag_policy, profiling

TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
        "--max-position-embeddings", "32", "--lr", "1e-3", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--eval-iters", "0",
        "--num-workers", "0", "--device", "cpu", "--use-distributed-optimizer"]


def _error(extra):
    with pytest.raises(ValueError) as info:
        arguments.validate_args(arguments.build_parser().parse_args([*TINY, "--train-iters", "5", *extra]),
                                world_size=2, device="cpu")
    return str(info.value)


def test_profiler_flags_are_checked_by_name():
    assert flag_policy.policy("profile").kind == flag_policy.HONOURED
    assert flag_policy.policy("use_pytorch_profiler").kind == flag_policy.HONOURED
    assert "--use-pytorch-profiler needs --tensorboard-dir" in _error(["--profile", "--use-pytorch-profiler"])
    assert "need 0 <= start < end" in _error(["--profile", "--use-pytorch-profiler", "--tensorboard-dir", "x",
                                              "--profile-step-start", "4", "--profile-step-end", "4"])
    assert "on CPU add --use-pytorch-profiler" in _error(["--profile"])


def _trace_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


@pytest.mark.distributed
def test_pytorch_profiler_writes_a_chrome_trace_of_the_requested_steps(tmp_path):
    from megatron.ciera.app.launch import run_pretrain

    tb = tmp_path / "tb"
    flags = [*TINY, "--train-iters", "5", "--log-interval", "5", "--profile", "--use-pytorch-profiler",
             "--profile-step-start", "2", "--profile-step-end", "4", "--tensorboard-dir", str(tb)]
    result = run_pretrain(flags, nproc=2, timeout=240)
    assert result.returncode == 0, result.output[-3000:]
    args = arguments.build_parser().parse_args(flags)
    out = profiling.trace_dir(args)
    traces = sorted(p for p in out.iterdir() if p.name.endswith((".pt.trace.json", ".json.gz")))
    # --profile-ranks' default: rank 0 alone (0.16), every rank (0.19: [] means all)
    assert len(traces) == (len(args.profile_ranks) or 2), traces
    for trace in traces:
        events = _trace_events(trace)
        steps = sorted({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")})
        assert steps == ["ProfilerStep#2", "ProfilerStep#3"]  # iterations start .. end - 1, nothing else
        assert any(e.get("cat") == "cpu_op" and e.get("name", "").startswith("aten::") for e in events)
