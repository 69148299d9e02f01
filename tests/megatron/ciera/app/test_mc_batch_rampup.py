"""--rampup-batch-size (megatron-core 0.16) / --step-batch-size-schedule (0.19): the global batch
grows as upstream's calculator says, a resume mid-ramp continues exactly, CIERA stays bit-identical."""

import re

import pytest

from megatron.ciera.app import arguments, flag_policy
from megatron.ciera.app.batch_schedule import BatchSchedule

BASE = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
        "--max-position-embeddings", "32", "--lr", "1e-3", "--micro-batch-size", "2", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--eval-iters", "0", "--num-workers", "0",
        "--device", "cpu", "--use-distributed-optimizer", "--seed", "7", "--log-interval", "1"]
NEW_RELEASE = hasattr(arguments.build_parser().parse_args([]), "step_batch_size_schedule")
# The same batches either way: 4 from sample 0, 8 from sample 12, 12 from sample 28 (the step schedule's
# thresholds count tokens: samples x --seq-length 32).
RAMP = (["--step-batch-size-schedule", "0:4 384:8 896:12", "--train-samples", "52"] if NEW_RELEASE else
        ["--rampup-batch-size", "4", "4", "24", "--global-batch-size", "12", "--train-samples", "52"])


def _parse(extra, world=2):
    parser = arguments.build_parser()
    args = parser.parse_args(BASE + extra)
    args.explicit = arguments.explicit_dests(parser, BASE + extra)
    return arguments.validate_args(args, world_size=world)


def _error(extra):
    with pytest.raises(ValueError) as info:
        _parse(extra)
    return str(info.value)


def _upstream_iterations(args):
    """Oracle: upstream's own loop over megatron-core's process-wide calculator (training.py's
    update_train_iters and train_step), independent of megatron.ciera.app.batch_schedule."""
    from megatron.core import num_microbatches_calculator as nmc

    kwargs = dict(rank=1, global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
                  data_parallel_size=args.data_parallel_size, decrease_batch_size_if_needed=False)
    if NEW_RELEASE:
        kwargs.update(step_batch_size_schedule=args.step_batch_size_schedule, seq_length=args.seq_length)
    else:
        kwargs.update(rampup_batch_size=args.rampup_batch_size)
    nmc.init_num_microbatches_calculator(**kwargs)
    try:
        consumed, batches = 0, []
        while consumed < args.train_samples if NEW_RELEASE else consumed <= min(int(args.rampup_batch_size[2]), args.train_samples):
            nmc.update_num_microbatches(consumed, consistency_check=True)
            batches.append((nmc.get_current_global_batch_size(), nmc.get_num_microbatches()))
            consumed += batches[-1][0]
        if not NEW_RELEASE:
            batches += [(args.global_batch_size, args.global_batch_size // 4)] * ((args.train_samples - consumed) // args.global_batch_size)
        return batches
    finally:
        nmc.destroy_num_microbatches_calculator()


def test_schedule_follows_megatron_cores_calculator():
    assert flag_policy.policy("rampup_batch_size").kind == flag_policy.HONOURED
    args = _parse(RAMP)
    schedule = BatchSchedule.from_args(args)
    expected = _upstream_iterations(args)
    assert [schedule.at_iteration(i) for i in range(args.train_iters)] == expected
    assert args.train_iters == len(expected)
    assert [b for b, _ in expected][:6] == [4, 4, 4, 8, 8, 12] and expected[-1][0] == 12  # it grows
    assert schedule.consumed_samples(args.train_iters) == sum(b for b, _ in expected)
    assert schedule.consumed_samples(4) == 20


def test_schedule_errors_name_the_flags():
    if NEW_RELEASE:
        assert _parse(RAMP[:2] + ["--train-iters", "5"]).train_iters == 5  # upstream: iterations, growing batches
        assert "--rampup-batch-size: megatron-core 0.19 ignores it" in _error(
            ["--rampup-batch-size", "4", "4", "24", "--train-samples", "52"])
        assert "are exclusive" in _error(RAMP + ["--global-batch-size", "12"])
    else:
        assert "--rampup-batch-size needs --train-samples" in _error(RAMP[:-2] + ["--train-iters", "5"])
        assert "--rampup-batch-size: megatron-core's batch calculator rejects it" in _error(
            ["--rampup-batch-size", "4", "3", "24", "--global-batch-size", "12", "--train-samples", "52"])


def _batch_sizes(result):
    return [int(m) for m in re.findall(r"global batch size:\s+(\d+)", result.output)]


@pytest.mark.distributed
def test_resume_mid_ramp_with_ciera_matches_the_straight_run(tmp_path):
    from megatron.ciera.app.launch import run_pretrain

    flags = BASE + RAMP
    straight = run_pretrain(flags, nproc=2, timeout=240)
    assert straight.returncode == 0, straight.output[-3000:]
    iters = len(straight.losses)
    sizes = _batch_sizes(straight)
    assert sizes == [b for b, _ in _upstream_iterations(_parse(RAMP))] and len(sizes) == iters
    ciera = ["--ciera-allgather", "--ciera-selection", "always", "--ciera-codec", "exponent_reuse",
             "--ciera-warmup-iters", "1"]
    ckpt = str(tmp_path / "ckpt")
    first = run_pretrain(flags + ciera + ["--save", ckpt, "--save-interval", "4", "--exit-interval", "4"],
                         nproc=2, timeout=240)  # iteration 4: batches 4, 4, 4, 8 done, still ramping
    assert first.returncode == 0, first.output[-3000:]
    assert first.losses == {i: straight.losses[i] for i in range(1, 5)}
    second = run_pretrain(flags + ciera + ["--load", ckpt], nproc=2, timeout=240)
    assert second.returncode == 0, second.output[-3000:]
    assert second.losses == {i: straight.losses[i] for i in range(5, iters + 1)}
    assert second.sha256 == straight.sha256
    assert _batch_sizes(second) == sizes[4:]
    assert re.search(r"iteration\s+5/.* consumed samples:\s+28 ", second.output)  # 20 before it, then 8
