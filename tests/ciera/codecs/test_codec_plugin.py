"""A codec is a plugin: a package outside the repository registers a toy codec when imported, and
CieraAllGather gathers with it on gloo bit for bit like all_gather_into_tensor, with no file of the
library touched. The toy codec sends the changed values verbatim (their indices and bit patterns) and
has only its pure-torch reference: no native or Triton twin."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ciera.codecs import as_bits
from ciera.testing import run_on_ranks

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = "ciera_toy_codec"
TOY_ID = 200

TOY = textwrap.dedent(f'''
    """toy: the changed values verbatim. Payload after the 32-byte header: the count k (int64, padded
    to 16 bytes), k int64 indices, then the k new bit patterns."""

    from dataclasses import dataclass

    import torch

    from ciera.codecs import Codec, CodecSpec, FloatFormat, as_bits, register_codec
    from ciera.codecs.base import HEADER_BYTES, align_up, decode_many_of

    OFF_INDEX = HEADER_BYTES + 16


    @dataclass(frozen=True)
    class ToyLayout:
        fmt: FloatFormat
        numel: int


    def encode_reference(*, layout, shard_bits, state, out):
        changed = torch.nonzero(shard_bits != state).squeeze(1)
        k, itemsize = changed.numel(), layout.fmt.itemsize
        needed = OFF_INDEX + k * (8 + itemsize)
        if needed <= out.numel():  # never write past the capacity: the header reports the overflow
            out[HEADER_BYTES : HEADER_BYTES + 8].view(torch.int64)[0] = k
            out[OFF_INDEX : OFF_INDEX + 8 * k].view(torch.int64).copy_(changed)
            values = out[OFF_INDEX + 8 * k : needed].view(layout.fmt.bits_dtype)
            values.copy_(shard_bits[changed])
        state.copy_(shard_bits)
        return needed


    def decode_reference(*, layout, payload, target_bits):
        k = int(payload[HEADER_BYTES : HEADER_BYTES + 8].view(torch.int64)[0])
        index = payload[OFF_INDEX : OFF_INDEX + 8 * k].view(torch.int64)
        end = OFF_INDEX + k * (8 + layout.fmt.itemsize)
        target_bits[index] = payload[OFF_INDEX + 8 * k : end].view(layout.fmt.bits_dtype)


    decode_many_reference = decode_many_of(decode_reference)


    class ToyCodec(Codec):
        spec = CodecSpec(name="toy", codec_id={TOY_ID}, reads_previous="values",
                         summary="the changed values verbatim (a test of the plugin interface)")
        encode_reference = staticmethod(encode_reference)
        decode_reference = staticmethod(decode_reference)
        decode_many_reference = staticmethod(decode_many_reference)

        def __init__(self, *, dtype, numel, backend="auto"):
            super().__init__(dtype=dtype, numel=numel, backend=backend)
            self.layout = ToyLayout(self.fmt, numel)

        @property
        def fixed_bytes(self):
            return align_up(OFF_INDEX)

        @property
        def max_bytes(self):
            return OFF_INDEX + self.numel * (8 + self.fmt.itemsize)

        def new_state(self, *, shard):
            self._check_shard(shard)
            return as_bits(shard).clone()

        def reset_state(self, *, state, shard):
            self._check_shard(shard)
            state.copy_(as_bits(shard))


    register_codec(ToyCodec)
''')


def _write_package(root: Path) -> Path:
    (root / PACKAGE).mkdir()
    (root / PACKAGE / "__init__.py").write_text(TOY)
    return root


def _import_toy(path: str):
    if path not in sys.path:
        sys.path.insert(0, path)
    import importlib

    return importlib.import_module(PACKAGE)


# Bit patterns the codec must carry exactly (unsigned; wrapped to the signed bits dtype): NaNs with
# payloads and both signs, a signalling NaN, -0.0, +-Inf, the smallest and a negative subnormal, 1.0, 0.
SPECIALS = {
    torch.bfloat16: [0x7FC1, 0xFFA5, 0x7F81, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x807F, 0x3F80, 0x0000],
    torch.float16: [0x7E01, 0xFD55, 0x7C01, 0x8000, 0x7C00, 0xFC00, 0x0001, 0x83FF, 0x3C00, 0x0000],
    torch.float32: [0x7FC00123, 0xFFAA55FE, 0x7F800001, 0x80000000, 0x7F800000, 0xFF800000, 0x00000001,
                    0x807FFFFF, 0x3F800000, 0x00000000],
}


def _shard(dtype: torch.dtype, numel: int, *, rank: int, step: int) -> torch.Tensor:
    """Step 0: ordinary values. Later steps: a few values changed, some to special bit patterns (which
    ones moves with the rank and the step, and some step changes nothing)."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = (torch.randn(numel, generator=gen) * 0.02).to(dtype)
    if step == 0:
        return x
    prev = _shard(dtype, numel, rank=rank, step=0)
    if step % 5 == 3:
        return prev  # nothing changed: a payload of the count alone
    bits = as_bits(prev).clone()
    width = 8 * bits.element_size()
    specials = torch.tensor([v - (1 << width) if v >> (width - 1) else v for v in SPECIALS[dtype]], dtype=bits.dtype)
    where = torch.randperm(numel, generator=gen)[: 3 + step]
    bits[where] = specials[(torch.arange(where.numel()) + step + rank) % specials.numel()]
    more = torch.randperm(numel, generator=gen)[:step]
    bits[more] = as_bits(x)[more]
    return bits.view(dtype)


def _gather_worker(rank, world, path, dtype, numel, steps):
    toy = _import_toy(path)
    from ciera import CieraAllGather, CieraConfig

    buf = torch.zeros(numel * world, dtype=dtype)
    ref = torch.empty_like(buf)
    gather = CieraAllGather(buf, config=CieraConfig(codec="toy", selection="always"), name="toy-b0")
    assert type(gather.codecs["toy"]) is toy.ToyCodec
    shard = buf.view(world, -1)[rank]
    impl = gather.codecs["toy"].implementation("encode", like=shard)
    for step in range(steps):
        x = _shard(dtype, numel, rank=rank, step=step)
        shard.copy_(x)
        gather.start().wait()
        dist.all_gather_into_tensor(ref, x)
        if not torch.equal(as_bits(buf), as_bits(ref)):
            diff = (as_bits(buf) != as_bits(ref)).nonzero()
            raise AssertionError(f"rank {rank} step {step}: {diff.numel()} values differ, first {diff[:5].tolist()}")
    return gather.stats, impl


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_registered_toy_codec_gathers_bit_exactly(tmp_path, dtype):
    path = str(_write_package(tmp_path))
    steps = 12
    results = run_on_ranks(_gather_worker, world=2, args=(path, dtype, 257, steps))
    for stats, impl in results:
        assert impl == PACKAGE  # its reference ran: it has no native or Triton twin
        assert stats.gathers == steps and stats.failures == 0 and stats.overflows == 0
        assert stats.raw_gathers < steps and stats.payload_bytes > 0  # the toy payloads went on the wire
    assert len({(s.wire_bytes, s.payload_bytes) for s, _ in results}) == 1, "ranks diverged"


def test_the_descriptor_is_what_the_library_asks(tmp_path):
    """In a fresh process (the suite's registry stays as it is): config, help, wire table, ZeRO-3's
    cache rule and the backends all follow the toy codec's descriptor."""
    path = str(_write_package(tmp_path))
    code = textwrap.dedent(f"""
        import sys
        import pytest, torch
        sys.path.insert(0, {path!r})
        from ciera import CieraConfig, Zero3Gather
        from ciera.codecs import available_codecs, codec_spec, make_codec
        from ciera.codecs.registry import WIRE_WORDS, codec_help, needs_values_cache
        with pytest.raises(ValueError, match="codec='toy'"):
            CieraConfig(codec="toy")
        import {PACKAGE}
        assert "toy" in available_codecs() and WIRE_WORDS["toy"] == {TOY_ID}
        assert CieraConfig(codec="toy").codec == "toy"
        assert "toy: the changed values verbatim" in codec_help()
        assert needs_values_cache("toy") and not codec_spec("toy").auto
        with pytest.raises(ValueError, match="needs cache='values'"):
            Zero3Gather(config=CieraConfig(codec="toy", cache="exponents"))
        codec = make_codec("toy", dtype=torch.bfloat16, numel=8, backend="native")
        state = codec.new_state(shard=torch.ones(8, dtype=torch.bfloat16))
        with pytest.raises(RuntimeError, match="toy: backend='native' but this codec has no native implementation"):
            codec.encode(shard=torch.zeros(8, dtype=torch.bfloat16), state=state,
                         out=torch.zeros(256, dtype=torch.uint8))
        codec = make_codec("toy", dtype=torch.bfloat16, numel=8, backend="triton")
        with pytest.raises(RuntimeError, match="toy: backend='triton' but this codec has no Triton twin"):
            one = torch.zeros(1, dtype=torch.int64)
            codec.decode_many(payloads=torch.zeros(64, dtype=torch.uint8), rows=one, offsets=one,
                              targets=torch.zeros(2, 8, dtype=torch.bfloat16))
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr
