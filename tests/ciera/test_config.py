import dataclasses

import pytest

from ciera import CieraConfig


def test_defaults_are_valid_and_frozen():
    cfg = CieraConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.codec = "raw"


@pytest.mark.parametrize("kwargs,match", [
    (dict(codec="zstd"), "codec='zstd'"),
    (dict(selection="sometimes"), "selection"),
    (dict(block_size=6), "block_size=6 must be a power of two"),
    (dict(delta_block_size=4), "delta_block_size=4"),
    (dict(warmup_gathers=0), "warmup_gathers=0"),
    (dict(verify_interval=-1), "verify_interval"),
    (dict(per_rank_sizes="no"), "per_rank_sizes='no' must be a bool"),
])
def test_invalid_values_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CieraConfig(**kwargs)


def test_fingerprint_is_stable_and_sensitive():
    assert CieraConfig().fingerprint() == CieraConfig().fingerprint()
    assert CieraConfig().fingerprint() != CieraConfig(block_size=16).fingerprint()
    assert 0 <= CieraConfig().fingerprint() < 2**63


def test_field_digests_name_the_field_that_differs():
    a, b = CieraConfig().field_digests(), CieraConfig(codec="delta").field_digests()
    names = CieraConfig.field_names()
    assert len(a) == len(names) and all(0 <= d < 2**63 for d in a)
    assert [n for n, x, y in zip(names, a, b) if x != y] == ["config.codec"]
