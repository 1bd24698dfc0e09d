"""One factory per role for every librdkafka client the worker's tools and the test kit make, each role's
properties defined here once, on top of bootstrap.servers and the [kafka] security settings (worker.kafka.client),
so `worker results`, `worker dlq`, `worker lag` and `worker produce` reach a SASL/TLS cluster as the worker does.

The worker's own consumer and producer are made in worker.kafka.consumer and worker.kafka.producer (through an
injected factory, so the in-memory kit can stand in); the worker's producer shares `output_producer_properties`
with the replay's transactional producer. A client is given a `Cluster`: the [kafka] section, or a bare bootstrap
address for a plaintext broker (the test kit's, the benchmarks').
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from confluent_kafka import Consumer, KafkaError, Producer
from confluent_kafka.admin import AdminClient

from worker.config import KafkaSettings
from worker.kafka.client import Cluster, client_properties, new_client

# librdkafka's range for message.max.bytes, and its default (also batch.size's).
LIBRDKAFKA_MIN_MESSAGE_MAX_BYTES = 1_000
LIBRDKAFKA_DEFAULT_MESSAGE_MAX_BYTES = 1_000_000
# A record batch's header (61 bytes) plus one record's framing and the dead letters' headers' names, rounded up.
RECORD_FRAMING_HEADROOM_BYTES = 512
# Tools' clients print errors only: librdkafka's informational lines would land in a command's output.
TOOL_LOG_LEVEL = 3

# librdkafka wants a group id even for a consumer of assigned partitions; these are never joined or committed.
RESULT_READER_GROUP = "streamfer-reader"
DEAD_LETTER_READER_GROUP = "streamfer-dlq-reader"
FRAME_PEEK_GROUP = "streamfer-lag-reader"


# -- producers ---------------------------------------------------------------------------------------------------
def output_producer_properties(kafka: KafkaSettings, client_id: str, max_message_bytes: int | None = None,
                               transactional_id: str | None = None,
                               transaction_timeout_ms: int | None = None) -> dict[str, Any]:
    """A producer of outputs whose every message counts once all in-sync replicas have it and whose retries never
    duplicate (the worker's results and dead letters, replayed frames); transactional with `transactional_id`,
    and kafka.producer_overrides last.

    `max_message_bytes` (the smallest limit of the topics written to) bounds one message and one batch, less the
    record framing, so librdkafka never builds a batch the broker refuses as a whole and an output too large is
    refused at produce() time, alone."""
    conf: dict[str, Any] = {
        **client_properties(kafka), "enable.idempotence": True, "acks": "all", "linger.ms": 2,
        "client.id": client_id,
        # Keep retrying through broker restarts; the frame's offset stays uncommitted meanwhile.
        "message.timeout.ms": 300_000,
    }
    if transactional_id:
        conf["transactional.id"] = transactional_id
        if transaction_timeout_ms is not None:
            # librdkafka requires message.timeout.ms <= transaction.timeout.ms.
            conf["transaction.timeout.ms"] = transaction_timeout_ms
            conf["message.timeout.ms"] = transaction_timeout_ms
    if max_message_bytes is not None:
        bound = max(LIBRDKAFKA_MIN_MESSAGE_MAX_BYTES, max_message_bytes - RECORD_FRAMING_HEADROOM_BYTES)
        conf["message.max.bytes"] = bound
        conf["batch.size"] = bound
    conf.update(kafka.producer_overrides)
    return conf


def transactional_producer(kafka: KafkaSettings, transactional_id: str, client_id: str, transaction_timeout_ms: int,
                           max_message_bytes: int | None = None) -> Producer:
    """An output producer in transactions (`worker dlq replay`'s; the worker's is made by its ResultSink from the
    same properties). A property librdkafka refuses is a ConfigError naming kafka.producer_overrides."""
    conf = output_producer_properties(kafka, client_id, max_message_bytes, transactional_id, transaction_timeout_ms)
    return new_client(Producer, {**conf, "log_level": TOOL_LOG_LEVEL}, "producer")


def frame_producer(cluster: Cluster, max_message_bytes: int | None = None, queue_max_kbytes: int | None = None,
                   logger: logging.Logger | None = None) -> Producer:
    """A producer of frames as cameras send them: idempotent (a retry never duplicates a frame), a small linger,
    compressed. `max_message_bytes` raises librdkafka's own request limit where above its default, so one large
    frame is not refused locally; `queue_max_kbytes` bounds its local queue (live cameras: a broker that cannot
    keep up makes their queues drop old frames instead of memory growing)."""
    conf: dict[str, Any] = {**client_properties(cluster), "enable.idempotence": True, "linger.ms": 5,
                            "compression.type": "lz4"}
    if max_message_bytes and max_message_bytes > LIBRDKAFKA_DEFAULT_MESSAGE_MAX_BYTES:
        conf["message.max.bytes"] = max_message_bytes
    if queue_max_kbytes is not None:
        conf["queue.buffering.max.kbytes"] = str(queue_max_kbytes)
    return new_client(Producer, conf, "frame producer", logger)


# -- readers of assigned partitions --------------------------------------------------------------------------------
def _assigned_reader(cluster: Cluster, group: str, role: str, fetch: Mapping[str, Any] | None = None) -> Consumer:
    """A consumer of partitions it assigns itself, read as the worker reads (read_committed), that joins no group,
    commits nothing and reports each partition's end (enable.partition.eof)."""
    conf: dict[str, Any] = {**client_properties(cluster), "group.id": group, "enable.auto.commit": False,
                            "isolation.level": "read_committed", "enable.partition.eof": True,
                            "log_level": TOOL_LOG_LEVEL, **(fetch or {})}
    return new_client(Consumer, conf, role)


def result_reader(cluster: Cluster) -> Consumer:
    """Reads the results (or dead-letter) topic as a downstream consumer should: `worker results`, the demo, tests."""
    return _assigned_reader(cluster, RESULT_READER_GROUP, "results reader")


def dead_letter_reader(cluster: Cluster) -> Consumer:
    """Reads dead letters, the replay ledger and input messages for `worker dlq`: dead letters carry frames, so
    little is fetched ahead."""
    return _assigned_reader(cluster, DEAD_LETTER_READER_GROUP, "dead-letter reader",
                            {"queued.max.messages.kbytes": 16384})


def frame_peeker(cluster: Cluster) -> Consumer:
    """Reads the one frame each lagging partition resumes at (`worker lag`'s oldest-frame age): fetches little."""
    return _assigned_reader(cluster, FRAME_PEEK_GROUP, "frame reader",
                            {"fetch.message.max.bytes": 65536, "queued.max.messages.kbytes": 4096})


def offsets_reader(cluster: Cluster, group: str) -> Consumer:
    """A consumer that only asks: `group`'s committed offsets and partitions' watermarks (the test kit's probes).
    It never subscribes, so it never joins `group` and commits nothing."""
    conf = {**client_properties(cluster), "group.id": group, "enable.auto.commit": False,
            "log_level": TOOL_LOG_LEVEL}
    return new_client(Consumer, conf, "offsets reader")


def uncommitted_end_reader(cluster: Cluster) -> Consumer:
    """A consumer that only asks partitions' high watermarks as read_uncommitted: where the records end, open and
    still-completing transactions' included (a read_committed consumer is told the last stable offset instead).
    It never subscribes, reads or commits."""
    conf = {**client_properties(cluster), "group.id": DEAD_LETTER_READER_GROUP, "enable.auto.commit": False,
            "isolation.level": "read_uncommitted", "log_level": TOOL_LOG_LEVEL}
    return new_client(Consumer, conf, "high watermark reader")


# -- admin ------------------------------------------------------------------------------------------------------------
def admin_client(cluster: Cluster, log_level: int = TOOL_LOG_LEVEL, logger: logging.Logger | None = None,
                 error_cb: Callable[[KafkaError], None] | None = None) -> AdminClient:
    """An admin client: topics, their configs, groups' offsets, ACLs, users. `log_level` 0 silences librdkafka (a
    broker still starting refuses connections); `error_cb` sees what librdkafka reports only there (a refused
    login: the start-up probe)."""
    conf: dict[str, Any] = {**client_properties(cluster), "log_level": log_level}
    if error_cb is not None:
        conf["error_cb"] = error_cb
    return new_client(AdminClient, conf, "admin", logger)
