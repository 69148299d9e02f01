"""Corrupt-payload errors that a device decoder found, reported without stalling its stream.

A decoder that checks a payload on the device lowers a per-payload error word there. Reading that
word at once would make the host wait for the decode; instead the decoder returns a
:class:`DeviceError` and its codec keeps it in a :class:`DeferredErrors`, which copies the word into
host memory behind an event and raises the reference's ``ValueError`` at the first check after the
copy has landed: the codec's next decode, or a sync point of the caller's choosing (the gather's
agreement, which reads the size table on the host anyway, and ``wait=True`` before a checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class DeviceError:
    """What a device decode found, still on the device."""

    word: torch.Tensor
    """int32 error codes, one per payload decoded (any shape); ``clean`` where a payload was valid."""
    clean: int
    """The code of a valid payload: the largest code, so the word's minimum is the first failure."""
    describe: Callable[[int], str]
    """The ``ValueError`` message for a failing code (the reference decoder's message)."""


class DeferredErrors:
    """The error words of one codec's device decodes in flight, oldest first.

    ``slots`` words may be in flight at once; each has a device cell, a host cell (pinned on CUDA)
    and an event, all made at the first :meth:`push`, so a decode allocates nothing here. A push
    into a full ring first checks the oldest word, waiting for it (long finished in practice: a
    gather checks at every agreement)."""

    def __init__(self, *, slots: int = 8):
        if slots < 1:
            raise ValueError(f"DeferredErrors: slots={slots} must be >= 1")
        self.slots = slots
        self._device: torch.device | None = None
        self._dev = self._host = None
        self._events: list = []
        self._describe: list = [None] * slots
        self._head = 0  # oldest slot in flight
        self._count = 0

    @property
    def in_flight(self) -> int:
        """Words pushed and not yet checked."""
        return self._count

    def push(self, error: DeviceError) -> None:
        """Queue ``error``'s word behind the work already on the current stream (no host wait
        unless the ring is full)."""
        word = error.word
        self._bind(word.device)
        if self._count == self.slots:
            self._check_one(wait=True)
        i = (self._head + self._count) % self.slots
        torch.amin(word.reshape(-1), dim=0, keepdim=True, out=self._dev[i : i + 1])
        self._host[i : i + 1].copy_(self._dev[i : i + 1], non_blocking=True)
        if self._events:
            self._events[i].record()
        self._describe[i] = (error.clean, error.describe)
        self._count += 1

    def check(self, *, wait: bool = False) -> None:
        """Raise the first failing word among those landed (every word pushed when ``wait``);
        forget the clean ones. A word that fails is forgotten too, after it is raised."""
        while self._count and self._check_one(wait=wait):
            pass

    def _check_one(self, *, wait: bool) -> bool:
        i = self._head
        if self._events:
            event = self._events[i]
            if not wait and not event.query():
                return False
            event.synchronize()
        code = int(self._host[i])
        clean, describe = self._describe[i]
        self._describe[i] = None
        self._head = (i + 1) % self.slots
        self._count -= 1
        if code != clean:
            raise ValueError(describe(code))
        return True

    def _bind(self, device: torch.device) -> None:
        if self._device is not None:
            if device != self._device:
                raise ValueError(f"DeferredErrors: a word on {device} after words on {self._device}; "
                                 "one ring per device")
            return
        cuda = device.type == "cuda"
        self._dev = torch.empty(self.slots, dtype=torch.int32, device=device)
        self._host = torch.empty(self.slots, dtype=torch.int32, pin_memory=cuda)
        self._events = [torch.cuda.Event() for _ in range(self.slots)] if cuda else []
        self._device = device
