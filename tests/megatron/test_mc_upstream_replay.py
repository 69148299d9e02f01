"""Megatron-LM's own commands pass our parser and validation at their own parallel layout.

The fixtures (``upstream_commands/``, see its README) are upstream's functional-test and example
flag sets, replayed as a user would: plus ``--use-distributed-optimizer --ciera-allgather``,
validated for the GPU node they were written for (``device='cuda'`` with transformer-engine), at
the smallest world size their layout fits (8 GPUs or a multiple of the layout's product).
"""

import math
import shlex
from pathlib import Path

import pytest

from megatron.ciera import arguments

FIXTURES = sorted((Path(__file__).parent / "upstream_commands").glob("*.txt"))
# Commands whose rejection is the right answer, with the flag that is named.
EXPECTED_REJECTIONS = {
    "train_gpt3_175b_distributed": "--rampup-batch-size: batch-size ramp-up is not implemented",
    "train_mixtral_8x7b_distributed": "--tokenizer-type Llama2Tokenizer: this entry point builds",
}


def _flags(path: Path) -> list[str]:
    return [w for line in path.read_text().splitlines() if not line.startswith("#") for w in shlex.split(line)]


def _world(args) -> int:
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size or tp
    need = math.lcm(tp * pp * cp, etp * ep * pp)
    return math.lcm(need, 8) if need <= 8 else need


def replay(path: Path):
    argv = _flags(path) + ["--use-distributed-optimizer", "--ciera-allgather"]
    parser = arguments.build_parser()
    args = parser.parse_args(argv)
    args.explicit = arguments.explicit_dests(parser, argv)
    return arguments.validate_args(args, world_size=_world(args), device="cuda", te_available=True)


def test_there_are_34_fixtures_with_their_source():
    assert len(FIXTURES) == 34
    assert all(p.read_text().startswith("# source: github.com/NVIDIA/Megatron-LM@") for p in FIXTURES)


def test_at_least_30_upstream_commands_pass():
    failures = {}
    for path in FIXTURES:
        try:
            replay(path)
        except (ValueError, SystemExit) as exc:
            failures[path.stem] = str(exc)
    passed = len(FIXTURES) - len(failures)
    print(f"upstream replay: {passed}/{len(FIXTURES)} pass")
    for name, why in failures.items():
        print(f"  {name}: {why}")
    assert passed >= 30, failures
    assert set(failures) <= set(EXPECTED_REJECTIONS), failures


@pytest.mark.parametrize("name", sorted(EXPECTED_REJECTIONS))
def test_rejected_commands_name_the_flag(name):
    with pytest.raises(ValueError) as info:
        replay(next(p for p in FIXTURES if p.stem == name))
    assert EXPECTED_REJECTIONS[name] in str(info.value)


def test_replayed_configs_pick_the_gpu_paths():
    """What a GPU node would build for upstream's MoE command: TE spec, grouped GEMM, fusions."""
    from megatron.ciera import model

    args = replay(next(p for p in FIXTURES if p.stem == "gpt3_mcore_te_tp2_pp1_te_8experts2parallel_overlap_grad_reduce_param_gather_groupedGEMM"))
    assert args.transformer_impl == "transformer_engine" and args.cpu_ignored == []
    config = model.transformer_config(args)
    assert config.moe_grouped_gemm and config.moe_token_dispatcher_type == "allgather"  # as upstream wrote it
    assert config.sequence_parallel and config.tensor_model_parallel_size == 2
    assert config.masked_softmax_fusion and config.bias_dropout_fusion  # upstream's default fusions stay on
