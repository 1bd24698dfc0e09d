"""The compact set of done offsets and the commit metadata that carries it (worker/partitions/donemeta.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.partitions.donemeta import (
    PREFIX,
    MetadataError,
    MetadataRefresh,
    OffsetRuns,
    decode,
    done_after,
    done_count,
    encode,
    read_already_done,
)
from worker.testing import FakeClock

TP = ("frames.standard", 0)


def test_adding_offsets_in_order_extends_one_run():
    runs = OffsetRuns()
    for o in range(100, 200):
        runs.add(o)
    assert runs.runs() == [(100, 200)] and len(runs) == 100 and runs.run_count == 1


def test_adjacent_and_overlapping_runs_merge():
    runs = OffsetRuns([(10, 12), (20, 22), (30, 32)])
    runs.add(12)  # touches the first run's end
    assert runs.runs() == [(10, 13), (20, 22), (30, 32)]
    runs.add_run(13, 20)  # fills the gap: the first two become one
    assert runs.runs() == [(10, 22), (30, 32)]
    runs.add_run(5, 40)  # covers everything
    assert runs.runs() == [(5, 40)]
    runs.add(3)
    assert runs.runs() == [(3, 4), (5, 40)]


def test_the_commit_point_advancing_forgets_what_is_below_it():
    runs = OffsetRuns([(10, 20), (30, 40)])
    runs.advance(15)
    assert runs.runs() == [(15, 20), (30, 40)]
    runs.advance(25)
    assert runs.runs() == [(30, 40)]
    runs.advance(40)
    assert not runs and len(runs) == 0


def test_contains_answers_inside_runs_only():
    runs = OffsetRuns([(10, 20), (30, 40)])
    assert [o for o in (9, 10, 19, 20, 29, 30, 39, 40) if runs.contains(o)] == [10, 19, 30, 39]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 200), st.integers(1, 10)), max_size=60), st.integers(0, 220))
def test_runs_hold_exactly_the_offsets_added_above_the_point(adds, point):
    """Property: against a plain set, whatever the order of adds; runs stay sorted, disjoint and non-adjacent."""
    runs, plain = OffsetRuns(), set()
    for start, length in adds:
        runs.add_run(start, start + length)
        plain.update(range(start, start + length))
    runs.advance(point)
    plain = {o for o in plain if o >= point}
    assert {o for s, e in runs.runs() for o in range(s, e)} == plain
    pairs = runs.runs()
    assert all(e1 < s2 for (_s1, e1), (s2, _e2) in zip(pairs, pairs[1:], strict=False))


def test_metadata_round_trips_the_done_offsets_beyond_the_point():
    # Read 100..119; not done: 100, 105-106, 118. Done: the rest.
    text = encode(100, [(100, 101), (105, 107), (118, 119)], 120, 4000)
    assert text is not None and text.startswith(PREFIX)
    assert decode(text, 100).runs() == [(101, 105), (107, 118), (119, 120)]
    assert done_count(text, 100) == 16


def test_nothing_done_beyond_the_point_is_an_empty_metadata():
    assert encode(100, [], 100, 4000) == ""
    assert not decode("", 100)


@settings(max_examples=100, deadline=None)
@given(st.sets(st.integers(0, 5000), max_size=400), st.integers(1, 300))
def test_metadata_round_trips_any_pending_set(pending_offsets, tail):
    point = 1_000_000
    pending = sorted(point + o for o in pending_offsets | {0})
    end = pending[-1] + tail
    runs = OffsetRuns()
    for o in pending:
        runs.add(o)
    text = encode(point, runs.runs(), end, 1_000_000)
    assert text is not None
    done = decode(text, point)
    assert {o for o in range(point, end) if done.contains(o)} == set(range(point, end)) - set(pending)


def test_metadata_at_its_size_limit_fits_and_one_run_more_falls_back():
    """Every other offset not done: the worst case per offset. The largest list that fits is encoded within the
    bound; one run more returns None (commit without metadata, counted by the caller)."""
    limit = 4000
    n = 1
    while encode(0, [(2 * i, 2 * i + 1) for i in range(n + 1)], 2 * (n + 1), limit) is not None:
        n += 1
    fits = encode(0, [(2 * i, 2 * i + 1) for i in range(n)], 2 * n, limit)
    assert fits is not None and len(fits) <= limit
    assert encode(0, [(2 * i, 2 * i + 1) for i in range(n + 1)], 2 * (n + 1), limit) is None
    assert len(decode(fits, 0)) == n  # the done offsets between them, all there
    assert n > 1000  # about 1,450 interleaved runs fit 4000 bytes


def test_metadata_disabled_or_too_small_falls_back():
    assert encode(0, [(0, 1)], 5, 0) == ""  # disabled: nothing carried (the caller commits without)
    assert encode(0, [(0, 1), (2, 3)], 5, 6) is None


def test_metadata_not_ours_is_ignored_and_ours_malformed_is_an_error():
    assert not decode("some other tool's note", 10)
    with pytest.raises(MetadataError):
        decode(PREFIX + "!!!", 10)
    with pytest.raises(MetadataError):
        decode(PREFIX + "gA", 10)  # a number cut short
    assert done_count(PREFIX + "gA", 10) == 0


def test_a_held_partition_is_committed_again_at_most_once_per_interval_while_its_done_offsets_grow():
    clock = FakeClock()
    refresh = MetadataRefresh(clock, interval_s=1.0)
    assert refresh.due({TP: 0}) == []  # nothing done beyond: nothing to say
    assert refresh.due({TP: 5}) == [TP]
    refresh.sent(TP, 5)
    assert refresh.due({TP: 9}) == []  # too soon
    clock.now += 1.0
    assert refresh.due({TP: 5}) == []  # unchanged
    assert refresh.due({TP: 9}) == [TP]
    refresh.forget(TP)
    assert refresh.due({TP: 9}) == [TP]


def test_a_partition_sought_to_a_commit_with_metadata_skips_the_listed_offsets_then_forgets_them():
    done: dict[tuple[str, int], OffsetRuns] = {}
    done_after(done, TP, 10, encode(10, [(10, 11), (13, 14)], 15, 4000))  # done: 11, 12, 14
    assert [o for o in range(10, 17) if read_already_done(done, TP, o)] == [11, 12, 14]
    assert TP not in done  # read past its end: no more cost per message


def test_metadata_that_does_not_decode_is_redone_not_trusted():
    done: dict[tuple[str, int], OffsetRuns] = {TP: OffsetRuns([(1, 2)])}
    done_after(done, TP, 10, PREFIX + "gA")
    assert done == {}


def test_a_partitions_list_is_encoded_at_most_once_per_interval_and_always_in_a_final_commit():
    from worker.partitions.donemeta import CommitMetadata
    from worker.partitions.offsets import OffsetTracker

    clock = FakeClock()
    tracker = OffsetTracker()
    for o in range(10):
        tracker.track(TP, o)
    tracker.mark_done(TP, 5)
    meta = CommitMetadata(clock, 4000, interval_s=1.0)
    points: dict[tuple[str, int], int] = {}
    first = meta.for_commit(points, tracker, lambda tp: True)
    assert points == {TP: 0} and done_count(first[TP], 0) == 1  # the held partition, committed again with its list
    tracker.mark_done(TP, 6)
    points = {}
    assert meta.for_commit(points, tracker, lambda tp: True) == {} and points == {}  # within the interval
    points = {}
    final = meta.for_commit(points, tracker, lambda tp: True, final=True)
    assert points == {TP: 0} and done_count(final[TP], 0) == 2  # a final commit says everything
