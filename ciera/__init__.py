"""CIERA: a lossless compressed all-gather for sharded (Mixture-of-Experts) training.

Public API::

    from ciera import CieraConfig, CieraAllGather
    gather = CieraAllGather(buffer, group=pg, config=CieraConfig())
    gather.start().wait()      # buffer == all_gather_into_tensor(buffer, my shard), bit for bit
"""

from .codecs import Codec, available_codecs, make_codec
from .config import CieraConfig
from .gather import CieraAllGather, CieraVerifyError, GatherHandle, verify_replicas
from .stats import GatherStats

__all__ = [
    "CieraAllGather", "CieraConfig", "CieraVerifyError", "Codec", "GatherHandle", "GatherStats",
    "available_codecs", "make_codec", "verify_replicas",
]
