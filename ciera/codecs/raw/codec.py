"""``raw``: the identity codec. Header plus the shard's bytes: the baseline every test compares to."""

from __future__ import annotations

import torch

from ..base import HEADER_BYTES, Codec, PayloadHeader, align_up, write_header
from ..registry import FLAG_WORDS, CodecSpec, register_codec


@register_codec
class RawCodec(Codec):
    """Sends every byte. Stateless; never overflows at capacity >= ``max_bytes``."""

    spec = CodecSpec(name="raw", codec_id=FLAG_WORDS["raw"], reads_previous="nothing",
                     summary="never compresses: every gather is a plain all_gather_into_tensor")

    def __init__(self, *, dtype: torch.dtype, numel: int, backend: str = "auto", block_size: int = 1):
        super().__init__(dtype=dtype, numel=numel, backend=backend)

    @property
    def fixed_bytes(self) -> int:
        return align_up(HEADER_BYTES + self.raw_bytes)

    @property
    def max_bytes(self) -> int:
        return self.fixed_bytes

    def new_state(self, *, shard):
        return None

    def reset_state(self, *, state, shard):
        return None

    def encode(self, *, shard: torch.Tensor, state, out: torch.Tensor) -> None:
        self._check_shard(shard)
        cap = self._check_out(out)
        out[HEADER_BYTES : HEADER_BYTES + self.raw_bytes].copy_(shard.view(torch.uint8))
        write_header(out, codec_id=self.codec_id, needed=self.fixed_bytes, capacity=cap)

    def decode(self, *, payload: torch.Tensor, target: torch.Tensor, header: PayloadHeader | None = None) -> None:
        self._check_shard(target, "target")
        self._check_payload(payload, header)
        target.view(torch.uint8).copy_(payload[HEADER_BYTES : HEADER_BYTES + self.raw_bytes])


__all__ = [
    "RawCodec",
]
