"""The broker the test kit and the benchmarks run against: KAFKA_BOOTSTRAP_SERVERS when set, else testcontainers'
Kafka where a Docker engine answers, else the project's local Apache Kafka. Which one serves is logged and set in
STREAMFER_TEST_BROKER, so a run can check it got the one it meant to."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.tools.kafka_container import KafkaContainer

log = logging.getLogger("worker.testing")


def _docker_engine_answers() -> bool:
    try:
        import docker

        client = docker.from_env(timeout=3)
        client.ping()
        return True
    except Exception:  # noqa: BLE001 (no engine, no socket, no permission, no docker package: all mean "no")
        return False


def _kafka_container() -> KafkaContainer | None:
    """testcontainers' Kafka (worker/tools/kafka_container.py: the `apache/kafka` image, or STREAMFER_KAFKA_IMAGE),
    started; None (and a warning) where it cannot start, e.g. when the engine cannot pull the image: the local
    broker serves instead."""
    try:
        from worker.tools.kafka_container import kafka_image, start_kafka_container
    except ImportError as exc:
        log.warning("a Docker engine answers but testcontainers cannot be imported (%s); using the local broker "
                    "(pip install 'testcontainers>=4.15')", exc)
        return None
    try:
        return start_kafka_container()
    except Exception as exc:  # noqa: BLE001 (docker's and testcontainers' errors have no common base)
        reason = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        log.warning("a Docker engine answers but testcontainers' Kafka (%s) did not start (%s); using the local "
                    "broker (STREAMFER_KAFKA_IMAGE names an image the engine has or can pull)", kafka_image(), reason)
        return None


@contextmanager
def kafka_broker(state_dir: Path | None = None) -> Iterator[str]:
    """Bootstrap servers of a real broker: KAFKA_BOOTSTRAP_SERVERS if set; else testcontainers' Kafka where a
    Docker engine answers; else the project's local Apache Kafka (KRaft, Java + Maven jars), removed after.
    Which one serves is logged and set in STREAMFER_TEST_BROKER (`external`, `testcontainers` or `local`)."""
    given = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if given:
        with _broker_chosen("external", given):
            yield given
        return
    container = _kafka_container() if _docker_engine_answers() else None
    if container is not None:
        try:
            with _broker_chosen("testcontainers", container.bootstrap_servers,
                                f"image {container.image}, container {container.container_id[:12]}"):
                yield container.bootstrap_servers
        finally:
            container.stop()
        return
    from worker.tools.local_broker import LocalKafka

    own_dir = state_dir is None
    broker = LocalKafka(state_dir if state_dir is not None else Path(tempfile.mkdtemp(prefix="streamfer-kafka-")))
    state = broker.start()
    # The reliability suite freezes this broker (SIGSTOP) to simulate a stall; it finds it here.
    os.environ["STREAMFER_TEST_BROKER_DIR"] = str(broker.state_dir)
    try:
        with _broker_chosen("local", state.bootstrap_servers, f"state in {broker.state_dir}"):
            yield state.bootstrap_servers
    finally:
        os.environ.pop("STREAMFER_TEST_BROKER_DIR", None)
        broker.destroy()
        if own_dir:
            shutil.rmtree(broker.state_dir, ignore_errors=True)


@contextmanager
def _broker_chosen(kind: str, bootstrap: str, detail: str = "") -> Iterator[None]:
    """Says which broker serves, in the log and in STREAMFER_TEST_BROKER, so a run can check it got the one it
    meant to (`./dev container-check` asserts `testcontainers`)."""
    log.info("test broker: %s on %s%s", kind, bootstrap, f" ({detail})" if detail else "")
    os.environ["STREAMFER_TEST_BROKER"] = kind
    try:
        yield
    finally:
        os.environ.pop("STREAMFER_TEST_BROKER", None)


def local_broker_pid() -> int | None:
    """The JVM's pid of the local broker `kafka_broker` started (or the one STREAMFER_TEST_BROKER_DIR names), for
    reading its CPU time; None for an external or a container broker, whose process is not ours to see."""
    state_dir = os.environ.get("STREAMFER_TEST_BROKER_DIR")
    if not state_dir:
        return None
    from worker.tools.local_broker import LocalKafka

    state = LocalKafka(state_dir).state()
    return state.pid if state else None
