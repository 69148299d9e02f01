"""Codec ids and the agreement's proposal words come from one table, whose values are wire words."""

import pytest
import torch

from ciera import agreement
from ciera.codecs import available_codecs, make_codec
from ciera.codecs.base import Codec
from ciera.codecs.registry import REGISTRY, WIRE_WORDS, CodecSpec


def test_the_wire_words_keep_their_values():  # changing one changes the payload header or the agreement
    assert dict(WIRE_WORDS) == {"corrupt": -3, "failed": -1, "raw": 0, "exponent_reuse": 1,
                                "delta": 2, "delta_ans": 3}
    assert len(set(WIRE_WORDS.values())) == len(WIRE_WORDS)


def test_agreement_flags_and_codec_ids_are_the_table():
    flags = {"raw": agreement.FLAG_RAW, "failed": agreement.FLAG_FAILED,
             "corrupt": agreement.FLAG_CORRUPT}
    assert flags == {k: WIRE_WORDS[k] for k in flags}
    for name in available_codecs():
        assert make_codec(name, dtype=torch.bfloat16, numel=8).codec_id == WIRE_WORDS[name]
    # Every word is either a flag or a registered codec's id: no proposal word is ambiguous.
    assert set(WIRE_WORDS) == set(flags) | set(available_codecs())


def test_a_codec_whose_name_or_id_is_taken_is_refused():
    class Stray(Codec):
        spec = CodecSpec(name="delta", codec_id=7, summary="x")

    with pytest.raises(ValueError, match="codec 'delta' \\(id 7\\) clashes with the registered 'delta' \\(id 2\\)"):
        REGISTRY.register(Stray)

    class Clash(Codec):
        spec = CodecSpec(name="zstd", codec_id=3, summary="x")

    with pytest.raises(ValueError, match="codec 'zstd' \\(id 3\\) clashes with the registered 'delta_ans'"):
        REGISTRY.register(Clash)
    assert "zstd" not in available_codecs()


@pytest.mark.parametrize("name, codec_id, match", [
    ("zstd", 0, "must be in \\[1, 255\\]"), ("zstd", 256, "must be in \\[1, 255\\]"),
    ("failed", 9, "reserved word"), ("auto", 9, "reserved word"), ("raw", 5, "reserved word"),
])
def test_a_descriptor_outside_the_wire_table_is_refused(name, codec_id, match):
    with pytest.raises(ValueError, match=match):
        CodecSpec(name=name, codec_id=codec_id, summary="x")


def test_a_class_without_a_descriptor_is_refused():
    class Bare(Codec):
        name, codec_id = "bare", 9

    with pytest.raises(ValueError, match="carries its CodecSpec as `spec`"):
        REGISTRY.register(Bare)


def test_registering_the_same_class_again_changes_nothing():
    cls = REGISTRY.get("delta")
    assert REGISTRY.register(cls) is cls and REGISTRY.get("delta") is cls
    assert available_codecs() == ["delta", "delta_ans", "exponent_reuse", "raw"]
