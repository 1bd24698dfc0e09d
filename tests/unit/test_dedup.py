"""A repeated (stream_id, frame_index) within a partition's window is a duplicate; the same offset read again is
not (worker/partitions/dedup.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.frames import DUPLICATE_FRAME
from worker.metrics import DEAD_LETTER_ERROR_TYPES
from worker.partitions.dedup import DuplicateFrames, duplicate_reason

P0 = ("frames.standard", 0)
P1 = ("frames.standard", 1)


def test_a_second_message_with_the_identity_of_a_first_is_a_duplicate_of_its_offset():
    d = DuplicateFrames(window=10)
    assert d.first_offset(P0, ("cam", 7, 0), 100) is None
    assert d.first_offset(P0, ("cam", 8, 0), 101) is None
    assert d.first_offset(P0, ("cam", 7, 0), 102) == 100


def test_the_same_offset_read_again_after_a_rewind_is_not_a_duplicate():
    d = DuplicateFrames(window=10)
    d.first_offset(P0, ("cam", 7, 0), 100)
    d.first_offset(P0, ("cam", 7, 0), 102)
    # The consumer is rewound to 100: the first copy is the frame again, the second still its duplicate.
    assert d.first_offset(P0, ("cam", 7, 0), 100) is None
    assert d.first_offset(P0, ("cam", 7, 0), 102) == 100


def test_partitions_have_windows_of_their_own():
    d = DuplicateFrames(window=10)
    d.first_offset(P0, ("cam", 7, 0), 100)
    assert d.first_offset(P1, ("cam", 7, 0), 5) is None


def test_a_released_partition_starts_again_with_an_empty_window():
    d = DuplicateFrames(window=10)
    d.first_offset(P0, ("cam", 7, 0), 100)
    d.first_offset(P1, ("cam", 7, 0), 5)
    d.drop_partitions([P0])
    assert d.remembered(P0) == 0 and d.remembered(P1) == 1
    assert d.first_offset(P0, ("cam", 7, 0), 102) is None


def test_an_identity_older_than_the_window_is_forgotten():
    d = DuplicateFrames(window=2)
    for offset, index in enumerate((1, 2, 3)):
        d.first_offset(P0, ("cam", index, 0), offset)
    assert d.first_offset(P0, ("cam", 1, 0), 10) is None
    assert d.first_offset(P0, ("cam", 3, 0), 11) == 2


def test_a_replayed_copy_is_not_a_duplicate_of_the_dead_lettered_original_but_a_second_copy_of_it_is():
    d = DuplicateFrames(window=10)
    d.first_offset(P0, ("cam", 7, 0), 100)  # dead-lettered (the model failed on it)
    assert d.first_offset(P0, ("cam", 7, 1), 150) is None  # `worker dlq replay` published it again: scored
    assert d.first_offset(P0, ("cam", 7, 1), 151) == 150  # the same replay twice: the second is a duplicate
    assert d.first_offset(P0, ("cam", 7, 0), 152) == 100  # the producer sending it again still is one too


def test_a_duplicate_replay_names_its_replay_count():
    assert "(replay 2)" in duplicate_reason(("cam", 7, 2), 100)
    assert "replay" not in duplicate_reason(("cam", 7, 0), 100)


def test_window_zero_turns_detection_off():
    d = DuplicateFrames(window=0)
    d.first_offset(P0, ("cam", 7, 0), 100)
    assert d.first_offset(P0, ("cam", 7, 0), 101) is None
    assert d.remembered(P0) == 0


def test_a_negative_window_is_refused():
    with pytest.raises(ValueError):
        DuplicateFrames(window=-1)


# One partition's reads: (identity index, offset). Offsets may repeat (rewinds) and identities recur.
reads = st.lists(st.tuples(st.integers(0, 12), st.integers(0, 40)), max_size=200)


def reference(window: int, events: list[tuple[int, int]]) -> list[int | None]:
    """The specification, spelled out: each identity's first offset, forgotten once `window` newer identities
    have been first seen after it."""
    first: dict[int, int] = {}
    order: list[int] = []
    out: list[int | None] = []
    for ident, offset in events:
        if ident in first:
            out.append(None if first[ident] == offset else first[ident])
            continue
        first[ident] = offset
        order.append(ident)
        if len(order) > window:
            del first[order.pop(0)]
        out.append(None)
    return out


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 8), reads)
def test_answers_match_the_reference_and_the_window_is_bounded(window, events):
    d = DuplicateFrames(window)
    answers = [d.first_offset(P0, ("s", ident, 0), offset) for ident, offset in events]
    assert answers == reference(window, events)
    assert d.remembered(P0) <= window


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 8), reads)
def test_reading_the_same_offset_twice_in_a_row_gives_the_same_answer(window, events):
    """A re-read of a message (rewind) never turns it into a duplicate, nor a duplicate into a frame."""
    d = DuplicateFrames(window)
    for ident, offset in events:
        first = d.first_offset(P0, ("s", ident, 0), offset)
        assert d.first_offset(P0, ("s", ident, 0), offset) == first


@settings(max_examples=200, deadline=None)
@given(reads)
def test_with_a_window_larger_than_the_reads_every_repeat_at_another_offset_is_flagged(events):
    """Nothing lost: no repeat escapes; nothing invented: a new identity or the first offset is never flagged."""
    d = DuplicateFrames(window=1000)
    first: dict[int, int] = {}
    for ident, offset in events:
        answer = d.first_offset(P0, ("s", ident, 0), offset)
        first.setdefault(ident, offset)
        assert answer == (None if first[ident] == offset else first[ident])


def test_a_duplicate_is_dead_lettered_under_a_known_error_type_with_the_first_offset_in_its_reason():
    assert DUPLICATE_FRAME in DEAD_LETTER_ERROR_TYPES
    reason = duplicate_reason(("cam", 7, 0), 100)
    assert "offset 100" in reason and "'cam', 7" in reason
