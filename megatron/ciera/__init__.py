"""CIERA for Megatron-Core (``megatron.ciera``), in two layers; imports go one way only,
``app`` -> ``binding`` -> the ``ciera`` library (``docs/architecture.md``).

``megatron`` is megatron-core's namespace package: this subpackage sits beside ``megatron.core``
and there must never be a ``megatron/__init__.py``.

- :mod:`megatron.ciera.binding`: what a Megatron-Core training loop imports to gather its
  parameters with CIERA (the distributed optimizer's bucket groups, FSDP2, Megatron-FSDP), the
  gated patches of megatron-core's objects and the CPU shims
- :mod:`megatron.ciera.app`: the training application behind ``pretrain_gpt.py`` (Megatron-LM's
  command line, the loop, checkpoints, data, logs, the error path)
"""
