"""megatron.ciera.binding.cpu_compat: inactive unless asked, active only inside, fully undone."""

import pytest
import torch

from megatron.ciera.binding import cpu_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the shims are for CUDA-less machines")


def test_inactive_unless_enabled():
    original = torch.cuda.current_device
    assert not cpu_compat.is_active()
    with cpu_compat.enabled(active=False):
        assert not cpu_compat.is_active()
        assert torch.cuda.current_device is original
        assert torch.zeros(1).type() == "torch.FloatTensor"


def test_enabled_redirects_cuda_and_is_undone():
    originals = {n: getattr(torch.cuda, n) for n in ("current_device", "synchronize", "Stream", "get_rng_state")}
    with cpu_compat.enabled():
        assert cpu_compat.is_active()
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.empty(3, device=torch.cuda.current_device()).device.type == "cpu"
        assert torch.ones(1).to("cuda").device.type == "cpu" and torch.ones(1).cuda().device.type == "cpu"
        assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        assert torch.zeros(1).type(torch.float16).dtype == torch.float16  # conversions untouched
        assert torch.tensor([1, 2], pin_memory=True).tolist() == [1, 2]  # no pinned allocator here
        torch.cuda.current_stream().wait_stream(torch.cuda.Stream())
        torch.cuda.synchronize()
        state = torch.cuda.get_rng_state()
        a = torch.rand(3)
        torch.cuda.set_rng_state(state)
        assert torch.equal(a, torch.rand(3))  # the CPU generator plays the CUDA generator's role
    assert not cpu_compat.is_active()
    assert {n: getattr(torch.cuda, n) for n in originals} == originals
    assert torch.zeros(1).type() == "torch.FloatTensor"
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")
    with pytest.raises(RuntimeError):
        torch.tensor([1], pin_memory=True)


def test_enable_refuses_where_cuda_exists(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA is available"):
        cpu_compat.enable()
    assert not cpu_compat.is_active()


def test_pipeline_outputs_freed_after_send_keep_their_storage_on_cpu():
    """The schedules pseudo-free a sent activation (their backward asserts one element), but gloo
    may still be sending from it: on CPU the storage must outlive the send, values untouched."""
    from megatron.core.pipeline_parallel import schedules

    with cpu_compat.enabled():
        out = torch.arange(12.0).reshape(3, 4)
        ptr = out.data_ptr()
        schedules.deallocate_output_tensor(out, True)
        assert out.numel() == 1
        kept = out._ciera_sent_storage
        assert kept.data_ptr() == ptr and torch.equal(kept, torch.arange(12.0).reshape(3, 4))
        untouched = torch.ones(2)
        schedules.deallocate_output_tensor(untouched, False)
        assert untouched.numel() == 2
    assert schedules.deallocate_output_tensor is not cpu_compat._keep_sent_output
