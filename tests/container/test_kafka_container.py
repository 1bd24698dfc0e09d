"""The test kit's broker came from testcontainers for real: `./dev container-check` runs this module in one pytest
session with the kit's integration tests (tests/integration/test_testing_kit.py, test_testing_doc.py), with
KAFKA_BOOTSTRAP_SERVERS unset and DOCKER_HOST naming its engine, and STREAMFER_EXPECT_BROKER=testcontainers.
Skipped otherwise: which broker serves depends on the machine (docs/testing.md)."""

from __future__ import annotations

import os

import pytest

from worker.tools.kafka_container import kafka_image

EXPECTED = os.environ.get("STREAMFER_EXPECT_BROKER", "")

pytestmark = [
    pytest.mark.container,
    pytest.mark.skipif(EXPECTED != "testcontainers",
                       reason="checks testcontainers' Kafka: ./dev container-check (STREAMFER_EXPECT_BROKER)"),
]


def test_the_session_broker_is_the_one_testcontainers_started(kafka_bootstrap: str) -> None:
    assert os.environ.get("STREAMFER_TEST_BROKER") == EXPECTED


def test_the_broker_runs_in_a_container_of_the_kits_image_labelled_by_this_session(kafka_bootstrap: str) -> None:
    import docker
    from testcontainers.core.labels import LABEL_SESSION_ID, SESSION_ID

    engine = docker.from_env()
    try:
        ours = engine.containers.list(filters={"label": f"{LABEL_SESSION_ID}={SESSION_ID}"})
        assert len(ours) == 1, [c.name for c in ours]
        (container,) = ours
        assert container.status == "running"
        assert kafka_image() in container.image.tags
        env = dict(e.split("=", 1) for e in container.attrs["Config"]["Env"])
        assert env["KAFKA_ADVERTISED_LISTENERS"].split(",")[0].split("://")[1] == kafka_bootstrap
    finally:
        engine.close()


def test_the_broker_answers_as_one_kraft_node(kafka_bootstrap: str) -> None:
    from confluent_kafka.admin import AdminClient

    metadata = AdminClient({"bootstrap.servers": kafka_bootstrap}).list_topics(timeout=10)
    assert [f"{b.host}:{b.port}" for b in metadata.brokers.values()] == [kafka_bootstrap]
