"""The one collective CIERA issues, under the name the installed torch prefers."""

from __future__ import annotations

import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor to all_gather_single (same semantics; the old name warns).
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""``all_gather_into(output, input, group=None, async_op=False)``: every rank's ``input`` concatenated
into ``output`` in rank order."""
