"""The test kit's pytest plugin (entry point `pytest11`, on whenever streamfer is installed): the fixtures of
docs/testing.md, over the helpers of worker.testing. Kafka and the worker are imported only when a fixture runs,
so the plugin costs nothing in test sessions that do not use it."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from worker.testing.broker import kafka_broker
from worker.testing.kafka import FrameProducer, ResultsReader, TestTopics, make_topics
from worker.testing.workers import RunningWorker, run_worker


# -- the fixtures ----------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Apache Kafka broker for the whole session (see `kafka_broker` for which)."""
    with kafka_broker(tmp_path_factory.mktemp("local-kafka")) as bootstrap:
        yield bootstrap


@pytest.fixture
def streamfer_topics(kafka_bootstrap: str) -> TestTopics:
    """Fresh input, results and dead-letter topics (3 partitions) and a consumer group, for this test only."""
    return make_topics(kafka_bootstrap, uuid.uuid4().hex[:8])


@pytest.fixture
def streamfer_worker(kafka_bootstrap: str, streamfer_topics: TestTopics, tmp_path: Path
                     ) -> Iterator[Callable[..., RunningWorker]]:
    """Starts ready workers on the test's topics: `streamfer_worker(settings={...}, env={...})`; each is
    stopped (SIGTERM, a drain) at the end of the test if the test did not stop it."""
    started: list[RunningWorker] = []

    def start(settings: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
              worker_id: str | None = None, ready_timeout_s: float = 120.0) -> RunningWorker:
        worker = run_worker(kafka_bootstrap, streamfer_topics, tmp_path, settings, env,
                            worker_id or f"w{len(started)}", ready_timeout_s)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


@pytest.fixture
def frame_producer(kafka_bootstrap: str, streamfer_topics: TestTopics) -> FrameProducer:
    return FrameProducer(kafka_bootstrap, streamfer_topics)


@pytest.fixture
def results_reader(kafka_bootstrap: str, streamfer_topics: TestTopics) -> ResultsReader:
    return ResultsReader(kafka_bootstrap, streamfer_topics)


# -- a Schema Registry (Confluent API) -------------------------------------------------------------------
@pytest.fixture(scope="session")
def schema_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The base URL of a real Schema Registry for the session (schema_registry.url): STREAMFER_SCHEMA_REGISTRY_URL,
    else Apicurio Registry from Maven Central on loopback (worker.tools.schema_registry), stopped after. Skips
    only where no Java 17+ exists."""
    from worker.tools.schema_registry import SchemaRegistryUnavailable
    from worker.tools.schema_registry import schema_registry as running_registry

    try:
        with running_registry(tmp_path_factory.mktemp("schema-registry")) as url:
            yield url
    except SchemaRegistryUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture
def registry_frame_producer(kafka_bootstrap: str, streamfer_topics: TestTopics, schema_registry: str) -> FrameProducer:
    """A frame_producer writing the Confluent wire format: frame.avsc registered under `<topic>-value`."""
    from worker.config import SchemaRegistrySettings
    from worker.kafka.registry import frame_serializer

    serializer = frame_serializer(SchemaRegistrySettings(url=schema_registry))
    return FrameProducer(kafka_bootstrap, streamfer_topics, encode=serializer)
