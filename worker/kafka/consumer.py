"""The Kafka consumer side: subscription to the per-priority input topics, decoding, pausing by class,
rebalance callbacks, offset commits and their outcomes (returned by the poll that served them). The I/O only:
where a partition is read from is decided in worker.kafka.committed, which partitions are paused in
worker.kafka.pauses, which offsets are repeats in worker.kafka.redelivery, the writer-schema hold's steps in
worker.kafka.schemagate, what is read and what is done in the pipeline.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import (
    OFFSET_BEGINNING,
    OFFSET_INVALID,
    Consumer,
    KafkaError,
    KafkaException,
    TopicPartition,
)

from worker.codec.schemas import MessageDecodeError, decode_frame
from worker.config import Settings, group_instance_id_problem
from worker.errors import OperatorError, StreamferError
from worker.frames import (
    MESSAGE_DECODE_ERROR,
    TP,
    CommitOutcome,
    DeadLetter,
    Polled,
    Priority,
    RebalanceHandler,
    RevokeHandler,
    SourceRef,
)
from worker.kafka.client import ClientFactory, client_properties, new_client
from worker.kafka.committed import COMMITTED_LOOKUP_TIMEOUT_S, CommittedPositions
from worker.kafka.errors import UNKNOWN_TOPIC, BrokerStatus, Identity, RefusalStreak, classify_consumer_error
from worker.kafka.membership import GroupMembership
from worker.kafka.pauses import PauseUnion
from worker.kafka.redelivery import RedeliveryGuard
from worker.kafka.schemagate import SchemaGate
from worker.kafka.schemalookups import HeldFrames
from worker.partitions.assignment import Assignments
from worker.partitions.donemeta import OffsetRuns, done_after, read_already_done
from worker.partitions.lifetime import PartitionState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CommittedOffsets:
    """The group's committed offsets as far as the broker could tell now.

    `offsets`: per answered partition, its committed offset, or OFFSET_BEGINNING where nothing is committed (a
    first assignment starts there too: auto.offset.reset is always earliest). `unknown`: the partitions it could
    not answer, and why (a per-partition error such as UNSTABLE_OFFSET_COMMIT while a transaction holds pending
    offsets, or the call timing out). Unknown is never "nothing committed"."""

    offsets: dict[TP, int] = field(default_factory=dict)
    unknown: dict[TP, str] = field(default_factory=dict)
    metadata: dict[TP, str] = field(default_factory=dict)  # each commit's metadata, where it has some


# Consumer fetch timing (see consumer_config): a resumed partition's frames arrive within ~0.1 s, not 0.5-1 s;
# the cost is an idle worker's fetch request to each broker 10 times a second instead of twice.
FETCH_WAIT_MAX_MS = 100
FETCH_QUEUE_BACKOFF_MS = 20
# librdkafka prefetches into one first-in-first-out queue shared by every partition, and keeps fetching until it
# holds queued.min.messages (default 100000) or queued.max.messages.kbytes (64 MiB). A deep queue puts a realtime
# frame behind everything prefetched before it (with small frames, tens of thousands of messages: seconds of
# reading) and is dropped and fetched again on every pause (reading by priority pauses lower classes). A shallow
# one leaves the loop idle for a fetch round trip each time it runs dry: with 1000, a broker slowed by the
# overload's own producer answered after 0.5-1 s while the loop read the queue in 0.3 s. 10000 hides such a round
# trip at a few thousand small frames a second; large frames stay bounded by the 64 MiB.
QUEUED_MIN_MESSAGES = 10_000


def consumer_config(settings: Settings) -> dict[str, object]:
    """The worker's librdkafka consumer configuration: what its delivery guarantees rest on, then the overrides."""
    k = settings.kafka
    conf: dict[str, object] = {
        **client_properties(k),
        "group.id": k.group_id,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",
        "partition.assignment.strategy": "cooperative-sticky",
        "session.timeout.ms": k.session_timeout_ms,
        # How soon a member notices a rebalance: a moved partition has no owner for about two of these.
        "heartbeat.interval.ms": k.heartbeat_interval_ms,
        "max.poll.interval.ms": k.max_poll_interval_ms,
        # Producers may write frames transactionally; never feed aborted frames to the model.
        "isolation.level": "read_committed",
        "client.id": settings.observability.worker_id,
        # The loop applies backpressure by pausing partitions, and each resume waits for the consumer's next fetch.
        # librdkafka's defaults suit a consumer that never pauses: an outstanding fetch for the partitions still
        # reading may wait at the broker for new data up to fetch.wait.max.ms (500 ms), and a partition whose
        # prefetch queue filled up is not fetched again for fetch.queue.backoff.ms (1 s). On a mixed backlog these
        # left the model with no batch 22-29% of the time (bench/batching_gain.py, docs/architecture.md).
        "fetch.wait.max.ms": FETCH_WAIT_MAX_MS,
        "fetch.queue.backoff.ms": FETCH_QUEUE_BACKOFF_MS,
        "queued.min.messages": QUEUED_MIN_MESSAGES,
    }
    if k.static_membership:
        conf["group.instance.id"] = group_instance_id(settings)
    conf.update(k.consumer_overrides)
    return conf


def group_instance_id(settings: Settings) -> str:
    """The static member's group.instance.id: the worker id (resolved: see worker.identity)."""
    worker_id = settings.observability.worker_id
    if not worker_id:
        raise StreamferError("observability.worker_id is empty: resolve it (worker.identity.worker_identity) before "
                             "making the consumer, whose group.instance.id it is")
    problem = group_instance_id_problem(worker_id)
    if problem is not None:
        raise OperatorError(problem, setting="observability.worker_id")
    return worker_id


def blocking_timeout_s(timeout_s: float) -> float:
    """The consume() timeout that blocks for `timeout_s` rounded up to a whole millisecond. confluent-kafka
    truncates timeouts to whole milliseconds: 0.9 ms does not block at all, so a loop waiting for a batch due
    in under a millisecond would spin through empty polls until then (measured: a dozen turns before each due
    batch), and 2.9 ms blocks for 2. The half millisecond added survives the float to integer truncation."""
    return (math.ceil(timeout_s * 1000.0 - 1e-6) + 0.5) / 1000.0


class FrameSource:
    """Consumes frames from the input topics; each message becomes a Frame or a DeadLetter, never vanishes."""

    def __init__(self, settings: Settings, clock: Callable[[], float] = time.time,
                 consumer_factory: ClientFactory = Consumer, writer_schemas: HeldFrames | None = None) -> None:
        k = settings.kafka
        # Authentication, authorisation and reachability are reported here, not as messages (librdkafka 2.x).
        self.broker_status = BrokerStatus(unreachable_limit_s=k.session_timeout_ms / 1000.0)
        self._identity = Identity.of(settings)
        self._refusals = RefusalStreak()
        conf = consumer_config(settings)
        conf["error_cb"] = self._on_client_error
        # Broker states for /healthz: the only sign librdkafka gives that a lost cluster is back.
        conf["stats_cb"] = self._on_stats
        conf["statistics.interval.ms"] = 5000
        # The outcome of every commit, served inside a consume(): kept until the poll returns it (Polled.commits).
        self._commit_outcomes: list[CommitOutcome] = []
        conf["on_commit"] = self._commit_reported
        self._topics = settings.topics.input_topics()
        self._clock = clock
        self._limits = settings.limits
        # With a Schema Registry: registry-framed frames are read with their writer schema, held on their partition
        # while it is looked up (worker.kafka.schemalookups); its steps in a poll: worker.kafka.schemagate.
        self._schemas: SchemaGate[HeldFrames] = SchemaGate(writer_schemas)
        self._group = GroupMembership(settings, lambda: new_client(consumer_factory, conf, "consumer", log), clock)
        # The partitions owned and their epochs: assigned and released here only, in the rebalance callbacks; the
        # pipeline and delivery read them.
        self.assignments = Assignments()
        self._pauses = PauseUnion(self._topics)
        # Per partition: the offset after the last one delivered since it was assigned or sought.
        self._redelivery = RedeliveryGuard()
        # Partitions to seek to their committed offsets, kept paused while those cannot be read.
        self._positions = CommittedPositions(clock)
        # Everything kept per partition, dropped together (drop_partitions); the schema gate's held messages are
        # uncommitted: the next owner reads them again.
        self._partition_state: tuple[PartitionState, ...] = (self._schemas, self._pauses, self._redelivery,
                                                             self._positions)
        # Per partition sought to a commit whose metadata lists offsets done beyond it: those offsets, skipped as read.
        self._already_done: dict[TP, OffsetRuns] = {}

    # -- subscription and rebalances ---------------------------------------------------------------
    def subscribe(self, on_assign: RebalanceHandler, on_revoke: RevokeHandler, on_lost: RebalanceHandler) -> None:
        """Subscribe to all input topics. Handlers get incremental (cooperative) partition lists, while the partitions
        are still in `assignments`; this source releases them once the handler returned."""

        def assigned(consumer: Consumer, partitions: list[TopicPartition]) -> None:
            tps = [(p.topic, p.partition) for p in partitions]
            self.assignments.assign(tps)
            self._redelivery.drop_partitions(tps)
            # Where librdkafka starts a new partition is not trusted: when the committed offset is held by an open
            # transaction and the assignment changes while it asks again, librdkafka 2.16 starts the partition at
            # "no offset", i.e. auto.offset.reset (its beginning). Each new partition stays paused until the next
            # polls have read its committed offset and sought it there (see seek_to_committed).
            self._await_committed(tps)
            on_assign(tps)
            # Pauses are per partition: re-apply the current class pauses to the new ones.
            self._apply_pauses()

        def revoked(consumer: Consumer, partitions: list[TopicPartition]) -> None:
            tps = [(p.topic, p.partition) for p in partitions]
            on_revoke(tps, self._take_commit_outcomes())
            self.drop_partitions(tps)

        def lost(consumer: Consumer, partitions: list[TopicPartition]) -> None:
            tps = [(p.topic, p.partition) for p in partitions]
            on_lost(tps)
            self.drop_partitions(tps)

        self._group.subscribe(list(self._topics), assigned, revoked, lost)

    @property
    def _consumer(self) -> Any:
        """The group member's consumer: a new one after the broker fenced the last (worker.kafka.membership)."""
        return self._group.consumer

    def drop_partitions(self, tps: Collection[TP]) -> None:
        """Partitions revoked or lost, once the loop's handler returned: their assignment released and everything
        this source keeps of them dropped (each part of its state is a worker.partitions.lifetime.PartitionState)."""
        self.assignments.release(tps)
        for state in self._partition_state:
            state.drop_partitions(tps)
        for tp in tps:
            self._already_done.pop(tp, None)

    @property
    def held_for_schemas(self) -> HeldFrames | None:
        """The frames held for their writer schemas (with a registry), for /readyz and tests."""
        return self._schemas.held

    @property
    def assignment(self) -> frozenset[TP]:
        return self.assignments.partitions

    def cluster_problem(self) -> str | None:
        """Why the worker cannot use the cluster now (refused, or unreachable too long), or None: for /healthz."""
        return self.broker_status.unhealthy_reason()

    def registry_problem(self) -> str | None:
        """The Schema Registry's trouble while frames wait for it, or None: for /readyz."""
        return self._schemas.held.problem() if self._schemas.held is not None else None

    def priority_of(self, topic: str) -> Priority:
        return self._topics[topic]

    # -- polling -------------------------------------------------------------------------------------
    def poll(self, max_messages: int, timeout_s: float) -> Polled:
        """Poll up to `max_messages`; also drives rebalance callbacks, so call it even while all is paused."""
        # consume() with a timeout waits for a *full* batch; so take what is queued now, and only block
        # (for the first message) when nothing is, then top up without waiting.
        if self._positions:
            self._seek_awaiting()
        messages = self._consumer.consume(num_messages=max_messages, timeout=0)
        if not messages and timeout_s > 0:
            messages = self._consumer.consume(num_messages=1, timeout=blocking_timeout_s(timeout_s))
            if messages and max_messages > 1:
                messages += self._consumer.consume(num_messages=max_messages - 1, timeout=0)
        now = self._clock()
        polled = Polled(frames=[], dead_letters=[], committed_offset_waits=self._positions.take_new_unknowns(),
                        drained=len(messages) < max_messages, commits=self._take_commit_outcomes())
        self._schemas.released_into(polled, now, self._topics, self._limits, self.assignments.is_current)
        self._redelivery.poll_started()
        # Read once per poll (rebalance callbacks run inside consume(), not in this loop): a frame per message.
        epoch_of, waiting, fresh = self.assignments.epoch, self._positions.waiting, self._redelivery.fresh
        topics, limits, writer_schemas = self._topics, self._limits, self._schemas.held
        already_done = self._already_done
        for msg in messages:
            err = msg.error()
            if err is not None:
                self._handle_error(err)
                continue
            tp: TP = (msg.topic() or "", msg.partition() or 0)
            epoch = epoch_of(tp)
            if epoch is None:
                continue  # fetched before a rebalance served inside this poll took the partition away
            if tp in waiting:
                # Assigned in this poll, or fetched before its pause. A rebalance callback runs inside consume(),
                # so one call can return messages of a partition from before it was revoked or lost *and* of its
                # re-assignment (confluent-kafka-python #1013): all are dropped; the seek to its committed offset
                # reads exactly what the new assignment starts from.
                continue
            source = SourceRef(tp[0], tp[1], msg.offset() or 0, epoch)
            if not fresh(tp, source.offset):  # delivered again by librdkafka (worker.kafka.redelivery)
                polled.redelivered += 1
                continue
            if already_done and read_already_done(already_done, tp, source.offset):
                polled.already_done.append(source)
                continue
            if writer_schemas is not None and writer_schemas.admit(tp, (source, msg), msg.value()):
                polled.held.append(source)
                continue
            headers = msg.headers()  # None without headers; they travel into the message's dead letter
            try:
                frame = decode_frame(msg.value(), source, topics[source.topic], now, limits, headers, writer_schemas)
            except MessageDecodeError as exc:
                polled.dead_letters.append(DeadLetter(source=source, reason=str(exc), error_type=MESSAGE_DECODE_ERROR,
                                                      payload=msg.value() or b"", key=msg.key(),
                                                      headers=tuple(headers) if headers else ()))
                continue
            polled.frames.append(frame)
        self._schemas.after_messages(polled)
        if self._pauses.schemas_changed(self._schemas.paused):
            self._apply_pauses()
        return polled

    def _handle_error(self, err: KafkaError) -> None:
        if err.code() == KafkaError._PARTITION_EOF:
            return
        refused = classify_consumer_error(err, self._identity)
        if refused is not None and refused.cause != UNKNOWN_TOPIC:
            raise refused
        # A fatal consumer error reaches the application as a message error _FATAL whose fatal() is False.
        if err.fatal() or err.code() == KafkaError._FATAL:
            self._group.on_fatal_error(err, sorted(self.assignments.partitions))
            return
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
    def pause_classes(self, classes: set[Priority], held: frozenset[TP] = frozenset()) -> None:
        """Pause exactly the partitions of these priority classes and the `held` ones; resume the rest."""
        if self._pauses.request(classes, held):
            self._apply_pauses()

    def _apply_pauses(self) -> None:
        """Pause the union of the reasons to pause (worker.kafka.pauses); resume the rest."""
        to_pause, to_resume = self._pauses.plan(self.assignments.partitions, self._positions, self._schemas.paused)
        if to_pause:
            self._consumer.pause([TopicPartition(t, p) for t, p in to_pause])
        if to_resume:
            self._consumer.resume([TopicPartition(t, p) for t, p in to_resume])

    @property
    def paused_partitions(self) -> int:
        return len(self._pauses)

    # -- commits -------------------------------------------------------------------------------------
    def commit(self, points: dict[TP, int], asynchronous: bool = False, metadata: dict[TP, str] | None = None) -> None:
        """Commit offsets of partitions still assigned (a revoked one belongs to someone else), with `metadata` where
        given (worker.partitions.donemeta). Every commit's outcome comes back in `Polled.commits`."""
        md = metadata or {}
        offsets = [TopicPartition(t, p, o, md[(t, p)]) if md.get((t, p)) else TopicPartition(t, p, o)
                   for (t, p), o in points.items() if (t, p) in self.assignments]
        if not offsets:
            return
        if asynchronous:
            self._consumer.commit(offsets=offsets, asynchronous=True)
            return
        result = self._consumer.commit(offsets=offsets, asynchronous=False)
        for tp in result or []:
            if tp.error is not None:
                raise KafkaException(tp.error)

    def committed(self, tps: list[TP], timeout_s: float = 10.0) -> CommittedOffsets:
        """The group's committed offsets of `tps`, telling "nothing committed" apart from "not known now"."""
        if not tps:
            return CommittedOffsets()
        try:
            answer = self._consumer.committed([TopicPartition(t, p) for t, p in tps], timeout=timeout_s)
        except KafkaException as exc:  # the call as a whole: timed out (an open transaction), coordinator away
            err = exc.args[0] if exc.args else None
            reason = err.str() if isinstance(err, KafkaError) else str(exc)
            return CommittedOffsets(unknown={tp: reason for tp in tps})
        out = CommittedOffsets()
        for r in answer:
            tp = (r.topic, r.partition)
            if r.error is not None:
                out.unknown[tp] = r.error.str()
            elif r.offset >= 0:
                out.offsets[tp] = r.offset
                if r.metadata:
                    out.metadata[tp] = r.metadata
            elif r.offset == OFFSET_INVALID:
                out.offsets[tp] = OFFSET_BEGINNING
            else:
                out.unknown[tp] = f"unexpected committed offset {r.offset}"
        for tp in tps:
            if tp not in out.offsets and tp not in out.unknown:
                out.unknown[tp] = "missing from the broker's answer"
        return out

    def caught_up(self, timeout_s: float = 5.0) -> bool:
        """Whether the group's committed offset has reached the end of every partition assigned here.

        Broker calls: for deciding to exit when idle, not for the loop. False while a committed offset cannot
        be read yet (a dead exactly-once member's transaction still holds it until the broker aborts it). A
        partition whose last offsets hold nothing to deliver (a transactional producer's commit marker, as
        `worker dlq replay` writes, or aborted frames) is caught up once the consumer has fetched past them."""
        assigned = sorted(self.assignments.partitions)
        committed = self.committed(assigned, timeout_s)
        if committed.unknown:
            return False
        try:
            for t, p in assigned:
                low, high = self._consumer.get_watermark_offsets(TopicPartition(t, p), timeout=timeout_s,
                                                                 cached=False)
                offset = committed.offsets[(t, p)]
                resume = low if offset == OFFSET_BEGINNING else offset
                if resume < high and not self._only_skipped_offsets_left((t, p), resume, high):
                    return False
        except KafkaException:
            return False
        return True

    def _only_skipped_offsets_left(self, tp: TP, committed: int, high: int) -> bool:
        """Between the committed offset and the end lie only offsets the consumer never delivers: everything it
        delivered is committed, and its position (which librdkafka moves past control records) is at the end."""
        if tp in self._positions or self._redelivery.delivered_past(tp, committed):
            return False
        (position,) = self._consumer.position([TopicPartition(*tp)])
        return position.offset >= high

    def group_metadata(self) -> object:
        return self._consumer.consumer_group_metadata()

    def seek_to_committed(self, tps: list[TP]) -> None:
        """Rewind partitions to their committed offsets, or to their beginning where nothing is committed yet
        (where a first assignment starts: auto.offset.reset is always earliest).

        A partition whose committed offset cannot be read now (a dead member's open transaction holds pending
        offsets until the broker aborts it, or the call times out) is never sought to its beginning, which would
        answer again what the group has committed: it stays paused, later polls ask again, and it is sought and
        resumed once the broker can tell."""
        self._await_committed([tp for tp in tps if tp in self.assignments])
        self._apply_pauses()
        self._seek_awaiting()

    def _await_committed(self, tps: list[TP]) -> None:
        """Mark partitions to be sought to their committed offsets by the next look-up (paused until then); what
        they held for the registry is read again from there."""
        self._redelivery.drop_partitions(tps)
        self._schemas.drop_partitions(tps)
        self._positions.wait(tps)

    @property
    def awaiting_committed_offset(self) -> frozenset[TP]:
        """Partitions paused until their committed offset can be read (see seek_to_committed)."""
        return self._positions.waiting

    def _seek_awaiting(self) -> None:
        """Ask for the committed offsets of the waiting partitions that are due (worker.kafka.committed decides
        which, and how many per poll); seek and resume those answered."""
        sought = False
        # Highest class first, so its fetches start first (in topic-name order bulk went first after each
        # assignment, and realtime no longer overtook an older bulk backlog).
        for tp in self._positions.due(self._pauses.priority_order):
            answer = self.committed([tp], COMMITTED_LOOKUP_TIMEOUT_S)
            if tp not in answer.offsets:
                self._positions.unknown(tp, answer.unknown[tp])
                continue
            refused = self._seek(tp, answer.offsets[tp])
            if refused is None:
                self._positions.sought(tp)
                done_after(self._already_done, tp, answer.offsets[tp], answer.metadata.get(tp))
                sought = True
            else:  # librdkafka starts a partition once it has its own answer; seek then
                self._positions.unstarted(tp, refused)
        if sought:
            self._apply_pauses()

    def _seek(self, tp: TP, offset: int) -> str | None:
        """Seek; None when done, else why not (`_STATE` while librdkafka has not started fetching the partition)."""
        try:
            self._consumer.seek(TopicPartition(tp[0], tp[1], offset))
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            return err.str() if isinstance(err, KafkaError) else str(exc)
        self._redelivery.drop_partitions([tp])
        return None

    def lag(self) -> dict[TP, int]:
        """High watermark minus position per assigned partition, from cached watermarks (no broker call)."""
        out: dict[TP, int] = {}
        if not self.assignments.partitions:
            return out
        positions = self._consumer.position([TopicPartition(t, p) for t, p in self.assignments.partitions])
        for tp in positions:
            try:
                _low, high = self._consumer.get_watermark_offsets(TopicPartition(tp.topic, tp.partition), cached=True)
            except KafkaException:
                continue
            if high >= 0 and tp.offset >= 0:
                out[(tp.topic, tp.partition)] = max(0, high - tp.offset)
        return out

    def close(self) -> None:
        """Leave the group (a final revoke; see worker.kafka.membership for a static member) and close: a closed
        source owns no partition."""
        try:
            self._group.close(holds_partitions=bool(self.assignments.partitions))
        finally:
            self.assignments.release(self.assignments.partitions)
        self._schemas.close()

    def _commit_reported(self, err: KafkaError | None, partitions: list[TopicPartition]) -> None:
        """librdkafka's commit callback (served inside consume()): recorded, returned by the poll."""
        self._commit_outcomes.append(_commit_outcome(err, partitions))

    def _take_commit_outcomes(self) -> list[CommitOutcome]:
        outcomes, self._commit_outcomes = self._commit_outcomes, []
        return outcomes


def _commit_outcome(err: KafkaError | None, partitions: list[TopicPartition]) -> CommitOutcome:
    """Adapt librdkafka's commit callback: the offsets the broker now has, the failed partitions and why."""
    failed = [(p.topic, p.partition) for p in partitions if err is not None or p.error is not None]
    committed = {(p.topic, p.partition): p.offset for p in partitions
                 if err is None and p.error is None and p.offset >= 0}
    reason = None
    if failed:
        reason = err.str() if err is not None else "; ".join(p.error.str() for p in partitions if p.error)
    return CommitOutcome(committed, failed, reason)
