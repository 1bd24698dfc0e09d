"""The commit point of a partition never passes a frame that is not done."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.partitions.offsets import OffsetTracker, OffsetTrackingError

TP = ("frames.standard", 0)


def test_nothing_tracked_gives_no_commit_point():
    assert OffsetTracker().commit_points() == {}


def test_commit_point_is_next_offset_after_contiguous_done_prefix():
    t = OffsetTracker()
    for o in range(5):
        t.track(TP, o)
    t.mark_done(TP, 0)
    t.mark_done(TP, 1)
    t.mark_done(TP, 3)
    assert t.commit_points() == {TP: 2}


def test_out_of_order_completion_waits_for_the_gap():
    t = OffsetTracker()
    for o in (10, 11, 12):
        t.track(TP, o)
    t.mark_done(TP, 12)
    t.mark_done(TP, 11)
    assert t.commit_points() == {TP: 10}
    t.mark_done(TP, 10)
    assert t.commit_points() == {TP: 13}


def test_committed_point_is_not_offered_again():
    t = OffsetTracker()
    t.track(TP, 0)
    t.mark_done(TP, 0)
    points = t.commit_points()
    t.mark_committed(points)
    assert t.commit_points() == {}


def test_marking_an_untracked_offset_is_a_bug():
    t = OffsetTracker()
    t.track(TP, 0)
    with pytest.raises(OffsetTrackingError):
        t.mark_done(TP, 1)
    with pytest.raises(OffsetTrackingError):
        t.track(TP, 0)


def test_an_offset_read_again_after_it_was_done_is_a_bug():
    """A re-delivery (a message from before a rebalance) would get a second result: refuse it."""
    t = OffsetTracker()
    for o in (3, 4):
        t.track(TP, o)
    t.mark_done(TP, 3)
    with pytest.raises(OffsetTrackingError, match="read again"):
        t.track(TP, 3)
    with pytest.raises(OffsetTrackingError):
        t.track(TP, 2)
    t.track(TP, 7)  # gaps (transaction markers, compaction) are normal


def test_a_forgotten_partition_may_be_read_again_from_anywhere():
    t = OffsetTracker()
    t.track(TP, 9)
    t.forget(TP)
    t.track(TP, 2)
    assert t.commit_points() == {TP: 2}


def test_forget_drops_a_revoked_partition():
    t = OffsetTracker()
    t.track(TP, 0)
    t.track(("x", 1), 5)
    assert t.forget(TP) == 1
    assert t.in_flight(TP) == 0
    assert t.in_flight() == 1
    assert t.commit_points() == {("x", 1): 5}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 60), min_size=1, max_size=60, unique=True), st.randoms(use_true_random=False))
def test_commit_point_never_passes_an_unfinished_offset(offsets, rnd):
    """Property: after any completion order, the commit point is the smallest unfinished offset
    (or one past the highest read when all are done)."""
    t = OffsetTracker()
    offsets = sorted(offsets)
    for o in offsets:
        t.track(TP, o)
    order = offsets[:]
    rnd.shuffle(order)
    done: set[int] = set()
    for o in order:
        t.mark_done(TP, o)
        done.add(o)
        pending = [x for x in offsets if x not in done]
        expected = min(pending) if pending else max(offsets) + 1
        assert t.commit_points().get(TP, None) == expected


def test_uncommitted_counts_from_the_first_offset_read_then_from_each_confirmed_commit():
    t = OffsetTracker()
    for o in range(100, 110):
        t.track(TP, o)
    assert t.uncommitted() == 10  # nothing committed yet: a re-reading starts at 100
    for o in range(100, 106):
        t.mark_done(TP, o)
    assert t.uncommitted() == 10  # done is not committed
    t.mark_committed(t.commit_points())
    assert t.uncommitted() == 10  # requested is not confirmed either
    t.commit_confirmed({TP: 106})
    assert t.uncommitted() == 4
    t.commit_confirmed({TP: 103})  # an older confirmation, reported late
    assert t.uncommitted() == 4
    t.forget(TP)
    assert t.uncommitted() == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["track", "done", "confirm", "forget"]), st.sampled_from([TP, ("x", 1)]),
                          st.integers(0, 4)), max_size=80))
def test_in_flight_and_uncommitted_totals_stay_the_sums_over_partitions(ops):
    """Property: kept as running totals, both still equal what the partitions hold, whatever happens in between."""
    t = OffsetTracker()
    reread: dict[tuple[str, int], int] = {}
    highest: dict[tuple[str, int], int] = {}
    flying: dict[tuple[str, int], list[int]] = {}
    for op, tp, k in ops:
        if op == "track":
            offset = highest.get(tp, -1) + 1 + k  # gaps: offsets of transaction markers, compacted records
            t.track(tp, offset)
            reread.setdefault(tp, offset)
            highest[tp] = offset
            flying.setdefault(tp, []).append(offset)
        elif op == "done" and flying.get(tp):
            t.mark_done(tp, flying[tp].pop(k % len(flying[tp])))
        elif op == "confirm" and tp in reread:
            point = reread[tp] + k - 1  # sometimes an older confirmation, reported late
            t.commit_confirmed({tp: point})
            reread[tp] = max(reread[tp], point)
        elif op == "forget":
            assert t.forget(tp) == len(flying.pop(tp, []))
            reread.pop(tp, None)
            highest.pop(tp, None)
        assert t.in_flight() == sum(len(f) for f in flying.values())
        assert t.uncommitted() == sum(highest[p] + 1 - reread[p] for p in reread)
        assert t.done_beyond() == sum(highest[p] + 1 - min(f) - len(f) for p, f in flying.items() if f)
        assert t.held() + t.done_beyond() == t.uncommitted()


def test_done_beyond_counts_answered_offsets_held_behind_the_commit_point_and_held_the_rest():
    t = OffsetTracker()
    for o in range(10):
        t.track(TP, o)
    for o in range(1, 10):
        t.mark_done(TP, o)
    assert (t.in_flight(), t.done_beyond(), t.held()) == (1, 9, 1)
    assert t.done_beyond(TP) == 9
    t.mark_done(TP, 0)
    assert (t.done_beyond(), t.held()) == (0, 10)  # all committable now: held until a commit is confirmed
    t.commit_confirmed(t.commit_points())
    assert (t.done_beyond(), t.held(), t.uncommitted()) == (0, 0, 0)


def test_done_runs_lists_the_offsets_not_done_from_the_commit_point():
    t = OffsetTracker()
    for o in range(100, 110):
        t.track(TP, o)
    for o in (101, 102, 105, 107, 108, 109):
        t.mark_done(TP, o)
    assert t.done_runs(TP) == (100, [(100, 101), (103, 105), (106, 107)], 110)


def test_an_offset_already_done_is_read_as_done_and_committed_past():
    t = OffsetTracker()
    t.track(TP, 5)
    t.track_done(TP, 6)
    t.track_done(TP, 7)
    assert (t.in_flight(), t.done_beyond()) == (1, 2)
    t.mark_done(TP, 5)
    assert t.commit_points() == {TP: 8}
    with pytest.raises(OffsetTrackingError):
        t.track_done(TP, 7)
