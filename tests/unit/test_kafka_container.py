"""The testcontainers Kafka's pure parts: the image the kit runs, the KAFKA_* environment it gives a node, and
the local image's entry point turning that environment into server properties as `apache/kafka`'s does. The
container itself runs in `./dev container-check` (tests/container/test_kafka_container.py)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from worker.tools.kafka_container import (
    CLIENT_PORT,
    DEFAULT_IMAGE,
    IMAGE_ENV,
    KAFKA_VERSION,
    host_network_env,
    kafka_image,
    port_mapped_env,
)

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "deploy" / "container-check" / "kafka-image" / "run"


def test_the_default_image_is_apache_kafka_of_the_local_brokers_version() -> None:
    pom = (ROOT / "deploy" / "local-kafka" / "pom.xml").read_text(encoding="utf-8")
    assert re.findall(r"<kafka.version>(.*?)</kafka.version>", pom) == [KAFKA_VERSION]
    assert DEFAULT_IMAGE == f"apache/kafka:{KAFKA_VERSION}"


def test_the_image_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(IMAGE_ENV, raising=False)
    assert kafka_image() == DEFAULT_IMAGE
    monkeypatch.setenv(IMAGE_ENV, " registry.example/kafka:4.1.1 ")
    assert kafka_image() == "registry.example/kafka:4.1.1"
    monkeypatch.setenv(IMAGE_ENV, "")
    assert kafka_image() == DEFAULT_IMAGE


def test_on_the_hosts_network_the_node_listens_on_loopback_ports_the_kit_chose() -> None:
    env = host_network_env(41000, 41001)
    assert env["KAFKA_LISTENERS"] == "PLAINTEXT://127.0.0.1:41000,CONTROLLER://127.0.0.1:41001"
    assert env["KAFKA_ADVERTISED_LISTENERS"] == "PLAINTEXT://127.0.0.1:41000"
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == f"{env['KAFKA_NODE_ID']}@127.0.0.1:41001"
    assert "0.0.0.0" not in "".join(env.values())


def test_with_a_mapped_port_clients_are_told_the_hosts_address_and_the_node_talks_to_itself_inside() -> None:
    env = port_mapped_env("localhost", 41000)
    assert f"PLAINTEXT_HOST://0.0.0.0:{CLIENT_PORT}" in env["KAFKA_LISTENERS"].split(",")
    assert env["KAFKA_ADVERTISED_LISTENERS"].split(",")[0] == "PLAINTEXT_HOST://localhost:41000"
    internal = env["KAFKA_INTER_BROKER_LISTENER_NAME"]
    assert any(a.startswith(f"{internal}://localhost:") for a in env["KAFKA_ADVERTISED_LISTENERS"].split(","))


def render(env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """Run the image's entry point with a `java` that does nothing; return the server properties it wrote."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "java").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "java").chmod(0o755)
    props = tmp_path / "server.properties"
    base = {k: v for k, v in os.environ.items() if not k.startswith("KAFKA_") and k != "CLUSTER_ID"}
    proc = subprocess.run([str(RUN)], env={**base, **env, "PATH": f"{bin_dir}:{os.environ['PATH']}",
                                           "STREAMFER_KAFKA_PROPERTIES": str(props)},
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dict(line.split("=", 1) for line in props.read_text().splitlines() if line)


@pytest.mark.skipif(shutil.which("bash") is None, reason="the entry point is a bash script")
def test_the_local_images_entry_point_renders_the_environment_as_apache_kafkas_does(tmp_path: Path) -> None:
    props = render({"KAFKA_LISTENER_NAME_CLIENT_SCRAM___SHA___256_SASL_JAAS_CONFIG": "x required;",
                    "KAFKA_LOG_RETENTION__MS": "5", "KAFKA_HEAP_OPTS": "-Xmx256m", "KAFKA_NUM_PARTITIONS": "3"},
                   tmp_path)
    assert props["listener.name.client.scram-sha-256.sasl.jaas.config"] == "x required;"
    assert props["log.retention_ms"] == "5"
    assert props["num.partitions"] == "3"
    assert not any("heap" in key for key in props)  # the JVM's settings are not server properties
    # Unset single-node settings take the official image's documented defaults.
    assert props["process.roles"] == "broker,controller"
    assert props["advertised.listeners"] == "PLAINTEXT://localhost:29092,PLAINTEXT_HOST://localhost:9092"


@pytest.mark.skipif(shutil.which("bash") is None, reason="the entry point is a bash script")
def test_the_kits_environment_becomes_the_local_brokers_listeners(tmp_path: Path) -> None:
    props = render(host_network_env(41000, 41001), tmp_path)
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:41000,CONTROLLER://127.0.0.1:41001"
    assert props["advertised.listeners"] == "PLAINTEXT://127.0.0.1:41000"
    assert props["controller.quorum.voters"] == "1@127.0.0.1:41001"
    assert props["transaction.state.log.replication.factor"] == "1"
    assert props["auto.create.topics.enable"] == "false"


def test_a_container_that_cannot_start_leaves_a_warning_naming_the_image_and_the_reason(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import worker.testing
    import worker.tools.kafka_container

    def refused() -> None:
        raise RuntimeError("500 Server Error: pull access denied for apache/kafka\nmore detail")

    monkeypatch.setenv(IMAGE_ENV, "apache/kafka:4.1.1")
    monkeypatch.setattr(worker.tools.kafka_container, "start_kafka_container", refused)
    with caplog.at_level("WARNING", logger="worker.testing"):
        assert worker.testing.broker._kafka_container() is None
    (record,) = caplog.records
    assert "apache/kafka:4.1.1" in record.getMessage()
    assert "pull access denied" in record.getMessage() and "more detail" not in record.getMessage()
    assert "using the local broker" in record.getMessage()
