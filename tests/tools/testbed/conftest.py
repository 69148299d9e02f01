"""Testbed tests need root, ``ip``/``tc`` and network namespaces (CI has them); SLURM tests also
need slurm-wlm and munge (``make testbed-setup``). Elsewhere they skip, saying why."""

import pytest

from tools.testbed.netns import TestbedUnavailable, check_available


@pytest.fixture(scope="session")
def netns_ok():
    try:
        check_available()
    except TestbedUnavailable as e:
        pytest.skip(f"testbed unavailable: {e}")


@pytest.fixture(scope="session")
def slurm_ok(netns_ok):
    from tools.testbed.slurm import check_slurm_available

    try:
        check_slurm_available()
    except TestbedUnavailable as e:
        pytest.skip(f"SLURM unavailable: {e}")
