"""Creating the worker's topics (the broker's auto-creation is off in production and in the local broker).

Frames can be large: the input topics and the dead-letter topic (which carries a failed frame's original
bytes) get `max.message.bytes` from the largest frame to accept; Kafka's default (about 1 MB) refuses a raw
720p frame. docs/configuration.md quotes measured frame sizes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import (
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewTopic,
)

from worker.config import TopicSettings
from worker.kafka.client import Cluster
from worker.kafka.roles import admin_client

log = logging.getLogger(__name__)

# The largest frame, as a Kafka record, the frame topics take by default: room for any 1080p JPEG (photos at
# quality 95 measured 0.32-0.66 MB, pure noise, the worst case, 2.44 MB) and a raw 720p frame (2.76 MB); not
# a raw 1080p frame (6.2 MB).
DEFAULT_MAX_FRAME_BYTES = 4 * 1024 * 1024


def worker_topics(topics: TopicSettings) -> list[str]:
    """The topics with the worker's partition count: inputs, results, dead letters, the routes that are on, and a
    candidate model's shadow results (issue 69)."""
    return [topics.realtime, topics.standard, topics.bulk, topics.results, topics.dead_letter, *topics.routes(),
            *([topics.shadow_results] if topics.shadow_results else [])]


# The control topic: Kafka Connect's config topic (docs/operations.md): one partition, so its order is total, and
# compacted, so the last record of each key (a group's policy, a worker's report) survives.
CONTROL_TOPIC_CONFIG = {"cleanup.policy": "compact"}


def ensure_control_topic(cluster: Cluster, topics: TopicSettings, replication: int = 1,
                         timeout_s: float = 30.0) -> list[str]:
    """Create the control topic (one partition, compacted) if it does not exist; returns it if created."""
    return ensure_topics(cluster, [topics.control], partitions=1, replication=replication, timeout_s=timeout_s,
                         configs={topics.control: CONTROL_TOPIC_CONFIG})


def frame_topics(topics: TopicSettings) -> list[str]:
    """The topics whose messages carry frame bytes: the three inputs and the dead-letter topic."""
    return [topics.realtime, topics.standard, topics.bulk, topics.dead_letter]


def frame_topic_configs(topics: TopicSettings, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
                        ) -> dict[str, dict[str, str]]:
    return {name: {"max.message.bytes": str(max_frame_bytes)} for name in frame_topics(topics)}


def ensure_topics(cluster: Cluster, names: list[str], partitions: int = 3, replication: int = 1,
                  timeout_s: float = 30.0, configs: Mapping[str, Mapping[str, str]] | None = None) -> list[str]:
    """Create the topics that do not exist yet (with `configs[name]`); returns the ones created. Existing
    topics are left alone."""
    admin = admin_client(cluster)
    existing = set(admin.list_topics(timeout=timeout_s).topics)
    missing = [n for n in names if n not in existing]
    if not missing:
        return []
    configs = configs or {}
    futures = admin.create_topics([NewTopic(n, num_partitions=partitions, replication_factor=replication,
                                            config=dict(configs.get(n, {}))) for n in missing],
                                  operation_timeout=timeout_s)
    created = []
    for name, fut in futures.items():
        try:
            fut.result(timeout_s)
            created.append(name)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
    log.info("created topics %s", created)
    return created


def topic_message_limits(cluster: Cluster, topics: Iterable[str], timeout_s: float = 10.0) -> dict[str, int]:
    """Each topic's `max.message.bytes` as the broker reports it; topics it cannot describe are left out."""
    topics = set(topics)
    if not topics:
        return {}
    admin = admin_client(cluster)
    futures = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, t) for t in topics])
    limits = {}
    for resource, fut in futures.items():
        try:
            entry = fut.result(timeout_s).get("max.message.bytes")
        except (KafkaException, TimeoutError):  # not described in time: left out, as the docstring says
            continue
        if entry is not None and entry.value is not None:
            limits[resource.name] = int(entry.value)
    return limits


def raise_message_limits(cluster: Cluster, names: list[str], max_message_bytes: int,
                         timeout_s: float = 30.0) -> list[str]:
    """Raise `max.message.bytes` of existing topics below `max_message_bytes` (never lower one); returns them."""
    low = [n for n, limit in topic_message_limits(cluster, names, timeout_s).items() if limit < max_message_bytes]
    if not low:
        return []
    admin = admin_client(cluster)
    entry = ConfigEntry("max.message.bytes", str(max_message_bytes),
                        incremental_operation=AlterConfigOpType.SET)
    futures = admin.incremental_alter_configs(
        [ConfigResource(ConfigResource.Type.TOPIC, n, incremental_configs=[entry]) for n in low])
    for fut in futures.values():
        fut.result(timeout_s)
    log.info("raised max.message.bytes to %d on %s", max_message_bytes, low)
    return sorted(low)
