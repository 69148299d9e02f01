"""megatron.ciera.app.arguments: Megatron-LM's flag table, the flag policy, clear errors with the
arithmetic, --ciera-* -> CieraConfig, the configs a GPU node would build."""

import pytest
import torch

from flag_args import TINY_FLAGS, parse_and_validate
from megatron.ciera.app import arguments, flag_table

BASE = [*TINY_FLAGS, "--use-distributed-optimizer"]
_HAS_STEP_SCHEDULE = any(flag["dest"] == "step_batch_size_schedule" for flag in flag_table.upstream_flags())
"""megatron-core 0.19's flag table: its batch ramp is --step-batch-size-schedule, --rampup-batch-size refused."""


def parse(extra, world=1, argv_base=BASE, **kw):
    return parse_and_validate(argv_base + extra, world=world, **kw)


def error(extra, world=1, **kw):
    with pytest.raises(ValueError) as info:
        parse(extra, world, **kw)
    return str(info.value)


def test_defaults_and_derived_values():
    args = parse(["--global-batch-size", "8"], world=2)
    assert (args.data_parallel_size, args.num_microbatches) == (2, 2)
    assert args.ffn_hidden_size == 256 and args.kv_channels == 16 and args.max_position_embeddings == 64
    assert args.params_dtype == torch.bfloat16 and not args.ciera_allgather
    assert arguments.ciera_config_from_args(args) is None


def test_bf16_reduces_gradients_in_fp32_as_upstream():
    """Megatron-LM forces fp32 gradient accumulation and reduction for bf16 (fp32 main grads)
    unless --grad-reduce-in-bf16; the DDP config carries it."""
    from megatron.ciera.app import model

    assert parse([]).accumulate_allreduce_grads_in_fp32
    assert model.ddp_config(parse([])).grad_reduce_in_fp32
    bf16_reduce = parse(["--grad-reduce-in-bf16"])
    assert not bf16_reduce.accumulate_allreduce_grads_in_fp32
    assert not model.ddp_config(bf16_reduce).grad_reduce_in_fp32
    fp32_run = parse([], argv_base=[a for a in BASE if a != "--bf16"])
    assert not fp32_run.accumulate_allreduce_grads_in_fp32
    assert "needs --main-grads-dtype fp32" in error(["--accumulate-allreduce-grads-in-fp32", "--main-grads-dtype", "bf16"])


def test_ddp_flags_with_another_dest_reach_the_ddp_config():
    """Upstream maps --ddp-* flags onto DistributedDataParallelConfig fields of other names."""
    from megatron.ciera.app import model

    assert not model.ddp_config(parse([])).reduce_scatter_with_fp32_accumulation
    cfg = model.ddp_config(parse(["--ddp-reduce-scatter-with-fp32-accumulation", "--ddp-pad-buckets-for-high-nccl-busbw"]))
    assert cfg.reduce_scatter_with_fp32_accumulation and cfg.pad_buckets_for_high_nccl_busbw


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


def test_ciera_per_rank_sizes_flag_reaches_the_config():
    assert arguments.ciera_config_from_args(parse(["--ciera-allgather"])).per_rank_sizes is True
    off = parse(["--ciera-allgather", "--ciera-per-rank-sizes", "false"])
    assert arguments.ciera_config_from_args(off).per_rank_sizes is False
    with pytest.raises(SystemExit):
        parse(["--ciera-allgather", "--ciera-per-rank-sizes", "sometimes"])


def test_ciera_tuning_flags_without_ciera_allgather_are_inert():
    args = parse(["--ciera-codec", "delta", "--ciera-warmup-iters", "2"])
    assert arguments.ciera_config_from_args(args) is None


@pytest.mark.parametrize("extra, world, needle", [
    (["--fp16"], 1, "--bf16 and --fp16 are mutually exclusive"),
    (["--global-batch-size", "6"], 2, "--global-batch-size 6 is not divisible by --micro-batch-size 2 x data-parallel size 2 = 4"),
    (["--tensor-model-parallel-size", "3"], 4, "world size 4 is not divisible by tensor x pipeline x context parallel size 3 x 1 x 1 = 3"),
    (["--pipeline-model-parallel-size", "3"], 3, "--num-layers 2 is not divisible by --pipeline-model-parallel-size 3"),
    (["--tensor-model-parallel-size", "2", "--num-experts", "4"], 2, "--num-experts with --tensor-model-parallel-size 2 needs --sequence-parallel"),
    (["--tensor-model-parallel-size", "8"], 8, "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 8"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "2"], 2,
     "the interleaved schedule needs the number of micro batches (1) to be a multiple of --pipeline-model-parallel-size 2"),
    (["--num-layers-per-virtual-pipeline-stage", "1"], 1, "needs --pipeline-model-parallel-size >= 2"),
    (["--micro-batch-size", "0"], 1, "--micro-batch-size 0 must be >= 1"),
    (["--global-batch-size", "-4"], 1, "--global-batch-size -4 must be >= 1"),
    (["--global-batch-size", "0"], 1, "--global-batch-size 0 must be >= 1"),
    (["--rampup-batch-size", "16", "16", "100"], 1,
     "--rampup-batch-size: megatron-core 0.19 ignores it" if _HAS_STEP_SCHEDULE
     else "--rampup-batch-size needs --train-samples"),
    (["--use-torch-fsdp2", "--no-gradient-accumulation-fusion"], 1,
     "--use-torch-fsdp2 is not supported with MCore's distributed optimizer"),
    (["--use-megatron-fsdp"], 1, "--use-megatron-fsdp with --ckpt-format torch_dist: Megatron FSDP only supports"),
    (["--no-save-optim", "--yaml-cfg", "x.yaml"], 1, "--yaml-cfg: YAML configs are not read"),
    (["--relative-attention-num-buckets", "16"], 1, "--relative-attention-num-buckets: not implemented by this pretrain_gpt.py"),
    (["--distributed-timeout-minutes", "0"], 1, "--distributed-timeout-minutes 0 must be > 0"),
    (["--moe-token-dispatcher-type", "flex", "--num-experts", "4"], 1, "--moe-token-dispatcher-type flex needs DeepEP"),
    (["--context-parallel-size", "2", "--multi-latent-attention"], 2,
     "--multi-latent-attention with --context-parallel-size 2 needs transformer-engine's attention"),
    (["--lr-warmup-samples", "10"], 1, "--lr-decay-samples / --lr-warmup-samples go with --train-samples"),
    (["--num-experts", "3", "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"], 2,
     "--num-experts 3 is not divisible by --expert-model-parallel-size 2"),
    (["--num-experts", "4", "--expert-model-parallel-size", "2"], 3, "world size 3 is not divisible by expert-tensor x expert x pipeline parallel size 1 x 2 x 1 = 2"),
    (["--ciera-allgather", "--ciera-warmup-iters", "0"], 1, "warmup_gathers=0 must be >= 1"),
    (["--ciera-allgather", "--ciera-block-size", "3"], 1, "block_size=3 must be a power of two"),
    (["--ciera-snapshot-dir", "/tmp/s"], 1, "--ciera-snapshot-dir and --ciera-snapshot-interval go together"),
    (["--save-interval", "5"], 1, "--save-interval needs --save"),
    (["--num-experts", "4", "--moe-token-dispatcher-type", "alltoall"], 1,
     "--num-experts with biased linears under --transformer-impl local (the CPU path)"),
    (["--multi-latent-attention"], 1, "--multi-latent-attention needs transformer-engine's attention"),
])
def test_errors_name_the_flags_and_numbers(extra, world, needle):
    assert needle in error(extra, world)


def test_scheduler_on_load_follows_upstreams_flags():
    """The LR schedule of a checkpoint against the command line's, by megatron-core's scheduler:
    by default they must match; --use-checkpoint-opt-param-scheduler takes the checkpoint's,
    --override-opt-param-scheduler the command line's."""
    from types import SimpleNamespace

    from megatron.ciera.app import model

    def scheduler(*extra):
        return model.scheduler(parse(["--global-batch-size", "8", *extra], world=2),
                               SimpleNamespace(param_groups=[{"params": []}]))

    saved = scheduler("--lr", "1e-4").state_dict()
    with pytest.raises(AssertionError, match="do not match"):
        scheduler("--lr", "2e-4").load_state_dict(saved)
    kept = scheduler("--lr", "2e-4", "--use-checkpoint-opt-param-scheduler")
    kept.load_state_dict(saved)
    assert kept.max_lr == 1e-4
    override = scheduler("--lr", "2e-4", "--override-opt-param-scheduler")
    override.load_state_dict(saved)
    assert override.max_lr == 2e-4
    assert "are exclusive" in error(["--override-opt-param-scheduler", "--use-checkpoint-opt-param-scheduler"])


def test_local_context_parallel_reports_or_refuses_another_cp_comm_type():
    """Without TE, CP runs megatron.ciera.app.cp_attention (all-gather-KV): upstream's default
    --cp-comm-type p2p is a TE kernel choice, reported on CPU and refused on a GPU."""
    args = parse(["--context-parallel-size", "2", "--device", "cpu"], world=2)
    assert args.cpu_ignored == ["--cp-comm-type p2p (the local context-parallel attention all-gathers K/V)"]
    assert parse(["--context-parallel-size", "2", "--cp-comm-type", "all_gather", "--device", "cpu"],
                 world=2).cpu_ignored == []
    assert "--cp-comm-type p2p: --transformer-impl local's context-parallel attention all-gathers K/V" in error(
        ["--context-parallel-size", "2", "--transformer-impl", "local"], 2, device="cuda", te_available=False)
    gpu = parse(["--context-parallel-size", "2", "--transformer-impl", "local", "--cp-comm-type", "all_gather"],
                world=2, device="cuda", te_available=False)
    assert gpu.context_parallel_size == 2 and gpu.data_parallel_size == 1


def test_every_upstream_flag_is_recognised_with_upstream_defaults():
    flags = flag_table.upstream_flags()
    assert len(flags) > 600
    parser = arguments.build_parser()
    defaults = vars(parser.parse_args([]))
    by_option = {o: a for a in parser._actions for o in a.option_strings}
    seen = set()
    for flag in flags:
        assert all(o in by_option for o in flag["options"]), flag["options"]
        if flag["type"] != "custom" and flag["dest"] not in seen:  # a shared dest keeps the first default
            assert defaults[flag["dest"]] == flag["default"], flag
        seen.add(flag["dest"])
    # a few types and defaults as upstream has them
    assert (defaults["transformer_impl"], defaults["distributed_timeout_minutes"], defaults["moe_token_dispatcher_type"]) == (
        "transformer_engine", 10, "allgather")
    assert defaults["bias_gelu_fusion"] and defaults["masked_softmax_fusion"] and not defaults["sequence_parallel"]


def test_policy_table_classifies_flags():
    from megatron.ciera.app import flag_policy as fp

    assert fp.policy("hidden_size").kind == fp.HONOURED  # a TransformerConfig field: by construction
    assert fp.policy("overlap_param_gather").kind == fp.HONOURED  # DistributedDataParallelConfig
    assert fp.policy("adam_beta2").kind == fp.HONOURED  # OptimizerConfig
    assert fp.policy("moe_grouped_gemm").kind == fp.GPU and fp.policy("masked_softmax_fusion").kind == fp.GPU
    assert fp.policy("save").kind == "feature:checkpoint" and fp.policy("eval_iters").kind == "feature:eval"
    assert fp.policy("num_workers").kind == "feature:data" and fp.policy("wandb_project").kind == "feature:logging"
    assert fp.policy("log_interval").kind == fp.HONOURED
    assert fp.policy("rampup_batch_size").kind == fp.HONOURED  # megatron.ciera.app.batch_schedule
    assert fp.policy("error_injection_rate") == fp.Policy(fp.REJECTED, fp.DEFAULT_REASON)


def test_rejected_flag_at_its_default_value_is_accepted():
    assert parse(["--error-injection-rate", "0"]).error_injection_rate == 0  # upstream's default: harmless
    assert "--error-injection-rate: not implemented" in error(["--error-injection-rate", "1"])


def test_cpu_reports_gpu_only_flags_and_runs_the_local_path():
    args = parse(["--moe-grouped-gemm", "--num-experts", "4", "--disable-bias-linear", "--no-masked-softmax-fusion",
                  "--attention-backend", "flash", "--transformer-impl", "transformer_engine"], device="cpu")
    assert args.transformer_impl == "local" and args.distributed_backend == "gloo"
    assert {"--moe-grouped-gemm", "--no-masked-softmax-fusion", "--attention-backend",
            "--transformer-impl transformer_engine"} <= set(args.cpu_ignored)
    from megatron.ciera.app import model

    config = model.transformer_config(args)
    assert not config.moe_grouped_gemm and not config.bias_activation_fusion and not config.gradient_accumulation_fusion


def test_gpu_config_keeps_upstream_paths_and_fusions():
    from megatron.core.transformer.enums import AttnBackend

    from megatron.ciera.app import model

    args = parse(["--moe-grouped-gemm", "--num-experts", "4", "--moe-token-dispatcher-type", "alltoall",
                  "--attention-backend", "flash", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                  "--disable-bias-linear", "--swiglu"],
                 world=2, device="cuda", te_available=True)
    assert args.transformer_impl == "transformer_engine" and args.distributed_backend == "nccl"
    config = model.transformer_config(args)
    assert config.moe_grouped_gemm and config.attention_backend == AttnBackend.flash
    assert config.masked_softmax_fusion and config.bias_dropout_fusion and config.gradient_accumulation_fusion
    assert config.sequence_parallel and config.tensor_model_parallel_size == 2
    # without transformer-engine on the GPU node: the local spec by default, a clear error if asked for
    assert parse([], device="cuda", te_available=False).transformer_impl == "local"
    assert "transformer-engine is not installed" in error(["--transformer-impl", "transformer_engine"],
                                                          device="cuda", te_available=False)
    assert "--moe-grouped-gemm needs transformer-engine" in error(["--moe-grouped-gemm", "--num-experts", "4"],
                                                                  device="cuda", te_available=False)


def test_schedule_in_samples_and_warmup_fraction():
    argv = [a for a in BASE if a not in ("--train-iters", "5")]
    parser = arguments.build_parser()
    args = parser.parse_args(argv + ["--train-samples", "80", "--lr-warmup-fraction", "0.1", "--global-batch-size", "8"])
    args = arguments.validate_args(args, world_size=2)
    assert args.train_iters == 10 and args.lr_decay_steps == 80 and args.lr_warmup_steps == 8
    args = parse(["--lr-warmup-iters", "2", "--global-batch-size", "8"], world=2)
    assert (args.lr_warmup_steps, args.lr_decay_steps) == (16, 40)


def test_layouts_fill_derived_sizes():
    args = parse(["--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2",
                  "--num-layers-per-virtual-pipeline-stage", "1", "--num-experts", "4", "--disable-bias-linear",
                  "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
                  "--global-batch-size", "8"], world=8)
    assert (args.data_parallel_size, args.expert_data_parallel_size, args.virtual_pipeline_model_parallel_size) == (2, 2, 1)
    assert args.num_microbatches == 2
    assert not parse(["--sequence-parallel"]).sequence_parallel  # TP 1: nothing to split (as upstream)


def test_rank_agreement_names_the_differing_flags():
    from megatron.ciera.app.parallel import differing_flags

    a, b = {"train_iters": "5", "ciera_allgather": "True"}, {"train_iters": "7", "ciera_allgather": "False"}
    diff = differing_flags(a, [a, b])
    assert diff == ["--ciera-allgather: rank 1 has False, rank 0 has True", "--train-iters: rank 1 has 7, rank 0 has 5"]


def test_distributed_optimizer_is_required_for_param_gather_features():
    argv = [a for a in BASE if a != "--use-distributed-optimizer"]
    args = arguments.build_parser().parse_args(argv + ["--overlap-grad-reduce", "--overlap-param-gather", "--ciera-allgather"])
    args.explicit = set()
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
