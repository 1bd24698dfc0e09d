"""In-memory stand-ins for librdkafka's Consumer and Producer, and a runtime that scores on demand, so the real
FrameSource, ResultSink, delivery and Pipeline run together in a unit test (or a benchmark of the loop) without a
broker or a model. Part of the public kit: `from worker.testing import FakeConsumer, FakeProducer, FakeExecutor`.

The consumer is a tiny log: partitions hold messages, the group holds committed offsets, and rebalance
callbacks run inside `consume()` as librdkafka runs them, optionally between messages of the same call. The
producer keeps what a read_committed reader would see (`visible`) apart from what was merely sent.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from confluent_kafka import OFFSET_BEGINNING, OFFSET_INVALID, KafkaError, KafkaException, TopicPartition

from worker.codec.schemas import FrameRecord, decode_result, encode_frame
from worker.frames import TP, BatchOutcome, Encoding, Frame, Priority, Verdict

if TYPE_CHECKING:
    from worker.kafka.wiring import KafkaClients

# Frames are captured a second before the kit's fake clock starts (worker.testing.clock.START).
CAPTURE_TS_MS = 1_799_999_999_000


def frame_value(stream: str, index: int, tenant: str = "t", side: int = 2) -> bytes:
    """A frame message as a producer writes it: `side` x `side` black RGB pixels, captured at CAPTURE_TS_MS."""
    return encode_frame(FrameRecord(stream_id=stream, frame_index=index, capture_ts_ms=CAPTURE_TS_MS, tenant=tenant,
                                    priority=Priority.REALTIME, width=side, height=side, channels=3,
                                    encoding=Encoding.RAW_RGB8, data=bytes(side * side * 3)))


@dataclass
class FakeMessage:
    _topic: str
    _partition: int
    _offset: int
    _value: bytes
    _key: bytes | None = b"s"
    _error: KafkaError | None = None
    _headers: list[tuple[str, bytes]] | None = None

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def value(self) -> bytes:
        return self._value

    def key(self) -> bytes | None:
        return self._key

    def headers(self) -> list[tuple[str, bytes]] | None:
        return self._headers

    def error(self) -> KafkaError | None:
        return self._error


@dataclass
class FakeConsumer:
    """A consumer of an in-memory log. `rebalance(...)` queues callbacks for the next consume() call; `script`
    gives one call's exact interleaving of messages and callbacks."""

    conf: dict[str, Any]
    log: dict[TP, list[bytes]] = field(default_factory=dict)
    group_committed: dict[TP, int] = field(default_factory=dict)
    commit_metadata: dict[TP, str] = field(default_factory=dict)  # each committed offset's metadata (empty: none)
    position_of: dict[TP, int] = field(default_factory=dict)
    paused: set[TP] = field(default_factory=set)
    callbacks: dict[str, Callable[..., None]] = field(default_factory=dict)
    queued_events: list[tuple[str, list[TP]]] = field(default_factory=list)
    script: list[tuple[str, Any]] = field(default_factory=list)
    commit_history: list[dict[TP, int]] = field(default_factory=list)
    seeks: list[tuple[TP, int]] = field(default_factory=list)
    commit_error: KafkaError | None = None  # while set, every commit fails (a coordinator away)
    headers: dict[tuple[TP, int], list[tuple[str, bytes]]] = field(default_factory=dict)  # by (tp, offset)
    hold_commit_reports: bool = False  # while set, commit outcomes are not reported (librdkafka still retrying)
    _commit_reports: list[tuple[KafkaError | None, list[TopicPartition]]] = field(default_factory=list)

    # -- test controls --
    def append(self, tp: TP, *values: bytes) -> None:
        self.log.setdefault(tp, []).extend(values)

    def rebalance(self, kind: str, tps: list[TP]) -> None:
        self.queued_events.append((kind, tps))

    # -- the Consumer API FrameSource uses --
    def subscribe(self, topics: list[str], on_assign: Callable[..., None], on_revoke: Callable[..., None],
                  on_lost: Callable[..., None]) -> None:
        self.callbacks = {"assign": on_assign, "revoke": on_revoke, "lost": on_lost}

    def _run_event(self, kind: str, tps: list[TP]) -> None:
        if kind == "assign":
            for tp in tps:
                self.position_of[tp] = self.group_committed.get(tp, 0)
        self.callbacks[kind](self, [TopicPartition(t, p) for t, p in tps])
        if kind != "assign":
            for tp in tps:
                self.position_of.pop(tp, None)
                self.paused.discard(tp)

    def _take(self, n: int) -> list[FakeMessage]:
        out: list[FakeMessage] = []
        for tp in sorted(self.position_of):
            if tp in self.paused:
                continue
            values = self.log.get(tp, [])
            while len(out) < n and self.position_of[tp] < len(values):
                offset = self.position_of[tp]
                out.append(FakeMessage(tp[0], tp[1], offset, values[offset], _headers=self.headers.get((tp, offset))))
                self.position_of[tp] = offset + 1
        return out

    def consume(self, num_messages: int, timeout: float) -> list[FakeMessage]:
        self._serve_commit_reports()
        out: list[FakeMessage] = []
        if self.script:
            script, self.script = self.script, []
            for kind, arg in script:
                if kind == "messages":
                    out += self._take(arg)
                else:
                    self._run_event(kind, arg)
            return out
        while self.queued_events:
            self._run_event(*self.queued_events.pop(0))
        return self._take(num_messages)

    def unsubscribe(self) -> None:
        """As librdkafka's: the revoke of everything assigned is served by a later consume()."""
        self.queued_events.append(("revoke", sorted(self.position_of)))

    def pause(self, partitions: list[TopicPartition]) -> None:
        self.paused.update((p.topic, p.partition) for p in partitions)

    def resume(self, partitions: list[TopicPartition]) -> None:
        self.paused.difference_update((p.topic, p.partition) for p in partitions)

    def commit(self, offsets: list[TopicPartition], asynchronous: bool = True) -> list[TopicPartition] | None:
        points = {(o.topic, o.partition): o.offset for o in offsets}
        if self.commit_error is not None:
            if asynchronous:
                self._commit_reports.append((self.commit_error, offsets))
                return None
            raise KafkaException(self.commit_error)
        self.commit_history.append(points)
        self.group_committed.update(points)
        self.commit_metadata.update({(o.topic, o.partition): o.metadata or "" for o in offsets})
        if asynchronous:
            self._commit_reports.append((None, offsets))
            return None
        cb = self.conf.get("on_commit")
        if cb is not None:
            cb(None, offsets)
        return offsets

    def _serve_commit_reports(self) -> None:
        if self.hold_commit_reports:
            return
        cb = self.conf.get("on_commit")
        reports, self._commit_reports = self._commit_reports, []
        for err, offsets in reports:
            if cb is not None:
                cb(err, offsets)

    def committed(self, partitions: list[TopicPartition], timeout: float) -> list[TopicPartition]:
        return [TopicPartition(p.topic, p.partition, self.group_committed.get((p.topic, p.partition), OFFSET_INVALID),
                               self.commit_metadata.get((p.topic, p.partition), ""))
                for p in partitions]

    def seek(self, tp: TopicPartition) -> None:
        offset = 0 if tp.offset == OFFSET_BEGINNING else tp.offset
        self.seeks.append(((tp.topic, tp.partition), offset))
        self.position_of[(tp.topic, tp.partition)] = offset

    def position(self, partitions: list[TopicPartition]) -> list[TopicPartition]:
        return [TopicPartition(p.topic, p.partition, self.position_of.get((p.topic, p.partition), -1))
                for p in partitions]

    def get_watermark_offsets(self, tp: TopicPartition, timeout: float = 1.0, cached: bool = False) -> tuple[int, int]:
        return 0, len(self.log.get((tp.topic, tp.partition), []))

    def consumer_group_metadata(self) -> object:
        return "group-metadata"

    def close(self) -> None:
        for tp in sorted(self.position_of):
            self.group_committed.setdefault(tp, self.group_committed.get(tp, 0))


@dataclass
class Produced:
    topic: str
    key: bytes | None
    value: bytes
    headers: dict[str, str]

    def partition(self) -> int:
        """The output partition (the kit's output topics have one)."""
        return 0


@dataclass
class FakeProducer:
    """A producer whose delivery reports arrive on poll()/flush(). Transactional when the conf says so: messages
    become `visible` (to a read_committed reader) only when their transaction commits."""

    conf: dict[str, Any]
    max_message_bytes: int = 1_000_000
    # The group's committed offsets (the consumer's): a committed transaction's offsets land there.
    group: dict[TP, int] | None = None
    visible: list[Produced] = field(default_factory=list)
    committed_offsets: list[dict[TP, int]] = field(default_factory=list)
    pending_reports: list[tuple[Callable[..., None], Produced]] = field(default_factory=list)
    # Broker-side refusals: a delivery report error for messages matching the predicate.
    refuse: Callable[[Produced], KafkaError | None] = lambda produced: None
    # Outputs whose partition is down (its leader away): their delivery reports wait while this says so.
    unacknowledged: Callable[[Produced], bool] = lambda produced: False
    # librdkafka's local queue: produce raises BufferError while this many messages await their reports.
    queue_capacity: int | None = None
    commit_errors: list[KafkaError] = field(default_factory=list)
    # Raised by send_offsets_to_transaction in turn (ILLEGAL_GENERATION after a rebalance round, say).
    send_offsets_errors: list[KafkaError] = field(default_factory=list)
    abort_errors: list[KafkaError] = field(default_factory=list)
    block_send_offsets: bool = False
    calls: list[str] = field(default_factory=list)
    _transaction: list[Produced] = field(default_factory=list)
    _transaction_offsets: dict[TP, int] = field(default_factory=dict)
    _transaction_failed: bool = False

    @property
    def transactional(self) -> bool:
        return "transactional.id" in self.conf

    def produce(self, topic: str, value: bytes, key: bytes | None = None,
                headers: list[tuple[str, bytes]] | None = None, on_delivery: Callable[..., None] | None = None) -> None:
        if len(value) > self.max_message_bytes:
            raise KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
        if self.queue_capacity is not None and len(self.pending_reports) >= self.queue_capacity:
            raise BufferError("Local: Queue full")
        produced = Produced(topic, key, value, {k: v.decode() for k, v in (headers or [])})
        assert on_delivery is not None
        self.pending_reports.append((on_delivery, produced))
        if self.transactional:
            self._transaction.append(produced)

    def poll(self, timeout: float = 0.0) -> int:
        reports, self.pending_reports = self.pending_reports, []
        waiting = [r for r in reports if self.unacknowledged(r[1])]
        if waiting:
            self.pending_reports = waiting
            reports = [r for r in reports if not self.unacknowledged(r[1])]
        for callback, produced in reports:
            err = self.refuse(produced)
            if err is None and not self.transactional:
                self.visible.append(produced)
            elif err is not None and self.transactional:
                self._transaction_failed = True
            callback(err, produced)
        return len(reports)

    def flush(self, timeout: float = 0.0) -> int:
        self.poll(0)
        return len(self.pending_reports)

    def __len__(self) -> int:
        return len(self.pending_reports)

    # -- transactions --
    def init_transactions(self, timeout: float) -> None:
        self.calls.append("init")

    def begin_transaction(self) -> None:
        self.calls.append("begin")
        self._transaction, self._transaction_offsets, self._transaction_failed = [], {}, False

    def send_offsets_to_transaction(self, offsets: list[TopicPartition], metadata: object, timeout: float) -> None:
        self.calls.append("send_offsets")
        if self.block_send_offsets:
            import threading

            threading.Event().wait()  # as librdkafka does when its coordinator request is never re-triggered
        if self.send_offsets_errors:
            raise KafkaException(self.send_offsets_errors.pop(0))
        self._transaction_offsets = {(o.topic, o.partition): o.offset for o in offsets}

    def commit_transaction(self, timeout: float) -> None:
        self.calls.append("commit")
        self.poll(0)
        if self.commit_errors:
            raise KafkaException(self.commit_errors.pop(0))
        if self._transaction_failed:
            raise KafkaException(KafkaError(KafkaError._STATE, "a message of the transaction failed",
                                            txn_requires_abort=True))
        self.visible.extend(self._transaction)
        self.committed_offsets.append(dict(self._transaction_offsets))
        if self.group is not None:
            self.group.update(self._transaction_offsets)
        self._transaction = []

    def abort_transaction(self, timeout: float) -> None:
        self.calls.append("abort")
        if self.abort_errors:
            raise KafkaException(self.abort_errors.pop(0))
        self._transaction = []


def abortable(reason: str = "injected") -> KafkaError:
    return KafkaError(KafkaError._STATE, reason, txn_requires_abort=True)


class FakeExecutor:
    """Scores every frame `scores` at once, or holds batches until `release()` when `hold` is set; reports
    `runners` runners (the loop keeps each fed)."""

    preferred_batch_sizes: tuple[int, ...] = ()
    model_input_hw: tuple[int, int] | None = None
    memory_policy = None
    model_name = "fake"
    model_version = "1"

    def __init__(self, hold: bool = False, runners: int = 1) -> None:
        self.hold = hold
        self.runner_count = runners
        self.held: list[tuple[list[Frame], Future[BatchOutcome]]] = []
        self.batches: list[list[Frame]] = []
        self.priorities: list[Priority] = []
        self.closed = False

    def close(self) -> None:
        """As InferenceExecutor.close (a rollout closes a replaced model after its last batch)."""
        self.closed = True

    def submit(self, frames: Any, shape: tuple[int, int, int],
               priority: Priority = Priority.BULK) -> Future[BatchOutcome]:
        frames = list(frames)
        self.batches.append(frames)
        self.priorities.append(priority)
        future: Future[BatchOutcome] = Future()
        if self.hold:
            self.held.append((frames, future))
        else:
            future.set_result(outcome(frames))
        return future

    def release(self, predicate: Callable[[Frame], bool] = lambda f: True) -> None:
        """Finish the held batches that contain a frame matching `predicate`."""
        still: list[tuple[list[Frame], Future[BatchOutcome]]] = []
        for frames, future in self.held:
            if any(predicate(f) for f in frames):
                future.set_result(outcome(frames))
            else:
                still.append((frames, future))
        self.held = still


def outcome(frames: list[Frame]) -> BatchOutcome:
    return BatchOutcome(verdicts=[(f, Verdict({"nudity": 0.1}, ())) for f in frames], failures=[],
                        batch_size=len(frames), preprocess_ms=1.0, inference_ms=1.0, started_at=0.0, bucket=len(frames),
                        used_graph=False)


class InMemoryKafka:
    """A broker for one pipeline, in memory: frames sent to a partition are assigned to the pipeline's consumer on
    its first poll; `results()` and `dead_letters()` are what a read_committed reader sees, `committed` the group's
    offsets. Pass `clients` to worker.loop.pipeline.build_pipeline (docs/testing.md has the example)."""

    def __init__(self) -> None:
        self.log: dict[TP, list[bytes]] = {}
        self.consumer: FakeConsumer | None = None
        self.producers: list[FakeProducer] = []

    def send(self, tp: TP, *values: bytes) -> None:
        """Append messages (e.g. `frame_value(...)`) to a partition of an input topic."""
        self.log.setdefault(tp, []).extend(values)

    @property
    def clients(self) -> KafkaClients:
        """The loop's Kafka clients over this broker (worker.kafka.wiring is imported late: it loads the Kafka edge)."""
        from worker.kafka.wiring import KafkaClients

        return KafkaClients(consumer=self._new_consumer, producer=self._new_producer,
                            output_message_limit=lambda settings: None)

    def _new_consumer(self, conf: dict[str, Any], logger: Any = None) -> FakeConsumer:
        self.consumer = FakeConsumer(conf, log=self.log)
        self.consumer.rebalance("assign", sorted(self.log))
        return self.consumer

    def _new_producer(self, conf: dict[str, Any], logger: Any = None) -> FakeProducer:
        producer = FakeProducer(conf, group=self.consumer.group_committed if self.consumer is not None else None)
        self.producers.append(producer)
        return producer

    def _visible(self, predicate: Callable[[Produced], bool]) -> list[Produced]:
        return [m for p in self.producers for m in p.visible if predicate(m)]

    def results(self, topic: str = "moderation.results") -> list[dict[str, Any]]:
        """The results produced (and committed, with transactions), decoded."""
        return [decode_result(m.value) for m in self._visible(lambda m: m.topic == topic)]

    def dead_letters(self, topic: str = "frames.dlq") -> list[Produced]:
        return self._visible(lambda m: m.topic == topic)

    @property
    def committed(self) -> dict[TP, int]:
        """The group's committed offsets (by commit or by a committed transaction)."""
        return dict(self.consumer.group_committed) if self.consumer is not None else {}
