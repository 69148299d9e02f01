"""megatron.ciera.app.upstream_features: the one probe of where the supported megatron-core releases
differ reads each checked release as recorded here."""

import dataclasses

import pytest

from megatron.ciera.app.upstream_features import features, has_flag, null_tokenizer_vocab_size

# What each checked release probes as (every field but version).
RECORDED = {
    "0.16.1": dict(flag_table="upstream_flags.json", ships_training=False, cp_slicer_takes_is_hybrid_cp=False,
                   gloo_groups_dest="enable_gloo_process_groups", null_tokenizer_eod_offset=0),
    "0.19.2": dict(flag_table="upstream_flags_core_v0.19.0.json", ships_training=True,
                   cp_slicer_takes_is_hybrid_cp=True, gloo_groups_dest="use_gloo_process_groups",
                   null_tokenizer_eod_offset=-1),
}


def test_installed_release_probes_as_recorded():
    probed = dataclasses.asdict(features())
    version = probed.pop("version")
    if version not in RECORDED:
        pytest.fail(f"megatron-core {version} is not a checked release; once the binding is checked on it, "
                    f"record {probed!r} in RECORDED")
    assert probed == RECORDED[version]


def test_has_flag_reads_the_installed_table():
    assert has_flag("num_layers") and has_flag(features().gloo_groups_dest)
    assert not has_flag("no_such_flag")


def test_null_tokenizer_vocab_size_puts_the_eod_where_asked():
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    for eod in (5, 260):
        assert NullTokenizer(null_tokenizer_vocab_size(eod)).eod == eod
