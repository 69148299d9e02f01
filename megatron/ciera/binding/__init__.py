"""The Megatron-Core binding of CIERA: what a training loop built on megatron-core imports to
gather its parameters with CIERA. It imports the ``ciera`` library and megatron-core, never
:mod:`megatron.ciera.app`; it takes a :class:`ciera.CieraConfig` and plain values, not a
command line.

- :mod:`megatron.ciera.binding.protocol`: :class:`~megatron.ciera.binding.protocol.Binding`, what
  a loop calls; :mod:`megatron.ciera.binding.engines`: ``binding_for``, the one factory
- :mod:`megatron.ciera.binding.bucket_group`: the distributed optimizer's engine, the one dispatch
  point replacing the bucket groups' parameter all-gather
- :mod:`megatron.ciera.binding.fsdp2`, :mod:`megatron.ciera.binding.megatron_fsdp`: the ZeRO-3
  engines (their shared code: :mod:`megatron.ciera.binding.sharded_binding`); a torchtitan engine
  would sit beside them (torchtitan's integration today: :mod:`ciera.integrations.torchtitan`)
- :mod:`megatron.ciera.binding.report`: the per-bucket table every engine's summary prints
- :mod:`megatron.ciera.binding.upstream_patch`: every patch of megatron-core's objects, gated by
  version; :mod:`megatron.ciera.binding.checkpoint_fixes`: megatron-core's checkpoint workarounds,
  under the same gate
- :mod:`megatron.ciera.binding.cpu_compat`: the only place that lets Megatron-Core run without CUDA
"""
