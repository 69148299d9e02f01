"""CIERA: a lossless compressed all-gather for sharded (Mixture-of-Experts) training.

Public API::

    from ciera import CieraConfig, CieraAllGather
    gather = CieraAllGather(buffer, group=pg, config=CieraConfig())
    gather.start().wait()      # buffer == all_gather_into_tensor(buffer, my shard), bit for bit

ZeRO-3, where the gathered buffer is freed between gathers: :class:`ciera.zero3.Zero3Gather`, and for
PyTorch FSDP2 ``ciera.fsdp2.enable(model, optimizer=...)``.
"""

from .codecs import Codec, available_codecs, make_codec
from .config import CieraConfig
from .errors import StaleReplayError
from .gather import CieraAllGather, CieraVerifyError, GatherHandle
from .replicas import verify_replicas
from .stats import GatherStats
from .zero3 import Zero3Gather

__all__ = [
    "CieraAllGather", "CieraConfig", "CieraVerifyError", "Codec", "GatherHandle", "GatherStats", "StaleReplayError",
    "Zero3Gather", "available_codecs", "make_codec", "verify_replicas",
]
