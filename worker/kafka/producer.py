"""The Kafka producer side: moderation results and dead letters, with delivery reports.

At-least-once: an idempotent producer; a source offset is reported acknowledged (in what `ResultSink.poll`
returns) only when the broker has its message, and a failed delivery is produced again, never dropped.
Exactly-once: a transactional producer whose calls (begin, send_offsets_to_transaction + commit_transaction,
abort) are guarded against librdkafka blocking;
worker.loop.delivery.ExactlyOnceDelivery opens one transaction per loop turn, holding the outputs released that turn
(of any number of batches) and the consumed offsets.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from confluent_kafka import KafkaError, KafkaException, Producer, TopicPartition

from worker.config import Settings
from worker.errors import StreamferError
from worker.frames import (
    DEAD_LETTER_HEADERS,
    HEADER_ERROR,
    HEADER_ERROR_TYPE,
    HEADER_SOURCE_OFFSET,
    HEADER_SOURCE_PARTITION,
    HEADER_SOURCE_TOPIC,
    HEADER_WORKER_ID,
    DeadLetter,
    Headers,
    SourceRef,
)
from worker.kafka.client import ClientFactory, new_client
from worker.kafka.errors import BrokerAccessError, Identity, classify_producer_error
from worker.kafka.outputstalls import OutputStalls
from worker.kafka.roles import LIBRDKAFKA_MIN_MESSAGE_MAX_BYTES, output_producer_properties
from worker.kafka.topics import topic_message_limits
from worker.threadnames import name_os_thread

log = logging.getLogger(__name__)

T = TypeVar("T")

# A transactional call still blocked this long past its own timeout is stuck (librdkafka issues #5456, #5511:
# send_offsets_to_transaction can wait for good on a group coordinator that went away with a broker restart).
STUCK_GRACE_S = 5.0
# How often the loop thread serves delivery reports while it waits for a transactional call.
DELIVERY_POLL_S = 0.02
# How long a transactional call that failed on a refused message waits for that message's delivery report.
REFUSAL_REPORT_WAIT_S = 1.0
# How often librdkafka reports each output partition's queue (OutputStalls): the resolution of a stall's age.
OUTPUT_STATS_INTERVAL_MS = 2000
# How long a new transactional producer keeps retrying init_transactions (the broker may still be coming back).
INIT_TRANSACTIONS_TIMEOUT_S = 120.0
# Waits between init_transactions attempts: doubling from the first to the last.
INIT_RETRY_FIRST_S = 0.1
INIT_RETRY_MAX_S = 2.0
# init_transactions errors a later attempt gets past, whether or not librdkafka flags them retriable: the transaction
# coordinator is moving or loading, or still completing the previous producer's transaction with this id
# (CONCURRENT_TRANSACTIONS: after a coordinator kill, the abort of a replaced producer's transaction waits for its
# markers to be written, so a new producer's init meets it for as long as that takes).
INIT_RETRY_ERRORS = frozenset({
    KafkaError.CONCURRENT_TRANSACTIONS,
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    KafkaError.COORDINATOR_NOT_AVAILABLE,
    KafkaError.NOT_COORDINATOR,
    KafkaError._TIMED_OUT,
    KafkaError._TRANSPORT,
})


# Errors about one message, not the producer: that message can never be produced as it is (it is dead-lettered
# by reference instead), and the next ones can. Not INVALID_MSG (CORRUPT_MESSAGE, a CRC mismatch): the bytes were
# damaged on their way, which producing them again fixes (Kafka's clients retry it); counting it here turned a
# good frame into a reference dead letter (issue 67). It is retried as any transient delivery failure.
PER_MESSAGE_ERRORS = frozenset({
    KafkaError.MSG_SIZE_TOO_LARGE,
    KafkaError.INVALID_RECORD,
    KafkaError.RECORD_LIST_TOO_LARGE,
    KafkaError.INVALID_MSG_SIZE,
})


FENCED_ERRORS = frozenset({KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH})


class SinkError(StreamferError):
    """The producer cannot go on (fatal error, fenced transactional id); the worker must stop and restart.

    `kafka_error` is librdkafka's own error where one caused it, so a caller can tell its code, whether it is
    retriable and whether it is fatal without parsing the message."""

    def __init__(self, message: str, kafka_error: KafkaError | None = None, setting: str | None = None) -> None:
        super().__init__(message, setting)
        self.kafka_error = kafka_error

    @property
    def code(self) -> int | None:
        return self.kafka_error.code() if self.kafka_error is not None else None

    @property
    def retriable(self) -> bool:
        return self.kafka_error is not None and bool(self.kafka_error.retriable())

    @property
    def fatal(self) -> bool:
        return self.kafka_error is not None and bool(self.kafka_error.fatal())


class MessageRejected(StreamferError):
    """The client or the broker refuses this one message (too large, invalid record); others still go."""


class TransactionStuckError(SinkError):
    """A transactional call outlived its timeout. The producer is unusable (the call still holds it); a new
    producer with the same transactional id fences it and aborts its open transaction."""


def output_message_limit(settings: Settings, timeout_s: float = 5.0) -> int | None:
    """The smallest max.message.bytes of the results and dead-letter topics, as the broker reports it.

    The producer's own limits are set to it (worker.kafka.roles.output_producer_properties), so that librdkafka
    never builds a batch the broker refuses as a whole (one oversized output would take its batch-mates down with
    it) and an output too large for the topic is refused at produce() time, alone. None when the topics cannot be
    described (then librdkafka's defaults apply, as they match the broker's)."""
    topics = [settings.topics.results, settings.topics.dead_letter]
    limits = topic_message_limits(settings.kafka, topics, timeout_s)
    if len(limits) < len(topics):
        log.warning("could not read max.message.bytes of %s; the producer keeps librdkafka's default limits",
                    sorted(set(topics) - set(limits)))
        return None
    return max(LIBRDKAFKA_MIN_MESSAGE_MAX_BYTES, min(limits.values()))


def producer_config(settings: Settings, transactional_id: str | None = None,
                    max_message_bytes: int | None = None) -> dict[str, Any]:
    """The worker's librdkafka producer configuration (transactional with an id), then the overrides.

    `max_message_bytes` (output_message_limit) bounds both one message and one batch."""
    # The broker aborts a transaction left open this long. A crashed worker's open transaction holds back
    # read_committed readers of the results and its partitions' committed offsets until then (unless a worker
    # with the same id starts first and fences it), so keep it short: a transaction lasts one loop turn, and a
    # call outliving transaction_call_timeout_ms replaces the producer. An aborted transaction is replayed from
    # the committed offsets, so the shorter message timeout it brings loses nothing.
    return output_producer_properties(settings.kafka, settings.observability.worker_id, max_message_bytes,
                                      transactional_id, 3 * settings.delivery.transaction_call_timeout_ms)


@dataclass(frozen=True)
class Refusal:
    """The broker refused the output of `source` for good (too large, invalid): it can never be produced as it is."""

    source: SourceRef
    reason: str


@dataclass(frozen=True)
class DeliveryReports:
    """What librdkafka reported since the last `ResultSink.poll`, in the order served: the source offsets whose
    output the broker has, the outputs it refused, and an error nothing but a restart fixes (sticky: every later
    poll carries it too)."""

    acknowledged: list[SourceRef] = field(default_factory=list)
    refused: list[Refusal] = field(default_factory=list)
    error: StreamferError | None = None


class ResultSink:
    """Produces encoded results and dead letters; its poll returns the delivery reports served since the last one
    (served by flush and transactional calls too), for the caller to hand on: it calls nobody back."""

    def __init__(self, settings: Settings, transactional_id: str | None = None, max_message_bytes: int | None = None,
                 producer_factory: ClientFactory = Producer, stuck_grace_s: float = STUCK_GRACE_S,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        conf = producer_config(settings, transactional_id, max_message_bytes)
        self._results_topic = settings.topics.results
        self._dlq_topic = settings.topics.dead_letter
        # Output partitions that stopped acknowledging (issue 67), from librdkafka's per-partition queue counts and
        # the partitions delivery reports acknowledged (gathered per poll).
        self.output_stalls = OutputStalls((self._results_topic, self._dlq_topic), time.monotonic)
        self._acked_partitions: set[tuple[str, int]] = set()
        conf["stats_cb"] = self.output_stalls.stats
        conf["statistics.interval.ms"] = OUTPUT_STATS_INTERVAL_MS
        self._worker_id = settings.observability.worker_id
        # Delivery reports served and not yet returned by poll (see DeliveryReports).
        self._acknowledged: list[SourceRef] = []
        self._refused: list[Refusal] = []
        self._sleep = sleep
        self.identity = Identity.of(settings, transactional_id)
        # Set by a delivery report the cluster refused (ACL, credentials): the pipeline raises it (exit 2).
        self.access_error: BrokerAccessError | None = None
        self._producer = new_client(producer_factory, conf, "producer", log)
        self._stuck_grace_s = stuck_grace_s
        self.transactional = bool(transactional_id)
        self._transactional_id = transactional_id
        # Set by a delivery report that the producer cannot recover from; the pipeline raises it.
        self.fatal_error: SinkError | None = None
        # Set when a transactional call got stuck: the producer is abandoned, never flushed or closed.
        self.stuck = False
        # Set when the broker refused a message of the open transaction: it can only fail, so waiting for it is
        # pointless, and librdkafka's abort then leaves the producer unusable (a sequence gap): it is replaced.
        self.transaction_refused = False
        self._calls: queue.SimpleQueue[Any] | None = None  # the transactional call thread's queue
        # At-least-once: outputs librdkafka's full local queue could not take yet, in order, produced again by the
        # next polls (the loop never waits for room: issue 67); the loop pauses its input while any wait.
        self._backlog: deque[tuple[SourceRef, str, Callable[[], None]]] = deque()
        if self.transactional:
            self._init_transactions()

    # -- producing -----------------------------------------------------------------------------------
    def send_result(self, source: SourceRef, key: bytes, value: bytes, headers: Headers = ()) -> None:
        """`headers`: the result's own (its trace context, worker.tracing), none when empty."""
        self._produce(self._results_topic, source, key, value, headers=list(headers) if headers else None)

    def send_copy(self, topic: str, source: SourceRef, key: bytes, value: bytes, headers: Headers = ()) -> None:
        """A copy of a result on a route topic (topics.review / topics.flagged): acknowledged for `source` as the
        result is, so the offset waits for both."""
        self._produce(topic, source, key, value, headers=list(headers) if headers else None)

    def send_dead_letter(self, dl: DeadLetter) -> None:
        """The input message's own headers (a replayed frame's replay count among them), then the context."""
        headers: list[tuple[str, str | bytes | None]] = [h for h in dl.headers if h[0] not in DEAD_LETTER_HEADERS]
        headers += [
            (HEADER_ERROR, dl.reason.encode()[:4000]),
            (HEADER_ERROR_TYPE, dl.error_type.encode()),
            (HEADER_SOURCE_TOPIC, dl.source.topic.encode()),
            (HEADER_SOURCE_PARTITION, str(dl.source.partition).encode()),
            (HEADER_SOURCE_OFFSET, str(dl.source.offset).encode()),
            (HEADER_WORKER_ID, self._worker_id.encode()),
        ]
        self._produce(self._dlq_topic, dl.source, dl.key, dl.payload, headers=headers)

    def _produce(self, topic: str, source: SourceRef, key: bytes | None, value: bytes,
                 headers: list[tuple[str, str | bytes | None]] | None) -> None:
        def delivered(err: KafkaError | None, msg: Any) -> None:
            if err is None:
                self._acknowledged.append(source)
                if msg is not None:
                    self._acked_partitions.add((topic, msg.partition()))
                return
            refused = classify_producer_error(err, topic, self.identity)
            if refused is not None:  # no retry helps: stop the worker (exit 2) instead of producing again
                self.access_error = self.access_error or refused
                return
            if err.fatal():
                self.fatal_error = SinkError(f"fatal producer error delivering {source}: {err.str()}", err)
                return
            if err.code() in PER_MESSAGE_ERRORS:
                # Producing it again would fail again: the caller replaces it (in exactly-once, after the
                # transaction that held it is given up).
                self._refused.append(Refusal(source, f"{topic} refused it: {err.str()}"))
                self.transaction_refused = self.transactional
                return
            if self.transactional:
                # The transaction's commit fails too; its abort path rewinds the consumer to read it again.
                log.warning("delivery of %s in a transaction failed: %s", source, err.str())
                return
            # At-least-once: never drop; produce it again (the offset is still uncommitted).
            log.warning("delivery of %s to %s failed (%s); producing again", source, topic, err.str())
            self._produce(topic, source, key, value, headers)

        def produce() -> None:
            self._producer.produce(topic, value=value, key=key, headers=headers, on_delivery=delivered)

        if self._backlog:  # behind the outputs already waiting for room, in order
            self._backlog.append((source, topic, produce))
            return
        while True:
            try:
                produce()
                return
            except BufferError:
                # Local queue full (the broker acknowledges slower than the loop answers, or a partition is down):
                # serve delivery reports to make room. At-least-once keeps the output for a later poll rather than
                # wait in the loop; a transaction must hold it before its commit, which waits for the queue anyway.
                if not self.transactional:
                    self._producer.poll(0)
                    self._backlog.append((source, topic, produce))
                    return
                self._producer.poll(0.05)
            except KafkaException as exc:
                err = exc.args[0]
                refused = classify_producer_error(err, topic, self.identity)
                if refused is not None:
                    raise refused from None
                if err.code() in PER_MESSAGE_ERRORS:
                    raise MessageRejected(f"{topic} cannot take the message for {source.topic}/"
                                          f"{source.partition}@{source.offset} ({len(value)} bytes): {err.str()}",
                                          setting="kafka.producer_overrides (message.max.bytes)") from None
                raise SinkError(f"producing to {topic} failed: {err.str()}", err) from exc

    def poll(self, timeout_s: float = 0.0) -> DeliveryReports:
        """Serve librdkafka's delivery reports, then produce what waited for room; returns every report served since
        the last poll."""
        self._producer.poll(timeout_s)
        self._produce_backlog()
        if self._acked_partitions:
            self.output_stalls.acknowledged(self._acked_partitions)
            self._acked_partitions = set()
        return self.reports()

    @property
    def backlog(self) -> int:
        """Outputs waiting for room in librdkafka's local queue (at-least-once)."""
        return len(self._backlog)

    def _produce_backlog(self) -> None:
        """Produce the outputs that waited for room, in order, until the queue is full again."""
        backlog = self._backlog
        while backlog:
            source, topic, produce = backlog[0]
            try:
                produce()
            except BufferError:
                return
            except KafkaException as exc:  # as in _produce: a message refused for good is replaced by the caller
                err = exc.args[0]
                refused = classify_producer_error(err, topic, self.identity)
                if refused is not None:
                    raise refused from None
                if err.code() not in PER_MESSAGE_ERRORS:
                    raise SinkError(f"producing to {topic} failed: {err.str()}", err) from exc
                self._refused.append(Refusal(source, f"{topic} refused it: {err.str()}"))
            backlog.popleft()

    def reports(self) -> DeliveryReports:
        """The reports served since the last poll, without serving more (a stuck producer's, before it goes)."""
        acknowledged, refused = self._acknowledged, self._refused
        self._acknowledged, self._refused = [], []
        return DeliveryReports(acknowledged, refused, self.access_error or self.fatal_error)

    def flush(self, timeout_s: float) -> int:
        """Wait for outstanding deliveries, those waiting for room in the queue first; returns how many are still
        outstanding. Their reports are returned by the next poll."""
        deadline = time.monotonic() + timeout_s
        while self._backlog and time.monotonic() < deadline:
            self._producer.poll(DELIVERY_POLL_S)
            self._produce_backlog()
        return self._producer.flush(max(0.0, deadline - time.monotonic())) + len(self._backlog)

    # -- transactions (exactly-once) ------------------------------------------------------------------
    def _init_transactions(self) -> None:
        """Register the transactional id (fencing any older producer with it and aborting its transaction),
        retrying with backoff, for at most INIT_TRANSACTIONS_TIMEOUT_S, while the broker is unreachable or its
        transaction coordinator busy (INIT_RETRY_ERRORS)."""
        deadline = time.monotonic() + INIT_TRANSACTIONS_TIMEOUT_S
        backoff = INIT_RETRY_FIRST_S
        while True:
            try:
                self._guarded(lambda: self._producer.init_transactions(10.0), 10.0)
                return
            except KafkaException as exc:
                err = exc.args[0]
                refused = classify_producer_error(err, None, self.identity)
                if refused is not None:  # TRANSACTIONAL_ID_AUTHORIZATION_FAILED, a refused login
                    raise refused from None
                transient = not err.fatal() and (err.retriable() or err.code() in INIT_RETRY_ERRORS)
                if transient and time.monotonic() + backoff < deadline:
                    log.warning("init_transactions for %s failed (%s); retrying in %.1fs", self._transactional_id,
                                err.str(), backoff)
                    self._sleep(backoff)
                    backoff = min(backoff * 2, INIT_RETRY_MAX_S)
                    continue
                within = f" within {INIT_TRANSACTIONS_TIMEOUT_S:.0f}s" if transient else ""
                raise SinkError(f"cannot initialise transactions for transactional id {self._transactional_id!r}"
                                f"{within}: {err.str()}", err) from exc

    def begin(self) -> None:
        try:
            self._producer.begin_transaction()
        except KafkaException as exc:
            raise self._unusable(exc.args[0], "begin_transaction") from exc

    def send_offsets(self, offsets: dict[tuple[str, int], int], group_metadata: object,
                     timeout_s: float = 30.0) -> None:
        """Attach the consumed offsets to the open transaction; the group coordinator checks the consumer's group
        generation here (ILLEGAL_GENERATION, abortable, once a rebalance round has moved the group on).

        Raises TransactionStuckError if librdkafka does not return within its timeout."""
        tps = [TopicPartition(t, p, o) for (t, p), o in offsets.items()]
        if tps:
            self._retrying(lambda: self._producer.send_offsets_to_transaction(tps, group_metadata, timeout_s),
                           time.monotonic() + timeout_s, timeout_s)

    def commit_transaction(self, timeout_s: float = 30.0) -> None:
        """Commit the open transaction: its messages and offsets, atomically.

        Raises TransactionStuckError if librdkafka does not return within its timeout."""
        self._retrying(lambda: self._producer.commit_transaction(timeout_s), time.monotonic() + timeout_s, timeout_s)

    def abort(self, timeout_s: float = 30.0) -> None:
        try:
            self._guarded(lambda: self._producer.abort_transaction(timeout_s), timeout_s)
        except KafkaException as exc:
            raise self._unusable(exc.args[0], "abort_transaction") from exc

    def _unusable(self, err: KafkaError, call: str) -> SinkError:
        """A transactional call failed in a way the transaction cannot recover from. Fenced: another producer
        owns this transactional id now, and this worker must stop. Otherwise (a fatal error such as the
        out-of-order sequence a broker-refused message leaves behind, or an abort that cannot run) the producer is
        replaced by a new one with the same id, which aborts whatever this one left open."""
        if err.code() in FENCED_ERRORS:
            return SinkError(f"transactional id {self._transactional_id!r} was fenced by a newer producer "
                             f"({err.str()}): another worker runs with the same observability.worker_id", err,
                             setting="observability.worker_id")
        self.stuck = True
        return TransactionStuckError(f"{call} of {self._transactional_id!r} failed and the producer cannot go on: "
                                     f"{err.str()}", err)

    def _retrying(self, call: Callable[[], object], deadline: float, timeout_s: float) -> None:
        while True:
            try:
                self._guarded(call, timeout_s)
                return
            except KafkaException as exc:
                err = exc.args[0]
                if err.fatal():
                    raise self._unusable(err, "a transactional call") from exc
                if err.txn_requires_abort():
                    self._await_refusal_report(err)
                    self._give_up_if_refused()
                if err.retriable() and not err.txn_requires_abort():
                    if time.monotonic() < deadline:
                        time.sleep(0.1)
                        continue
                    # The transaction's outcome is unknown: only a new producer can settle it.
                    self.stuck = True
                    raise TransactionStuckError(f"a transactional call of {self._transactional_id!r} still fails "
                                                f"after {timeout_s:.0f}s: {err.str()}", err) from exc
                raise

    def _guarded(self, call: Callable[[], T], timeout_s: float) -> T:
        """Run a blocking transactional call on this sink's call thread and give up on it shortly after its
        own timeout: a call stuck inside librdkafka must not stop the worker's loop for good.

        The thread is a daemon (a thread per call would cost ~50 us more per call): if the call never
        returns, it stays blocked, holding only this abandoned producer."""
        if self._calls is None:
            self._calls = queue.SimpleQueue()
            threading.Thread(target=self._serve_calls, args=(self._calls,), name="transaction-calls",
                             daemon=True).start()
        done = threading.Event()
        box: dict[str, Any] = {}
        self._calls.put((call, done, box))
        # Serve delivery reports meanwhile: commit_transaction and abort_transaction wait for every outstanding
        # message, and abort_transaction fails when nobody polls for their reports.
        deadline = time.monotonic() + timeout_s + self._stuck_grace_s
        while not done.wait(DELIVERY_POLL_S) and time.monotonic() < deadline:
            self._producer.poll(0)
            self._give_up_if_refused()
        if not done.is_set():
            self.stuck = True
            raise TransactionStuckError(f"a transactional call of {self._transactional_id!r} is still blocked "
                                        f"{timeout_s + self._stuck_grace_s:.0f}s after it started (its timeout is "
                                        f"{timeout_s:.0f}s)")
        if "error" in box:
            raise box["error"]
        return box.get("result")  # type: ignore[return-value]

    def _await_refusal_report(self, err: KafkaError) -> None:
        """A transactional call can fail on a refused message before `_guarded` served that message's delivery
        report, which says which offset it was (so that it is dead-lettered by reference when read again)."""
        per_message = err.code() in PER_MESSAGE_ERRORS
        deadline = time.monotonic() + REFUSAL_REPORT_WAIT_S
        self._producer.poll(0)
        while per_message and not self.transaction_refused and time.monotonic() < deadline:
            self._producer.poll(DELIVERY_POLL_S)
        self.transaction_refused = self.transaction_refused or per_message

    def _give_up_if_refused(self) -> None:
        """A transaction the broker refused a message of is never aborted (see `transaction_refused`): aborting
        it makes librdkafka bump the producer's epoch in the background, and a bump still under way when the
        producer is replaced can fence the replacement."""
        if self.transaction_refused:
            self.stuck = True
            raise TransactionStuckError(f"the broker refused a message of {self._transactional_id!r}'s "
                                        "transaction, which can only fail")

    @staticmethod
    def _serve_calls(calls: queue.SimpleQueue[Any]) -> None:
        name_os_thread()
        while True:
            item = calls.get()
            if item is None:
                return
            call, done, box = item
            try:
                box["result"] = call()
            except BaseException as exc:  # noqa: BLE001 (handed to the caller, who re-raises it)
                box["error"] = exc
            finally:
                done.set()

    def close(self, timeout_s: float = 30.0) -> None:
        if self.stuck:
            log.warning("abandoning a stuck transactional producer: its open transaction is aborted by the "
                        "producer that fenced it")
            return
        if self._calls is not None:
            self._calls.put(None)
        remaining = self._producer.flush(timeout_s)
        if remaining:
            log.warning("%d messages not acknowledged at close; their offsets stay uncommitted", remaining)
