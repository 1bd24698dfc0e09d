"""The Kafka consumer side: subscription to the per-priority input topics, decoding, pausing by class,
rebalance callbacks and offset commits. A thin typed wrapper; the decisions live in the pipeline.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from confluent_kafka import OFFSET_BEGINNING, OFFSET_INVALID, Consumer, KafkaError, KafkaException, Message, TopicPartition

from worker.config import ConfigError, Settings
from worker.frames import DeadLetter, Frame, Priority, SourceRef
from worker.kafka_access import client_properties
from worker.kafka_errors import UNKNOWN_TOPIC, BrokerStatus, Identity, RefusalStreak, classify_consumer_error
from worker.schemas import MessageDecodeError, decode_frame

log = logging.getLogger(__name__)

TP = tuple[str, int]


class SourceError(RuntimeError):
    """The consumer hit an error it cannot continue from (bad config, fatal broker error)."""


@dataclass
class Polled:
    """One poll's worth of input: decodable frames and the messages that go to the dead-letter topic."""

    frames: list[Frame]
    dead_letters: list[DeadLetter]
    # Messages dropped because this assignment had already delivered their offsets (see FrameSource.poll).
    redelivered: int = 0


RebalanceHandler = Callable[[list[TP]], None]


class FrameSource:
    """Consumes frames from the input topics; each message becomes a Frame or a DeadLetter, never vanishes."""

    def __init__(self, settings: Settings, clock: Callable[[], float] = time.time,
                 on_commit_done: Callable[[list[TP], str | None], None] | None = None) -> None:
        k = settings.kafka
        # Authentication, authorisation and reachability are reported here, not as messages (librdkafka 2.x).
        self.broker_status = BrokerStatus(unreachable_limit_s=k.session_timeout_ms / 1000.0)
        self._identity = Identity.of(settings)
        self._refusals = RefusalStreak()
        conf: dict[str, object] = {
            **client_properties(k),
            "group.id": k.group_id,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "partition.assignment.strategy": "cooperative-sticky",
            "session.timeout.ms": k.session_timeout_ms,
            "max.poll.interval.ms": k.max_poll_interval_ms,
            # Producers may write frames transactionally; never feed aborted frames to the model.
            "isolation.level": "read_committed",
            "client.id": settings.observability.worker_id,
            "error_cb": self._on_client_error,
            # Broker states for /healthz: the only sign librdkafka gives that a lost cluster is back.
            "stats_cb": self._on_stats,
            "statistics.interval.ms": 5000,
        }
        if k.group_instance_id:
            conf["group.instance.id"] = k.group_instance_id
        if on_commit_done is not None:
            conf["on_commit"] = lambda err, parts: _report_commit(err, parts, on_commit_done)
        conf.update(k.consumer_overrides)
        self._topics = settings.topics.input_topics()
        self._clock = clock
        try:
            self._consumer = Consumer(conf, logger=log)
        except KafkaException as exc:
            raise ConfigError([f"kafka.consumer_overrides / kafka settings: librdkafka rejected the consumer "
                               f"configuration: {exc.args[0].str()}"]) from None
        self._assigned: set[TP] = set()
        self._paused_classes: set[Priority] = set()
        self._paused: set[TP] = set()
        # Partitions revoked or lost while a poll() was consuming: its messages of them are suspect.
        self._rebalanced_in_poll: set[TP] = set()
        # Per partition: the offset after the last one delivered since it was assigned or sought.
        self._next_offset: dict[TP, int] = {}

    # -- subscription and rebalances ---------------------------------------------------------------
    def subscribe(self, on_assign: RebalanceHandler, on_revoke: RebalanceHandler, on_lost: RebalanceHandler) -> None:
        """Subscribe to all input topics. Handlers get incremental (cooperative) partition lists."""

        def assigned(consumer: Consumer, partitions: list[TopicPartition]) -> None:
            tps = [(p.topic, p.partition) for p in partitions]
            self._assigned.update(tps)
            for tp in tps:
                self._next_offset.pop(tp, None)
            on_assign(tps)
            # Pauses are per partition: re-apply the current class pauses to the new ones.
            self._apply_pauses()

        def revoked(consumer: Consumer, partitions: list[TopicPartition]) -> None:
            tps = [(p.topic, p.partition) for p in partitions]
            on_revoke(tps)
            self._forget(tps)
            self._rebalanced_in_poll.update(tps)

        def lost(consumer: Consumer, partitions: list[TopicPartition]) -> None:
            tps = [(p.topic, p.partition) for p in partitions]
            on_lost(tps)
            self._forget(tps)
            self._rebalanced_in_poll.update(tps)

        self._consumer.subscribe(list(self._topics), on_assign=assigned, on_revoke=revoked, on_lost=lost)

    def _forget(self, tps: Iterable[TP]) -> None:
        for tp in tps:
            self._assigned.discard(tp)
            self._paused.discard(tp)
            self._next_offset.pop(tp, None)

    @property
    def assignment(self) -> frozenset[TP]:
        return frozenset(self._assigned)

    def priority_of(self, topic: str) -> Priority:
        return self._topics[topic]

    # -- polling -------------------------------------------------------------------------------------
    def poll(self, max_messages: int, timeout_s: float) -> Polled:
        """Poll up to `max_messages`; also drives rebalance callbacks, so call it even while all is paused."""
        # consume() with a timeout waits for a *full* batch; so take what is queued now, and only block
        # (for the first message) when nothing is, then top up without waiting.
        self._rebalanced_in_poll = set()
        messages = self._consumer.consume(num_messages=max_messages, timeout=0)
        if not messages and timeout_s > 0:
            messages = self._consumer.consume(num_messages=1, timeout=timeout_s)
            if messages and max_messages > 1:
                messages += self._consumer.consume(num_messages=max_messages - 1, timeout=0)
        if self._rebalanced_in_poll:
            messages = self._drop_rebalanced(messages, self._rebalanced_in_poll)
        now = self._clock()
        polled = Polled(frames=[], dead_letters=[])
        rewound: set[TP] = set()
        for msg in messages:
            err = msg.error()
            if err is not None:
                self._handle_error(err)
                continue
            source = SourceRef(msg.topic(), msg.partition(), msg.offset())
            tp = source.topic_partition
            if tp not in self._assigned:
                continue  # fetched before a rebalance served inside this poll took the partition away
            # librdkafka can rewind a partition it was not asked to (seen once in 18 exactly-once SIGKILL runs,
            # right after an assignment, with pauses and resumes) and deliver offsets it already delivered;
            # they are in the pipeline already, and a second copy would get a second result.
            expected = self._next_offset.get(tp)
            if expected is not None and source.offset < expected:
                polled.redelivered += 1
                if tp not in rewound:
                    rewound.add(tp)
                    log.warning("the consumer delivered %s again from offset %d (already read up to %d): dropping "
                                "the offsets already read", tp, source.offset, expected - 1)
                continue
            self._next_offset[tp] = source.offset + 1
            try:
                frame = decode_frame(msg.value(), source, self._topics[source.topic], now)
            except MessageDecodeError as exc:
                polled.dead_letters.append(DeadLetter(source=source, reason=str(exc), error_type="MessageDecodeError",
                                                      payload=msg.value() or b"", key=msg.key()))
                continue
            polled.frames.append(frame)
        return polled

    def _drop_rebalanced(self, messages: list[Message], rebalanced: set[TP]) -> list[Message]:
        """Drop the messages of partitions revoked or lost during this poll, and re-read those we own again.

        A rebalance callback runs inside consume(), so one call can return messages fetched before a
        partition was revoked (no longer ours) and, when it was assigned back within the same poll, messages
        of the new assignment as well, in one list we cannot split: the same offset twice, or a frame from
        before the revocation that the new assignment delivers again. Dropping them all and seeking the
        partitions still ours to their committed offsets re-reads exactly what the new assignment starts from.
        """
        kept: list[Message] = []
        dropped: dict[TP, int] = {}
        for msg in messages:
            tp = (msg.topic(), msg.partition())
            if msg.error() is None and tp in rebalanced:
                dropped[tp] = dropped.get(tp, 0) + 1
                continue
            kept.append(msg)
        reread = sorted(tp for tp in dropped if tp in self._assigned)
        if dropped:
            log.info("dropped %d messages read across a rebalance of %s; re-reading %s from the committed offsets",
                     sum(dropped.values()), sorted(dropped), reread)
        if reread:
            self.seek_to_committed(reread)
        return kept

    def _handle_error(self, err: KafkaError) -> None:
        if err.code() == KafkaError._PARTITION_EOF:
            return
        refused = classify_consumer_error(err, self._identity)
        if refused is not None and refused.cause != UNKNOWN_TOPIC:
            raise refused
        if err.fatal():
            raise SourceError(f"fatal consumer error: {err.str()}")
        # Transient errors (broker down, leader moves, a topic not yet in the metadata) are retried by librdkafka.
        log.warning("consumer error: %s", err.str())

    def _on_client_error(self, err: KafkaError) -> None:
        """librdkafka's error callback (served inside poll): a refusal that persists stops the worker, raised out
        of consume(); everything else is retried by the client and only recorded for /healthz."""
        self.broker_status.on_error(err)
        refused = classify_consumer_error(err, self._identity)
        if refused is not None and refused.cause != UNKNOWN_TOPIC and self._refusals.refusal(refused):
            raise refused

    def _on_stats(self, stats_json: str) -> None:
        self.broker_status.on_stats(stats_json)
        if self.broker_status.problem is None:
            self._refusals.reset()

    # -- pausing -------------------------------------------------------------------------------------
    def pause_classes(self, classes: set[Priority]) -> None:
        """Pause exactly the partitions of these priority classes; resume the rest."""
        if classes != self._paused_classes:
            self._paused_classes = set(classes)
            self._apply_pauses()

    def _apply_pauses(self) -> None:
        want = {tp for tp in self._assigned if self._topics[tp[0]] in self._paused_classes}
        to_pause = want - self._paused
        to_resume = self._paused - want
        if to_pause:
            self._consumer.pause([TopicPartition(t, p) for t, p in to_pause])
        if to_resume:
            self._consumer.resume([TopicPartition(t, p) for t, p in to_resume])
        self._paused = want

    @property
    def paused_partitions(self) -> int:
        return len(self._paused)

    # -- commits -------------------------------------------------------------------------------------
    def commit(self, points: dict[TP, int], asynchronous: bool = False) -> None:
        """Commit offsets of partitions still assigned (a revoked one belongs to someone else).

        Asynchronous commits report their outcome through `on_commit_done` (served by a later poll)."""
        offsets = [TopicPartition(t, p, o) for (t, p), o in points.items() if (t, p) in self._assigned]
        if not offsets:
            return
        if asynchronous:
            self._consumer.commit(offsets=offsets, asynchronous=True)
            return
        result = self._consumer.commit(offsets=offsets, asynchronous=False)
        for tp in result or []:
            if tp.error is not None:
                raise KafkaException(tp.error)

    def committed(self, tps: list[TP], timeout_s: float = 10.0) -> dict[TP, int]:
        res = self._consumer.committed([TopicPartition(t, p) for t, p in tps], timeout=timeout_s)
        return {(r.topic, r.partition): r.offset for r in res if r.offset != OFFSET_INVALID}

    def caught_up(self, timeout_s: float = 5.0) -> bool:
        """Whether the group's committed offset has reached the end of every partition assigned here.

        Broker calls: for deciding to exit when idle, not for the loop. False while a committed offset cannot
        be read yet (a dead exactly-once member's transaction still holds it until the broker aborts it)."""
        try:
            committed = self.committed(sorted(self._assigned), timeout_s)
            for t, p in self._assigned:
                low, high = self._consumer.get_watermark_offsets(TopicPartition(t, p), timeout=timeout_s,
                                                                 cached=False)
                if committed.get((t, p), low) < high:
                    return False
        except KafkaException:
            return False
        return True

    def group_metadata(self) -> object:
        return self._consumer.consumer_group_metadata()

    def seek_to_committed(self, tps: list[TP]) -> None:
        """Rewind partitions to their committed offsets, or to their beginning where nothing is committed yet
        (where a first assignment starts: auto.offset.reset is always earliest)."""
        committed = self.committed(tps)
        for t, p in tps:
            self._next_offset.pop((t, p), None)
            self._consumer.seek(TopicPartition(t, p, committed.get((t, p), OFFSET_BEGINNING)))

    def lag(self) -> dict[TP, int]:
        """High watermark minus position per assigned partition, from cached watermarks (no broker call)."""
        out: dict[TP, int] = {}
        if not self._assigned:
            return out
        positions = self._consumer.position([TopicPartition(t, p) for t, p in self._assigned])
        for tp in positions:
            try:
                _low, high = self._consumer.get_watermark_offsets(TopicPartition(tp.topic, tp.partition), cached=True)
            except KafkaException:
                continue
            if high >= 0 and tp.offset >= 0:
                out[(tp.topic, tp.partition)] = max(0, high - tp.offset)
        return out

    def close(self) -> None:
        """Leave the group (triggers a final revoke) and close."""
        self._consumer.close()


def _report_commit(err: KafkaError | None, partitions: list[TopicPartition],
                   on_done: Callable[[list[TP], str | None], None]) -> None:
    """Adapt librdkafka's commit callback: the failed partitions and why, or ([], None) on success."""
    failed = [(p.topic, p.partition) for p in partitions if err is not None or p.error is not None]
    reason = None
    if failed:
        reason = err.str() if err is not None else "; ".join(p.error.str() for p in partitions if p.error)
    on_done(failed, reason)
