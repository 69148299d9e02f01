"""Bindings of CIERA to training frameworks other than Megatron-Core (whose binding is
``megatron.ciera``). Each binding imports its framework lazily: ``import ciera`` never needs one.

- :mod:`ciera.integrations.torchtitan`: torchtitan's own trainer, enabled from its job config
  (``--ciera.enable``).
"""
