"""Corrupt-payload verdicts that a device decoder returns unread: DeferredErrors (run here on CPU,
where its copies land at once) and the codec's raising of them at its next decode or on request."""

import pytest
import torch

from ciera.codecs import as_bits
from ciera.codecs.deferred import DeferredErrors, DeviceError
from ciera.codecs.delta_ans import DeltaAnsCodec

CLEAN = 99


def _found(*codes):
    return DeviceError(word=torch.tensor(codes, dtype=torch.int32), clean=CLEAN, describe=lambda c: f"bad {c}")


def test_clean_words_pass_and_are_forgotten():
    errors = DeferredErrors(slots=3)
    for _ in range(7):  # more than the ring holds: a full ring checks its oldest word first
        errors.push(_found(CLEAN, CLEAN))
    assert errors.in_flight == 3
    errors.check()
    assert errors.in_flight == 0


def test_the_first_failure_is_raised_with_its_smallest_code():
    errors = DeferredErrors(slots=4)
    errors.push(_found(CLEAN))
    errors.push(_found(CLEAN, 7, 3))
    errors.push(_found(5))
    with pytest.raises(ValueError, match="^bad 3$"):
        errors.check()
    assert errors.in_flight == 1  # the later word stays for the next check
    with pytest.raises(ValueError, match="^bad 5$"):
        errors.check(wait=True)
    assert errors.in_flight == 0


def test_a_full_ring_raises_its_oldest_failure_at_the_push():
    errors = DeferredErrors(slots=1)
    errors.push(_found(4))
    with pytest.raises(ValueError, match="bad 4"):
        errors.push(_found(CLEAN))


def test_one_ring_per_device():
    errors = DeferredErrors()
    errors.push(_found(CLEAN))
    with pytest.raises(ValueError, match="one ring per device"):
        errors.push(DeviceError(word=torch.zeros(1, dtype=torch.int32, device="meta"), clean=CLEAN,
                                describe=str))
    with pytest.raises(ValueError, match="slots=0"):
        DeferredErrors(slots=0)


def test_a_codec_raises_a_deferred_verdict_later_and_before_its_next_decode(monkeypatch):
    """A decoder that returns its verdict unread (as the Triton twin does on CUDA): the decode itself
    returns, the codec raises the verdict on request, and a verdict still pending when the next
    decode comes is raised before that decode writes anything."""
    n = 4096
    codec = DeltaAnsCodec(dtype=torch.bfloat16, numel=n, backend="torch")
    prev = torch.randn(n).to(torch.bfloat16)
    new = (prev.float() * 1.001).to(torch.bfloat16)
    payload = torch.empty(codec.max_bytes, dtype=torch.uint8)
    codec.encode(shard=new, state=codec.new_state(shard=prev), out=payload)
    import ciera.codecs.delta_ans as ref

    verdicts = []

    def decode_returning(**kw):
        ref.decode_reference(**kw)
        return verdicts.pop(0)

    monkeypatch.setattr(type(codec), "decode_reference", staticmethod(decode_returning))
    target = prev.clone()
    verdicts[:] = [_found(CLEAN)]
    codec.decode(payload=payload, target=target)
    codec.raise_pending_errors(wait=True)
    assert torch.equal(as_bits(target), as_bits(new))

    verdicts[:] = [_found(2)]
    codec.decode(payload=payload, target=prev.clone())  # returns: the verdict is not read yet
    with pytest.raises(ValueError, match="bad 2"):
        codec.raise_pending_errors()
    codec.raise_pending_errors()  # raised once, then forgotten

    verdicts[:] = [_found(6), _found(CLEAN)]
    codec.decode(payload=payload, target=prev.clone())
    untouched = prev.clone()
    with pytest.raises(ValueError, match="bad 6"):
        codec.decode(payload=payload, target=untouched)
    assert torch.equal(as_bits(untouched), as_bits(prev))


@pytest.mark.gpu
def test_on_cuda_a_corrupt_payload_is_raised_at_the_sync_point_not_at_the_decode():
    """The Triton delta_ans decoder on CUDA: a decode of a corrupt payload returns without a host
    read; the verdict lands in pinned memory and the codec raises the reference's error on request.
    A clean decode leaves nothing to raise."""
    n = 1 << 16
    codec = DeltaAnsCodec(dtype=torch.bfloat16, numel=n)
    prev = torch.randn(n, device="cuda").to(torch.bfloat16)
    new = (prev.float() * 1.001).to(torch.bfloat16)
    payload = torch.empty(codec.max_bytes, dtype=torch.uint8, device="cuda")
    codec.encode(shard=new, state=codec.new_state(shard=prev), out=payload)
    assert codec.implementation("decode", like=prev).startswith("ciera.kernels")
    target = prev.clone()
    codec.decode(payload=payload, target=target)
    codec.raise_pending_errors(wait=True)
    assert torch.equal(as_bits(target), as_bits(new))
    bad = payload.clone()
    bad[codec.layout.off_tables : codec.layout.off_data(0)] = 0xFF  # tables, counts: garbage
    codec.decode(payload=bad, target=prev.clone())  # returns: the verdict is read later
    with pytest.raises(ValueError, match="delta_ans: corrupt payload"):
        codec.raise_pending_errors(wait=True)
