"""Single-pass prefix sums across the programs of a launch: tickets and decoupled look-back.

A kernel whose tiles need the sum of some count over every earlier tile (a byte offset, a slot
number) gets it in the same launch, without a separate count-then-scan pass over memory:

* :func:`tile_ticket` numbers programs in the order they *start* (an atomic ticket), so a tile only
  ever waits for tiles that are already running (no deadlock whatever the scheduling order);
* :func:`look_back` publishes the tile's own total, walks back over earlier tiles' flag words
  until one carries an inclusive prefix, then publishes its own inclusive prefix.

Flag words carry ``(epoch % 2^18) + 1`` in bits 44..62 (the call's number, from the ticket, so
no flag ever needs clearing), a 2-bit state in 42..43 (1: the tile's own total, 2: the inclusive
prefix up to it) and the count in bits 0..41. All launches that share one scratch (one ticket
counter) must run one after the other on one stream, each call with the same ``k x n_tiles``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def tile_ticket(counter_ptr, k, n_full, n_tiles, EVEN: tl.constexpr):
    """(epoch, row, tile) of this program from a ticket. Full tiles come from the main launch
    (``EVEN``: ``k * n_full`` programs), the partial last tile of each of the ``k`` rows from a
    second launch of ``k`` programs."""
    t = tl.atomic_add(counter_ptr, 1)
    per_call = k * n_tiles
    epoch = t // per_call
    rem = t % per_call
    if EVEN:
        row = rem // n_full
        vid = rem % n_full
    else:
        row = rem - k * n_full
        vid = rem * 0 + n_tiles - 1
    return epoch, row, vid


@triton.jit
def look_back(flags_ptr, vid, total, epoch):
    """Publish this tile's ``total`` (int64, < 2^42), return the sum over tiles ``0 .. vid - 1``
    of its chain (``flags_ptr[0 .. vid)``)."""
    tag = ((epoch % 262144) + 1) << 44
    first = vid == 0
    tl.atomic_xchg(flags_ptr + vid, tag | (tl.where(first, 2, 1).to(tl.int64) << 42) | total)
    prefix = total * 0
    j = vid - 1
    while j >= 0:
        word = tl.atomic_add(flags_ptr + j, 0)
        state = (word >> 42) & 3
        ready = ((word >> 44) == (tag >> 44)) & (state != 0)
        prefix += tl.where(ready, word & 4398046511103, 0)
        j = tl.where(ready & (state == 2), -1, tl.where(ready, j - 1, j))
    if vid > 0:
        tl.atomic_xchg(flags_ptr + vid, tag | (2 << 42) | (prefix + total))
    return prefix


def scratch(key: tuple, device: torch.device, n_flags: int) -> dict:
    """``counter`` (the ticket), ``flags`` (``n_flags`` words) and ``needed`` (one int64 word for a
    kernel's result, e.g. an encoder's bytes needed) for one kernel family and shape
    ``key`` on ``device``'s current stream, allocated once. Per stream: ticket order only means
    something for launches that run one after the other."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    return _scratch_on(key, device, n_flags, stream)


@functools.lru_cache(maxsize=64)
def _scratch_on(key: tuple, device: torch.device, n_flags: int, stream) -> dict:
    return dict(counter=torch.zeros(1, dtype=torch.int64, device=device),
                flags=torch.zeros(max(1, n_flags), dtype=torch.int64, device=device),
                needed=torch.zeros(1, dtype=torch.int64, device=device))
