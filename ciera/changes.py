"""Whether a shard changed since receivers last got it: the one tracker every binding keeps per
gathered unit (a ZeRO-1 bucket group, a ZeRO-3 unit).

Whatever writes a shard marks it (:meth:`ShardWrites.mark`: the optimizer step, found by each
engine's own hook, or a checkpoint load through ``invalidate``); the gather that sends the new
values clears it (:meth:`ShardWrites.sent`). What a marked shard costs differs by engine: ZeRO-1
gathers a bucket group only while it is marked (receivers' persistent buffers hold the rest);
ZeRO-3 encodes a unit once per mark, and the step's later gathers replay.
"""

from __future__ import annotations

__all__ = ["ShardWrites"]


class ShardWrites:
    """One unit's "written since its last gather" flag. Starts marked unless told otherwise (the
    first gather sends everything)."""

    __slots__ = ("written",)

    def __init__(self, *, written: bool = True):
        self.written = written
        """The shard changed (or may have) since the last gather that sent it."""

    def mark(self) -> None:
        """The shard was written: the next gather sends (encodes) it anew."""
        self.written = True

    def sent(self) -> None:
        """A gather sent the shard as it is now: receivers hold it."""
        self.written = False

    def __repr__(self) -> str:
        return f"ShardWrites(written={self.written})"
