"""Megatron-Core binding of CIERA (``megatron.ciera``).

``megatron`` is megatron-core's namespace package: this subpackage sits beside ``megatron.core``
and there must never be a ``megatron/__init__.py``.

- :mod:`megatron.ciera.bucket_group`: the one dispatch point replacing the parameter all-gather
- :mod:`megatron.ciera.upstream_patch`: every patch of megatron-core's objects, gated by version
- :mod:`megatron.ciera.arguments`: Megatron-LM's whole command line (``upstream_flags.json``) plus ``--ciera-*``
- :mod:`megatron.ciera.flag_policy`: the one table of what each upstream flag does here
- :mod:`megatron.ciera.model`: configs derived from megatron-core's dataclasses, layer specs, model chunks
- :mod:`megatron.ciera.parallel`: process group, TP/PP/CP/EP layout, start-up agreement of all ranks
- :mod:`megatron.ciera.training`: the pretraining loop behind ``pretrain_gpt.py``
- :mod:`megatron.ciera.cpu_compat`: the only place that lets Megatron-Core run without CUDA
"""
