"""megatron-core's Apex / transformer-engine fallback warnings: filtered, and said once."""

import warnings

from megatron.ciera.app import upstream_notices


def test_filter_silences_the_fallback_notices_and_nothing_else():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        upstream_notices.silence_fallback_warnings()
        warnings.warn("Apex is not installed. Falling back to Torch Norm")
        warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.")
        warnings.warn("something else is not installed")
    assert [str(w.message) for w in caught] == ["something else is not installed"]


def test_note_names_what_is_missing_and_its_cost(monkeypatch):
    present = {"apex": None, "transformer_engine": object()}
    monkeypatch.setattr(upstream_notices.importlib.util, "find_spec", lambda name: present.get(name))
    cpu = upstream_notices.fallback_note(device="cpu")
    assert cpu.startswith("Apex not installed:") and "no cost on CPU" in cpu
    assert "slower" in upstream_notices.fallback_note(device="cuda")
    present["apex"] = object()
    assert upstream_notices.fallback_note(device="cuda") is None
