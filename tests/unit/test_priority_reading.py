"""Reading by priority (worker.reading.priority), the pure policy on a fake clock: which classes are paused so
that a more urgent class's backlog in Kafka is read first, the floor the paused classes keep, and when a backlog is past
saving."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from worker.config import BatchingSettings, ClassSettings
from worker.frames import Priority
from worker.reading.priority import (
    BACKLOG_S,
    FLOOR_PERIOD_S,
    FLOOR_WINDOW_S,
    NEAR_DEADLINE,
    PERSIST_S,
    RATE_WINDOW_S,
    PriorityReading,
    PriorityReadingDecision,
)
from worker.testing import FakeClock

RT, STD, BULK = Priority.REALTIME, Priority.STANDARD, Priority.BULK
TURN_S = 0.01
BATCH = 32  # batching.max_batch_size below: the smallest backlog that counts


def settings(floor: float = 0.0, realtime_max_age_ms: float = 2_000, standard_max_age_ms: float = 30_000
             ) -> BatchingSettings:
    return BatchingSettings(max_batch_size=BATCH, lower_class_read_floor=floor,
                            realtime=ClassSettings(5, realtime_max_age_ms, 8, 250, 1.0),
                            standard=ClassSettings(15, standard_max_age_ms, 3, 1_000, 0.5))


class Loop:
    """Drives the policy as the pipeline does each turn: decide on the backlogs, then report one poll."""

    def __init__(self, batching: BatchingSettings | None = None) -> None:
        self.clock = FakeClock()
        self.policy = PriorityReading(batching or settings(), self.clock)
        self.decision = PriorityReadingDecision()

    def turn(self, backlog: Mapping[Priority, int], read: Mapping[Priority, int] | None = None,
             drained: bool | None = False, late: Mapping[Priority, int] | None = None,
             age_s: Mapping[Priority, float] | None = None) -> PriorityReadingDecision:
        self.decision = self.policy.decide(backlog)
        read = read or {}
        oldest = {p: self.clock.now - (age_s or {}).get(p, 0.0) for p in read if read[p]}
        self.policy.record_read(read, late or {}, oldest, drained)
        self.clock.now += TURN_S
        return self.decision

    def turns(self, seconds: float, backlog: Mapping[Priority, int], read: Mapping[Priority, int] | None = None,
              drained: bool | None = False, late: Mapping[Priority, int] | None = None,
              age_s: Mapping[Priority, float] | None = None) -> list[PriorityReadingDecision]:
        return [self.turn(backlog, read, drained, late, age_s) for _ in range(round(seconds / TURN_S))]


def measured(loop: Loop, rate: float) -> None:
    """Two busy rate windows reading a realtime backlog at `rate` messages a second."""
    per_turn = round(rate * TURN_S)
    loop.turns(2 * RATE_WINDOW_S + 2 * TURN_S, {RT: 100_000}, {RT: per_turn})
    assert loop.policy.rate == pytest.approx(rate, rel=0.05)


def quiet(loop: Loop) -> None:
    """Turns with nothing in Kafka: every backlog is over."""
    loop.turns(0.1, {}, {}, drained=True)
    assert loop.policy.backlogged == frozenset()


# -- what pauses, what does not -----------------------------------------------------------------------------------
def test_a_steady_stream_within_capacity_pauses_nothing() -> None:
    """The worker reads what arrives at each poll (polls come back short); a few frames seen in Kafka between two
    polls are no backlog."""
    loop = Loop()
    decisions = loop.turns(5.0, {RT: 40, STD: 60, BULK: 80}, {RT: 4, STD: 6, BULK: 8}, drained=True)
    assert all(d == PriorityReadingDecision() for d in decisions)
    assert loop.policy.backlogged == frozenset()


def test_a_realtime_backlog_while_the_worker_is_behind_pauses_standard_and_bulk() -> None:
    loop = Loop()
    decisions = loop.turns(PERSIST_S + 2 * TURN_S, {RT: 500, STD: 500, BULK: 500}, {RT: 50, STD: 50, BULK: 50})
    assert decisions[0].paused == frozenset()  # not before it has lasted PERSIST_S
    assert decisions[-1].paused == {STD, BULK}
    assert loop.policy.backlogged >= {RT}


def test_a_backlog_that_the_next_poll_reads_is_no_backlog() -> None:
    """Between two polls that took everything the consumer had, frames pile up in Kafka for a moment."""
    loop = Loop()
    loop.turns(1.0, {RT: 500, BULK: 500}, {RT: 50, BULK: 50}, drained=True)
    assert loop.decision.paused == frozenset()


def test_a_standard_backlog_pauses_bulk_only() -> None:
    loop = Loop()
    loop.turns(0.2, {RT: 0, STD: 800, BULK: 800}, {STD: 100, BULK: 100})
    assert loop.decision.paused == {BULK}


def test_classes_stay_paused_until_the_backlog_is_below_half_the_threshold() -> None:
    loop = Loop()
    loop.turns(0.2, {RT: 500}, {RT: 50})
    assert loop.decision.paused == {STD, BULK}
    loop.turns(0.2, {RT: BATCH // 2}, {RT: 50})  # at half of it: still a backlog (hysteresis)
    assert loop.decision.paused == {STD, BULK}
    loop.turns(2 * TURN_S, {RT: BATCH // 2 - 1}, {RT: 50})
    assert loop.decision.paused == frozenset()


def test_the_threshold_is_a_batch_or_backlog_s_of_reading_at_the_measured_rate() -> None:
    loop = Loop()
    measured(loop, 10_000)
    quiet(loop)
    threshold = 10_000 * BACKLOG_S
    loop.turns(0.2, {RT: int(threshold) - 1}, {RT: 100})
    assert loop.decision.paused == frozenset()
    loop.turns(0.2, {RT: int(threshold) + 1}, {RT: 100})
    assert loop.decision.paused == {STD, BULK}


def test_the_rate_is_measured_only_while_some_class_has_a_backlog() -> None:
    loop = Loop()
    loop.turns(3 * RATE_WINDOW_S, {RT: 0}, {RT: 10}, drained=True)  # 1000 frames/s arriving, no backlog
    assert loop.policy.rate is None
    measured(loop, 4_000)
    loop.turns(3 * RATE_WINDOW_S, {RT: 0}, {RT: 10}, drained=True)
    assert loop.policy.rate == pytest.approx(4_000, rel=0.05)


def test_polls_of_a_paused_consumer_neither_start_nor_end_a_spell_of_full_polls() -> None:
    """With every partition paused (backpressure) a poll comes back empty: that says nothing about keeping up."""
    loop = Loop()
    loop.turns(0.2, {RT: 500}, {}, drained=None)
    assert loop.decision.paused == frozenset()  # never a full poll
    loop.turns(PERSIST_S, {RT: 500}, {RT: 50})
    loop.turns(0.2, {RT: 500}, {}, drained=None)
    assert loop.decision.paused == {STD, BULK}


def test_a_class_without_a_backlog_in_kafka_pauses_no_one_whatever_the_others_hold() -> None:
    loop = Loop()
    loop.turns(0.5, {RT: 0, STD: 0, BULK: 50_000}, {BULK: 500})
    assert loop.decision.paused == frozenset()


# -- the floor --------------------------------------------------------------------------------------------------
def shares_read(loop: Loop, seconds: float, backlog: Mapping[Priority, int], per_turn: int,
                age_s: Mapping[Priority, float] | None = None) -> dict[Priority, int]:
    """Turns in which every poll takes `per_turn` messages, of the classes not paused, as evenly as it can."""
    got = dict.fromkeys(Priority, 0)
    for _ in range(round(seconds / TURN_S)):
        decision = loop.policy.decide(backlog)
        reading = [p for p in Priority if p not in decision.paused and backlog.get(p, 0)]
        n = min(per_turn, decision.poll_limit or per_turn)
        read = {p: n // len(reading) for p in reading}
        for p, k in read.items():
            got[p] += k
        oldest = {p: loop.clock.now - (age_s or {}).get(p, 0.0) for p in read}
        loop.policy.record_read(read, {}, oldest, False)
        loop.clock.now += TURN_S
    return got


def test_a_class_paused_for_priority_still_reads_its_floor_share() -> None:
    loop = Loop(settings(floor=0.05))
    measured(loop, 5_000)  # realtime's backlog: bulk paused
    got = shares_read(loop, 10.0, {RT: 100_000, BULK: 100_000}, 50)
    share = got[BULK] / sum(got.values())
    assert 0.04 <= share <= 0.05 + BATCH / sum(got.values())
    # and over every FLOOR_WINDOW_S-long span, at most its share and one turn of overshoot
    for _ in range(5):
        got = shares_read(loop, FLOOR_WINDOW_S, {RT: 100_000, BULK: 100_000}, 50)
        assert got[BULK] <= 0.05 * sum(got.values()) + BATCH


def test_a_floor_turn_takes_at_least_a_chunk_and_polls_stay_small_meanwhile() -> None:
    loop = Loop(settings(floor=0.05))
    measured(loop, 5_000)
    resumes = 0
    for _ in range(500):
        before = loop.decision
        loop.turn({RT: 100_000, BULK: 100_000}, {RT: 25, BULK: 25} if BULK not in before.paused else {RT: 50})
        if BULK in before.paused and BULK in loop.decision.floor_reading:
            resumes += 1
            assert loop.decision.poll_limit is not None
            assert loop.decision.poll_limit >= 0.05 * 5_000 * FLOOR_PERIOD_S - 50  # a chunk, less one poll
    # 5 s at 5000 messages/s: the floor is ~1250 of them, read in chunks of ~125: not a resume every turn.
    assert 3 <= resumes <= 15


def test_no_floor_while_a_more_urgent_class_reads_frames_past_half_their_max_age() -> None:
    loop = Loop(settings(floor=0.05))
    measured(loop, 5_000)
    old = {RT: NEAR_DEADLINE * 2.0 + 0.1}
    loop.turn({RT: 100_000, BULK: 100_000}, {RT: 50}, age_s=old)
    got = shares_read(loop, 2 * FLOOR_WINDOW_S, {RT: 100_000, BULK: 100_000}, 50, age_s=old)
    assert got[BULK] == 0
    got = shares_read(loop, 2 * FLOOR_WINDOW_S, {RT: 100_000, BULK: 100_000}, 50)  # realtime read fresh again
    assert got[BULK] > 0


def test_no_floor_while_a_more_urgent_class_expires_frames() -> None:
    loop = Loop(settings(floor=0.05))
    measured(loop, 5_000)
    got = dict.fromkeys(Priority, 0)
    for _ in range(round(2 * FLOOR_WINDOW_S / TURN_S)):
        loop.policy.record_expired({RT: 1})  # frames of it expire waiting for a batch
        decision = loop.turn({RT: 100_000, BULK: 100_000}, {RT: 50})
        got[BULK] += BULK not in decision.paused
    assert got[BULK] == 0


def test_a_floor_of_zero_keeps_paused_classes_paused() -> None:
    loop = Loop(settings(floor=0.0))
    measured(loop, 5_000)
    got = shares_read(loop, 2 * FLOOR_WINDOW_S, {RT: 100_000, BULK: 100_000}, 50)
    assert got[BULK] == 0


# -- a backlog past saving ----------------------------------------------------------------------------------------
def test_a_backlog_nothing_of_which_can_be_read_in_time_holds_no_class_back() -> None:
    """Every realtime frame read for longer than its max_age was already past it, and the rest would take longer
    than max_age to read: lower classes read again; realtime's frames are still read (and answered EXPIRED)."""
    loop = Loop()
    measured(loop, 1_000)
    backlog = {RT: 5_000, STD: 5_000, BULK: 5_000}  # realtime's: 5 s of reading at 1000/s; max_age 2 s
    loop.turns(1.0, backlog, {RT: 10}, late={RT: 10})
    assert loop.decision.paused == {STD, BULK}
    loop.turns(1.2, backlog, {RT: 10}, late={RT: 10})
    assert loop.decision.unservable == {RT}
    assert loop.decision.paused == {BULK}  # standard's backlog still holds bulk back; realtime's holds no one


def test_a_backlog_whose_frames_are_partly_read_in_time_keeps_its_priority() -> None:
    """Just above capacity the oldest frames expire while newer ones are scored: the class is still served."""
    loop = Loop()
    measured(loop, 1_000)
    loop.turns(5.0, {RT: 5_000, BULK: 5_000}, {RT: 10}, late={RT: 9})
    assert loop.decision.unservable == frozenset()
    assert loop.decision.paused == {STD, BULK}


def test_a_backlog_left_by_a_stall_is_read_faster_than_it_expires_and_keeps_its_priority() -> None:
    """Frames read late, but the whole backlog takes less than max_age to read at the measured rate."""
    loop = Loop()
    measured(loop, 5_000)
    loop.turns(3.0, {RT: 9_000, BULK: 5_000}, {RT: 50}, late={RT: 50})
    assert loop.decision.unservable == frozenset()


def test_a_class_without_max_age_is_never_past_saving() -> None:
    loop = Loop(settings(realtime_max_age_ms=0))
    measured(loop, 1_000)
    loop.turns(5.0, {RT: 50_000, BULK: 5_000}, {RT: 10}, late={RT: 10})
    assert loop.decision.unservable == frozenset()
    assert loop.decision.paused == {STD, BULK}


def test_a_class_past_saving_gets_its_priority_back_once_a_frame_is_read_in_time() -> None:
    loop = Loop()
    measured(loop, 1_000)
    loop.turns(2.5, {RT: 5_000, BULK: 5_000}, {RT: 10}, late={RT: 10})
    assert loop.decision.unservable == {RT}
    loop.turns(2 * TURN_S, {RT: 5_000, BULK: 5_000}, {RT: 10}, late={RT: 5})
    assert loop.decision.unservable == frozenset()
    assert loop.decision.paused == {STD, BULK}
