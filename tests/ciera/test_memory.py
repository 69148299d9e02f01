"""The ZeRO-3 cache budget (ciera.memory) and the per-unit choice under it (ciera.zero3.plan_caches)."""

import pytest
import torch

from ciera import CieraConfig
from ciera.memory import Budget, measure_budget, parse_budget
from ciera.zero3 import cache_bytes_per_rank, plan_caches


@pytest.mark.parametrize("spec, expected", [("50%", (0.5, None)), ("100%", (1.0, None)), ("8GiB", (None, 8 << 30)),
                                            ("512 MiB", (None, 512 << 20)), ("1000000", (None, 10**6)),
                                            ("2.5gb", (None, 2_500_000_000))])
def test_budget_specs(spec, expected):
    assert parse_budget(spec) == expected


@pytest.mark.parametrize("spec", ["0%", "150%", "lots", "-1GiB", ""])
def test_bad_budget_specs_are_named(spec):
    with pytest.raises(ValueError, match="cache budget"):
        parse_budget(spec)
    with pytest.raises(ValueError, match="CieraConfig: cache budget"):
        CieraConfig(cache_budget=spec)


def test_measured_budget_without_a_process_group():
    share = measure_budget(spec="10%", device=torch.device("cpu"))
    assert share.free > 0 and share.bytes == int(share.free * 0.1) and "10% of the" in share.describe()
    fixed = measure_budget(spec="3MiB", device=torch.device("cpu"))
    assert (fixed.bytes, fixed.free) == (3 << 20, 0)


def test_auto_gives_values_while_they_fit_then_exponents():
    units = [(4000, 2, torch.bfloat16)] * 3
    values = cache_bytes_per_rank(numel=4000, world=2, dtype=torch.bfloat16, cache="values")
    exps = cache_bytes_per_rank(numel=4000, world=2, dtype=torch.bfloat16, cache="exponents")
    assert (values, exps) == (4000 * 2 + 2000 * 2, 4000 + 2000 * 2)
    budget = lambda n: Budget(bytes=n, free=0, spec=str(n))  # noqa: E731
    assert plan_caches(units, cache="auto", budget=budget(3 * values)) == ["values"] * 3
    assert plan_caches(units, cache="auto", budget=budget(2 * values)) == ["values", "values", "exponents"]
    assert plan_caches(units, cache="auto", budget=budget(values - 1)) == ["exponents"] * 3
    assert plan_caches(units, cache="exponents", budget=None) == ["exponents"] * 3
