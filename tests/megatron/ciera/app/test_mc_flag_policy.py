"""megatron.ciera.app.flag_policy: flags whose effect upstream depends on another flag are accepted and
inert while that flag is off (named at start-up), and decided by their own row once it is on;
the activation and experimental flags read as upstream reads them."""

import pytest

from flag_args import TINY_FLAGS, parse_and_validate
from megatron.ciera.app import arguments, flag_policy, flag_table

BASE = [*TINY_FLAGS, "--use-distributed-optimizer"]


def _dests() -> set:
    return {flag["dest"] for flag in flag_table.upstream_flags()}


def test_inert_rows_name_upstream_flags_and_say_why():
    dests = _dests()
    rows = [(dest, flag_policy.policy(dest)) for dest in sorted(dests) if flag_policy.policy(dest).needs]
    assert {"use_persistent_ckpt_worker", "profile_step_start", "profile_ranks"} <= {d for d, _ in rows}
    for dest, pol in rows:
        assert set(pol.needs) <= dests and pol.inert_reason, dest  # gates are upstream flags, with a reason
    assert flag_policy.policy("hidden_size").needs == ()


def test_profile_steps_without_profile_are_inert_and_named():
    args = parse_and_validate([*BASE, "--profile-step-start", "3", "--profile-step-end", "5", "--profile-ranks", "1"],
                              world=1)
    assert (args.profile_step_start, args.profile_step_end) == (3, 5)
    assert [note.split(" ")[0] for note in args.upstream_inert] == ["--profile-step-start", "--profile-step-end",
                                                                    "--profile-ranks"]
    assert "--profile" in args.upstream_inert[0]


def test_persistent_ckpt_worker_without_async_save_is_inert():
    args = parse_and_validate([*BASE, "--use-persistent-ckpt-worker"], world=1)
    assert args.upstream_inert == ["--use-persistent-ckpt-worker (picks the background writer of --async-save)"]


def test_a_gated_flag_with_its_gate_on_is_decided_by_its_own_row(tmp_path):
    assert flag_policy.policy("non_persistent_save_interval").kind == flag_policy.REJECTED
    args = parse_and_validate([*BASE, "--non-persistent-save-interval", "5"], world=1)
    assert args.upstream_inert[0].startswith("--non-persistent-save-interval (")
    with pytest.raises(ValueError, match="--non-persistent-save-interval: not implemented"):
        parse_and_validate([*BASE, "--save", str(tmp_path), "--non-persistent-save-interval", "5"], world=1)


def test_gpu_only_rows_of_newer_releases():
    for dest in ("use_transformer_engine_op_fuser", "cuda_graph_modules"):
        assert flag_policy.policy(dest).kind == flag_policy.GPU


def test_squared_relu_is_the_activation_and_excludes_swiglu():
    from megatron.core.activations import squared_relu

    from megatron.ciera.app import model

    args = parse_and_validate([*BASE, "--squared-relu"], world=1, device="cpu")
    config = model.transformer_config(args)
    assert config.activation_func is squared_relu and not config.gated_linear_unit
    with pytest.raises(ValueError, match="--squared-relu and --swiglu are exclusive"):
        parse_and_validate([*BASE, "--squared-relu", "--swiglu"], world=1)


def test_enable_experimental_is_honoured():
    assert flag_policy.policy("enable_experimental").kind == flag_policy.HONOURED
    assert parse_and_validate([*BASE, "--enable-experimental"], world=1).enable_experimental
