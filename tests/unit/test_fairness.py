"""Fair reading within a class (worker.reading.fairness), the pure policy on a fake clock: which partitions are held so
that the partitions of a class with a backlog in Kafka are read at the same pace, whatever order the consumer serves
them in."""

from __future__ import annotations

from collections import deque

import pytest

from worker.config import BatchingSettings
from worker.frames import TP, Priority
from worker.reading.fairness import CHUNK_BATCHES, FAIR_PERIOD_S, RATE_WINDOW_S, STUCK_S, PartitionFairness
from worker.testing import FakeClock

BULK_TOPIC, STD_TOPIC = "frames.bulk", "frames.standard"
BATCH = 32
CHUNK = CHUNK_BATCHES * BATCH  # at low read rates the chunk is two batches
TURN_S = 0.01


def class_of(tp: TP) -> Priority:
    return Priority.BULK if tp[0] == BULK_TOPIC else Priority.STANDARD


def bulk(*partitions: int) -> list[TP]:
    return [(BULK_TOPIC, p) for p in partitions]


def policy() -> tuple[PartitionFairness, FakeClock]:
    clock = FakeClock()
    return PartitionFairness(BatchingSettings(max_batch_size=BATCH), clock), clock


def test_a_partition_read_a_chunk_ahead_of_its_siblings_is_held_until_they_catch_up() -> None:
    fair, clock = policy()
    backlog = dict.fromkeys(bulk(0, 1, 2), 1000)
    assert fair.decide(backlog, class_of, set()).held == frozenset()
    fair.record_read({(BULK_TOPIC, 0): CHUNK}, class_of)
    clock.advance(TURN_S)
    assert fair.decide(backlog, class_of, set()).held == {(BULK_TOPIC, 0)}
    fair.record_read({(BULK_TOPIC, 1): CHUNK}, class_of)
    clock.advance(TURN_S)
    assert fair.decide(backlog, class_of, set()).held == {(BULK_TOPIC, 0), (BULK_TOPIC, 1)}
    fair.record_read({(BULK_TOPIC, 2): CHUNK // 2 + 1}, class_of)
    clock.advance(TURN_S)
    assert fair.decide(backlog, class_of, set()).held == frozenset()  # less than half a chunk ahead: read again


def test_polls_take_at_most_a_chunk_while_a_reading_class_has_partitions_to_keep_level() -> None:
    fair, _clock = policy()
    assert fair.decide(dict.fromkeys(bulk(0, 1), 1000), class_of, set()).poll_limit == CHUNK
    # One backlogged partition has nobody to keep level with; a paused class reads nothing anyway.
    assert fair.decide({(BULK_TOPIC, 0): 1000, (BULK_TOPIC, 1): 0}, class_of, set()).poll_limit is None
    assert fair.decide(dict.fromkeys(bulk(0, 1), 1000), class_of, {Priority.BULK}).poll_limit is None


def test_the_chunk_grows_with_the_class_read_rate() -> None:
    fair, clock = policy()
    backlog = dict.fromkeys(bulk(0, 1), 10_000)
    for _ in range(int(RATE_WINDOW_S / TURN_S) + 1):  # 200 frames a turn: 20,000 frames/s
        fair.decide(backlog, class_of, set())
        fair.record_read({(BULK_TOPIC, 0): 100, (BULK_TOPIC, 1): 100}, class_of)
        clock.advance(TURN_S)
    limit = fair.decide(backlog, class_of, set()).poll_limit
    assert limit is not None and limit == pytest.approx(20_000 * FAIR_PERIOD_S / 2, rel=0.05)


def test_a_partition_with_nothing_left_in_kafka_holds_nobody() -> None:
    fair, clock = policy()
    fair.record_read({(BULK_TOPIC, 0): 5 * CHUNK}, class_of)
    clock.advance(TURN_S)
    # Partition 1 read nothing because it has nothing to read: partition 0 reads on.
    assert fair.decide({(BULK_TOPIC, 0): 1000, (BULK_TOPIC, 1): 0}, class_of, set()).held == frozenset()


def test_classes_are_kept_fair_apart() -> None:
    fair, clock = policy()
    backlog = {**dict.fromkeys(bulk(0, 1), 1000), (STD_TOPIC, 0): 1000}
    fair.record_read({(BULK_TOPIC, 0): CHUNK, (STD_TOPIC, 0): 10 * CHUNK}, class_of)
    clock.advance(TURN_S)
    # Standard's only partition is ahead of nobody; bulk-0 is ahead of bulk-1.
    assert fair.decide(backlog, class_of, set()).held == {(BULK_TOPIC, 0)}


def test_a_partition_that_was_idle_gets_no_credit_for_its_idle_time() -> None:
    fair, clock = policy()
    fair.decide({(BULK_TOPIC, 0): 1000, (BULK_TOPIC, 1): 0}, class_of, set())
    fair.record_read({(BULK_TOPIC, 0): 100 * CHUNK}, class_of)
    clock.advance(TURN_S)
    fair.decide({(BULK_TOPIC, 0): 1000, (BULK_TOPIC, 1): 0}, class_of, set())
    # Partition 1 gets a backlog now: it starts level with partition 0, which is not held for 100 chunks.
    clock.advance(TURN_S)
    assert fair.decide(dict.fromkeys(bulk(0, 1), 1000), class_of, set()).held == frozenset()
    fair.record_read({(BULK_TOPIC, 0): CHUNK}, class_of)
    clock.advance(TURN_S)
    assert fair.decide(dict.fromkeys(bulk(0, 1), 1000), class_of, set()).held == {(BULK_TOPIC, 0)}


def test_a_partition_waiting_for_its_committed_offset_holds_nobody() -> None:
    fair, clock = policy()
    fair.record_read({(BULK_TOPIC, 0): 10 * CHUNK}, class_of)
    clock.advance(TURN_S)
    assert fair.decide(dict.fromkeys(bulk(0, 1), 1000), class_of, set(),
                       unreadable={(BULK_TOPIC, 1)}).held == frozenset()


def test_a_partition_that_reads_nothing_while_it_could_stops_holding_its_siblings() -> None:
    fair, clock = policy()
    backlog = dict.fromkeys(bulk(0, 1), 1000)
    fair.decide(backlog, class_of, set())
    fair.record_read({(BULK_TOPIC, 0): CHUNK}, class_of)
    clock.advance(TURN_S)
    assert fair.decide(backlog, class_of, set()).held == {(BULK_TOPIC, 0)}
    # Partition 1 (its leader away, say) reads nothing though it could: partition 0 waits STUCK_S at most.
    waited = 0.0
    while fair.decide(backlog, class_of, set()).held:
        clock.advance(TURN_S)
        waited += TURN_S
        assert waited <= STUCK_S + 2 * TURN_S
    assert waited >= STUCK_S - 2 * TURN_S


def test_time_its_class_is_paused_does_not_make_a_partition_stuck() -> None:
    fair, clock = policy()
    backlog = dict.fromkeys(bulk(0, 1), 1000)
    fair.decide(backlog, class_of, set())
    fair.record_read({(BULK_TOPIC, 0): CHUNK}, class_of)
    for _ in range(int(3 * STUCK_S / TURN_S)):  # bulk paused for priority: nobody reads
        clock.advance(TURN_S)
        fair.decide(backlog, class_of, {Priority.BULK})
    clock.advance(TURN_S)
    assert fair.decide(backlog, class_of, set()).held == {(BULK_TOPIC, 0)}


def test_a_revoked_partition_is_forgotten() -> None:
    fair, clock = policy()
    fair.record_read({(BULK_TOPIC, 0): 10 * CHUNK}, class_of)
    clock.advance(TURN_S)
    assert fair.decide(dict.fromkeys(bulk(0, 1), 1000), class_of, set()).held == {(BULK_TOPIC, 0)}
    clock.advance(TURN_S)
    assert fair.decide(dict.fromkeys(bulk(0), 1000), class_of, set()).held == frozenset()


class LowestFirstConsumer:
    """A class's partitions as the consumer serves them under overload: each partition gets one frame a turn
    (capture time = now), and a poll reads up to `room` frames, the lowest-numbered unpaused partition first (as
    librdkafka's fetch queue can favour some), or none while the class is paused (backpressure)."""

    def __init__(self, partitions: int) -> None:
        self.unread: dict[TP, deque[float]] = {tp: deque() for tp in bulk(*range(partitions))}

    def arrive(self, now: float) -> None:
        for q in self.unread.values():
            q.append(now)

    def poll(self, room: int, held: frozenset[TP]) -> dict[TP, int]:
        read: dict[TP, int] = {}
        for tp, q in sorted(self.unread.items()):
            if tp in held:
                continue
            n = min(room, len(q))
            for _ in range(n):
                q.popleft()
            read[tp], room = n, room - n
        return read

    def head_waits(self, now: float) -> list[float]:
        """How long each partition's oldest unread frame has waited."""
        return [now - q[0] if q else 0.0 for q in self.unread.values()]


def run_overload(fair: PartitionFairness | None, clock: FakeClock, turns: int) -> float:
    """Six partitions, each sending a frame a turn, read at 4 frames a turn in bursts: the class is read for one
    turn in 25 (a resume after backpressure) with room for 100 frames. The largest spread between the partitions'
    oldest unread frames (longest wait minus shortest) over the run's second half."""
    consumer = LowestFirstConsumer(6)
    spread = 0.0
    for turn in range(turns):
        clock.advance(TURN_S)
        consumer.arrive(clock())
        reading = turn % 25 == 0
        paused = set() if reading else {Priority.BULK}
        backlog = {tp: len(q) for tp, q in consumer.unread.items()}
        held, limit = frozenset[TP](), None
        if fair is not None:
            decision = fair.decide(backlog, class_of, paused)
            held, limit = decision.held, decision.poll_limit
        if reading:
            room = 100 if limit is None else min(100, limit)
            read = consumer.poll(room, held)
            if fair is not None:
                fair.record_read(read, class_of)
        if turn >= turns // 2:
            waits = consumer.head_waits(clock())
            spread = max(spread, max(waits) - min(waits))
    return spread


def test_under_a_sustained_overload_no_partitions_oldest_frame_waits_much_longer_than_its_siblings() -> None:
    fair, clock = policy()
    turns = 20_000  # 200 s
    spread = run_overload(fair, clock, turns)
    # Bound: a partition is held once a chunk ahead, and the poll that got it there took at most a chunk, so read
    # counts differ by 2 chunks at most; at a frame a turn per partition, that is 2 chunks of turns between the
    # partitions' oldest unread frames, plus the burst period.
    bound_s = (2 * CHUNK + 25) * TURN_S
    assert spread <= bound_s
    # Without the policy, the lowest-numbered partitions take every burst and the others' waits grow all run long.
    assert run_overload(None, FakeClock(), turns) > 10 * bound_s
