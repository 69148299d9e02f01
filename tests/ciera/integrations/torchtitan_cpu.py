"""Test-only shim: torchtitan's own trainer and entry point on CPU / gloo, with synthetic data.

torchtitan 0.3.0 assumes an accelerator: with none, ``torchtitan.tools.utils`` takes ``cuda`` as the
device type. Run as a script, this module makes torch report ``cpu`` as the available device type
before torchtitan is imported (every torchtitan module then picks ``cpu`` / gloo), then runs
``python -m torchtitan.train`` unchanged::

    torchrun --nproc_per_node 2 tests/ciera/integrations/torchtitan_cpu.py \\
        --module torchtitan_cpu --config llama3_debugmodel --ciera.enable

Its config functions (``llama3_debugmodel``, ``deepseek_v3_debugmodel``) are torchtitan's own,
through :func:`ciera.integrations.torchtitan.with_ciera`, with two swaps the wheel needs: a synthetic
token stream for the C4 test set and a tokenizer that only knows its vocabulary size (the wheel
ships neither the data nor the tokenizer files). Without the ``datasets`` package (torchtitan imports
it at start-up; its pin conflicts with transformers' huggingface_hub), a stub stands in for it:
nothing here loads a dataset. GPU runs need none of this (see examples/torchtitan/README.md).
"""

from __future__ import annotations

import importlib.util
import runpy
import sys
import types
from dataclasses import dataclass

import torch
import torch._utils


def patch_for_cpu() -> None:
    """Before torchtitan is imported: CPU as its device type (and :func:`cpu_device_module` as its
    device module), and a ``datasets`` stub if that package is absent. torch itself is left as it is:
    the patch lasts only while ``torchtitan.tools.utils`` (which every torchtitan module asks)
    is imported."""
    if not torch.cuda.is_available() and "torchtitan.tools.utils" not in sys.modules:
        saved = torch._utils._get_available_device_type, torch._utils._get_device_module
        torch._utils._get_available_device_type = lambda: "cpu"
        torch._utils._get_device_module = lambda device_type=None: cpu_device_module()
        try:
            importlib.import_module("torchtitan.tools.utils")
        finally:
            torch._utils._get_available_device_type, torch._utils._get_device_module = saved
        _sum_reductions_for_gloo()
    _timeouts_without_set_timeout()
    if "datasets" not in sys.modules and importlib.util.find_spec("datasets") is None:
        stub = types.ModuleType("datasets")
        stub.Dataset = type("Dataset", (), {})
        stub.load_dataset = _no_datasets
        dist = types.ModuleType("datasets.distributed")
        dist.split_dataset_by_node = _no_datasets
        stub.distributed = dist
        sys.modules.update({"datasets": stub, "datasets.distributed": dist})


def _sum_reductions_for_gloo() -> None:
    """torchtitan turns FSDP2's gradient division off (factor 1.0: it scales by the global token
    count itself), which FSDP2 sends as ``PREMUL_SUM(1.0)``: gloo has no PREMUL_SUM. A plain SUM
    (FSDP2's ``force_sum_reduction_for_comms``) then divides by 1.0: the same gradients."""
    import torchtitan.distributed.fsdp as titan_fsdp
    from torch.distributed.fsdp import FSDPModule

    disable = titan_fsdp.disable_fsdp_gradient_division

    def disable_division_with_sums(model):
        disable(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    titan_fsdp.disable_fsdp_gradient_division = disable_division_with_sums


def _timeouts_without_set_timeout() -> None:
    """torchtitan 0.3.0 shortens the process groups' timeouts after the first step with
    ``torch.distributed.set_timeout``, which torch 2.13 lacks (any device): keep the timeouts."""
    if hasattr(torch.distributed, "set_timeout"):
        return
    import torchtitan.distributed.utils as titan_dist

    titan_dist.set_pg_timeouts = lambda *args, **kwargs: torch.distributed.barrier()


def cpu_device_module() -> types.ModuleType:
    """``torch.cpu`` with the memory queries torchtitan's metrics make of an accelerator (no figures)."""
    mod = types.ModuleType("torchtitan_cpu_device")
    mod.__dict__.update({k: v for k, v in vars(torch.cpu).items() if not k.startswith("__")})
    mod.get_device_name = lambda device=None: "cpu"
    mod.get_device_properties = lambda device=None: types.SimpleNamespace(name="cpu", total_memory=1 << 30)
    mod.reset_peak_memory_stats = mod.empty_cache = lambda *a, **k: None
    mod.memory_stats = lambda device=None: {}
    mod.current_device = lambda: 0  # an index (barrier device_ids), not torch.cpu's "cpu"
    return mod


def _no_datasets(*args, **kwargs):
    raise RuntimeError("the datasets package is not installed (tests/ciera/integrations/torchtitan_cpu.py stub)")


patch_for_cpu()

from torchtitan.components.dataloader import BaseDataLoader  # noqa: E402
from torchtitan.components.tokenizer import BaseTokenizer  # noqa: E402
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention  # noqa: E402
from torchtitan.models.common.config_utils import decoder_vocab_size  # noqa: E402

import ciera.integrations.torchtitan as titan  # noqa: E402


class SizeOnlyTokenizer(BaseTokenizer):
    """A tokenizer that knows its vocabulary size only (the synthetic data are token ids)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 256
        """Token ids are in [0, vocab_size)."""

    def __init__(self, config: Config, **kwargs):
        super().__init__()
        self.vocab_size = config.vocab_size

    def encode(self, *args, **kwargs) -> list[int]:
        raise NotImplementedError("SizeOnlyTokenizer has no vocabulary")

    def decode(self, *args, **kwargs) -> str:
        raise NotImplementedError("SizeOnlyTokenizer has no vocabulary")

    def get_vocab_size(self) -> int:
        return self.vocab_size


class SyntheticDataLoader(BaseDataLoader):
    """Seeded random token ids, a different stream per data-parallel rank, the same every run."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        vocab_size: int = 256
        """Token ids are in [0, vocab_size)."""
        seed: int = 1234
        """Seed of rank 0's stream (rank r: seed + r)."""

    def __init__(self, config: Config, *, dp_rank: int, seq_len: int, local_batch_size: int, **kwargs):
        self.config, self.dp_rank, self.seq_len, self.batch = config, dp_rank, seq_len, local_batch_size
        self.batches = 0

    def __iter__(self):
        gen = torch.Generator().manual_seed(self.config.seed + self.dp_rank)
        while True:
            tokens = torch.randint(0, self.config.vocab_size, (self.batch, self.seq_len + 1), generator=gen)
            self.batches += 1
            positions = torch.arange(self.seq_len).expand(self.batch, -1)  # one document per row
            yield {"input": tokens[:, :-1], "positions": positions}, tokens[:, 1:]

    def state_dict(self):
        return {"batches": self.batches}

    def load_state_dict(self, state_dict):
        self.batches = state_dict["batches"]


def _on_cpu(config):
    """A torchtitan config made CIERA's, small, fp32, with the synthetic data."""
    config = titan.with_ciera(config)
    vocab = decoder_vocab_size(config.model_spec)
    config.tokenizer = SizeOnlyTokenizer.Config(vocab_size=vocab)
    config.dataloader = SyntheticDataLoader.Config(vocab_size=vocab)
    # FlexAttention has no backward on CPU: causal SDPA instead (each synthetic row is one
    # document, so the block-causal mask FlexAttention would build is the causal one).
    for _, _, parent, attr in config.model_spec.model.traverse(FlexAttention.Config):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    config.parallelism.spmd_backend = "partial_dtensor"
    config.debug.seed = 0  # torchtitan's default: a fresh seed per run
    config.training.local_batch_size = 2
    config.training.seq_len = 64
    config.training.steps = 3
    config.training.disable_cuda_graphs = True
    config.validator.enable = False
    config.checkpoint.enable = False
    return config


def llama3_debugmodel():
    """torchtitan's ``llama3_debugmodel`` on CPU."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel as base
    return _on_cpu(base())


def deepseek_v3_debugmodel():
    """torchtitan's ``deepseek_v3_debugmodel`` (MoE) on CPU."""
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel as base
    return _on_cpu(base())


if __name__ == "__main__":
    sys.argv[0] = "torchtitan.train"
    runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)
    from ciera.shutdown import end_process

    end_process(0)  # after torchtitan's own teardown: no interpreter finalization for gloo's workers to race
