"""How the worker reaches Kafka: the factories its consumer and producer are made with (librdkafka's, or the
in-memory kit's), and the check that librdkafka accepts the worker's client configurations. The loop and the
process assembly take these, so neither imports the client library."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from confluent_kafka import Consumer, Producer

from worker.config import Settings
from worker.kafka.client import ClientFactory, new_client
from worker.kafka.consumer import consumer_config
from worker.kafka.producer import STUCK_GRACE_S, output_message_limit, producer_config


@dataclass(frozen=True)
class KafkaClients:
    """How the loop reaches Kafka: librdkafka's clients and the broker's topic limits by default; the unit tests
    and the GPU check pass in-memory stand-ins (worker.testing.InMemoryKafka) to run the real loop without a broker."""

    consumer: ClientFactory = Consumer
    producer: ClientFactory = Producer
    # The smallest max.message.bytes of the output topics, or None to keep librdkafka's defaults.
    output_message_limit: Callable[[Settings], int | None] = output_message_limit
    # How long a transactional call may block past its own timeout before its producer is replaced.
    stuck_grace_s: float = STUCK_GRACE_S


def check_client_configs(settings: Settings) -> None:
    """Build (and drop) a consumer and a producer with the worker's configurations: librdkafka validates every
    property when a client is made, without connecting; ConfigError names the override it refused."""
    new_client(Consumer, consumer_config(settings), "consumer").close()
    new_client(Producer, producer_config(settings), "producer")
