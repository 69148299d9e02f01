"""plan_from_table: the pure rule every rank applies to the agreed sizes table."""

import pytest

from ciera.agreement import FLAG_FAILED, FLAG_RAW, Plan, plan_from_table

NAMES = {1: "exponent_reuse", 2: "delta"}


def plan(column, shard_bytes=4096):
    return plan_from_table(column, codec_names=NAMES, shard_bytes=shard_bytes, name="b0")


def test_exact_size_is_the_largest_payload_aligned():
    p = plan([(2, 1190), (2, 1201), (2, 1200)])  # per-rank sizes would save under 1.5%
    assert p == Plan(raw=False, codec_name="delta", size=1216, payload_bytes=3591)


def test_per_rank_sizes_when_they_save_enough():
    from ciera.agreement import UNEVEN_MIN_SAVING

    p = plan([(2, 1000), (2, 1201), (2, 990)])
    assert p == Plan(raw=False, codec_name="delta", size=1216, payload_bytes=3191, sizes=(1008, 1216, 992))
    assert sum(p.sizes) <= (1 - UNEVEN_MIN_SAVING) * 3 * p.size


def test_per_rank_sizes_off_sends_the_largest_payload_from_every_rank():
    column = [(2, 1000), (2, 1201), (2, 990)]
    p = plan_from_table(column, codec_names=NAMES, shard_bytes=4096, per_rank_sizes=False)
    assert p == Plan(raw=False, codec_name="delta", size=1216, payload_bytes=3191)


def test_any_raw_request_or_failure_makes_it_raw_everywhere():
    assert plan([(2, 100), (FLAG_RAW, 0)]) == Plan(raw=True)
    assert plan([(FLAG_FAILED, 0), (2, 100), (FLAG_FAILED, 0)]) == Plan(raw=True, failed_ranks=(0, 2))


def test_a_shard_that_would_not_shrink_is_sent_raw():
    assert plan([(2, 100), (2, 4090)]).raw  # 4096 aligned >= the 4096-byte shard
    assert not plan([(2, 100), (2, 4000)]).raw


def test_disagreeing_codecs_are_an_error_naming_the_bucket():
    with pytest.raises(RuntimeError, match="b0: ranks propose different codecs"):
        plan([(1, 100), (2, 100)])


def test_a_corrupt_payload_found_late_outranks_every_other_word():
    from ciera.agreement import FLAG_CORRUPT

    assert plan([(2, 100), (FLAG_CORRUPT, 0)]) == Plan(raw=True, corrupt_ranks=(1,))
    assert plan([(FLAG_CORRUPT, 0), (FLAG_FAILED, 0), (FLAG_RAW, 0), (FLAG_CORRUPT, 0)]) == \
        Plan(raw=True, corrupt_ranks=(0, 3))


def test_ring_bytes_per_rank_follow_the_planned_shape():
    from ciera.agreement import ring_bytes_per_rank

    assert ring_bytes_per_rank([1008, 1216, 992]) == (1008 + 1216 + 992 - 992) / 2  # per-rank sizes
    assert ring_bytes_per_rank([1008, 1216, 992], per_rank_sizes=False) == 1216
    assert ring_bytes_per_rank([1200, 1216, 1200]) == 1216  # saves under 1.5%: every rank the largest
    assert ring_bytes_per_rank([700, 1216]) == 1216  # two ranks: the larger payload paces the exchange
    assert ring_bytes_per_rank([512]) == 512
