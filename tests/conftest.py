"""Shared fixtures. The Kafka broker is chosen in this order: KAFKA_BOOTSTRAP_SERVERS if set; testcontainers'
Kafka where a Docker engine answers; else the project's own local Apache Kafka (KRaft) from Maven jars."""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path
from typing import Iterator

import pytest

log = logging.getLogger(__name__)


def _docker_engine_answers() -> bool:
    try:
        import docker

        client = docker.from_env(timeout=3)
        client.ping()
        return True
    except Exception:  # noqa: BLE001 (no engine, no socket, no permission: all mean "no")
        return False


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Apache Kafka broker for the whole session."""
    given = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if given:
        yield given
        return
    if _docker_engine_answers():
        try:
            from testcontainers.kafka import KafkaContainer
        except ImportError:  # testcontainers >= 4.15 also has the community path
            from testcontainers.community.kafka import KafkaContainer  # type: ignore[no-redef]
        with KafkaContainer().with_kraft() as container:
            yield container.get_bootstrap_server()
        return
    from worker.local_kafka import LocalKafka

    broker = LocalKafka(tmp_path_factory.mktemp("local-kafka"))
    state = broker.start()
    os.environ["STREAMFER_TEST_BROKER_DIR"] = str(broker.state_dir)
    try:
        yield state.bootstrap_servers
    finally:
        broker.destroy()


@pytest.fixture
def unique() -> str:
    return uuid.uuid4().hex[:8]


PROJECT_ROOT = Path(__file__).resolve().parent.parent
