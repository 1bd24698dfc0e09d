"""Kafka in a container for the test kit, started and stopped by testcontainers: one KRaft node (broker and
controller) of the official `apache/kafka` image, configured by its documented KAFKA_* environment variables.
testcontainers' own Kafka module only runs Confluent's cp-kafka, so this uses its generic `DockerContainer`.

Where the engine has a bridge network (Docker's default) the client port is mapped to a free host port; on an
engine without one (`dockerd --bridge=none`, as `./dev container-check` runs it) the container shares the host's
network and listens on free loopback ports the kit picks. Ready means the log says "Kafka Server started" and
a metadata request answers. The image is a setting: STREAMFER_KAFKA_IMAGE (docs/testing.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from testcontainers.core.container import DockerContainer
from testcontainers.core.wait_strategies import CompositeWaitStrategy, LogMessageWaitStrategy
from testcontainers.core.waiting_utils import WaitStrategy, WaitStrategyTarget

from worker.tools.local_broker import free_port, wait_until_ready

# The version the project's local broker runs (deploy/local-kafka/pom.xml); a unit test keeps them equal.
KAFKA_VERSION = "4.1.1"
DEFAULT_IMAGE = f"apache/kafka:{KAFKA_VERSION}"
IMAGE_ENV = "STREAMFER_KAFKA_IMAGE"
READY_LOG = "Kafka Server started"
# Inside the container, where it has a network of its own (the image's documented client port).
CLIENT_PORT = 9092
INTERNAL_PORT = 29092
CONTROLLER_PORT = 29093

# The same single-node settings as the local broker (worker/tools/local_broker.py): transactions and the
# group coordinator need replication factor 1 on one node; tests create their topics themselves.
_SINGLE_NODE = {
    "CLUSTER_ID": "5L6g3nShT-eMCtK--X86sw",
    "KAFKA_NODE_ID": "1",
    "KAFKA_PROCESS_ROLES": "broker,controller",
    "KAFKA_CONTROLLER_LISTENER_NAMES": "CONTROLLER",
    "KAFKA_NUM_PARTITIONS": "3",
    "KAFKA_DEFAULT_REPLICATION_FACTOR": "1",
    "KAFKA_MIN_INSYNC_REPLICAS": "1",
    "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR": "1",
    "KAFKA_OFFSETS_TOPIC_NUM_PARTITIONS": "1",
    "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR": "1",
    "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR": "1",
    "KAFKA_TRANSACTION_STATE_LOG_NUM_PARTITIONS": "1",
    "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_REPLICATION_FACTOR": "1",
    "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_MIN_ISR": "1",
    "KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS": "0",
    "KAFKA_TRANSACTION_ABORT_TIMED_OUT_TRANSACTION_CLEANUP_INTERVAL_MS": "5000",
    "KAFKA_AUTO_CREATE_TOPICS_ENABLE": "false",
    "KAFKA_LOG_DIRS": "/tmp/kraft-combined-logs",
    "KAFKA_HEAP_OPTS": "-Xmx512m -Xms512m",  # the JVM's, not a server property (the image's default is 1 GB)
}


def kafka_image() -> str:
    """The image the kit runs: STREAMFER_KAFKA_IMAGE, else the official image of the local broker's version."""
    return os.environ.get(IMAGE_ENV, "").strip() or DEFAULT_IMAGE


def host_network_env(port: int, controller_port: int) -> dict[str, str]:
    """Environment of a node on the host's network: it listens on loopback only, on ports the kit chose."""
    return {**_SINGLE_NODE,
            "KAFKA_LISTENERS": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
            "KAFKA_ADVERTISED_LISTENERS": f"PLAINTEXT://127.0.0.1:{port}",
            "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "KAFKA_INTER_BROKER_LISTENER_NAME": "PLAINTEXT",
            "KAFKA_CONTROLLER_QUORUM_VOTERS": f"1@127.0.0.1:{controller_port}"}


def port_mapped_env(host: str, host_port: int) -> dict[str, str]:
    """Environment of a node on a network of its own whose CLIENT_PORT the engine maps to `host:host_port`:
    clients are told that address; the node reaches itself on an internal listener."""
    return {**_SINGLE_NODE,
            "KAFKA_LISTENERS": f"PLAINTEXT_HOST://0.0.0.0:{CLIENT_PORT},PLAINTEXT://localhost:{INTERNAL_PORT},"
                               f"CONTROLLER://localhost:{CONTROLLER_PORT}",
            "KAFKA_ADVERTISED_LISTENERS": f"PLAINTEXT_HOST://{host}:{host_port},"
                                          f"PLAINTEXT://localhost:{INTERNAL_PORT}",
            "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,"
                                                    "PLAINTEXT_HOST:PLAINTEXT",
            "KAFKA_INTER_BROKER_LISTENER_NAME": "PLAINTEXT",
            "KAFKA_CONTROLLER_QUORUM_VOTERS": f"1@localhost:{CONTROLLER_PORT}"}


@dataclass(frozen=True)
class KafkaContainer:
    """A started node: its bootstrap servers, image and container id; `stop()` removes it."""

    container: DockerContainer
    bootstrap_servers: str
    image: str
    host_network: bool

    @property
    def container_id(self) -> str:
        return self.container.get_container_id()

    def stop(self) -> None:
        self.container.stop()


def start_kafka_container(image: str | None = None, timeout_s: float = 180.0) -> KafkaContainer:
    """Start a node of `image` (default `kafka_image()`) and return once it answers a metadata request. Raises
    what docker and testcontainers raise (image missing, engine refusing, not ready in time); a container
    that did start is removed first."""
    image = image or kafka_image()
    container = DockerContainer(image)
    engine = container.get_docker_client().client
    host_network = not engine.networks.list(names=["bridge"])
    if host_network:
        port, controller_port = free_port(), free_port()
        while controller_port == port:  # the OS may hand the same free port out twice in a row
            controller_port = free_port()
        container.with_kwargs(network_mode="host").with_envs(**host_network_env(port, controller_port))
        bootstrap = f"127.0.0.1:{port}"
    else:
        host, port = container.get_docker_client().host(), free_port()
        container.with_bind_ports(CLIENT_PORT, port).with_envs(**port_mapped_env(host, port))
        bootstrap = f"{host}:{port}"
    container.waiting_for(CompositeWaitStrategy(LogMessageWaitStrategy(READY_LOG), MetadataAnswers(bootstrap))
                          .with_startup_timeout(int(timeout_s)))
    try:
        container.start()
    except BaseException:
        container.stop()  # removes what was created; a no-op when nothing was
        raise
    return KafkaContainer(container, bootstrap, image, host_network)


class MetadataAnswers(WaitStrategy):
    """Ready once the broker answers a metadata request from the host, through the address clients use."""

    def __init__(self, bootstrap: str) -> None:
        super().__init__()
        self.bootstrap = bootstrap

    def wait_until_ready(self, container: WaitStrategyTarget) -> None:
        def running() -> bool:
            container.reload()
            return container.status == "running"

        wait_until_ready(self.bootstrap, self._startup_timeout, alive=running)
