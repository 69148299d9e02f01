"""The long run: 10,000 iterations of the tiny MoE with the delta codec and verify on train bit for
bit like Megatron's own gather (every iteration's loss as float.hex, the final params sha256).

Two runs of ~15 min each on 2 vCPUs: ``slow``. ``CIERA_LONG_RUN_ITERS`` shortens it by hand."""

import os
import re

import pytest

from megatron.ciera.app.launch import run_pretrain

from test_mc_training import TINY

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ITERS = int(os.environ.get("CIERA_LONG_RUN_ITERS", "10000"))
VERIFY_EVERY = 100  # gathers per bucket between cross-rank checks: 100 checks per bucket over the run


def test_ten_thousand_iterations_with_delta_and_verify_are_bit_identical():
    common = [*TINY, "--train-iters", str(ITERS), "--global-batch-size", "8", "--log-interval", "500"]
    plain = run_pretrain(common, nproc=2, timeout=4 * 3600)
    ciera = run_pretrain([*common, "--ciera-allgather", "--ciera-codec", "delta", "--ciera-selection", "always",
                          "--ciera-verify-interval", str(VERIFY_EVERY)], nproc=2, timeout=4 * 3600)
    for result in (plain, ciera):
        assert result.returncode == 0, result.output[-4000:]
        assert sorted(result.losses) == list(range(1, ITERS + 1)) and result.sha256
    differing = [it for it in plain.losses if plain.losses[it] != ciera.losses[it]]
    assert not differing, f"losses differ at {len(differing)} iterations, first {differing[:5]}"
    assert plain.sha256 == ciera.sha256
    rows = [line.split() for line in ciera.summary_block().splitlines() if re.match(r"\w+\d\.bucket\d", line)]
    assert rows and all(int(r[-4]) == ITERS and r[-1] == "delta" for r in rows), ciera.summary_block()
