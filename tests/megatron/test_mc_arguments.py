"""megatron.ciera.arguments: Megatron-LM flag names, clear errors with the arithmetic, --ciera-* -> CieraConfig."""

import pytest

from megatron.ciera import arguments

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--lr", "1e-4", "--micro-batch-size", "2", "--train-iters", "5", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--use-distributed-optimizer", "--bf16"]


def parse(extra, world=1):
    args = arguments.build_parser().parse_args(BASE + extra)
    return arguments.validate_args(args, world_size=world)


def error(extra, world=1):
    with pytest.raises(ValueError) as info:
        parse(extra, world)
    return str(info.value)


def test_defaults_and_derived_values():
    args = parse(["--global-batch-size", "8"], world=2)
    assert (args.data_parallel_size, args.num_microbatches) == (2, 2)
    assert args.ffn_hidden_size == 256 and args.kv_channels == 16 and args.max_position_embeddings == 64
    assert args.params_dtype == "bf16" and not args.ciera_allgather
    assert arguments.ciera_config_from_args(args) is None


def test_launch_script_flags_are_accepted():
    args = parse(["--use-mcore-models", "--ffn-hidden-size", "128", "--normalization", "RMSNorm",
                  "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
                  "--untie-embeddings-and-output-weights", "--group-query-attention", "--num-query-groups", "2",
                  "--kv-channels", "16", "--max-position-embeddings", "64", "--num-experts", "4",
                  "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--moe-shared-expert-intermediate-size", "64",
                  "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2",
                  "--moe-token-dispatcher-type", "alltoall", "--expert-model-parallel-size", "2",
                  "--moe-layer-freq", "([0]*1+[1]*1)", "--tensor-model-parallel-size", "1",
                  "--pipeline-model-parallel-size", "1", "--overlap-grad-reduce", "--overlap-param-gather",
                  "--optimizer", "adam", "--min-lr", "1e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
                  "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--adam-eps", "1e-8",
                  "--clip-grad", "1.0", "--init-method-std", "0.02", "--seed", "7", "--global-batch-size", "8",
                  "--log-interval", "1", "--device", "cpu", "--attention-dropout", "0", "--hidden-dropout", "0",
                  "--save", "/tmp/x", "--load", "/tmp/x", "--save-interval", "2", "--ciera-allgather",
                  "--ciera-codec", "delta", "--ciera-block-size", "16", "--ciera-warmup-iters", "3",
                  "--ciera-selection", "never", "--ciera-verify-interval", "5",
                  "--ciera-snapshot-dir", "/tmp/s", "--ciera-snapshot-interval", "10"], world=2)
    assert args.moe_layer_freq == [0, 1] and args.num_query_groups == 2
    config = arguments.ciera_config_from_args(args)
    assert (config.codec, config.block_size, config.warmup_gathers, config.selection, config.verify_interval) == (
        "delta", 16, 3, "never", 5)


def test_ciera_config_keeps_library_defaults_for_unset_flags():
    from ciera.config import CieraConfig

    assert arguments.ciera_config_from_args(parse(["--ciera-allgather"])) == CieraConfig()


def test_ciera_tuning_flags_without_ciera_allgather_are_inert():
    args = parse(["--ciera-codec", "delta", "--ciera-warmup-iters", "2"])
    assert arguments.ciera_config_from_args(args) is None


@pytest.mark.parametrize("extra, world, needle", [
    (["--fp16"], 1, "--bf16 and --fp16 are mutually exclusive"),
    (["--global-batch-size", "6"], 2, "--global-batch-size 6 is not divisible by --micro-batch-size 2 x data-parallel size 2 = 4"),
    (["--tensor-model-parallel-size", "2"], 2, "--tensor-model-parallel-size 2: only 1 is supported"),
    (["--pipeline-model-parallel-size", "2"], 2, "--pipeline-model-parallel-size 2: only 1 is supported"),
    (["--num-experts", "3", "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"], 2,
     "--num-experts 3 is not divisible by --expert-model-parallel-size 2"),
    (["--num-experts", "4", "--expert-model-parallel-size", "2"], 3, "data-parallel size 3 (world 3 / (tp 1 x pp 1)) is not divisible by --expert-model-parallel-size 2"),
    (["--ciera-allgather", "--ciera-warmup-iters", "0"], 1, "warmup_gathers=0 must be >= 1"),
    (["--ciera-allgather", "--ciera-block-size", "3"], 1, "block_size=3 must be a power of two"),
    (["--ciera-snapshot-dir", "/tmp/s"], 1, "--ciera-snapshot-dir and --ciera-snapshot-interval go together"),
    (["--save-interval", "5"], 1, "--save-interval needs --save"),
])
def test_errors_name_the_flags_and_numbers(extra, world, needle):
    assert needle in error(extra, world)


def test_distributed_optimizer_is_required_for_param_gather_features():
    argv = [a for a in BASE if a != "--use-distributed-optimizer"]
    args = arguments.build_parser().parse_args(argv + ["--overlap-grad-reduce", "--overlap-param-gather", "--ciera-allgather"])
    with pytest.raises(ValueError) as info:
        arguments.validate_args(args, world_size=2)
    assert "--overlap-param-gather requires --use-distributed-optimizer" in str(info.value)
    assert "--ciera-allgather requires --use-distributed-optimizer" in str(info.value)


def test_parse_args_exits_with_usage_error(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit) as info:
        arguments.parse_args(BASE + ["--fp16"])
    assert info.value.code == 2
    assert "mutually exclusive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        arguments.parse_args(BASE + ["--no-such-flag"])


def test_moe_layer_freq_patterns():
    assert arguments._moe_layer_freq("2") == 2
    assert arguments._moe_layer_freq("[0]+[1]*3") == [0, 1, 1, 1]
    with pytest.raises(Exception):
        arguments._moe_layer_freq("__import__('os')")
