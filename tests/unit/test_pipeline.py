"""The worker loop with its real parts (FrameSource, ResultSink, delivery, batcher, offset tracker) over
in-memory Kafka fakes and a fake clock: each test is one delivery guarantee, deterministic, no broker.

Several guard a bug the fault suite once found only in a few SIGKILL runs of many (docs/reliability.md,
"Worker bugs the suite found"); the test names the bug number."""

from __future__ import annotations

import dataclasses
from collections import Counter
from concurrent.futures import Future
from typing import Any

import pytest
from confluent_kafka import KafkaError

import worker.loop.delivery as delivery_module
from worker.codec.schemas import FrameRecord, decode_result, encode_frame
from worker.config import BatchingSettings, DeliverySettings, ObservabilitySettings, Settings
from worker.frames import OUTPUT_REJECTED, BatchOutcome, Encoding, Priority, Verdict
from worker.kafka.producer import SinkError
from worker.kafka.wiring import KafkaClients
from worker.loop.pipeline import Pipeline, build_pipeline
from worker.metrics import Health, Metrics
from worker.partitions.donemeta import done_count
from worker.testing import (
    FakeClock,
    FakeConsumer,
    FakeExecutor,
    FakeProducer,
    Produced,
    abortable,
    frame_value,
    outcome,
)

BULK = Settings().topics.bulk
REALTIME = Settings().topics.realtime
P0 = (BULK, 0)
P1 = (BULK, 1)
STEP_S = 0.2  # past bulk's max_wait_ms: every step releases what is pending


class World:
    """A pipeline over fakes; `consumer` is the group's view, `producers` every producer created, in order."""

    def __init__(self, mode: str = "at_least_once", hold: bool = False,
                 batching: BatchingSettings | None = None, max_inflight: int = 4, executor: Any = None,
                 max_uncommitted_frames: int = 0, commit_interval_ms: float = 0.0,
                 metrics: Metrics | None = None, max_done_offsets_held: int = 0,
                 commit_metadata_max_bytes: int = 4000, max_unacknowledged_outputs: int = 0) -> None:
        self.settings = Settings(batching=batching or BatchingSettings(rare_shape_min_count=1, max_batch_size=4),
                                 delivery=DeliverySettings(mode=mode, max_inflight_batches=max_inflight,
                                                           transaction_call_timeout_ms=1_000,
                                                           max_uncommitted_frames=max_uncommitted_frames,
                                                           commit_interval_ms=commit_interval_ms,
                                                           max_done_offsets_held=max_done_offsets_held,
                                                           max_unacknowledged_outputs=max_unacknowledged_outputs,
                                                           commit_metadata_max_bytes=commit_metadata_max_bytes),
                                 observability=ObservabilitySettings(worker_id="w0", metrics_enabled=False))
        self.consumer: FakeConsumer | None = None
        self.producers: list[FakeProducer] = []
        self.max_message_bytes = 1_000_000
        self.apply_txn = True  # committed transactions move the group's offsets (as the broker does)

        def consumer(conf: dict[str, Any], logger: Any = None) -> FakeConsumer:
            self.consumer = FakeConsumer(conf)
            return self.consumer

        def producer(conf: dict[str, Any], logger: Any = None) -> FakeProducer:
            made = FakeProducer(conf, max_message_bytes=self.max_message_bytes,
                                group=self.consumer.group_committed if self.consumer and self.apply_txn else None)
            self.producers.append(made)
            return made

        # No admin calls for the output topics' limit; a stuck transactional call is given up on quickly.
        self.clients = KafkaClients(consumer=consumer, producer=producer, output_message_limit=lambda settings: None,
                                    stuck_grace_s=0.05)
        self.clock = FakeClock()
        self.executor = executor if executor is not None else FakeExecutor(hold=hold)
        self.health = Health()
        self.metrics = metrics or Metrics()
        self.pipeline: Pipeline = build_pipeline(self.settings, self.executor, self.metrics, self.health, self.clock,
                                                 clients=self.clients)
        assert self.consumer is not None
        self.pipeline.source.subscribe(self.pipeline._on_assign, self.pipeline._on_revoke, self.pipeline._on_lost)

    @property
    def kafka(self) -> FakeConsumer:
        assert self.consumer is not None
        return self.consumer

    @property
    def producer(self) -> FakeProducer:
        return self.producers[-1]

    def assign(self, tps: list[tuple[str, int]]) -> None:
        """Assign partitions and take the turn in which the source seeks them to their committed offsets
        (a new partition stays paused until then: FrameSource.seek_to_committed)."""
        self.kafka.rebalance("assign", tps)
        self.step()

    def frames(self, tp: tuple[str, int], count: int, start: int = 0) -> None:
        self.kafka.append(tp, *(frame_value(f"s{tp[1]}", start + i) for i in range(count)))

    def step(self, turns: int = 1) -> None:
        for _ in range(turns):
            self.clock.now += STEP_S
            self.pipeline.step()

    def results(self) -> list[tuple[str, int, int]]:
        """(topic, partition, offset) of every result a read_committed reader sees, over all producers."""
        out = []
        for p in self.producers:
            for m in p.visible:
                if m.topic == self.settings.topics.results:
                    r = decode_result(m.value)
                    out.append((r["source_topic"], r["source_partition"], r["source_offset"]))
        return out

    def dead_letters(self) -> list[Produced]:
        return [m for p in self.producers for m in p.visible if m.topic == self.settings.topics.dead_letter]

    def committed(self, tp: tuple[str, int]) -> int | None:
        if self.pipeline.settings.delivery.mode == "exactly_once":
            points = [c[tp] for p in self.producers for c in p.committed_offsets if tp in c]
            return points[-1] if points else None
        return self.kafka.group_committed.get(tp)


def offsets(results: list[tuple[str, int, int]], tp: tuple[str, int]) -> list[int]:
    return sorted(o for t, p, o in results if (t, p) == tp)


# -- commit points ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["at_least_once", "exactly_once"])
def test_every_frame_gets_one_result_and_the_commit_reaches_the_end(mode: str) -> None:
    w = World(mode)
    w.frames(P0, 6)
    w.kafka.rebalance("assign", [P0])
    w.step(6)
    assert offsets(w.results(), P0) == [0, 1, 2, 3, 4, 5]
    assert w.committed(P0) == 6


def test_bug2_exactly_once_never_commits_an_output_beyond_its_partitions_commit_point() -> None:
    w = World("exactly_once", hold=True)
    # Offset 1 is not a frame: its dead letter is ready at once, while offset 0 is still running.
    w.kafka.append(P0, frame_value("s", 0), b"not a frame", frame_value("s", 2))
    w.kafka.rebalance("assign", [P0])
    w.step(4)
    assert w.dead_letters() == []  # beyond the commit point (0): held back, not committed
    assert (w.committed(P0) or 0) == 0
    w.executor.release()
    w.step(2)
    assert offsets(w.results(), P0) == [0, 2]
    assert [d.headers["streamfer.source_offset"] for d in w.dead_letters()] == ["1"]
    assert w.committed(P0) == 3


def test_at_least_once_commit_stays_below_an_unfinished_frame() -> None:
    w = World("at_least_once", hold=True)
    w.kafka.append(P0, frame_value("s", 0), b"not a frame", frame_value("s", 2))
    w.kafka.rebalance("assign", [P0])
    w.step(4)
    assert len(w.dead_letters()) == 1  # produced and acknowledged ...
    assert (w.committed(P0) or 0) == 0  # ... but offset 0 is not done: nothing past it may be committed
    w.executor.release()
    w.step(2)
    assert offsets(w.results(), P0) == [0, 2]
    assert w.committed(P0) == 3


def test_while_commits_fail_reading_stops_at_the_uncommitted_cap_and_goes_on_when_a_commit_lands() -> None:
    w = World("at_least_once", max_uncommitted_frames=8)
    w.frames(P0, 40)
    w.kafka.commit_error = KafkaError(KafkaError.COORDINATOR_NOT_AVAILABLE)
    w.assign([P0])
    w.step(20)
    # Answered, but no commit lands: a lost session would answer these again, so no more is read.
    assert offsets(w.results(), P0) == list(range(8))
    assert w.pipeline.tracker.uncommitted() == 8
    assert P0 in w.kafka.paused
    w.kafka.commit_error = None
    w.step(20)
    assert offsets(w.results(), P0) == list(range(40))
    assert w.committed(P0) == 40
    assert w.pipeline.tracker.uncommitted() == 0


def test_a_session_lost_while_commits_fail_answers_again_at_most_the_derived_uncommitted_cap() -> None:
    # The suite's at-least-once bound per fault: what one lost session can answer twice. By default the cap is a
    # full batcher plus every batch in flight, realtime's reserved slot included: 8 + (2 + 1) x 4 = 20 here.
    w = World("at_least_once", max_inflight=2,
              batching=BatchingSettings(rare_shape_min_count=1, max_batch_size=4, max_pending_frames=8))
    cap = w.settings.max_uncommitted_frames
    assert cap == 20
    w.frames(P0, 100)
    w.kafka.commit_error = KafkaError(KafkaError.COORDINATOR_NOT_AVAILABLE)
    w.assign([P0])
    w.step(40)
    answered_before_the_loss = len(w.results())
    assert answered_before_the_loss == cap  # answered and acknowledged, never committed
    w.kafka.rebalance("lost", [P0])
    w.step()
    w.kafka.commit_error = None
    w.assign([P0])
    w.step(80)
    counts = Counter(offsets(w.results(), P0))
    assert sorted(counts) == list(range(100))
    assert sum(n - 1 for n in counts.values()) == answered_before_the_loss <= cap


def test_at_least_once_sends_the_next_commit_only_once_the_last_ones_outcome_is_reported() -> None:
    # librdkafka retries a failed OffsetCommit as it was sent: with a newer commit on its way, the older offsets
    # could land after it and move the committed offset back (two nodes of three down: 8 landed after 9).
    w = World("at_least_once")
    w.frames(P0, 40)
    w.kafka.hold_commit_reports = True
    w.assign([P0])
    w.step(10)
    assert len(w.kafka.commit_history) == 1
    w.kafka.hold_commit_reports = False
    w.step(10)
    assert w.committed(P0) == 40
    history = [c[P0] for c in w.kafka.commit_history]
    assert history == sorted(history) and len(history) > 1


def test_a_commit_outcome_never_reported_holds_back_the_next_commit_only_so_long() -> None:
    w = World("at_least_once")
    w.frames(P0, 40)
    w.kafka.hold_commit_reports = True
    w.assign([P0])
    w.step(10)
    assert len(w.kafka.commit_history) == 1
    w.clock.now += delivery_module.COMMIT_OUTCOME_WAIT_S
    w.step()
    assert len(w.kafka.commit_history) == 2
    assert w.committed(P0) == 40


def stalled_stream(w: World, stream: str) -> None:
    """The results partition of `stream` is down: its outputs are produced and never acknowledged."""
    results = w.settings.topics.results
    for p in w.producers:
        p.unacknowledged = lambda m: m.topic == results and decode_result(m.value)["stream_id"] == stream


def interleaved(w: World, tp: tuple[str, int], count: int, every: int) -> None:
    """`count` frames on `tp`: every `every`-th of the stream "stalled", the others of stream "ok"."""
    w.kafka.append(tp, *(frame_value("stalled" if i % every == 0 else "ok", i) for i in range(count)))


def test_a_stalled_output_partition_holds_the_commit_point_but_not_the_answered_frames_behind_it() -> None:
    """Issue 67: answered frames held behind a stalled one no longer count against the uncommitted cap (8 here):
    the healthy stream is answered in full while its partition's commit point waits for the stalled frames."""
    w = World("at_least_once", max_uncommitted_frames=8)
    interleaved(w, P0, 60, every=10)
    w.step()
    stalled_stream(w, "stalled")
    w.assign([P0])
    w.step(40)
    ok = [o for o in range(60) if o % 10]
    assert offsets(w.results(), P0) == ok  # 54 answered, past a cap of 8
    assert (w.committed(P0) or 0) == 0  # offset 0 is not answered: nothing past it is committable
    assert w.pipeline.tracker.in_flight() == 6
    assert w.pipeline.tracker.done_beyond() == 54  # offsets 1..59 less the 5 stalled after 0
    w.producer.unacknowledged = lambda m: False
    w.step(5)
    assert offsets(w.results(), P0) == list(range(60))
    assert w.committed(P0) == 60
    assert w.pipeline.tracker.done_beyond() == 0


def test_frames_waiting_for_an_acknowledgement_stop_reading_at_their_own_bound_not_the_memory_bound() -> None:
    """Issue 67: a frame whose output awaits its acknowledgement holds no pixels: past 8 of them (the memory bound)
    reading goes on, and pauses at `max_unacknowledged_outputs` (20), then resumes once they are acknowledged."""
    w = World("at_least_once", max_uncommitted_frames=8, max_unacknowledged_outputs=20)
    interleaved(w, P0, 100, every=2)
    w.step()
    stalled_stream(w, "stalled")
    w.assign([P0])
    w.step(40)
    unacknowledged = w.pipeline.delivery.unacknowledged
    # Frames read under the memory bound may still join them: at most one memory bound past the bound.
    assert 20 <= unacknowledged < 20 + 8
    assert w.pipeline.tracker.in_flight() == unacknowledged  # nothing else held: all answered
    assert w.metrics.unacknowledged_outputs._value.get() == unacknowledged
    assert P0 in w.kafka.paused
    assert len(offsets(w.results(), P0)) == unacknowledged  # the healthy half answered, past the memory bound
    w.producer.unacknowledged = lambda m: False
    w.step(40)
    assert offsets(w.results(), P0) == list(range(100)) and w.committed(P0) == 100
    assert w.pipeline.delivery.unacknowledged == 0 and w.metrics.unacknowledged_outputs._value.get() == 0


def timely_frames(w: World, tp: tuple[str, int], streams: list[str], start: int) -> None:
    """One frame of each stream on `tp`, captured now (the fake clock): none expires however long the test runs."""
    now_ms = int(w.clock.now * 1000)
    w.kafka.append(tp, *(encode_frame(FrameRecord(
        stream_id=s, frame_index=start, capture_ts_ms=now_ms, tenant="t", priority=Priority.REALTIME, width=2,
        height=2, channels=3, encoding=Encoding.RAW_RGB8, data=bytes(12))) for s in streams))


def answered_streams(w: World) -> Counter[str]:
    results = w.settings.topics.results
    return Counter(decode_result(m.value)["stream_id"] for p in w.producers for m in p.visible if m.topic == results)


def test_healthy_streams_keep_being_answered_while_an_output_partition_never_acknowledges_for_ten_minutes() -> None:
    """Issue 67, the partial outage: one stream's results partition acknowledges nothing for 600 simulated seconds
    while frames arrive on two input partitions (each carries the stalled stream). Every second the healthy streams'
    frames of that second are answered; what holds pixels stays within the memory bound (8) throughout. Before, the
    unacknowledged outputs counted against that bound and every input paused after 8 stalled frames."""
    w = World("at_least_once", max_uncommitted_frames=8, max_unacknowledged_outputs=5_000,
              max_done_offsets_held=20_000)
    stalled_stream(w, "stalled")
    w.assign([P0, P1])
    streams = ["stalled", "ok-a", "ok-b", "ok-c"]
    for second in range(600):
        for tp in (P0, P1):
            timely_frames(w, tp, streams, second)
        before = answered_streams(w)
        w.step(5)  # one simulated second
        answered = answered_streams(w) - before
        assert answered == Counter({"ok-a": 2, "ok-b": 2, "ok-c": 2}), second
        delivery = w.pipeline.delivery
        assert w.pipeline.tracker.held() - delivery.unacknowledged <= 8
        assert delivery.unacknowledged == 2 * (second + 1)
        assert not w.kafka.paused
    assert w.metrics.unacknowledged_outputs._value.get() == 1200
    assert (w.committed(P0) or 0) == 0 and (w.committed(P1) or 0) == 0  # the first stalled frames hold both
    w.producer.unacknowledged = lambda m: False
    w.step(10)
    assert answered_streams(w) == Counter({s: 1200 for s in streams})  # nothing lost or duplicated
    assert w.committed(P0) == w.committed(P1) == 2400
    assert w.pipeline.delivery.unacknowledged == 0


def test_an_output_librdkafka_times_out_is_produced_again_and_counted_once() -> None:
    """An output to a partition down past `message.timeout.ms` is failed by librdkafka (_MSG_TIMED_OUT) and produced
    again by the sink: it stays one unacknowledged frame (no leak in the count) and is answered once."""
    w = World("at_least_once")
    w.frames(P0, 10)
    w.step()
    timeouts: Counter[int] = Counter()

    def timed_out(m: Produced) -> KafkaError | None:
        offset = decode_result(m.value)["source_offset"] if m.topic == w.settings.topics.results else -1
        if offset % 2 == 0 and timeouts[offset] < 3:
            timeouts[offset] += 1
            return KafkaError(KafkaError._MSG_TIMED_OUT)
        return None

    w.producer.refuse = timed_out
    w.producer.unacknowledged = lambda m: True
    w.assign([P0])
    w.step(10)
    assert w.pipeline.delivery.unacknowledged == 10 and not w.results()
    w.producer.unacknowledged = lambda m: False
    for _ in range(3):
        w.step()
        # Each turn the even offsets time out once more and are produced again; the count never grows.
        assert w.pipeline.delivery.unacknowledged == 5 and w.pipeline.tracker.in_flight() == 5
    w.step(5)
    assert timeouts == Counter({o: 3 for o in range(0, 10, 2)})
    assert Counter(offsets(w.results(), P0)) == Counter(range(10))  # once each
    assert w.pipeline.delivery.unacknowledged == 0 and w.pipeline.tracker.in_flight() == 0
    assert w.committed(P0) == 10


def test_answered_frames_held_behind_a_stalled_one_stop_reading_at_their_own_bound() -> None:
    w = World("at_least_once", max_uncommitted_frames=8, max_done_offsets_held=30)
    interleaved(w, P0, 100, every=50)
    w.step()
    stalled_stream(w, "stalled")
    w.assign([P0])
    w.step(40)
    assert 30 <= w.pipeline.tracker.done_beyond() < 30 + 8  # one poll past it at most
    assert P0 in w.kafka.paused
    w.producer.unacknowledged = lambda m: False
    w.step(40)
    assert offsets(w.results(), P0) == list(range(100))
    assert w.committed(P0) == 100


def test_a_partition_handed_over_during_an_outage_redoes_only_its_unanswered_frames() -> None:
    """Issue 67: the commit held at the stalled frame lists the answered ones beyond it in its metadata; the next
    owner (here the same worker after a lost session) skips them, and commits past them once the rest is answered."""
    w = World("at_least_once", max_uncommitted_frames=8)
    interleaved(w, P0, 60, every=10)
    w.step()
    stalled_stream(w, "stalled")
    w.assign([P0])
    w.step(40)
    assert w.kafka.group_committed[P0] == 0
    assert done_count(w.kafka.commit_metadata[P0], 0) == 54  # refreshed as they were answered
    w.kafka.rebalance("lost", [P0])
    w.step()
    w.assign([P0])
    w.step(20)
    assert w.metrics.frames_already_done._value.get() == 54
    w.producer.unacknowledged = lambda m: False
    w.step(10)
    counts = Counter(offsets(w.results(), P0))
    assert sorted(counts) == list(range(60))  # nothing lost
    stalled = set(range(0, 60, 10))
    assert {o for o, n in counts.items() if n > 1} == stalled  # redone: the stalled frames, answered late twice
    assert w.committed(P0) == 60 and w.kafka.commit_metadata[P0] == ""


def test_a_done_list_past_the_metadata_bound_is_committed_without_it_counted_and_redone() -> None:
    w = World("at_least_once", max_uncommitted_frames=8, commit_metadata_max_bytes=8)
    interleaved(w, P0, 60, every=10)
    w.step()
    stalled_stream(w, "stalled")
    w.assign([P0])
    w.step(40)
    assert w.metrics.commit_metadata_overflows._value.get() >= 1
    assert not w.kafka.commit_metadata.get(P0)
    w.kafka.rebalance("lost", [P0])
    w.step()
    w.assign([P0])
    w.producer.unacknowledged = lambda m: False
    w.step(30)
    counts = Counter(offsets(w.results(), P0))
    assert sorted(counts) == list(range(60)) and all(n == 2 for n in counts.values())  # everything redone


def test_a_full_producer_queue_pauses_the_input_and_never_blocks_the_loop() -> None:
    """Issue 67: librdkafka's local queue full (a results partition down): outputs wait in the sink for a later turn
    and every input partition pauses; once acknowledgements come back all is answered once."""
    w = World("at_least_once")
    w.frames(P0, 40)
    w.step()
    w.producer.queue_capacity = 3
    stalled_stream(w, f"s{P0[1]}")
    w.assign([P0])
    w.step(10)
    assert w.producer.pending_reports and len(w.producer.pending_reports) == 3
    assert w.pipeline.delivery.sink.backlog > 0 and P0 in w.kafka.paused
    w.producer.unacknowledged = lambda m: False
    w.step(30)
    assert Counter(offsets(w.results(), P0)) == Counter(range(40)) and w.committed(P0) == 40


def test_a_long_commit_interval_commits_early_rather_than_stop_at_the_uncommitted_cap() -> None:
    w = World("at_least_once", max_uncommitted_frames=8, commit_interval_ms=3_600_000)
    w.frames(P0, 40)
    w.assign([P0])
    w.step(40)
    assert offsets(w.results(), P0) == list(range(40))
    assert w.committed(P0) == 40


def test_a_class_held_at_its_pending_share_reads_all_its_partitions_at_the_same_pace() -> None:
    """Issue 51: the kit's consumer serves the lowest partition first, as librdkafka's fetch queue may; a class that
    backpressure lets read only part of it still reads (and so answers) every backlogged partition alike."""
    w = World(batching=BatchingSettings(rare_shape_min_count=1, max_batch_size=4, max_pending_frames=64))
    tps = [(BULK, p) for p in range(6)]
    for tp in tps:
        w.frames(tp, 300)
    w.assign(tps)
    while len(w.results()) < 600:
        w.step()
    answered = Counter((t, p) for t, p, _ in w.results())
    assert len(answered) == 6
    assert min(answered.values()) >= 0.75 * max(answered.values())


# -- stale work ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["at_least_once", "exactly_once"])
def test_bug3_outputs_of_a_lost_partition_are_dropped(mode: str) -> None:
    w = World(mode, hold=True)
    w.frames(P0, 2)
    w.frames(P1, 2)
    w.assign([P0, P1])
    w.step()
    w.kafka.rebalance("lost", [P0])
    w.step()
    w.executor.release()
    w.step(3)
    assert offsets(w.results(), P0) == []
    assert offsets(w.results(), P1) == [0, 1]
    assert (w.committed(P0) or 0) == 0


def test_outputs_of_a_lost_partition_are_dropped_even_when_it_comes_back() -> None:
    w = World("exactly_once", hold=True)
    w.frames(P0, 2)
    w.kafka.rebalance("assign", [P0])
    w.step()
    w.kafka.rebalance("lost", [P0])
    w.kafka.rebalance("assign", [P0])  # back to us before the old batch finishes: a new epoch
    w.step()
    w.executor.release()
    w.step(4)
    w.executor.release()
    w.step(3)
    assert offsets(w.results(), P0) == [0, 1]  # once each: the old epoch's outputs were dropped


@pytest.mark.parametrize("mode", ["at_least_once", "exactly_once"])
def test_bug9_a_partition_revoked_and_reassigned_inside_one_poll_is_reread_from_its_commit_never_twice(
        mode: str) -> None:
    w = World(mode)
    w.frames(P0, 3)
    w.kafka.rebalance("assign", [P0])
    w.step(3)
    w.frames(P0, 3, start=3)
    # One consume() call: messages 3-4 fetched, then revoke + re-assign from the committed offset 3, then 3-5.
    w.kafka.script = [("messages", 2), ("revoke", [P0]), ("assign", [P0]), ("messages", 3)]
    w.step(4)
    assert offsets(w.results(), P0) == [0, 1, 2, 3, 4, 5]
    assert w.committed(P0) == 6


def test_bug9_a_partition_lost_and_reassigned_inside_one_poll_loses_nothing() -> None:
    w = World("exactly_once", hold=True)
    w.kafka.group_committed[P0] = 3
    w.frames(P0, 7)
    w.kafka.script = [("assign", [P0]), ("messages", 2)]  # reads 3, 4
    w.step()
    # One consume() call: 5, 6 fetched ahead, the partition lost and assigned back (from 3), then 3..6 again.
    w.kafka.script = [("messages", 2), ("lost", [P0]), ("assign", [P0]), ("messages", 4)]
    w.step()
    for _ in range(4):
        w.executor.release()
        w.step(2)
    assert offsets(w.results(), P0) == [3, 4, 5, 6]
    assert w.committed(P0) == 7


@pytest.mark.parametrize("mode", ["at_least_once", "exactly_once"])
def test_revoked_partitions_are_finished_delivered_and_committed_before_they_go(mode: str) -> None:
    """Inside the revoke callback (exactly-once: one transaction, with the consumer's group metadata as the
    rebalance left it); once released, nothing of the partition is committed here any more."""
    w = World(mode)
    w.frames(P0, 3)
    w.assign([P0])
    w.step()  # 0..2 read
    w.kafka.rebalance("revoke", [P0])
    w.step()  # dispatched, then revoked inside the poll
    assert offsets(w.results(), P0) == [0, 1, 2]
    assert w.committed(P0) == 3
    assert P0 not in w.pipeline.assignments


def test_a_commit_that_failed_just_before_a_revocation_is_made_again_before_the_partition_goes() -> None:
    """Its outcome is served in the same consume() as the revoke, before the loop saw it: the revoke handler gets
    it, so the final commit offers that commit point again instead of taking it as committed."""
    w = World("at_least_once")
    w.frames(P0, 3)
    w.kafka.commit_error = KafkaError(KafkaError.REBALANCE_IN_PROGRESS)
    w.assign([P0])
    w.step(4)  # every commit fails and is made again the next turn
    assert offsets(w.results(), P0) == [0, 1, 2] and w.committed(P0) is None
    w.kafka.hold_commit_reports = True
    w.step()  # the commit of 3 is sent again, fails, and its outcome is not served yet
    w.kafka.commit_error = None
    w.kafka.hold_commit_reports = False
    w.kafka.rebalance("revoke", [P0])
    w.step()
    assert w.committed(P0) == 3


def test_bug11_offsets_the_consumer_delivers_again_within_an_assignment_are_dropped() -> None:
    w = World("exactly_once")
    w.frames(P0, 4)
    w.kafka.rebalance("assign", [P0])
    w.step(3)
    w.kafka.position_of[P0] = 1  # librdkafka rewinds on its own, no seek asked for
    w.step(3)
    assert offsets(w.results(), P0) == [0, 1, 2, 3]
    assert w.pipeline.metrics.redelivered._value.get() == 3


# -- exactly-once transactions -------------------------------------------------------------------------------
def test_an_aborted_transaction_rewinds_and_every_frame_is_answered_once() -> None:
    w = World("exactly_once")
    w.frames(P0, 3)
    w.kafka.rebalance("assign", [P0])
    w.producer.commit_errors.append(abortable())
    w.step(5)
    assert "abort" in w.producer.calls
    # The assignment's seek to the committed offset, then the rewind's: read again (nothing committed: the start).
    assert w.kafka.seeks == [(P0, 0), (P0, 0)]
    assert offsets(w.results(), P0) == [0, 1, 2]
    assert w.committed(P0) == 3


def illegal_generation() -> KafkaError:
    """What the group coordinator answers a transaction's offsets after a rebalance round moved the group on."""
    return KafkaError(KafkaError.ILLEGAL_GENERATION, "Specified group generation id is not valid",
                      txn_requires_abort=True)


def test_offsets_refused_for_an_old_generation_abort_a_transaction_that_holds_nothing_and_nothing_is_read_again(
        ) -> None:
    """Issue #51: every rebalance round refused one transaction's offsets on each busy worker, and its abort
    rewound everything read since the last commit. The offsets now go first: refused, the transaction holds no
    output yet, and the held outputs go out with the next transaction; nothing is sought or read again."""
    w = World("exactly_once")
    w.frames(P0, 3)
    w.assign([P0])
    w.producer.send_offsets_errors.append(illegal_generation())
    w.step(5)
    assert w.producer.calls.count("abort") == 1
    first = w.producer.calls.index("abort")
    assert w.producer.calls[first - 2:first] == ["begin", "send_offsets"]  # nothing produced in the aborted one
    assert w.kafka.seeks == [(P0, 0)]  # the assignment's seek to its committed offset, and no rewind
    assert offsets(w.results(), P0) == [0, 1, 2]
    assert w.committed(P0) == 3
    assert w.pipeline.metrics.commits.labels("aborted")._value.get() == 1


def test_an_output_never_joins_a_transaction_before_its_offsets_are_accepted() -> None:
    w = World("exactly_once")
    w.frames(P0, 2)
    w.assign([P0])
    produced_at: list[int] = []
    produce = w.producer.produce

    def produce_after_offsets(*args: Any, **kwargs: Any) -> None:
        produced_at.append(len(w.producer.calls))
        produce(*args, **kwargs)

    w.producer.produce = produce_after_offsets  # type: ignore[method-assign]
    w.step(4)
    assert produced_at and all(w.producer.calls[i - 1] == "send_offsets" for i in produced_at)


def test_offsets_refused_every_time_are_retried_each_turn_without_loss_or_duplicates() -> None:
    w = World("exactly_once")
    w.frames(P0, 3)
    w.assign([P0])
    w.producer.send_offsets_errors += [illegal_generation()] * 3
    w.step(8)
    assert w.producer.calls.count("abort") == 3
    assert offsets(w.results(), P0) == [0, 1, 2] and w.committed(P0) == 3


def test_a_refusal_of_offsets_that_is_not_abortable_stops_the_worker() -> None:
    w = World("exactly_once")
    w.frames(P0, 3)
    w.assign([P0])
    w.producer.send_offsets_errors.append(KafkaError(KafkaError._FENCED, fatal=True))
    with pytest.raises(SinkError, match="fenced"):
        w.step(3)
    assert w.results() == []


def test_bug8_a_stuck_transactional_call_is_replaced_by_a_fencing_producer() -> None:
    w = World("exactly_once")
    w.frames(P0, 3)
    w.assign([P0])
    stuck = w.producer
    stuck.block_send_offsets = True
    w.step()
    w.step()
    assert len(w.producers) == 2  # a new producer with the same transactional id fences the stuck one
    assert w.producers[1].conf["transactional.id"] == stuck.conf["transactional.id"]
    assert (P0, 0) in w.kafka.seeks
    w.step(4)
    assert offsets(w.results(), P0) == [0, 1, 2]
    assert stuck.visible == []


# -- outputs that cannot be produced ------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["at_least_once", "exactly_once"])
def test_a_result_the_client_refuses_is_dead_lettered_by_reference_and_the_partition_moves_on(
        mode: str) -> None:
    w = World(mode)
    w.max_message_bytes = 400
    w.producers.clear()
    w.pipeline = build_pipeline(w.settings, w.executor, Metrics(), w.health, w.clock, clients=w.clients)
    w.pipeline.source.subscribe(w.pipeline._on_assign, w.pipeline._on_revoke, w.pipeline._on_lost)
    w.kafka.append(P0, frame_value("s", 0), frame_value("s", 1, tenant="x" * 600), frame_value("s", 2))
    w.kafka.headers = {(P0, 1): [("streamfer.replay_count", b"2")]}
    w.kafka.rebalance("assign", [P0])
    w.step(4)
    assert offsets(w.results(), P0) == [0, 2]
    [dl] = w.dead_letters()
    assert dl.headers["streamfer.error_type"] == OUTPUT_REJECTED
    assert dl.headers["streamfer.source_offset"] == "1"
    assert dl.headers["streamfer.replay_count"] == "2"  # so `worker dlq` knows how often it was replayed
    assert dl.value == b""
    assert w.committed(P0) == 3


@pytest.mark.parametrize("mode", ["at_least_once", "exactly_once"])
def test_a_result_the_broker_refuses_is_dead_lettered_by_reference(mode: str) -> None:
    w = World(mode)
    w.frames(P0, 3)

    def refuse_offset_1(m: Produced) -> KafkaError | None:
        if m.topic == w.settings.topics.results and decode_result(m.value)["source_offset"] == 1:
            return KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)
        return None

    w.producer.refuse = refuse_offset_1
    w.kafka.rebalance("assign", [P0])
    w.step(6)
    assert offsets(w.results(), P0) == [0, 2]
    assert [d.headers["streamfer.source_offset"] for d in w.dead_letters()] == ["1"]
    assert w.committed(P0) == 3


# -- lifecycle --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["at_least_once", "exactly_once"])
def test_a_stop_request_drains_running_batches_delivers_and_commits(mode: str) -> None:
    w = World(mode)
    w.frames(P0, 3)
    w.assign([P0])
    turns = iter(range(1))

    def should_stop() -> bool:
        w.clock.now += STEP_S
        return next(turns, None) is None  # SIGTERM after one turn: the frames are read, not yet batched

    summary = w.pipeline.run(should_stop)
    assert offsets(w.results(), P0) == [0, 1, 2]
    assert w.committed(P0) == 3
    assert summary.results == 3


def test_bug1_idle_time_counts_only_from_the_first_assignment() -> None:
    w = World()
    w.clock.now += 3_600
    assert w.pipeline._idle_for() == 0.0  # still joining the group: never idle
    w.kafka.rebalance("assign", [P0])
    w.step()
    w.clock.now += 5
    assert w.pipeline._idle_for() == pytest.approx(5)


@pytest.mark.parametrize("committed_moves", [True, False])
def test_bug12_exit_when_idle_waits_until_the_committed_offsets_reach_the_end(committed_moves: bool) -> None:
    w = World("exactly_once")
    if not committed_moves:  # as while a dead member's open transaction still holds the group's offsets
        w.producer.group = None
    w.frames(P0, 2)
    w.kafka.rebalance("assign", [P0])
    turns = 0

    def should_stop() -> bool:
        nonlocal turns
        turns += 1
        w.clock.now += STEP_S
        return turns > 40

    w.pipeline.run(should_stop, exit_when_idle_s=1.0)
    assert offsets(w.results(), P0) == [0, 1]
    if committed_moves:
        assert turns < 20  # idle for 1 s (5 turns) after the last commit, and caught up: gone
    else:
        assert turns > 40  # never caught up: stays until stopped


def test_a_repeated_frame_identity_is_dead_lettered_and_the_first_copy_scored() -> None:
    w = World("exactly_once")
    w.kafka.append(P0, frame_value("s", 0), frame_value("s", 1), frame_value("s", 0))  # offset 2 repeats 0
    w.kafka.rebalance("assign", [P0])
    w.step(4)
    assert offsets(w.results(), P0) == [0, 1]
    [dl] = w.dead_letters()
    assert (dl.headers["streamfer.error_type"], dl.headers["streamfer.source_offset"]) == ("DuplicateFrame", "2")
    assert w.committed(P0) == 3


@pytest.mark.parametrize("mode", ["at_least_once", "exactly_once"])
def test_a_replayed_copy_of_a_frame_is_scored_and_a_second_copy_of_that_replay_is_a_duplicate(
        mode: str) -> None:
    """`worker dlq replay` publishes a dead-lettered frame again with streamfer.replay_count: a new copy on purpose,
    not a duplicate of the first (which the worker dead-lettered), while the same replay twice is one."""
    w = World(mode)
    w.kafka.append(P0, frame_value("s", 0), frame_value("s", 0), frame_value("s", 0))
    w.kafka.headers = {(P0, 1): [("streamfer.replay_count", b"1")], (P0, 2): [("streamfer.replay_count", b"1")]}
    w.kafka.rebalance("assign", [P0])
    w.step(4)
    assert offsets(w.results(), P0) == [0, 1]
    [dl] = w.dead_letters()
    assert dl.headers["streamfer.error_type"] == "DuplicateFrame" and dl.headers["streamfer.source_offset"] == "2"
    assert "(replay 1)" in dl.headers["streamfer.error"] and "offset 1 " in dl.headers["streamfer.error"]
    assert w.committed(P0) == 3


@pytest.mark.parametrize("mode", ["at_least_once", "exactly_once"])
def test_a_dead_letter_keeps_the_input_messages_headers_and_replay_count_before_its_own_context(
        mode: str) -> None:
    w = World(mode)
    w.kafka.append(P0, frame_value("s", 0), frame_value("s", 0))
    w.kafka.headers = {(P0, 1): [("trace-id", b"abc"), ("streamfer.error", b"forged"),
                                 ("streamfer.replay_count", b"0")]}
    w.kafka.rebalance("assign", [P0])
    w.step(4)
    [dl] = w.dead_letters()
    assert dl.headers["trace-id"] == "abc" and dl.headers["streamfer.replay_count"] == "0"
    assert dl.headers["streamfer.error"].startswith("duplicate frame")  # the input's "forged" copy is dropped
    assert list(dl.headers) == ["trace-id", "streamfer.replay_count", "streamfer.error", "streamfer.error_type",
                                "streamfer.source_topic", "streamfer.source_partition", "streamfer.source_offset",
                                "streamfer.worker_id"]


@pytest.mark.parametrize("mode", ["at_least_once", "exactly_once"])
def test_a_replay_count_that_is_not_a_count_is_a_decode_error_with_the_headers_kept(
        mode: str) -> None:
    w = World(mode)
    w.kafka.append(P0, frame_value("s", 0))
    w.kafka.headers = {(P0, 0): [("streamfer.replay_count", b"two")]}
    w.kafka.rebalance("assign", [P0])
    w.step(4)
    [dl] = w.dead_letters()
    assert dl.headers["streamfer.error_type"] == "MessageDecodeError"
    assert "streamfer.replay_count" in dl.headers["streamfer.error"] and dl.headers["streamfer.replay_count"] == "two"
    assert w.results() == [] and w.committed(P0) == 1


def test_a_producer_that_cannot_abort_is_replaced_and_the_frames_answered_once() -> None:
    # As after a message the broker refused inside a transaction: the commit fails, then the abort too
    # (OUT_OF_ORDER_SEQUENCE_NUMBER is fatal for a transactional producer).
    w = World("exactly_once")
    w.frames(P0, 3)
    w.kafka.rebalance("assign", [P0])
    broken = w.producer
    broken.commit_errors.append(abortable())
    broken.abort_errors.append(KafkaError(KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER, fatal=True))
    w.step(6)
    assert len(w.producers) == 2 and broken.visible == []
    assert offsets(w.results(), P0) == [0, 1, 2]
    assert w.committed(P0) == 3


def test_a_fenced_producer_stops_the_worker() -> None:
    w = World("exactly_once")
    w.frames(P0, 3)
    w.kafka.rebalance("assign", [P0])
    w.producer.commit_errors.append(KafkaError(KafkaError._FENCED, fatal=True))
    with pytest.raises(SinkError, match="fenced"):
        w.step(6)
    assert len(w.producers) == 1  # never replaced: another worker owns the transactional id


# -- metrics: counted once per label set per poll or batch, the counts as exact as frame by frame ----------------
def sample(w: World, name: str, **labels: str) -> float:
    return w.metrics.registry.get_sample_value(name, labels) or 0.0


def test_frames_consumed_in_one_poll_are_counted_per_topic_and_tenant_label_in_the_order_tenants_came() -> None:
    s = Settings()
    metrics = Metrics(settings=dataclasses.replace(s, observability=dataclasses.replace(s.observability,
                                                                                          max_metric_tenants=2)))
    w = World(metrics=metrics)
    # First seen: zed, then amy; bob comes third (although the most frequent, and first in name order): "other".
    tenants = ["zed", "amy", "zed", "bob", "amy", "bob", "bob"]
    w.kafka.append(P0, *(frame_value("s", i, tenant=t) for i, t in enumerate(tenants)), b"not a frame")
    w.kafka.append((REALTIME, 0), frame_value("r", 0, tenant="bob"), frame_value("r", 1, tenant="amy"))
    w.assign([P0, (REALTIME, 0)])
    w.step()
    assert w.pipeline.summary.consumed == 10  # all read in one poll
    consumed = {(labels["topic"], labels["tenant"]): value for metric in w.metrics.registry.collect()
                for name, labels, value, *_ in metric.samples if name == "streamfer_frames_consumed_total"}
    assert consumed == {(BULK, "zed"): 2, (BULK, "amy"): 2, (BULK, "other"): 3, (BULK, "unknown"): 1,
                        (REALTIME, "other"): 1, (REALTIME, "amy"): 1}


def test_expired_frames_are_counted_per_topic_and_tenant() -> None:
    w = World(hold=True, max_inflight=1)
    tenants = ["a", "b", "b", "c"] * 4
    w.kafka.append((REALTIME, 0), *(frame_value("r", i, tenant=t) for i, t in enumerate(tenants)))
    w.assign([(REALTIME, 0)])
    w.step(10)  # realtime's max_age_ms (2 s) passes while two batches hold the model
    ran = Counter(f.tenant for batch in w.executor.batches for f in batch)
    expired = Counter(tenants) - ran
    assert w.pipeline.summary.expired == sum(expired.values()) > 0
    for tenant in "abc":
        assert sample(w, "streamfer_frames_expired_total", topic=REALTIME, tenant=tenant) == expired[tenant]


class FlaggingExecutor(FakeExecutor):
    """Flags frame i with nothing, "nudity", or "nudity" and "violence", by i % 3."""

    LABELS: tuple[tuple[str, ...], ...] = ((), ("nudity",), ("nudity", "violence"))

    def submit(self, frames: Any, shape: tuple[int, int, int],
               priority: Priority = Priority.BULK) -> Future[BatchOutcome]:
        frames = list(frames)
        future: Future[BatchOutcome] = Future()
        future.set_result(dataclasses.replace(outcome(frames), verdicts=[
            (f, Verdict({"nudity": 0.9}, self.LABELS[f.frame_index % 3])) for f in frames]))
        return future


def test_flags_latencies_and_results_are_counted_per_label_class_and_tenant() -> None:
    w = World(executor=FlaggingExecutor())
    w.kafka.append(P0, *(frame_value("s", i, tenant="ab"[i % 2]) for i in range(9)))
    w.kafka.append((REALTIME, 0), *(frame_value("r", i, tenant="a") for i in range(5)))
    w.assign([P0, (REALTIME, 0)])
    w.step(6)
    assert len(w.results()) == 14
    indices = list(range(9)) + list(range(5))
    assert sample(w, "streamfer_frames_flagged_total", label="nudity") == sum(i % 3 > 0 for i in indices)
    assert sample(w, "streamfer_frames_flagged_total", label="violence") == sum(i % 3 == 2 for i in indices)
    for metric in ("streamfer_queue_wait_seconds_count", "streamfer_end_to_end_seconds_count"):
        assert sample(w, metric, priority="bulk") == 9
        assert sample(w, metric, priority="realtime") == 5
    results = w.settings.topics.results
    assert sample(w, "streamfer_results_produced_total", topic=results, tenant="a", status="OK") == 5 + 5
    assert sample(w, "streamfer_results_produced_total", topic=results, tenant="b", status="OK") == 4


def test_warm_up_timings_of_any_frame_size_seed_the_batch_shape_a_fixed_model_input_gives(monkeypatch):
    """The batcher keys frames bound for a fixed input by that input: so must the warm-up's calibration."""
    executor = FakeExecutor()
    executor.model_input_hw = (224, 224)
    w = World(monkeypatch, executor=executor)
    w.pipeline.seed_costs([((720, 1280, 3), 4, 0.010), ((1080, 1920, 3), 4, 0.012)])

    assert set(w.pipeline.cost.snapshot()) == {"224x224x3"}
