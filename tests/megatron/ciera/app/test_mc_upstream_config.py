"""Our argument-to-config translation builds the TransformerConfig upstream's builds, field for field,
for Megatron-LM commands whose activation / fusion / ModelOpt flags once differed from upstream's:
the ``--squared-relu --disable-bias-linear`` release test and the gpt-oss example (``--quick-geglu``,
``--recompute-activations``, ModelOpt's ``--enable-gpt-oss`` / ``--export-force-local-attention``).

Upstream's side is Megatron-LM's own ``megatron.training`` (``parse_args``, ``validate_args``,
``core_transformer_config_from_args``), which megatron-core 0.19 ships; skipped where it does not
(0.16.1). Upstream validates for the GPU node: the test tells it an H100 (compute capability 9) and
sets the environment its launch scripts set.
"""

import dataclasses
import functools
import sys

import pytest

import test_mc_upstream_replay as replay_fixtures
from megatron.ciera.app import arguments

FIXTURE = {p.stem: p for p in replay_fixtures.FIXTURES}
TE_FLAGS = {"--fp8-format", "--fp8-param-gather", "--fp8-amax-compute-algo", "--fp8-amax-history-len",
            "--moe-permute-fusion"}


def _comparable(value):
    """Partials (init methods) compare by function and arguments; everything else as it is."""
    if isinstance(value, functools.partial):
        return value.func, value.args, tuple(sorted(value.keywords.items()))
    return value


def _upstream_config(flags: list[str], monkeypatch):
    up = pytest.importorskip("megatron.training.arguments", reason="megatron-core without megatron.training (< 0.19)")
    from megatron.training.argument_utils import core_transformer_config_from_args

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *flags])
    for name, value in dict(WORLD_SIZE="8", RANK="0", LOCAL_RANK="0", CUDA_DEVICE_MAX_CONNECTIONS="1").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(up, "get_device_arch_version", lambda: 9)
    monkeypatch.setattr(up.torch.cuda, "get_device_capability", lambda *a: (9, 0))
    args = up.parse_args()
    args = up.validate_args(args, {}) or args
    return core_transformer_config_from_args(args)


@pytest.mark.parametrize("name", ["gpt3_15b_8t_release", "gptoss_02_train"])
def test_transformer_config_is_upstreams(name, monkeypatch):
    pytest.importorskip("megatron.training.arguments", reason="megatron-core without megatron.training (< 0.19)")
    from megatron.ciera.app import model

    # FP8 and the fused permutation: megatron-core asks transformer-engine's version for them, not installed
    # here; on both sides the rest is built as the GPU node with TE would (model._te_importable).
    flags = replay_fixtures._strip(replay_fixtures._flags(FIXTURE[name]), TE_FLAGS)
    monkeypatch.setattr(model, "_te_importable", lambda: True)
    parsed = replay_fixtures._parse(flags + ["--use-distributed-optimizer", "--ciera-allgather"])
    ours = model.transformer_config(arguments.validate_args(parsed, world_size=8, device="cuda", te_available=True))
    # Upstream's parser knows ModelOpt's flags only with nvidia-modelopt installed; they do not reach
    # its plain GPT config either way.
    theirs = _upstream_config([f for f in flags if f not in arguments.MODELOPT_FLAGS] + ["--use-distributed-optimizer"],
                              monkeypatch)
    assert type(ours) is type(theirs)
    differ = {f.name: (getattr(ours, f.name), getattr(theirs, f.name)) for f in dataclasses.fields(theirs)
              if _comparable(getattr(ours, f.name)) != _comparable(getattr(theirs, f.name))}
    assert not differ
    if name == "gpt3_15b_8t_release":  # the case megatron-core refused before: no bias, so no bias-GeLU fusion
        from megatron.core.activations import squared_relu

        assert ours.activation_func is squared_relu and not ours.add_bias_linear and not ours.bias_activation_fusion
    else:
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        assert ours.activation_func is quick_gelu and ours.gated_linear_unit
        assert ours.recompute_granularity == "selective"


def test_modelopt_flags_are_inert_without_load_and_refused_with_it():
    args = replay_fixtures.replay(FIXTURE["gptoss_02_train"])
    inert = " ".join(args.upstream_inert)
    assert "--enable-gpt-oss" in inert and "--export-force-local-attention" in inert
    flags = replay_fixtures._flags(FIXTURE["gptoss_02_train"]) + ["--load", "/data/ckpt"]
    parsed = replay_fixtures._parse(flags + ["--use-distributed-optimizer", "--ciera-allgather"])
    with pytest.raises(ValueError, match=r"--enable-gpt-oss with --load: ModelOpt checkpoints"):
        arguments.validate_args(parsed, world_size=8, device="cuda", te_available=True)


def test_flex_dispatcher_without_deep_ep_says_how_to_install_it():
    pytest.importorskip("megatron.core")
    try:
        import deep_ep  # noqa: F401
        pytest.skip("deep_ep is installed here")
    except ImportError:
        pass
    flags = replay_fixtures._flags(FIXTURE["gpt3_mcore_te_tp2_pp1_te_8experts2parallel_top2router"])
    parsed = replay_fixtures._parse(flags + ["--use-distributed-optimizer", "--ciera-allgather",
                                             "--moe-token-dispatcher-type", "flex"])
    with pytest.raises(ValueError) as info:
        arguments.validate_args(parsed, world_size=8, device="cuda", te_available=True)
    assert "--moe-token-dispatcher-type flex needs DeepEP" in str(info.value)
    assert "https://github.com/deepseek-ai/DeepEP" in str(info.value)
