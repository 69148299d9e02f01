"""pretrain_gpt.py --use-torch-fsdp2 (megatron-core's FSDP2 wrapper, ZeRO-3) on gloo ranks:
--ciera-allgather trains bit for bit like FSDP2's own gather, each unit gathered in the forward and
again in the backward of every micro batch and encoded once per optimizer step.

Every comparison is exact: per-iteration losses (float.hex) and the final params sha256."""

import functools
import re

import pytest

from flag_args import TINY_FLAGS, parse_and_validate
from megatron.ciera.app import arguments
from megatron.ciera.app.launch import run_pretrain

from test_mc_training import TINY  # noqa: E402  (the same tiny MoE)

pytestmark = pytest.mark.distributed

# Upstream's FSDP2 rules: no distributed optimizer, no gradient-accumulation fusion.
FSDP2 = [a for a in TINY if a != "--use-distributed-optimizer"] + ["--use-torch-fsdp2",
                                                                   "--no-gradient-accumulation-fusion"]
ITERS, MICRO = 4, 2  # global batch 8 = micro batch 2 x 2 ranks x 2 micro batches


@functools.lru_cache(maxsize=None)
def run(*flags, nproc=2, iters=ITERS, gbs=8):
    result = run_pretrain([*FSDP2, "--train-iters", str(iters), "--global-batch-size", str(gbs), *flags],
                          nproc=nproc, timeout=300)
    assert result.returncode == 0, result.output[-4000:]
    assert sorted(result.losses) == list(range(1, iters + 1)) and result.sha256
    return result


def ciera(selection, cache, codec):
    return ("--ciera-allgather", "--ciera-selection", selection, "--ciera-cache", cache, "--ciera-codec", codec)


def units(result) -> dict:
    """The closing summary's rows: unit -> (gathers, raw gathers, codec, raw MB, wire MB)."""
    rows = {}
    for line in result.summary_block().splitlines()[2:-1]:
        f = line.split()
        rows[f[0]] = (int(f[-4]), int(f[-3]), f[-1], float(f[1]), float(f[2]))
    return rows


def encodes(result) -> dict:
    line = re.search(r"^CIERA ZeRO-3 encodes per unit \(one per optimizer step\): (.*)$", result.output, re.M).group(1)
    return {name: int(n) for name, n in (part.rsplit(" ", 1) for part in line.split(", "))}


def cache_bytes(result) -> tuple[int, int]:
    """(bytes printed at start-up, computed from the units; bytes measured at the end)."""
    planned = re.search(r"^CIERA ZeRO-3 cache \([\w+]+\): [\d.]+ MiB \((\d+) bytes\) per rank", result.output, re.M)
    measured = re.search(r"^CIERA ZeRO-3 cache: [\d.]+ MiB \((\d+) bytes\) per rank .* \(measured\)$",
                         result.output, re.M)
    return int(planned.group(1)), int(measured.group(1))


def assert_bit_identical_and_zero3(base, result, *, iters=ITERS, micro=MICRO, per_micro=2, cached=True):
    """Same losses and params; each layer unit gathered ``per_micro`` times per micro batch; every
    unit encoded once per optimizer step (``cached=False``, ``--ciera-cache none``: never); the
    cache's bytes printed at start-up are the bytes kept."""
    assert result.losses == base.losses, "per-iteration losses differ"
    assert result.sha256 == base.sha256, "final params differ"
    rows = units(result)
    layers = [name for name in rows if name.startswith("decoder.layers.")]
    assert layers and "embedding" in rows
    for name in layers:
        assert rows[name][0] == iters * micro * per_micro, (name, rows[name])
    assert encodes(result) == {name: iters if cached else 0 for name in rows}
    planned, measured = cache_bytes(result)
    assert planned == measured and (measured > 0) == cached


# The values cache under auto selection: slow (a third launch); both caches and auto selection's
# switches run by default on plain FSDP2 in tests/ciera/test_zero3.py.
@pytest.mark.parametrize("selection, cache, codec", [("always", "exponents", "exponent_reuse"),
                                                     pytest.param("auto", "values", "auto", marks=pytest.mark.slow)])
def test_fsdp2_training_is_bit_identical_with_ciera(selection, cache, codec):
    base, result = run(), run(*ciera(selection, cache, codec))
    assert_bit_identical_and_zero3(base, result)
    rows = units(result)
    if selection == "always":  # every unit compressed after its one raw (warmup) gather
        assert all(codec_ == codec and raw == 1 and wire < raw_mb for _, raw, codec_, raw_mb, wire in rows.values()), rows
    else:  # values cache: the step's replays send nothing, whatever the selection chose
        assert all(wire < raw_mb for *_, raw_mb, wire in rows.values()), rows
    assert "ciera raw/wire" in result.iteration_lines()[0] and "ciera raw/wire" not in base.output


@pytest.mark.slow
@pytest.mark.parametrize("selection, cache, codec", [("always", "values", "delta"), ("auto", "exponents", "auto"),
                                                     ("always", "none", "auto")])
def test_fsdp2_other_caches_and_selections(selection, cache, codec):
    assert_bit_identical_and_zero3(run(), run(*ciera(selection, cache, codec)), cached=cache != "none")


@pytest.mark.slow
def test_fsdp2_without_reshard_after_forward_gathers_once_per_micro_batch():
    flags = ("--torch-fsdp2-no-reshard-after-forward",)
    base, result = run(*flags), run(*flags, *ciera("always", "exponents", "exponent_reuse"))
    assert base.sha256 == run().sha256  # when, not what, is gathered
    assert_bit_identical_and_zero3(base, result, per_micro=1)


@pytest.mark.slow
def test_fsdp2_four_ranks_longer_run():
    kw = dict(nproc=4, iters=12, gbs=16)
    for flags in (ciera("always", "exponents", "exponent_reuse"), ciera("auto", "values", "auto")):
        assert_bit_identical_and_zero3(run(**kw), run(*flags, **kw), iters=12, micro=2)


@pytest.mark.slow
def test_fsdp2_with_tensor_parallelism_four_ranks():
    """TP 2 x FSDP2 over DP 2 (upstream allows it; the MoE needs sequence parallelism)."""
    flags = ("--tensor-model-parallel-size", "2", "--sequence-parallel")
    base, result = run(*flags, nproc=4), run(*flags, *ciera("always", "exponents", "exponent_reuse"), nproc=4)
    assert_bit_identical_and_zero3(base, result, micro=2)


@pytest.mark.slow
def test_fsdp2_fp16_skipped_steps_encode_nothing():
    """fp16 from a loss scale that overflows the first steps: Megatron's optimizer skips them, the
    parameters stay, and the next iteration's gathers replay (no encode); each step that does update
    makes the next iteration's first gather encode."""
    flags = [a if a != "--bf16" else "--fp16" for a in FSDP2]
    flags += ["--initial-loss-scale", str(2**22), "--log-interval", "1", "--train-iters", str(ITERS),
              "--global-batch-size", "8"]
    base, result = (run_pretrain(flags + list(extra), nproc=2, timeout=300)
                    for extra in ((), ciera("always", "exponents", "exponent_reuse")))
    assert result.returncode == 0, result.output[-4000:]
    assert result.losses == base.losses and result.sha256 == base.sha256
    skipped = [int(re.search(r"number of skipped iterations:\s+(\d+)", line).group(1)) for line in result.iteration_lines()]
    updated = [i for i in range(ITERS) if skipped[i] == (skipped[i - 1] if i else 0)]  # iterations whose step applied
    assert 0 < len(updated) < ITERS, skipped  # some skipped, some applied
    expected = 1 + sum(1 for i in updated if i < ITERS - 1)  # the first gather, then one after each applied step
    assert set(encodes(result).values()) == {expected}


# -- the flags: upstream's rules for --use-torch-fsdp2 and --ciera-cache ---------------------------
ARGS = [*TINY_FLAGS, "--use-torch-fsdp2", "--no-gradient-accumulation-fusion",
        "--untie-embeddings-and-output-weights", "--device", "cpu"]


def parse(extra, base=ARGS):
    return parse_and_validate(base + extra, world=2)


def test_fsdp2_flags_map_onto_the_ciera_config():
    args = parse(["--ciera-allgather", "--ciera-cache", "values", "--ciera-codec", "delta"])
    config = arguments.ciera_config_from_args(args)
    assert (config.cache, config.codec) == ("values", "delta")
    default = arguments.ciera_config_from_args(parse(["--ciera-allgather"]))
    assert (default.cache, default.cache_budget) == ("auto", "50%")  # the library's
    assert arguments.ciera_config_from_args(parse(["--ciera-allgather", "--ciera-cache-budget", "2GiB"])).cache_budget == "2GiB"
    two = arguments.ciera_config_from_args(parse(["--ciera-allgather", "--ciera-cache", "two_level", "--ciera-node-size", "8"]))
    assert (two.cache, two.node_size, default.node_size) == ("two_level", 8, 0)  # 0: LOCAL_WORLD_SIZE
    assert "--no-gradient-accumulation-fusion" not in args.cpu_ignored  # off is what runs on CPU


@pytest.mark.parametrize("extra, needle", [
    (["--expert-model-parallel-size", "2", "--num-experts", "4"], "--use-torch-fsdp2 is not supported with expert parallelism"),
    (["--pipeline-model-parallel-size", "2"], "--use-torch-fsdp2 is not supported with pipeline parallelism"),
    (["--use-distributed-optimizer"], "--use-torch-fsdp2 is not supported with MCore's distributed optimizer"),
    (["--ckpt-format", "torch"], "--use-torch-fsdp2 with --ckpt-format torch"),
    (["--overlap-grad-reduce"], "--overlap-grad-reduce: only Megatron's DDP wrapper reads it"),
    (["--ddp-bucket-size", "1000"], "--ddp-bucket-size: only Megatron's DDP wrapper reads it"),
    (["--save", "/tmp/x"], "--save with --use-torch-fsdp2: not supported yet"),
    (["--ciera-allgather", "--ciera-cache", "exponents", "--ciera-codec", "delta"],
     "codec='delta' adds to the previous values, so it needs cache='values'"),
])
def test_fsdp2_errors_name_the_flags(extra, needle):
    with pytest.raises(ValueError) as info:
        parse(extra)
    assert needle in str(info.value)


@pytest.mark.parametrize("dropped, needle", [
    ("--no-gradient-accumulation-fusion", "pass --no-gradient-accumulation-fusion"),
    ("--untie-embeddings-and-output-weights", "--use-torch-fsdp2 requires --untie-embeddings-and-output-weights"),
])
def test_fsdp2_needs_upstreams_flags(dropped, needle):
    with pytest.raises(ValueError, match=needle):
        parse([], base=[a for a in ARGS if a != dropped])


def test_units_are_encoded_after_megatrons_whole_optimizer_step():
    """Megatron's mixed-precision optimizer copies its main parameters into the model's after the
    inner torch step: the units are staged and encoded by the training loop's
    ``after_optimizer_step`` (every chunk's gathers stepped once), not by a hook on the inner step,
    which would encode the previous values (and stop training at the next step's check)."""
    from megatron.ciera.binding import fsdp2

    class Gathers:
        steps = 0

        def step(self):
            self.steps += 1

    chunks = [type("Chunk", (), {})() for _ in range(2)]
    for c in chunks:
        setattr(c, fsdp2._ATTR, Gathers())
    binding = fsdp2.Fsdp2Binding()
    binding.after_optimizer_step(chunks, overlap_param_gather=False)
    binding.after_optimizer_step(chunks, overlap_param_gather=False)
    assert [getattr(c, fsdp2._ATTR).steps for c in chunks] == [2, 2]
