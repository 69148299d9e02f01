"""Where the supported megatron-core releases (0.16.1, 0.19.2) differ: probed once, in one place.

The binding is one code path for both releases. A place that must act differently asks
:func:`features` (or :func:`has_flag`) instead of comparing version strings; each field is read
off the installed release's own objects (a class attribute, a signature, its flag table), so a
release that adds or drops one of them is read as it is. (The bucket-group patches probe each
bucket group object instead: :func:`megatron.ciera.binding.upstream_patch.upstream_post_sync`.) ``tests/megatron/ciera/app/test_mc_upstream_features.py``
records what each checked release probes as.

    from megatron.ciera.app.upstream_features import features, has_flag
    if features().cp_slicer_takes_is_hybrid_cp: ...
    if has_flag("async_strategy"): ...
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from dataclasses import dataclass

__all__ = ["UpstreamFeatures", "features", "has_flag", "null_tokenizer_vocab_size"]


@dataclass(frozen=True)
class UpstreamFeatures:
    """What the installed megatron-core offers where the supported releases differ."""

    version: str
    """The installed megatron-core's version (for messages: nothing branches on it)."""

    flag_table: str
    """File name of the upstream flag table the parser reads (:mod:`megatron.ciera.app.flag_table`)."""

    ships_training: bool
    """The wheel ships ``megatron/training`` (0.17 on): its parser can be compared with the table."""

    cp_slicer_takes_is_hybrid_cp: bool
    """``megatron.core.utils.get_batch_on_this_cp_rank`` takes (and requires) ``is_hybrid_cp`` (0.19)."""

    gloo_groups_dest: str
    """The dest of ``--disable-gloo-process-groups`` in the flag table: ``enable_gloo_process_groups``
    (0.16) or ``use_gloo_process_groups`` (0.19); ``initialize_model_parallel`` takes its value."""

    null_tokenizer_eod_offset: int
    """Where ``NullTokenizer(vocab_size)`` puts its EOD, relative to ``vocab_size``: 0 (0.16: EOD =
    ``vocab_size``, ``vocab_size + 1`` ids) or -1 (0.19: EOD = ``vocab_size - 1``, ``vocab_size`` ids).
    A corpus whose EOD is id E trains with ``--vocab-size`` :func:`null_tokenizer_vocab_size` (E)."""


@functools.lru_cache(maxsize=None)
def _flag_dests() -> frozenset:
    from .flag_table import upstream_flags

    return frozenset(flag["dest"] for flag in upstream_flags())


def has_flag(dest: str) -> bool:
    """Whether the installed release's upstream flag table has a flag with this ``dest``."""
    return dest in _flag_dests()


def _gloo_dest() -> str:
    for dest in ("use_gloo_process_groups", "enable_gloo_process_groups"):
        if has_flag(dest):
            return dest
    raise RuntimeError("the upstream flag table has no --disable-gloo-process-groups (neither "
                       "use_gloo_process_groups nor enable_gloo_process_groups)")


@functools.lru_cache(maxsize=None)
def features() -> UpstreamFeatures:
    """The installed megatron-core's :class:`UpstreamFeatures` (probed on first call)."""
    from importlib.metadata import version

    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer
    from megatron.core.utils import get_batch_on_this_cp_rank

    from .flag_table import table_path

    return UpstreamFeatures(
        version=version("megatron-core"),
        flag_table=table_path().name,
        ships_training=importlib.util.find_spec("megatron.training") is not None,
        cp_slicer_takes_is_hybrid_cp="is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters,
        gloo_groups_dest=_gloo_dest(),
        null_tokenizer_eod_offset=NullTokenizer(16).eod - 16,
    )


def null_tokenizer_vocab_size(eod: int) -> int:
    """The ``--vocab-size`` that puts the installed release's ``NullTokenizer`` EOD at id ``eod``
    (``tools/preprocess_data.py``'s byte corpus: EOD 260, so 260 on 0.16 and 261 on 0.19)."""
    return eod - features().null_tokenizer_eod_offset
