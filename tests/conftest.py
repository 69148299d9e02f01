"""Test options shared by the whole suite.

The default run stays quick: tests marked ``slow`` (long multi-process trajectories at full size)
run only with ``--runslow`` or ``CIERA_RUN_SLOW=1``; each has a small-size twin that always runs.
"""

import os
import sys

import pytest
import torch

# Triton picks its interpreter when @triton.jit decorates (triton.language's own helpers included),
# so on machines without CUDA switch it on before any test module imports triton.
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        no_gpu = pytest.mark.skip(reason="gpu: needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(no_gpu)
    if config.getoption("--runslow") or os.environ.get("CIERA_RUN_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow or CIERA_RUN_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
