"""megatron.ciera.binding.engines: one Binding class per engine, picked by binding_for."""

import torch

from megatron.ciera.binding.bucket_group import DistributedOptimizerBinding
from megatron.ciera.binding.engines import binding_for
from megatron.ciera.binding.fsdp2 import Fsdp2Binding
from megatron.ciera.binding.megatron_fsdp import MegatronFsdpBinding
from megatron.ciera.binding.protocol import Binding

ENGINES = (DistributedOptimizerBinding, Fsdp2Binding, MegatronFsdpBinding)
DEFAULTS = {"sync_params", "full_tensor"}  # the protocol's own code, for engines that keep it


def _methods():
    return sorted(n for n, v in vars(Binding).items() if callable(v) and not n.startswith("_"))


def test_binding_for_picks_one_engine_per_setting():
    assert type(binding_for()) is DistributedOptimizerBinding
    assert type(binding_for(use_torch_fsdp2=True)) is Fsdp2Binding
    assert type(binding_for(use_megatron_fsdp=True)) is MegatronFsdpBinding
    assert binding_for(use_torch_fsdp2=True, reshard_after_forward=False).reshard_after_forward is False
    assert binding_for(use_megatron_fsdp=True, device="cpu").cpu is True
    assert binding_for(use_megatron_fsdp=True, device="cuda").cpu is False


def test_every_engine_implements_the_protocol():
    assert {"wrap", "install", "after_optimizer_step", "sync_params", "raise_pending_errors",
            "invalidate_param_caches", "bucket_stats", "summary", "full_tensor"} == set(_methods())
    for engine in ENGINES:
        assert isinstance(engine.noun, str) and engine.noun
        for name in _methods():
            if name not in DEFAULTS:
                assert getattr(engine, name) is not getattr(Binding, name), f"{engine.__name__}.{name}"


def test_plain_tensors_are_their_own_full_value():
    t = torch.arange(4.0)
    for binding in (binding_for(), binding_for(use_torch_fsdp2=True), binding_for(use_megatron_fsdp=True)):
        assert binding.full_tensor(t) is t
