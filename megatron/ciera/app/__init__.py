"""The training application behind ``pretrain_gpt.py``: Megatron-LM's command line and the loop
around the :mod:`megatron.ciera.binding` (which never imports this package).

- :mod:`megatron.ciera.app.arguments`: Megatron-LM's whole command line plus ``--ciera-*``
  (:mod:`megatron.ciera.app.flag_table`: the upstream flag tables ``upstream_flags*.json``;
  :mod:`megatron.ciera.app.feature_args`, :mod:`megatron.ciera.app.engine_args`: the feature and
  engine flags' checks)
- :mod:`megatron.ciera.app.flag_policy`: the one table of what each upstream flag does here
- :mod:`megatron.ciera.app.model`: configs derived from megatron-core's dataclasses, layer specs, model chunks
- :mod:`megatron.ciera.app.parallel`: process group, TP/PP/CP/EP layout, start-up agreement of all ranks
- :mod:`megatron.ciera.app.training`: the pretraining loop, calling the run's
  :class:`~megatron.ciera.binding.protocol.Binding`
- :mod:`megatron.ciera.app.checkpointing` (and ``checkpoint_*``, ``torch_checkpoint``,
  ``fsdp_dtensor_checkpoint``), ``data``, ``evaluation``, ``logging_utils``, ``timers``,
  ``profiling``, ``failfast``, ``watchdog``, ``exit_signal``, ``launch``: the loop's parts
- :mod:`megatron.ciera.app.upstream_features`, :mod:`megatron.ciera.app.upstream_notices`: where
  the supported megatron-core releases differ, and their notices said once
"""
