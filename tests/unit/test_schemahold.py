"""The hold-and-retry policy of frames waiting for their writer schema (worker/kafka/schemahold.py), on a fake clock:
transient failures hold and retry with backoff, permanent ones make dead letters, framed frames keep their order
on each partition while unframed ones are never held, and a partition holding the byte bound is paused while the
others read on."""

from __future__ import annotations

from worker.kafka.schemahold import LookupState, Released, SchemaHold
from worker.testing.clock import FakeClock

A, B = ("frames.standard", 0), ("frames.standard", 1)
SCHEMA = {"type": "record", "name": "Frame", "fields": []}


def policy(clock: FakeClock, held_bytes_max: int = 1000, passed_frames_max: int = 100) -> SchemaHold[str]:
    return SchemaHold(held_bytes_max, passed_frames_max, clock, backoff_initial_s=0.5, backoff_max_s=4.0,
                      permanent_retry_s=30.0)


def read(hold: SchemaHold[str], tp: tuple[str, int], message: str, schema_id: int | None, nbytes: int = 10) -> bool:
    """What the consumer does with each message (worker.kafka.schemalookups.HeldFrames.admit): hold it when the
    policy says so; True when held."""
    if hold.must_hold(tp, schema_id):
        assert schema_id is not None, "an unframed message held"
        hold.hold(tp, message, nbytes, schema_id)
        return True
    if schema_id is None:
        hold.passed(tp)
    return False


def test_a_frame_with_an_unknown_id_is_held_and_its_id_looked_up_once() -> None:
    hold = policy(FakeClock())
    assert read(hold, A, "a0", 7)
    assert read(hold, A, "a1", 7)
    assert hold.due_lookups() == [7]
    assert hold.due_lookups() == []  # asking: not asked twice
    assert hold.release() == []
    assert hold.held_frames == 2


def test_frames_of_a_known_id_and_unframed_frames_are_not_held() -> None:
    hold = policy(FakeClock())
    hold.hold(A, "a0", 10, 7)
    hold.due_lookups()
    hold.found(7, SCHEMA)
    hold.release()
    assert not hold.must_hold(B, 7)
    assert not hold.must_hold(B, None)
    assert hold.schema(7) is SCHEMA


def test_a_transient_failure_holds_the_frames_and_asks_again_after_the_backoff() -> None:
    clock = FakeClock()
    hold = policy(clock)
    read(hold, A, "a0", 7)
    assert hold.due_lookups() == [7]
    hold.failed(7, "the Schema Registry could not be reached (ReadTimeout)", transient=True)
    assert hold.state(7) is LookupState.RETRYING
    assert hold.release() == []  # held, never a dead letter for it
    assert not read(hold, A, "u0", None)  # an unframed frame of the partition flows while it retries
    assert read(hold, A, "a1", 7)
    clock.advance(0.4)
    assert hold.due_lookups() == []
    clock.advance(0.1)
    assert hold.due_lookups() == [7]
    hold.found(7, SCHEMA)
    assert [r.message for r in hold.release()] == ["a0", "a1"]


def test_the_backoff_doubles_from_its_initial_wait_up_to_its_cap() -> None:
    clock = FakeClock()
    hold = policy(clock)
    read(hold, A, "a0", 7)
    assert hold.due_lookups() == [7]
    waits = []
    for _ in range(6):
        hold.failed(7, "HTTP 503 (unavailable)", transient=True)
        start = clock.now
        while not hold.due_lookups():
            clock.advance(0.25)
        waits.append(clock.now - start)
    assert waits == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert hold.held_frames == 1 and hold.release() == []


def test_when_the_id_becomes_known_the_held_frames_are_released_in_order() -> None:
    hold = policy(FakeClock())
    for i in range(5):
        read(hold, A, f"a{i}", 7)
    hold.due_lookups()
    hold.failed(7, "unreachable", transient=True)
    hold.found(7, SCHEMA)
    assert hold.release() == [Released(f"a{i}", None) for i in range(5)]
    assert hold.held_frames == 0 and not hold.held_partitions


def test_unframed_frames_of_a_holding_partition_pass_while_its_framed_frames_keep_their_order() -> None:
    hold = policy(FakeClock())
    hold.found(3, SCHEMA)  # a known id
    assert read(hold, A, "a0", 7)
    assert not read(hold, A, "a1", None)  # unframed: needs no registry, flows on past the held frame
    assert read(hold, A, "a2", 3)  # framed with a known id, but behind a held framed frame of its partition
    assert not read(hold, A, "a3", None)
    assert not read(hold, B, "b0", None)  # another partition flows
    assert not read(hold, B, "b1", 3)
    assert hold.held_frames == 2 and hold.held_partitions == {A}
    hold.due_lookups()
    hold.found(7, SCHEMA)
    assert [r.message for r in hold.release()] == ["a0", "a2"]
    assert not read(hold, A, "a4", 3)  # nothing held: a framed frame with a known id flows again


def test_a_queue_is_released_only_up_to_its_first_frame_still_waiting() -> None:
    hold = policy(FakeClock())
    read(hold, A, "a0", 7)
    read(hold, A, "a1", 8)
    read(hold, A, "a2", 7)
    assert sorted(hold.due_lookups()) == [7, 8]
    hold.found(8, SCHEMA)
    assert hold.release() == []  # a1's id is known, but a0 still waits: order first
    hold.found(7, SCHEMA)
    assert [r.message for r in hold.release()] == ["a0", "a1", "a2"]


def test_a_permanent_failure_releases_the_frames_as_dead_letters_with_the_reason() -> None:
    hold = policy(FakeClock())
    hold.found(3, SCHEMA)
    read(hold, A, "a0", 9)
    read(hold, A, "a1", 3)
    hold.due_lookups()
    hold.failed(9, "registry schema id 9 is unknown to the Schema Registry", transient=False)
    assert hold.release() == [Released("a0", "registry schema id 9 is unknown to the Schema Registry"),
                              Released("a1", None)]
    # Later frames with the id are not held: the consumer dead-letters them at once with the same reason.
    assert not hold.must_hold(B, 9)
    assert hold.failure(9) == "registry schema id 9 is unknown to the Schema Registry"


def test_a_frame_with_a_failed_id_read_behind_a_held_one_is_dead_lettered_in_its_turn() -> None:
    hold = policy(FakeClock())
    read(hold, A, "b9", 9)
    hold.due_lookups()
    hold.failed(9, "unknown id", transient=False)
    hold.release()
    assert read(hold, A, "a0", 7)
    assert read(hold, A, "a1", 9)  # its id failed, but a0 comes first
    hold.due_lookups()
    assert hold.release() == []
    hold.found(7, SCHEMA)
    assert hold.release() == [Released("a0", None), Released("a1", "unknown id")]


def test_a_permanent_failure_is_asked_again_once_its_memory_runs_out() -> None:
    clock = FakeClock()
    hold = policy(clock)
    read(hold, A, "a0", 9)
    hold.due_lookups()
    hold.failed(9, "unknown id", transient=False)
    hold.release()
    clock.advance(29.9)
    assert not hold.must_hold(A, 9)
    clock.advance(0.1)
    assert read(hold, A, "a1", 9)  # registered since, perhaps: asked once more
    assert hold.due_lookups() == [9]


def test_a_partition_holding_the_byte_bound_is_paused_until_released() -> None:
    hold = policy(FakeClock(), held_bytes_max=100)
    read(hold, A, "a0", 7, nbytes=60)
    read(hold, B, "b0", 7, nbytes=10)
    assert hold.paused == frozenset()
    read(hold, A, "a1", 7, nbytes=40)
    assert hold.paused == {A}  # 100 bytes held; B, holding 10, reads on
    assert hold.held_bytes(A) == 100
    hold.due_lookups()
    hold.found(7, SCHEMA)
    hold.release()
    assert hold.paused == frozenset() and hold.held_bytes(A) == 0


def test_the_byte_bound_counts_held_framed_bytes_only() -> None:
    hold = policy(FakeClock(), held_bytes_max=100)
    read(hold, A, "a0", 7, nbytes=60)
    for i in range(10):
        assert not read(hold, A, f"u{i}", None, nbytes=60)  # unframed frames pass: not held, not counted
    assert hold.held_bytes(A) == 60 and hold.paused == frozenset()
    read(hold, A, "a1", 3, nbytes=40)  # framed behind a0 (its id unknown too): held and counted
    assert hold.paused == {A}


def test_a_partition_past_whose_held_frames_the_bound_of_unframed_frames_flowed_is_paused_until_released() -> None:
    hold = policy(FakeClock(), passed_frames_max=3)
    for i in range(5):
        read(hold, B, f"b{i}", None)  # a partition that holds nothing: its unframed frames count for nothing
    read(hold, A, "a0", 7)
    read(hold, A, "u0", None)
    read(hold, A, "u1", None)
    assert hold.paused == frozenset() and hold.pinned_frames == 3
    read(hold, A, "u2", None)
    assert hold.paused == {A}  # three answered past a0, none committable until a0 is: read no further
    assert hold.pinned_frames == 4
    hold.due_lookups()
    hold.found(7, SCHEMA)
    hold.release()
    assert hold.paused == frozenset() and hold.pinned_frames == 0
    read(hold, A, "a1", 8)
    read(hold, A, "u3", None)
    assert hold.pinned_frames == 2 and hold.paused == frozenset()  # counted afresh from the new hold
    assert hold.drop([A]) == 1 and hold.pinned_frames == 0


def test_a_dropped_partition_forgets_its_held_frames_and_nothing_asks_for_their_id() -> None:
    clock = FakeClock()
    hold = policy(clock)
    read(hold, A, "a0", 7)
    read(hold, A, "a1", 7)
    read(hold, B, "b0", 8)
    hold.due_lookups()
    hold.failed(7, "unreachable", transient=True)
    hold.failed(8, "unreachable", transient=True)
    assert hold.drop([A]) == 2
    assert hold.held_frames == 1 and hold.held_partitions == {B}
    clock.advance(10)
    assert hold.due_lookups() == [8]  # 7: nothing waits for it any more
    assert hold.waiting_ids == {8: 1}

