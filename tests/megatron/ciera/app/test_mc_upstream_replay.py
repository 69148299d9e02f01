"""Megatron-LM's own commands pass our parser and validation at their own parallel layout, and a
shrunk copy of each trains bit for bit alike with and without ``--ciera-allgather``.

The fixtures (``upstream_commands/``, see its README) are upstream's functional-test and example
flag sets at one release tag, replayed as a user would: plus ``--use-distributed-optimizer
--ciera-allgather``, validated for the GPU node they were written for (``device='cuda'`` with
transformer-engine), at the smallest world size their layout fits (8 GPUs or a multiple of the
layout's product). On an older installed megatron-core, flags of the fixtures' newer release are
refused by name (:func:`megatron.ciera.app.flag_table.newer_release_flags`).

The runs (:func:`shrink`) keep every flag and cut what is a size (layers, hidden, heads, experts,
sequence, batch, iterations) to fit at most 8 CPU gloo ranks; data becomes ``--mock-data``, and
checkpoints are not written (``--save`` / ``--load`` and the flags that only act with them go:
``test_mc_checkpointing`` covers those). A few are in the default suite, all of them ``slow``.
"""

import functools
import json
import math
import re
import shlex
from pathlib import Path

import pytest

from megatron.ciera.app import arguments, flag_table
from megatron.ciera.app.launch import run_pretrain

FIXTURES = sorted((Path(__file__).parent / "upstream_commands").glob("*.txt"))
# Commands whose rejection (on the fixtures' release) is the right answer, with what is named.
EXPECTED_REJECTIONS = {
    "train_gpt3_175b_distributed": "--step-batch-size-schedule",
    "gpt3_mcore_te_tp2_zp_z3_resume_fsdp_dtensor": "--async-save with --ckpt-format fsdp_dtensor: not implemented",
    "gpt3_mcore_tp2_pp2_ep2_etp2_te_4experts2parallel_dp_last": "--use-tp-pp-dp-mapping: not implemented",
    "gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_muon": "--no-use-layer-wise-param-layout: not implemented",
}
# Run in the default suite (4 ranks each); every fixture runs under ``slow``.
DEFAULT_RUNS = {"gpt3_mcore_te_tp2_pp1_multi_dist_optimizer_instances"}
# Shrunk runs that cannot run on CPU, with megatron-core's reason.
CPU_UNRUNNABLE = {name: "--recompute-modules moe_act needs --moe-grouped-gemm (megatron-core), a GPU kernel"
                  for name in ("gpt3_mcore_te_tp2_pp2_ep4_etp1_selective_recompute_experimental",
                               "gpt3_moe_mcore_te_tp4_ep2_etp2_pp2_scoped_cudagraph")}
CPU_UNRUNNABLE.update({name: "--multi-latent-attention needs transformer-engine's attention (refused by name on "
                             "the local path: megatron-core's local attention takes no k_channels)"
                       for name in ("gpt3_mcore_te_tp2_pp2_ep4_etp1_memory_speed",
                                    "gpt3_mcore_te_tp2_pp2_ep4_etp1_mtp_resume_torch_dist_fp8",
                                    "gpt3_moe_mcore_te_tp2_pp2_ep4_etp1_fine_grained_offloading",
                                    "gpt3_moe_mcore_te_tp2_pp2_ep4_etp1_no_mtp_no_a2a_ovlp_fine_grained_offloading")})


def _flags(path: Path) -> list[str]:
    return [w for line in path.read_text().splitlines() if not line.startswith("#") for w in shlex.split(line)]


def _tag(path: Path) -> str:
    return path.read_text().split()[2].rsplit("@", 1)[1]


def _installed_tag() -> str:
    source = json.loads(flag_table.table_path().read_text())["source"]
    return source.split()[1]


def _world(args) -> int:
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size or tp
    need = math.lcm(tp * pp * cp, etp * ep * pp)
    return math.lcm(need, 8) if need <= 8 else need


def _parse(argv: list[str]):
    if newer := flag_table.newer_release_flags(argv):
        raise ValueError(f"{', '.join(newer)}: flags of a newer Megatron-LM release ({', '.join(set(newer.values()))})")
    parser = arguments.build_parser()
    args = parser.parse_args(argv)
    args.explicit = arguments.explicit_dests(parser, argv)
    return args


def replay(path: Path):
    args = _parse(_flags(path) + ["--use-distributed-optimizer", "--ciera-allgather"])
    return arguments.validate_args(args, world_size=_world(args), device="cuda", te_available=True)


def test_there_are_42_fixtures_with_their_source():
    assert len(FIXTURES) == 42
    assert all(p.read_text().startswith("# source: github.com/NVIDIA/Megatron-LM@core_v") for p in FIXTURES)
    moe = [p for p in FIXTURES if "--num-experts" in _flags(p)]
    assert (len(moe), len(FIXTURES) - len(moe)) == (34, 8)
    assert len({_tag(p) for p in FIXTURES}) == 1


def test_upstream_commands_on_the_installed_release():
    """On the fixtures' release at least 38 of 42 are accepted and the rest are the expected
    refusals; on an older one every refusal is expected or names the newer release's flags."""
    same_release = _installed_tag() == _tag(FIXTURES[0])
    failures = {}
    for path in FIXTURES:
        try:
            replay(path)
        except (ValueError, SystemExit) as exc:
            failures[path.stem] = str(exc)
    passed = len(FIXTURES) - len(failures)
    print(f"upstream replay on {_installed_tag()}: {passed}/{len(FIXTURES)} accepted")
    for name, why in failures.items():
        print(f"  {name}: {why}")
    unexplained = {name: why for name, why in failures.items()
                   if EXPECTED_REJECTIONS.get(name, "\0") not in why
                   and (same_release or "flags of a newer Megatron-LM release" not in why)}
    assert not unexplained, unexplained
    if same_release:
        assert passed >= 38, failures


@pytest.mark.parametrize("name", sorted(EXPECTED_REJECTIONS))
def test_rejected_commands_name_the_flag(name):
    with pytest.raises(ValueError) as info:
        replay(next(p for p in FIXTURES if p.stem == name))
    assert EXPECTED_REJECTIONS[name] in str(info.value) or "flags of a newer Megatron-LM release" in str(info.value)


def test_replayed_configs_pick_the_gpu_paths():
    """What a GPU node would build for upstream's MoE command: TE spec, grouped GEMM, fusions."""
    from megatron.ciera.app import model

    path = next(p for p in FIXTURES
                if p.stem == "gpt3_mcore_te_tp2_pp1_te_8experts2parallel_overlap_grad_reduce_param_gather_groupedGEMM")
    try:
        args = replay(path)
    except ValueError as exc:
        pytest.skip(f"not accepted on {_installed_tag()}: {exc}")
    assert args.transformer_impl == "transformer_engine" and args.cpu_ignored == []
    config = model.transformer_config(args)
    assert config.sequence_parallel and config.tensor_model_parallel_size == 2
    assert config.moe_grouped_gemm and config.moe_token_dispatcher_type == "allgather"  # as upstream wrote it
    assert config.masked_softmax_fusion and config.bias_dropout_fusion  # upstream's default fusions stay on


# --- running a shrunk copy --------------------------------------------------------------------

# Flags (with their values) a shrunk run drops: data and tokenizer (mock data instead), where
# checkpoints and logs go, and what only acts with those; layouts tied to the full layer count.
_DROP = {"--data-path", "--vocab-file", "--merge-file", "--tokenizer-type", "--tokenizer-model", "--data-cache-path",
         "--split", "--train-data-path", "--valid-data-path", "--test-data-path", "--save", "--load",
         "--save-interval", "--async-save", "--finetune", "--save-retain-interval", "--auto-detect-ckpt-format",
         "--non-persistent-save-interval", "--tensorboard-dir", "--wandb-project", "--wandb-exp-name",
         "--wandb-save-dir", "--train-samples", "--lr-decay-samples", "--lr-warmup-samples", "--lr-decay-iters",
         "--lr-warmup-iters", "--eval-interval", "--eval-iters", "--distributed-backend", "--exit-interval",
         "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers", "--rampup-batch-size",
         "--step-batch-size-schedule", "--vocab-size", "--mock-data", "--exit-duration-in-mins", "--num-workers",
         "--dist-ckpt-strictness", "--use-checkpoint-opt_param-scheduler",
         "--use-checkpoint-opt-param-scheduler"}
# Size flags a shrunk run sets (the rest of its sizes are derived in shrink()).
_SIZES = {"--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--kv-channels",
          "--num-query-groups", "--seq-length", "--max-position-embeddings", "--micro-batch-size",
          "--global-batch-size", "--train-iters", "--num-experts", "--moe-ffn-hidden-size",
          "--moe-shared-expert-intermediate-size", "--moe-layer-freq", "--q-lora-rank", "--kv-lora-rank",
          "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim", "--moe-router-num-groups",
          "--moe-router-group-topk", "--moe-router-topk", "--num-layers-per-virtual-pipeline-stage",
          "--expert-model-parallel-size", "--pipeline-model-parallel-size", "--tensor-model-parallel-size"}
ITERS = 3  # warm-up gather raw, then compressed gathers feed iterations 3 on


def _strip(flags: list[str], drop: set) -> list[str]:
    """``flags`` without each option in ``drop`` and its values."""
    out, skipping = [], False
    for word in flags:
        if word.startswith("--"):
            skipping = word.split("=", 1)[0] in drop
        if not skipping:
            out.append(word)
    return out


def shrink(path: Path) -> tuple[list[str], int]:
    """The fixture's flags with sizes cut to CPU scale and the number of gloo ranks to run on (a
    layout over 8 ranks halves its expert, then pipeline, then tensor parallel size)."""
    full = _flags(path)
    args = _parse(full)
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size or tp
    while (need := math.lcm(tp * pp * cp, etp * ep * pp)) > 8:
        if ep > 1:
            ep //= 2
        elif pp > 1:
            pp //= 2
        else:
            tp, etp = max(tp // 2, 1), max(etp // 2, 1)
    world = need * 2 if need * 2 <= 8 else need  # data-parallel 2 where it fits: the gather has peers
    vstage, vranks = args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank
    layers = pp * (2 * vstage if vstage else vranks or 1) if pp > 1 else 2
    heads = 4 * tp
    groups = tp if args.group_query_attention else None
    sizes = ["--num-layers", str(layers), "--hidden-size", str(16 * heads), "--num-attention-heads", str(heads),
             "--ffn-hidden-size", str(32 * heads), "--seq-length", "32", "--max-position-embeddings", "32",
             "--micro-batch-size", "1", "--train-iters", str(ITERS), "--tensor-model-parallel-size", str(tp),
             "--pipeline-model-parallel-size", str(pp), "--expert-model-parallel-size", str(ep), "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--eval-iters", "0",
             "--num-workers", "0", "--device", "cpu", "--log-interval", "1", "--use-distributed-optimizer"]
    dp = world // (tp * pp * cp)
    micro = pp if pp > 1 else 1
    sizes += ["--global-batch-size", str(dp * micro)]
    if vstage:
        sizes += ["--num-layers-per-virtual-pipeline-stage", str(vstage)]
    if args.lr_warmup_fraction is None:
        sizes += ["--lr-warmup-iters", "1"]
    if args.expert_tensor_parallel_size is not None:
        sizes += ["--expert-tensor-parallel-size", str(etp)]
    if args.kv_channels is not None:
        sizes += ["--kv-channels", "16"]
    if groups:
        sizes += ["--num-query-groups", str(groups)]
    if args.num_experts:
        experts = max(2 * ep, 4)
        topk = min(args.moe_router_topk, experts // 2)
        sizes += ["--num-experts", str(experts), "--moe-ffn-hidden-size", str(8 * heads), "--moe-router-topk",
                  str(topk)]
        if args.moe_shared_expert_intermediate_size:
            sizes += ["--moe-shared-expert-intermediate-size", str(8 * heads)]
        if args.moe_router_num_groups:
            sizes += ["--moe-router-num-groups", "2", "--moe-router-group-topk", "1"]
        if isinstance(args.moe_layer_freq, list):
            sizes += ["--moe-layer-freq", f"([0]*1+[1]*{layers - 1})" if 0 in args.moe_layer_freq else "1"]
        if "--disable-bias-linear" not in full:  # the local experts take no bias (a CPU limit: validate_args)
            sizes += ["--disable-bias-linear"]
    if args.multi_latent_attention:
        sizes += ["--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8",
                  "--v-head-dim", "16"]
    return _strip(full, _DROP | _SIZES) + sizes, world


CIERA = ["--ciera-allgather", "--ciera-selection", "always", "--ciera-codec", "exponent_reuse",
         "--ciera-warmup-iters", "1"]


@functools.lru_cache(maxsize=None)
def _run(name: str, ciera: bool):
    path = next(p for p in FIXTURES if p.stem == name)
    if name in CPU_UNRUNNABLE:
        pytest.skip(CPU_UNRUNNABLE[name])
    if newer := flag_table.newer_release_flags(_flags(path)):
        pytest.skip(f"{', '.join(newer)}: flags of {_tag(path)}, newer than the installed {_installed_tag()}")
    flags, world = shrink(path)
    return run_pretrain([*flags, *(CIERA if ciera else [])], nproc=world, timeout=900)


@pytest.mark.distributed
@pytest.mark.parametrize("name", [pytest.param(p.stem, marks=() if p.stem in DEFAULT_RUNS else pytest.mark.slow)
                                  for p in FIXTURES])
def test_shrunk_upstream_command_is_bit_identical_with_ciera(name):
    base = _run(name, False)
    assert base.returncode == 0, base.output[-4000:]
    ciera = _run(name, True)
    assert ciera.returncode == 0, ciera.output[-4000:]
    assert sorted(base.losses) == list(range(1, ITERS + 1)) and base.sha256
    assert base.losses == ciera.losses, "per-iteration losses differ"
    assert base.sha256 == ciera.sha256
    assert "CIERA summary" in ciera.output


def test_shrink_keeps_the_flags_and_cuts_the_sizes():
    path = next(p for p in FIXTURES if p.stem == "gpt3_mcore_tp2_pp2_ep2_te_4experts2parallel")
    flags, world = shrink(path)
    args = _parse(flags)
    assert world == 8 and (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                           args.expert_model_parallel_size) == (2, 2, 2)
    assert (args.num_layers, args.hidden_size, args.seq_length, args.train_iters) == (2, 128, 32, ITERS)
    assert args.mock_data and args.save is None and not re.search(r"/data/", " ".join(flags))
    kept = {w for w in _flags(path) if w.startswith("--")} - _DROP - _SIZES
    assert kept <= {w for w in flags if w.startswith("--")}


def test_virtual_stages_per_rank_must_divide_the_layers():
    """Refused up front, as megatron-core would refuse it while building the model on every rank."""
    from flag_args import TINY_FLAGS, parse_and_validate

    with pytest.raises(ValueError, match=r"--num-layers 2 is not divisible by --pipeline-model-parallel-size 2 x "
                                         r"--num-virtual-stages-per-pipeline-rank 4 = 8"):
        parse_and_validate([*TINY_FLAGS, "--use-distributed-optimizer", "--pipeline-model-parallel-size", "2",
                            "--num-virtual-stages-per-pipeline-rank", "4", "--global-batch-size", "8"], world=2)
