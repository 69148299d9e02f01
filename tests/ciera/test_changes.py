"""ciera.changes.ShardWrites: the one "written since the last gather" tracker, kept by ZeRO-1's
bucket groups and ZeRO-3's units alike."""

import dataclasses

from ciera.changes import ShardWrites
from ciera.zero3 import Zero3Gather


def test_marks_and_sends():
    w = ShardWrites()
    assert w.written, "a new unit's first gather sends everything"
    w.sent()
    assert not w.written
    w.mark()
    assert w.written
    assert not ShardWrites(written=False).written


def test_zero1_and_zero3_keep_the_same_tracker():
    from megatron.ciera.binding.bucket_group import _GroupState

    fields = {f.name: f for f in dataclasses.fields(_GroupState)}
    assert isinstance(fields["writes"].default_factory(), ShardWrites)
    unit = Zero3Gather()
    assert isinstance(unit.writes, ShardWrites) and unit.writes.written
    unit.step()
    assert unit.writes.written
