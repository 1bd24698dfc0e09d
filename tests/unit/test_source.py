"""FrameSource against a scripted consumer: rebalances served inside consume(), and where a partition is read from.

librdkafka runs the rebalance callbacks within consume(), so one call can return messages fetched before a
partition was revoked together with messages of its next assignment (confluent-kafka-python issue #1013). And a
committed offset can be unknown for a while (a dead member's open transaction holds it until the broker aborts
it): such a partition waits, paused, and is never read from its beginning (issue 13). The fake consumer below
scripts both; everything else about the source is tested against the real broker.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from confluent_kafka import OFFSET_BEGINNING, OFFSET_INVALID, KafkaError, KafkaException, TopicPartition

import worker.kafka.consumer as source_module
from worker.config import KafkaSettings, ObservabilitySettings, Settings, load_settings
from worker.errors import OperatorError, StreamferError
from worker.frames import CommitOutcome, Priority
from worker.kafka.committed import COMMITTED_LOOKUP_TIMEOUT_S, COMMITTED_RETRY_FIRST_S
from worker.kafka.consumer import FrameSource
from worker.kafka.membership import REFENCED_WITHIN_S, SourceError
from worker.testing import FakeClock, FakeMessage, frame_value
from worker.testing import FakeConsumer as KitConsumer

REALTIME = Settings().topics.realtime
BULK = Settings().topics.bulk
# A source is made with its worker id resolved (worker.identity), as `worker run` makes it.
SETTINGS = Settings(observability=ObservabilitySettings(worker_id="host-0"))


# One consume() call's script: messages returned, and rebalance callbacks run in between, in order.
Event = tuple[str, Any]


@dataclass
class Answer:
    """One partition of a committed() answer (a TopicPartition whose error can be set)."""

    topic: str
    partition: int
    offset: int
    error: KafkaError | None = None
    metadata: str | None = None


@dataclass
class FakeConsumer:
    """Plays scripted consume() calls; records seeks, pauses and committed() look-ups.

    `committed_offsets` is the group's committed offsets; a partition in `unstable` answers with that error (a
    transaction holds its offset); with `timing_out` every look-up raises a time-out after blocking its timeout."""

    clock: FakeClock = field(default_factory=FakeClock)
    script: list[list[Event]] = field(default_factory=list)
    committed_offsets: dict[tuple[str, int], int] = field(default_factory=dict)
    unstable: set[tuple[str, int]] = field(default_factory=set)
    timing_out: bool = False
    unstarted: set[tuple[str, int]] = field(default_factory=set)  # librdkafka refuses to seek them (_STATE)
    lookups: list[list[tuple[str, int]]] = field(default_factory=list)
    seeks: list[tuple[str, int, int]] = field(default_factory=list)
    paused: set[tuple[str, int]] = field(default_factory=set)
    callbacks: dict[str, Callable[..., None]] = field(default_factory=dict)
    timeouts: list[float] = field(default_factory=list)  # of every consume() call
    positions: dict[tuple[str, int], int] = field(default_factory=dict)  # where the consumer would read next
    calls: list[str] = field(default_factory=list)  # unsubscribe and close, in order
    fatal: bool = False  # after a fatal error librdkafka refuses an unsubscribe

    def subscribe(self, topics: list[str], on_assign: Callable[..., None], on_revoke: Callable[..., None],
                  on_lost: Callable[..., None]) -> None:
        self.callbacks = {"assign": on_assign, "revoke": on_revoke, "lost": on_lost}

    def consume(self, num_messages: int, timeout: float) -> list[FakeMessage]:
        self.timeouts.append(timeout)
        if not self.script:
            return []
        out: list[FakeMessage] = []
        for kind, arg in self.script.pop(0):
            if kind == "msg":
                out.append(FakeMessage(*arg, frame_value("s", arg[2])))
            elif kind == "error":
                out.append(FakeMessage("", 0, 0, b"", _error=arg))
            else:
                self.callbacks[kind](self, [TopicPartition(t, p) for t, p in arg])
        return out

    def unsubscribe(self) -> None:
        self.calls.append("unsubscribe")
        if self.fatal:
            raise KafkaException(KafkaError(KafkaError._FATAL, "Failed to remove subscription: Local: Fatal error"))

    def close(self) -> None:
        self.calls.append("close")

    def committed(self, partitions: list[TopicPartition], timeout: float) -> list[Answer]:
        self.lookups.append([(p.topic, p.partition) for p in partitions])
        if self.timing_out:
            self.clock.now += timeout
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT))
        return [Answer(p.topic, p.partition, OFFSET_INVALID, KafkaError(KafkaError.UNSTABLE_OFFSET_COMMIT))
                if (p.topic, p.partition) in self.unstable else
                Answer(p.topic, p.partition, self.committed_offsets.get((p.topic, p.partition), OFFSET_INVALID))
                for p in partitions]

    def seek(self, tp: TopicPartition) -> None:
        if (tp.topic, tp.partition) in self.unstarted:
            raise KafkaException(KafkaError(KafkaError._STATE))
        self.seeks.append((tp.topic, tp.partition, tp.offset))

    def pause(self, partitions: list[TopicPartition]) -> None:
        self.paused |= {(p.topic, p.partition) for p in partitions}

    def resume(self, partitions: list[TopicPartition]) -> None:
        self.paused -= {(p.topic, p.partition) for p in partitions}

    def get_watermark_offsets(self, tp: TopicPartition, timeout: float, cached: bool) -> tuple[int, int]:
        return 0, 100

    def position(self, partitions: list[TopicPartition]) -> list[TopicPartition]:
        return [TopicPartition(p.topic, p.partition, self.positions.get((p.topic, p.partition), OFFSET_INVALID))
                for p in partitions]


@pytest.fixture
def fake() -> FakeConsumer:
    return FakeConsumer()


def make_source(fake: FakeConsumer, settings: Settings = SETTINGS
                ) -> tuple[FrameSource, list[tuple[str, list[tuple[str, int]]]]]:
    source = FrameSource(settings, clock=fake.clock, consumer_factory=lambda conf, logger=None: fake)
    return source, subscribed(source)


def subscribed(source: FrameSource) -> list[tuple[str, list[tuple[str, int]]]]:
    """Subscribe `source`; the partitions assigned, revoked and lost, in the order the pipeline is told."""
    events: list[tuple[str, list[tuple[str, int]]]] = []
    source.subscribe(lambda tps: events.append(("assign", tps)), lambda tps, commits: events.append(("revoke", tps)),
                     lambda tps: events.append(("lost", tps)))
    return events


def started(fake: FakeConsumer, tps: list[tuple[str, int]], settings: Settings = SETTINGS) -> FrameSource:
    """A source assigned `tps` and past the first poll, which sought them to their committed offsets."""
    source, _ = make_source(fake, settings)
    fake.script = [[("assign", tps)], []]
    source.poll(10, 0.0)
    source.poll(10, 0.0)
    assert source.awaiting_committed_offset == frozenset() and not fake.paused
    fake.seeks.clear()
    fake.lookups.clear()
    return source


def offsets(polled: Any) -> list[tuple[str, int, int]]:
    return [(f.source.topic, f.source.partition, f.source.offset) for f in polled.frames]


# -- where a new or rewound partition is read from ------------------------------------------------------------
def test_a_new_partition_is_read_from_its_committed_offset_after_the_next_look_up(fake: FakeConsumer) -> None:
    source, _ = make_source(fake)
    fake.committed_offsets = {(REALTIME, 0): 5}
    fake.script = [[("assign", [(REALTIME, 0)]), ("msg", (REALTIME, 0, 0))],  # librdkafka's start is not trusted
                   [("msg", (REALTIME, 0, 5)), ("msg", (REALTIME, 0, 6))]]
    assert offsets(source.poll(10, 0.0)) == [] and fake.paused == {(REALTIME, 0)}
    assert offsets(source.poll(10, 0.0)) == [(REALTIME, 0, 5), (REALTIME, 0, 6)]
    assert fake.seeks == [(REALTIME, 0, 5)] and fake.paused == set()


def test_new_partitions_are_sought_highest_class_first(fake: FakeConsumer) -> None:
    """So realtime's fetches start first (tests/integration/test_priorities_and_shutdown.py failed with
    topic-name order, which put bulk first)."""
    source, _ = make_source(fake)
    fake.script = [[("assign", [(BULK, 0), (REALTIME, 1), (REALTIME, 0)])], []]
    source.poll(10, 0.0)
    source.poll(10, 0.0)
    assert [tp for (tp,) in fake.lookups] == [(REALTIME, 0), (REALTIME, 1), (BULK, 0)]


def test_with_nothing_committed_and_no_error_a_partition_is_read_from_its_beginning(fake: FakeConsumer) -> None:
    source, _ = make_source(fake)
    fake.script = [[("assign", [(REALTIME, 0)])], []]
    source.poll(10, 0.0)
    polled = source.poll(10, 0.0)
    assert fake.seeks == [(REALTIME, 0, OFFSET_BEGINNING)] and polled.committed_offset_waits == 0


def test_a_committed_offset_held_by_a_transaction_is_waited_for_never_read_from_the_beginning(
        fake: FakeConsumer) -> None:
    source = started(fake, [(REALTIME, 0), (BULK, 1)])
    fake.committed_offsets = {(REALTIME, 0): 219, (BULK, 1): 7}
    fake.unstable = {(REALTIME, 0)}
    # A rewind; messages of the partition fetched before it are not delivered.
    fake.script = [[("msg", (REALTIME, 0, 230)), ("msg", (BULK, 1, 7))], [], [], [("msg", (REALTIME, 0, 219))]]
    source.seek_to_committed([(REALTIME, 0), (BULK, 1)])
    assert fake.seeks == [(BULK, 1, 7)]  # the other partition is not held up
    assert source.awaiting_committed_offset == {(REALTIME, 0)} and fake.paused == {(REALTIME, 0)}
    assert offsets(source.poll(10, 0.0)) == [(BULK, 1, 7)]
    # Asked again on a later poll, not on every one.
    asked = len(fake.lookups)
    fake.clock.now += COMMITTED_RETRY_FIRST_S
    source.poll(10, 0.0)
    assert len(fake.lookups) == asked + 1 and fake.seeks == [(BULK, 1, 7)]
    # The broker aborts the dead transaction: the committed offset is known, sought, and the partition resumed.
    fake.unstable = set()
    fake.clock.now += 10.0
    source.poll(10, 0.0)
    assert fake.seeks == [(BULK, 1, 7), (REALTIME, 0, 219)]
    assert source.awaiting_committed_offset == frozenset() and fake.paused == set()
    assert offsets(source.poll(10, 0.0)) == [(REALTIME, 0, 219)]


def test_a_look_up_that_times_out_is_unknown_not_nothing_committed(fake: FakeConsumer) -> None:
    source = started(fake, [(REALTIME, 0)])
    fake.committed_offsets = {(REALTIME, 0): 50}
    fake.timing_out = True
    source.seek_to_committed([(REALTIME, 0)])
    assert fake.seeks == [] and fake.paused == {(REALTIME, 0)}
    assert not source.caught_up()
    fake.timing_out = False
    fake.clock.now += 10.0
    source.poll(10, 0.0)
    assert fake.seeks == [(REALTIME, 0, 50)] and fake.paused == set()


def test_a_partition_waiting_for_its_committed_offset_is_counted_once(fake: FakeConsumer) -> None:
    source = started(fake, [(REALTIME, 0)])
    fake.unstable = {(REALTIME, 0)}
    source.seek_to_committed([(REALTIME, 0)])
    assert source.poll(10, 0.0).committed_offset_waits == 1
    fake.clock.now += 10.0
    assert source.poll(10, 0.0).committed_offset_waits == 0


def test_a_partition_librdkafka_has_not_started_is_sought_once_it_has(fake: FakeConsumer) -> None:
    """librdkafka starts a new partition once it has its own answer; until then a seek is refused (_STATE)."""
    source, _ = make_source(fake)
    fake.committed_offsets = {(REALTIME, 0): 5}
    fake.unstarted = {(REALTIME, 0)}
    fake.script = [[("assign", [(REALTIME, 0)])], [], []]
    source.poll(10, 0.0)
    polled = source.poll(10, 0.0)
    assert fake.seeks == [] and fake.paused == {(REALTIME, 0)} and polled.committed_offset_waits == 0
    fake.unstarted = set()
    fake.clock.now += COMMITTED_RETRY_FIRST_S
    source.poll(10, 0.0)
    assert fake.seeks == [(REALTIME, 0, 5)] and fake.paused == set()


def test_the_look_ups_of_one_poll_stay_within_their_budget(fake: FakeConsumer) -> None:
    """Each held partition may block a look-up for its timeout; one poll asks no more once the budget is spent,
    so the loop keeps polling and the member stays in the group."""
    source = started(fake, [(REALTIME, 0), (REALTIME, 1), (REALTIME, 2)])
    fake.timing_out = True
    before = fake.clock.now
    source.seek_to_committed([(REALTIME, 0), (REALTIME, 1), (REALTIME, 2)])
    assert fake.lookups == [[(REALTIME, 0)]] and fake.clock.now - before == COMMITTED_LOOKUP_TIMEOUT_S
    source.poll(10, 0.0)
    assert fake.lookups == [[(REALTIME, 0)], [(REALTIME, 1)]]


def test_a_class_paused_while_its_partition_waits_stays_paused_once_sought(fake: FakeConsumer) -> None:
    source = started(fake, [(REALTIME, 0)])
    fake.unstable = {(REALTIME, 0)}
    source.seek_to_committed([(REALTIME, 0)])
    source.pause_classes({Priority.REALTIME})
    fake.unstable = set()
    fake.clock.now += 10.0
    source.poll(10, 0.0)
    assert fake.seeks == [(REALTIME, 0, OFFSET_BEGINNING)] and fake.paused == {(REALTIME, 0)}
    source.pause_classes(set())
    assert fake.paused == set()


def test_a_partition_lost_while_it_waits_is_forgotten(fake: FakeConsumer) -> None:
    source = started(fake, [(REALTIME, 0)])
    fake.unstable = {(REALTIME, 0)}
    source.seek_to_committed([(REALTIME, 0)])
    fake.script = [[("lost", [(REALTIME, 0)])]]
    source.poll(10, 0.0)
    fake.unstable = set()
    fake.clock.now += 10.0
    source.poll(10, 0.0)
    assert fake.seeks == [] and source.awaiting_committed_offset == frozenset()


# -- rebalances inside one consume() call ----------------------------------------------------------------------
def test_a_partition_revoked_and_assigned_back_within_one_call_is_reread_from_its_commit(fake: FakeConsumer) -> None:
    source, events = make_source(fake)
    fake.committed_offsets = {(REALTIME, 0): 3, (BULK, 1): 40}
    fake.script = [[("assign", [(REALTIME, 0), (BULK, 1)])], []]
    source.poll(10, 0.0)
    source.poll(10, 0.0)
    fake.seeks.clear()
    # Offsets 5, 6 fetched before the revocation; the new assignment restarts at the committed 3.
    fake.script = [[("msg", (REALTIME, 0, 5)), ("msg", (BULK, 1, 40)), ("msg", (REALTIME, 0, 6)),
                    ("revoke", [(REALTIME, 0)]), ("assign", [(REALTIME, 0)]),
                    ("msg", (REALTIME, 0, 3)), ("msg", (REALTIME, 0, 4)), ("msg", (REALTIME, 0, 5))]]
    polled = source.poll(10, 0.0)
    assert offsets(polled) == [(BULK, 1, 40)]  # the untouched partition keeps its messages
    source.poll(10, 0.0)  # the re-assigned partition is sought to its committed offset by the next poll
    assert fake.seeks == [(REALTIME, 0, 3)]
    assert (REALTIME, 0) in source.assignment
    assert [e for e, _ in events] == ["assign", "revoke", "assign"]


def test_a_partition_revoked_for_good_loses_its_messages_and_is_not_sought(fake: FakeConsumer) -> None:
    source = started(fake, [(REALTIME, 0)])
    fake.script = [[("msg", (REALTIME, 0, 5)), ("lost", [(REALTIME, 0)])]]
    assert offsets(source.poll(10, 0.0)) == []
    assert fake.seeks == []
    assert source.assignment == frozenset()


def test_with_nothing_committed_the_partition_is_reread_from_its_beginning(fake: FakeConsumer) -> None:
    source = started(fake, [(REALTIME, 0)])
    fake.script = [[("msg", (REALTIME, 0, 0)), ("revoke", [(REALTIME, 0)]), ("assign", [(REALTIME, 0)]),
                    ("msg", (REALTIME, 0, 0))]]
    assert offsets(source.poll(10, 0.0)) == []
    source.poll(10, 0.0)
    assert fake.seeks == [(REALTIME, 0, OFFSET_BEGINNING)]


def test_a_rebalance_in_the_blocking_call_also_drops_the_earlier_calls_messages(fake: FakeConsumer) -> None:
    """poll() may call consume() up to three times; a rebalance in a later call drops the earlier calls' messages
    of that partition too."""
    fake.committed_offsets = {(REALTIME, 0): 1}
    source = started(fake, [(REALTIME, 0)])
    fake.script = [[],  # nothing queued: poll blocks for one message
                   [("msg", (REALTIME, 0, 1))],
                   [("revoke", [(REALTIME, 0)]), ("assign", [(REALTIME, 0)]), ("msg", (REALTIME, 0, 1))]]
    assert offsets(source.poll(10, 1.0)) == []
    source.poll(10, 0.0)
    assert fake.seeks == [(REALTIME, 0, 1)]


def test_offsets_delivered_again_within_an_assignment_are_dropped(fake: FakeConsumer) -> None:
    """A rewind the worker did not ask for (librdkafka after pause/resume) re-delivers offsets already read."""
    fake.committed_offsets = {(BULK, 2): 56}
    source = started(fake, [(BULK, 2)])
    fake.script = [[("msg", (BULK, 2, 56)), ("msg", (BULK, 2, 57))],
                   [("msg", (BULK, 2, 0)), ("msg", (BULK, 2, 57)), ("msg", (BULK, 2, 58))]]
    assert offsets(source.poll(10, 0.0)) == [(BULK, 2, 56), (BULK, 2, 57)]
    polled = source.poll(10, 0.0)
    assert offsets(polled) == [(BULK, 2, 58)] and polled.redelivered == 2


def test_a_seek_or_a_new_assignment_accepts_lower_offsets_again(fake: FakeConsumer) -> None:
    fake.committed_offsets = {(BULK, 2): 10}
    source = started(fake, [(BULK, 2)])
    fake.script = [[("msg", (BULK, 2, 20))],
                   [("msg", (BULK, 2, 10))],  # after the rewind below
                   [("revoke", [(BULK, 2)])],
                   [("assign", [(BULK, 2)])],
                   [("msg", (BULK, 2, 11))]]
    fake.committed_offsets = {(BULK, 2): 11}
    source.poll(10, 0.0)
    fake.committed_offsets = {(BULK, 2): 10}
    source.seek_to_committed([(BULK, 2)])  # the pipeline's rewind after an aborted transaction
    assert offsets(source.poll(10, 0.0)) == [(BULK, 2, 10)]
    source.poll(10, 0.0)
    fake.committed_offsets = {(BULK, 2): 11}
    source.poll(10, 0.0)
    assert offsets(source.poll(10, 0.0)) == [(BULK, 2, 11)]


def test_the_consumer_heartbeats_as_often_as_the_setting_says() -> None:
    """A member notices a rebalance at its next heartbeat: librdkafka's 3000 ms left moved partitions unowned 3 s."""
    assert source_module.consumer_config(SETTINGS)["heartbeat.interval.ms"] == 500
    tuned = load_settings(env={}, overrides={"kafka": {"heartbeat_interval_ms": 1000},
                                             "observability": {"worker_id": "host-0"}})
    assert source_module.consumer_config(tuned)["heartbeat.interval.ms"] == 1000


def test_fetches_wait_briefly_so_a_resumed_class_is_read_again_soon_and_overrides_still_apply() -> None:
    """Backpressure pauses and resumes partitions; with librdkafka's defaults (a fetch waits at the broker up to
    500 ms, a full prefetch queue postpones the next fetch by 1 s) each resume left the model idle that long."""
    conf = source_module.consumer_config(SETTINGS)
    assert conf["fetch.wait.max.ms"] == source_module.FETCH_WAIT_MAX_MS <= 100
    assert conf["fetch.queue.backoff.ms"] == source_module.FETCH_QUEUE_BACKOFF_MS <= 50
    # and the shared prefetch queue stays shallow: a realtime frame is never behind 100000 prefetched messages
    assert conf["queued.min.messages"] == source_module.QUEUED_MIN_MESSAGES <= 10_000
    tuned = load_settings(env={}, overrides={"kafka": {"consumer_overrides": {"fetch.wait.max.ms": 500}},
                                             "observability": {"worker_id": "host-0"}})
    assert source_module.consumer_config(tuned)["fetch.wait.max.ms"] == "500"


# -- how long a poll blocks ----------------------------------------------------------------------------------------
def librdkafka_ms(timeout_s: float) -> int:
    """What confluent-kafka makes of a consume() timeout: whole milliseconds, truncated (measured: 0.99 ms
    returns at once, 1 ms blocks for 1 ms, 2.9 ms for 2)."""
    return int(timeout_s * 1000.0)


@pytest.mark.parametrize(("wanted_s", "blocked_ms"), [(0.0003, 1), (0.00099, 1), (0.001, 1), (0.002, 2), (0.0021, 3),
                                                      (0.0029, 3), (0.015, 15), (0.1, 100)])
def test_a_poll_that_may_wait_blocks_for_at_least_its_timeout_rounded_up_to_a_whole_millisecond(
        fake: FakeConsumer, wanted_s: float, blocked_ms: int) -> None:
    source = started(fake, [(BULK, 0)])
    fake.timeouts.clear()
    source.poll(10, wanted_s)
    assert [librdkafka_ms(t) for t in fake.timeouts] == [0, blocked_ms]  # take what is queued, then wait


def test_a_poll_with_no_timeout_never_blocks(fake: FakeConsumer) -> None:
    source = started(fake, [(BULK, 0)])
    fake.timeouts.clear()
    source.poll(10, 0.0)
    assert fake.timeouts == [0]


def test_a_full_poll_says_more_may_be_waiting_and_a_short_one_that_it_took_all_the_consumer_had(
        fake: FakeConsumer) -> None:
    source = started(fake, [(BULK, 0)])
    fake.script = [[("msg", (BULK, 0, i)) for i in range(3)], [("msg", (BULK, 0, 3))], []]

    full, short, empty = source.poll(3, 0.0), source.poll(3, 0.0), source.poll(3, 0.0)

    assert (len(full.frames), full.drained) == (3, False)
    assert (len(short.frames), short.drained) == (1, True)
    assert (len(empty.frames), empty.drained) == (0, True)


# -- caught up (exit when idle) ------------------------------------------------------------------------------
def test_a_partition_is_caught_up_when_its_committed_offset_is_its_end(fake: FakeConsumer) -> None:
    source = started(fake, [(REALTIME, 0)])
    fake.committed_offsets = {(REALTIME, 0): 100}  # the fake's partitions end at 100
    assert source.caught_up()
    fake.committed_offsets = {(REALTIME, 0): 99}
    assert not source.caught_up()


def test_a_transaction_marker_after_the_last_frame_does_not_keep_a_partition_behind(fake: FakeConsumer) -> None:
    """A transactional producer (`worker dlq replay`) ends with a commit marker: the worker commits after the last
    frame (99), the marker holds offset 99 and never reaches the worker; the consumer's position moves past it."""
    source = started(fake, [(REALTIME, 0)])
    fake.script = [[("msg", (REALTIME, 0, 98))]]
    source.poll(10, 0.0)
    fake.committed_offsets = {(REALTIME, 0): 99}
    fake.positions = {(REALTIME, 0): 99}
    assert not source.caught_up()  # not fetched past the marker yet: a frame may still be at 99
    fake.positions = {(REALTIME, 0): 100}
    assert source.caught_up()


def test_a_delivered_frame_not_yet_committed_keeps_a_partition_behind_whatever_the_position(
        fake: FakeConsumer) -> None:
    source = started(fake, [(REALTIME, 0)])
    fake.script = [[("msg", (REALTIME, 0, 98)), ("msg", (REALTIME, 0, 99))]]
    source.poll(10, 0.0)
    fake.committed_offsets = {(REALTIME, 0): 99}
    fake.positions = {(REALTIME, 0): 100}
    assert not source.caught_up()


# -- static membership -----------------------------------------------------------------------------------------------
def test_the_worker_id_is_the_group_instance_id_unless_membership_is_dynamic() -> None:
    assert source_module.consumer_config(SETTINGS)["group.instance.id"] == "host-0"
    dynamic = Settings(kafka=KafkaSettings(static_membership=False), observability=SETTINGS.observability)
    assert "group.instance.id" not in source_module.consumer_config(dynamic)


def test_a_consumer_is_not_made_before_the_worker_id_is_resolved_or_with_one_kafka_refuses() -> None:
    with pytest.raises(StreamferError, match="observability.worker_id is empty"):
        source_module.consumer_config(Settings())
    # A default id from a host name Kafka refuses as an instance id (config validation sees only explicit ids).
    odd = Settings(observability=ObservabilitySettings(worker_id="host name-0"))
    with pytest.raises(OperatorError, match="group.instance.id") as refused:
        source_module.consumer_config(odd)
    assert refused.value.setting == "observability.worker_id"


def test_a_static_member_leaves_the_group_on_close_once_its_revoke_is_served(fake: FakeConsumer) -> None:
    """librdkafka sends a static member's LeaveGroup only on unsubscribe, once the revoke is served; a plain
    close would leave its partitions to wait out the session."""
    source, events = make_source(fake)
    fake.script = [[("assign", [(BULK, 0)])], []]
    source.poll(10, 0.0)
    source.poll(10, 0.0)
    fake.script = [[], [("revoke", [(BULK, 0)])], []]
    source.close()
    assert fake.calls == ["unsubscribe", "close"]
    assert events[-1] == ("revoke", [(BULK, 0)]) and source.assignment == frozenset()
    assert fake.script == [[]]  # it stopped serving callbacks once the revoke was in


def test_a_dynamic_member_or_one_holding_nothing_just_closes(fake: FakeConsumer) -> None:
    dynamic = Settings(kafka=KafkaSettings(static_membership=False), observability=SETTINGS.observability)
    started(fake, [(BULK, 0)], dynamic).close()
    assert fake.calls == ["close"]
    other = FakeConsumer()
    make_source(other)[0].close()
    assert other.calls == ["close"]


def test_the_consumer_is_closed_even_when_the_final_revoke_fails(fake: FakeConsumer) -> None:
    source = FrameSource(SETTINGS, clock=fake.clock, consumer_factory=lambda conf, logger=None: fake)

    def failing(tps: list[tuple[str, int]], commits: list[CommitOutcome]) -> None:
        raise RuntimeError("revoke handler failed")

    source.subscribe(lambda tps: None, failing, lambda tps: None)
    fake.script = [[("assign", [(BULK, 0)])], [], [("revoke", [(BULK, 0)])]]
    source.poll(10, 0.0)
    source.poll(10, 0.0)
    with pytest.raises(RuntimeError, match="revoke handler failed"):
        source.close()
    assert fake.calls == ["unsubscribe", "close"]


FENCED = KafkaError(KafkaError._FATAL, "Fatal error: " + KafkaError(KafkaError.FENCED_INSTANCE_ID).str())


def fencing_source() -> tuple[FrameSource, list[FakeConsumer], list[tuple[str, list[tuple[str, int]]]]]:
    """A source whose every consumer is a new fake on one clock (a fenced consumer is replaced)."""
    clock, consumers = FakeClock(), []

    def make(conf: dict[str, Any], logger: Any = None) -> FakeConsumer:
        consumers.append(FakeConsumer(clock=clock))
        return consumers[-1]

    source = FrameSource(SETTINGS, clock=clock, consumer_factory=make)
    return source, consumers, subscribed(source)


def test_a_member_fenced_after_its_session_expired_loses_its_partitions_and_rejoins_under_a_new_consumer() -> None:
    """A process frozen past its session (SIGSTOP, a paused VM) is fenced when it wakes: fatal to its consumer."""
    source, consumers, events = fencing_source()
    first = consumers[0]
    first.script = [[("assign", [(BULK, 0)])], [], [("error", FENCED), ("msg", (BULK, 0, 5))]]
    source.poll(10, 0.0)
    source.poll(10, 0.0)
    assert source.poll(10, 0.0).frames == []  # read before the fence, of a partition it no longer holds
    assert events[-1] == ("lost", [(BULK, 0)]) and source.assignment == frozenset()
    assert len(consumers) == 2 and first.calls == ["close"] and set(consumers[1].callbacks) == {
        "assign", "revoke", "lost"}
    consumers[1].script = [[("assign", [(BULK, 0)])]]
    source.poll(10, 0.0)
    assert source.assignment == frozenset({(BULK, 0)})


def test_a_second_fence_soon_after_the_first_means_two_processes_share_the_worker_id() -> None:
    source, consumers, _ = fencing_source()
    consumers[0].script = [[("error", FENCED)]]
    source.poll(10, 0.0)
    consumers[0].clock.now += REFENCED_WITHIN_S + 1  # long after: frozen again, it rejoins again
    consumers[1].script = [[("error", FENCED)]]
    source.poll(10, 0.0)
    assert len(consumers) == 3
    consumers[2].script = [[("error", FENCED)]]
    with pytest.raises(OperatorError, match="two processes share one observability.worker_id") as stopped:
        source.poll(10, 0.0)
    assert stopped.value.setting == "observability.worker_id" and len(consumers) == 3


def test_a_consumer_that_failed_cannot_leave_and_that_is_not_the_error_reported(fake: FakeConsumer) -> None:
    source = started(fake, [(BULK, 0)])
    fake.fatal = True  # librdkafka refuses the unsubscribe after a fatal error
    source.close()
    assert fake.calls == ["unsubscribe", "close"]


def test_any_other_fatal_consumer_error_stops_the_worker(fake: FakeConsumer) -> None:
    """librdkafka hands a fatal error to the application as a message error _FATAL whose fatal() is False."""
    source = started(fake, [(BULK, 0)])
    fake.script = [[("error", KafkaError(KafkaError._FATAL, "Fatal error: something else"))]]
    with pytest.raises(SourceError, match="something else"):
        source.poll(10, 0.0)


# -- commit outcomes and the assignment's owner (over the test kit's in-memory consumer) ----------------------------
def kit_source() -> tuple[FrameSource, KitConsumer]:
    made: list[KitConsumer] = []

    def consumer(conf: dict[str, Any], logger: Any = None) -> KitConsumer:
        made.append(KitConsumer(conf))
        return made[-1]

    source = FrameSource(SETTINGS, clock=FakeClock(), consumer_factory=consumer)
    return source, made[0]


def test_commit_outcomes_come_back_in_the_poll_that_served_them_once() -> None:
    source, kafka = kit_source()
    source.subscribe(lambda tps: None, lambda tps, commits: None, lambda tps: None)
    kafka.rebalance("assign", [(BULK, 0), (BULK, 1)])
    source.poll(10, 0.0)
    source.commit({(BULK, 0): 3}, asynchronous=True)
    kafka.commit_error = KafkaError(KafkaError.REBALANCE_IN_PROGRESS)
    source.commit({(BULK, 1): 5}, asynchronous=True)
    assert source.poll(10, 0.0).commits == [
        CommitOutcome({(BULK, 0): 3}, [], None),
        CommitOutcome({}, [(BULK, 1)], KafkaError(KafkaError.REBALANCE_IN_PROGRESS).str())]
    assert source.poll(10, 0.0).commits == []


def test_a_revoke_handler_gets_the_outcomes_served_before_it_while_its_partitions_are_still_assigned() -> None:
    """The loop has not seen those outcomes yet, and its final commit must see a failed one (to offer its commit
    point again); the source alone releases the partitions, once the handler returned."""
    source, kafka = kit_source()
    seen: list[tuple[list[tuple[str, int]], list[CommitOutcome], bool]] = []
    source.subscribe(lambda tps: None,
                     lambda tps, commits: seen.append((tps, commits, (BULK, 0) in source.assignments)),
                     lambda tps: None)
    kafka.rebalance("assign", [(BULK, 0)])
    source.poll(10, 0.0)
    source.commit({(BULK, 0): 3}, asynchronous=True)
    kafka.rebalance("revoke", [(BULK, 0)])
    polled = source.poll(10, 0.0)
    assert seen == [([(BULK, 0)], [CommitOutcome({(BULK, 0): 3}, [], None)], True)]
    assert polled.commits == [] and (BULK, 0) not in source.assignments
