"""The one factory of :class:`~megatron.ciera.binding.protocol.Binding` objects: which engine
gathers the parameters, from the run's settings (:func:`binding_for`).

A new engine (a torchtitan binding, say) is one more class implementing the protocol, in a module
of its own beside :mod:`~megatron.ciera.binding.fsdp2`, and one more branch here.
"""

from __future__ import annotations

from .protocol import Binding

__all__ = ["binding_for"]


def binding_for(*, use_torch_fsdp2: bool = False, use_megatron_fsdp: bool = False,
                reshard_after_forward: bool = True, device: str = "cuda") -> Binding:
    """The binding of the run's engine: FSDP2's units (``use_torch_fsdp2``; ``reshard_after_forward``
    its config's one field), Megatron-FSDP's buckets (``use_megatron_fsdp``; ``device`` "cpu" keeps
    its buffers on the CPU) or, otherwise, the distributed optimizer's bucket groups (the first that
    applies, in that order)."""
    if use_torch_fsdp2:
        from .fsdp2 import Fsdp2Binding

        return Fsdp2Binding(reshard_after_forward=reshard_after_forward)
    if use_megatron_fsdp:
        from .megatron_fsdp import MegatronFsdpBinding

        return MegatronFsdpBinding(cpu=device == "cpu")
    from .bucket_group import DistributedOptimizerBinding

    return DistributedOptimizerBinding()
