"""Creating the worker's topics (the broker's auto-creation is off in production and in the local broker)."""

from __future__ import annotations

import logging
from typing import Mapping

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from worker.config import TopicSettings

log = logging.getLogger(__name__)


def worker_topics(topics: TopicSettings) -> list[str]:
    return [topics.realtime, topics.standard, topics.bulk, topics.results, topics.dead_letter]


def ensure_topics(bootstrap_servers: str, names: list[str], partitions: int = 3, replication: int = 1,
                  timeout_s: float = 30.0, properties: Mapping[str, str] | None = None) -> list[str]:
    """Create the topics that do not exist yet; returns the ones created. Existing topics are left alone.

    `properties`: librdkafka security properties (worker.kafka_access.security_properties)."""
    admin = AdminClient({"bootstrap.servers": bootstrap_servers, **(properties or {})})
    existing = set(admin.list_topics(timeout=timeout_s).topics)
    missing = [n for n in names if n not in existing]
    if not missing:
        return []
    futures = admin.create_topics([NewTopic(n, num_partitions=partitions, replication_factor=replication)
                                   for n in missing], operation_timeout=timeout_s)
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
