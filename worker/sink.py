"""The Kafka producer side: moderation results and dead letters, with delivery reports.

At-least-once: an idempotent producer; `on_done(source)` fires only when the broker acknowledged the
message, and a failed delivery is produced again, never dropped. Exactly-once: a transactional producer;
the pipeline wraps each batch in a transaction that also carries the consumed offsets.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from confluent_kafka import KafkaError, KafkaException, Producer, TopicPartition

from worker.config import ConfigError, Settings
from worker.frames import DeadLetter, SourceRef

log = logging.getLogger(__name__)

DoneCallback = Callable[[SourceRef], None]


class SinkError(RuntimeError):
    """The producer cannot go on (fatal error, fenced transactional id); the worker must stop and restart."""


class ResultSink:
    """Produces encoded results and dead letters; reports each source offset as done once acknowledged."""

    def __init__(self, settings: Settings, on_done: DoneCallback, transactional_id: str | None = None) -> None:
        conf: dict[str, Any] = {
            "bootstrap.servers": settings.kafka.bootstrap_servers,
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 2,
            "client.id": settings.observability.worker_id,
            # Keep retrying through broker restarts; the frame's offset stays uncommitted meanwhile.
            "message.timeout.ms": 300_000,
        }
        if transactional_id:
            conf["transactional.id"] = transactional_id
            # librdkafka requires message.timeout.ms <= transaction.timeout.ms; an aborted transaction is
            # replayed from the committed offsets, so a shorter timeout loses nothing.
            conf["transaction.timeout.ms"] = 60_000
            conf["message.timeout.ms"] = 60_000
        conf.update(settings.kafka.producer_overrides)
        self._results_topic = settings.topics.results
        self._dlq_topic = settings.topics.dead_letter
        self._worker_id = settings.observability.worker_id
        self._on_done = on_done
        try:
            self._producer = Producer(conf, logger=log)
        except KafkaException as exc:
            raise ConfigError([f"kafka.producer_overrides / kafka settings: librdkafka rejected the producer "
                               f"configuration: {exc.args[0].str()}"]) from None
        self.transactional = bool(transactional_id)
        self.retried_deliveries = 0
        # Set by a delivery report that the producer cannot recover from; the pipeline raises it.
        self.fatal_error: str | None = None
        if self.transactional:
            self._producer.init_transactions(30)

    # -- producing -----------------------------------------------------------------------------------
    def send_result(self, source: SourceRef, key: bytes, value: bytes) -> None:
        self._produce(self._results_topic, source, key, value, headers=None)

    def send_dead_letter(self, dl: DeadLetter) -> None:
        headers = [
            ("streamfer.error", dl.reason.encode()[:4000]),
            ("streamfer.error_type", dl.error_type.encode()),
            ("streamfer.source_topic", dl.source.topic.encode()),
            ("streamfer.source_partition", str(dl.source.partition).encode()),
            ("streamfer.source_offset", str(dl.source.offset).encode()),
            ("streamfer.worker_id", self._worker_id.encode()),
        ]
        self._produce(self._dlq_topic, dl.source, dl.key, dl.payload, headers=headers)

    def _produce(self, topic: str, source: SourceRef, key: bytes | None, value: bytes,
                 headers: list[tuple[str, bytes]] | None) -> None:
        def delivered(err: KafkaError | None, _msg: Any) -> None:
            if err is None:
                self._on_done(source)
                return
            if err.fatal():
                self.fatal_error = f"fatal producer error delivering {source}: {err.str()}"
                return
            if self.transactional:
                # The transaction's commit fails too; its abort path rewinds the consumer to read it again.
                log.warning("delivery of %s in a transaction failed: %s", source, err.str())
                return
            # At-least-once: never drop; produce it again (the offset is still uncommitted).
            self.retried_deliveries += 1
            log.warning("delivery of %s to %s failed (%s); producing again", source, topic, err.str())
            self._produce(topic, source, key, value, headers)

        while True:
            try:
                self._producer.produce(topic, value=value, key=key, headers=headers, on_delivery=delivered)
                return
            except BufferError:
                # Local queue full: serve delivery reports to make room (backpressure, not loss).
                self._producer.poll(0.05)

    def poll(self, timeout_s: float = 0.0) -> int:
        """Serve delivery callbacks."""
        return self._producer.poll(timeout_s)

    def flush(self, timeout_s: float) -> int:
        """Wait for outstanding deliveries; returns how many are still outstanding."""
        return self._producer.flush(timeout_s)

    def __len__(self) -> int:
        return len(self._producer)

    # -- transactions (exactly-once) ------------------------------------------------------------------
    def begin(self) -> None:
        self._producer.begin_transaction()

    def commit_transaction(self, offsets: dict[tuple[str, int], int], group_metadata: object,
                           timeout_s: float = 30.0) -> None:
        """Attach the consumed offsets to the open transaction and commit both atomically."""
        tps = [TopicPartition(t, p, o) for (t, p), o in offsets.items()]
        deadline = time.monotonic() + timeout_s
        if tps:
            self._retrying(lambda: self._producer.send_offsets_to_transaction(tps, group_metadata, timeout_s), deadline)
        self._retrying(lambda: self._producer.commit_transaction(timeout_s), deadline)

    def abort(self, timeout_s: float = 30.0) -> None:
        self._producer.abort_transaction(timeout_s)

    @staticmethod
    def _retrying(call: Callable[[], object], deadline: float) -> None:
        while True:
            try:
                call()
                return
            except KafkaException as exc:
                err = exc.args[0]
                if err.retriable() and time.monotonic() < deadline:
                    time.sleep(0.1)
                    continue
                if err.fatal():
                    raise SinkError(f"fatal producer error: {err.str()}") from exc
                raise

    def close(self, timeout_s: float = 30.0) -> None:
        remaining = self._producer.flush(timeout_s)
        if remaining:
            log.warning("%d messages not acknowledged at close; their offsets stay uncommitted", remaining)
