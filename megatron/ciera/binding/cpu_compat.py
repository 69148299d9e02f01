"""The only place that lets Megatron-Core run on a machine without CUDA.

Megatron-Core assumes a GPU in a handful of places (see ``shared/reference/megatron-core-notes``):
buffers allocated on ``torch.cuda.current_device()``, ``device='cuda'`` tensors in the optimizer,
pinned host staging tensors, a type check that wants ``torch.cuda.*Tensor`` names, CUDA streams
and events around the collectives, the CUDA RNG state in the tensor-parallel RNG tracker, two collectives gloo
lacks (uneven list ``all_gather``, list ``reduce_scatter``: MoE token exchange under TP), and the
pipeline's early free of sent activations, which relies on CUDA's stream-ordered allocator, and the
FSDP2 wrapper's ``"cuda"`` device mesh; Megatron-FSDP's device meshes, its
``f"cuda:{torch.cuda.current_device()}"`` device and its NCCL-only ``PREMUL_SUM`` gradient reduction.
:func:`enable` redirects exactly those to the CPU so that DDP + the distributed optimizer +
GPTModel (local spec) run on gloo ranks; nothing else is changed.

It is opt-in and refuses to run where CUDA exists: the GPU path never sees any of this.

    with cpu_compat.enabled():      # or cpu_compat.enable() for the rest of the process
        ...build and train on CPU...
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["enable", "disable", "enabled", "is_active"]

_state: dict | None = None  # saved originals while active; None when inactive

# CPU tensor type names as Megatron's optimizer expects to see them on a GPU.
_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int is a CUDA ordinal in torch's device arguments.
    return isinstance(device, int) and not isinstance(device, bool)


class _CpuDeviceMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU, drops ``pin_memory`` (no pinned allocator without
    an accelerator) and reports CUDA type names for CPU tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.device and args == ("cuda:cpu",):  # f"cuda:{torch.cuda.current_device()}"
            return torch.device("cpu")
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = _CUDA_TYPE_NAMES.get(args[0].dtype)
            if name is not None:
                return name
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device="cpu")
        if kwargs.get("pin_memory"):  # staging for a host-to-GPU copy (RoPE under CP): nothing to pin
            kwargs = dict(kwargs, pin_memory=False)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu") + tuple(args[2:])
        return func(*args, **kwargs)


class _FakeEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


class _FakeStream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event or _FakeEvent()

    def synchronize(self):
        pass

    def query(self):
        return True


_FAKE_STREAM = _FakeStream()


def _drop_cpu_rng_warning(record: logging.LogRecord) -> bool:
    return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _split_sizes_to_host(tensor, as_numpy=False, record_stream=False):
    """MoE all-to-all split sizes: upstream converts them to numpy only for CUDA tensors."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _uneven_all_gather(original):
    """gloo's list all_gather needs equal shapes; MoE with TP gathers token counts that differ
    per rank (dim 0): pad to the longest, gather, copy each rank's rows out."""

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if async_op or len({t.shape for t in tensor_list} | {tensor.shape}) == 1:
            return original(tensor_list, tensor, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in tensor_list)
        padded = tensor.new_zeros((rows, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        out = [torch.empty_like(padded) for _ in tensor_list]
        original(out, padded, group=group)
        for dst, src in zip(tensor_list, out):
            dst.copy_(src[: dst.shape[0]])

    return all_gather


def _list_reduce_scatter(output, input_list, op=None, group=None, async_op=False):
    """gloo has no list reduce_scatter: all-reduce the concatenation, keep this rank's part."""
    import torch.distributed as dist

    assert not async_op, "cpu_compat: asynchronous list reduce_scatter is not emulated"
    full = torch.cat([t.reshape(-1) for t in input_list])
    dist.all_reduce(full, op=op if op is not None else dist.ReduceOp.SUM, group=group)
    rank = dist.get_rank(group)
    offset = sum(t.numel() for t in input_list[:rank])
    output.copy_(full[offset: offset + output.numel()].view_as(output))


def _keep_sent_output(out, deallocate_pipeline_outputs=False):
    """The pipeline schedules' ``deallocate_output_tensor``, with the sent storage kept alive.

    Upstream swaps a sent activation's storage for a scalar right after ``isend`` (its backward
    then asserts the scalar). The interleaved schedule waits on that send later; on a GPU the
    caching allocator orders any reuse after the send on its stream, but gloo sends from host
    memory that is already freed and reused, so the next stage received corrupted activations
    (PP 2 x VPP 2 differed run to run, sometimes with a NaN gradient norm). The old storage now
    lives as long as the output tensor itself: peak memory changes, no value does."""
    if out is None or not deallocate_pipeline_outputs:
        return
    if isinstance(out, (list, tuple, dict)):  # megatron-core 0.19's schedules send lists and dicts too
        for item in out.values() if isinstance(out, dict) else out:
            _keep_sent_output(item, deallocate_pipeline_outputs)
        return
    sent = out.data
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)
    out._ciera_sent_storage = sent


def _reduce_preprocessing_without_premul(original):
    """Megatron-FSDP's ``gradient_reduce_preprocessing`` without NCCL's ``PREMUL_SUM`` (gloo lacks
    it): the gradient is scaled in place and summed, the path upstream itself takes for bf16."""

    def gradient_reduce_preprocessing(grad_data, scaling_factor, ddp_config):
        if scaling_factor is not None and not ddp_config.average_in_collective:
            grad_data.mul_(scaling_factor)
            return torch.distributed.ReduceOp.SUM
        return original(grad_data, scaling_factor, ddp_config)

    return gradient_reduce_preprocessing


class _CpuDeviceMesh:
    """``DeviceMesh`` as megatron-core's FSDP2 wrapper sees it: ``from_group(group, "cuda")``
    builds the mesh on the CPU (gloo); everything else is torch's ``DeviceMesh``."""

    @staticmethod
    def from_group(group, device_type, *args, **kwargs):
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh.from_group(group, "cpu" if device_type == "cuda" else device_type, *args, **kwargs)


def _patches() -> list[tuple[object, str, object]]:
    """(owner, attribute, replacement) for everything replaced while active."""
    from megatron.core.distributed import torch_fully_sharded_data_parallel as torch_fsdp2
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter as megatron_fsdp_adapter
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as fsdp_buffer
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    cuda = {
        "current_device": lambda: torch.device("cpu"),
        "set_device": lambda device: None,
        "device_count": lambda: 1,
        "synchronize": lambda device=None: None,
        "empty_cache": lambda: None,
        "current_stream": lambda device=None: _FAKE_STREAM,
        "default_stream": lambda device=None: _FAKE_STREAM,
        "set_stream": lambda stream: None,
        "stream": lambda stream=None: contextlib.nullcontext(),
        "Stream": _FakeStream,
        "Event": _FakeEvent,
        # The tensor-parallel RNG tracker saves, seeds and restores the "CUDA" generator around
        # dropout; the CPU's default generator takes that role, so the tracker forks and restores
        # it exactly as it would the GPU's (and its states checkpoint the same way).
        "get_rng_state": lambda device="cuda": torch.get_rng_state(),
        "set_rng_state": lambda new_state, device="cuda": torch.set_rng_state(new_state),
        # (torch.manual_seed itself calls torch.cuda.manual_seed_all: seed the generator directly)
        "manual_seed": lambda seed: torch.default_generator.manual_seed(int(seed)),
        "manual_seed_all": lambda seed: None,
    }
    patches = [(torch.cuda, name, fake) for name, fake in cuda.items()]
    patches += [
        (torch.cuda.random, "get_rng_state", cuda["get_rng_state"]),
        (torch.cuda.random, "set_rng_state", cuda["set_rng_state"]),
        # The tracker sets states through its own helper, which defers the call until CUDA
        # initialises (never, here).
        (tp_random, "_set_cuda_rng_state", lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)),
        (moe_utils, "maybe_move_tensor_to_cpu", _split_sizes_to_host),
        (token_dispatcher, "maybe_move_tensor_to_cpu", _split_sizes_to_host),
        (torch.distributed, "all_gather", _uneven_all_gather(torch.distributed.all_gather)),
        (torch.distributed, "reduce_scatter", _list_reduce_scatter),
        (schedules, "deallocate_output_tensor", _keep_sent_output),
        (torch_fsdp2, "DeviceMesh", _CpuDeviceMesh),  # --use-torch-fsdp2: a CPU mesh
        (megatron_fsdp_adapter, "DeviceMesh", _CpuDeviceMesh),  # --use-megatron-fsdp: a CPU mesh
        (fsdp_buffer, "gradient_reduce_preprocessing",
         _reduce_preprocessing_without_premul(fsdp_buffer.gradient_reduce_preprocessing)),
    ]
    return patches


_MISSING = object()


def is_active() -> bool:
    """True while :func:`enable` is in effect."""
    return _state is not None


def enable() -> None:
    """Redirect Megatron-Core's CUDA assumptions to the CPU for the rest of the process.

    Raises ``RuntimeError`` when CUDA is available: on a GPU use the real device. Idempotent.
    """
    global _state
    if _state is not None:
        return
    if torch.cuda.is_available():
        raise RuntimeError(
            "megatron.ciera.binding.cpu_compat: CUDA is available; the CPU shims are only for machines "
            "without a GPU (use --device cuda)"
        )
    saved = []
    for owner, name, fake in _patches():
        saved.append((owner, name, getattr(owner, name, _MISSING)))
        setattr(owner, name, fake)
    # The tracker warns when the CPU generator moves inside a fork: here it is the forked one.
    logging.getLogger("megatron.core.tensor_parallel.random").addFilter(_drop_cpu_rng_warning)
    mode = _CpuDeviceMode()
    mode.__enter__()
    _state = {"saved": saved, "mode": mode}


def disable() -> None:
    """Undo :func:`enable` (no-op when inactive)."""
    global _state
    if _state is None:
        return
    _state["mode"].__exit__(None, None, None)
    logging.getLogger("megatron.core.tensor_parallel.random").removeFilter(_drop_cpu_rng_warning)
    for owner, name, original in reversed(_state["saved"]):
        if original is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, original)
    _state = None


@contextlib.contextmanager
def enabled(active: bool = True) -> Iterator[None]:
    """Context manager form of :func:`enable`; ``active=False`` makes it a no-op."""
    if not active or is_active():
        yield
        return
    enable()
    try:
        yield
    finally:
        disable()
