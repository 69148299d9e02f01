"""Codec ids and the agreement's proposal words come from one table, whose values are wire words."""

import pytest
import torch

from ciera import agreement
from ciera.codecs import available_codecs, make_codec
from ciera.codecs.base import Codec
from ciera.codecs.registry import REGISTRY, WIRE_WORDS


def test_the_wire_words_keep_their_values():  # changing one changes the payload header or the agreement
    assert dict(WIRE_WORDS) == {"corrupt": -3, "replay": -2, "failed": -1, "raw": 0, "exponent_reuse": 1,
                                "delta": 2, "delta_ans": 3}
    assert len(set(WIRE_WORDS.values())) == len(WIRE_WORDS)


def test_agreement_flags_and_codec_ids_are_the_table():
    flags = {"raw": agreement.FLAG_RAW, "failed": agreement.FLAG_FAILED, "replay": agreement.FLAG_REPLAY,
             "corrupt": agreement.FLAG_CORRUPT}
    assert flags == {k: WIRE_WORDS[k] for k in flags}
    for name in available_codecs():
        assert make_codec(name, dtype=torch.bfloat16, numel=8).codec_id == WIRE_WORDS[name]
    # Every word is either a flag or a registered codec's id: no proposal word is ambiguous.
    assert set(WIRE_WORDS) == set(flags) | set(available_codecs())


def test_a_codec_whose_id_is_not_its_table_entry_is_refused():
    class Stray(Codec):
        name, codec_id = "delta", 7

    with pytest.raises(ValueError, match="'delta' has id 7, but the wire table WIRE_WORDS gives 2"):
        REGISTRY.register(Stray)

    class Unknown(Codec):
        name, codec_id = "zstd", 4

    with pytest.raises(ValueError, match="'zstd' has id 4, but the wire table WIRE_WORDS gives none"):
        REGISTRY.register(Unknown)
