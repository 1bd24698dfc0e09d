"""One client factory per role (worker/kafka/roles.py): each role's client carries the [kafka] security settings,
librdkafka takes its properties, no librdkafka client is made in worker/ outside worker/kafka/, and only the Kafka
edge (with the test kit's stand-ins for its clients and the Kafka tools) imports the client library."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

from worker.config import ConfigError, KafkaSettings, load_settings
from worker.kafka import roles
from worker.kafka.client import client_properties, security_properties
from worker.kafka.producer import producer_config

ROOT = Path(__file__).resolve().parents[2]
# Nothing listens here: making a client never connects, and what it tries later is refused at once.
NOWHERE = "127.0.0.1:9"
SASL = KafkaSettings(bootstrap_servers=NOWHERE, security_protocol="SASL_PLAINTEXT", sasl_mechanism="SCRAM-SHA-512",
                     sasl_username="streamfer", sasl_password_env="STREAMFER_TEST_PASSWORD")


def every_role(cluster: KafkaSettings) -> dict[str, Any]:
    return {
        "frame producer": lambda: roles.frame_producer(cluster),
        "results reader": lambda: roles.result_reader(cluster),
        "dead-letter reader": lambda: roles.dead_letter_reader(cluster),
        "frame reader": lambda: roles.frame_peeker(cluster),
        "offsets reader": lambda: roles.offsets_reader(cluster, "g"),
        "admin": lambda: roles.admin_client(cluster),
        "producer": lambda: roles.transactional_producer(cluster, "t-1", "streamfer-test", 60_000),
    }


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, Any]]:
    """Each client made through roles.new_client, by role: its properties (the client itself is made too)."""
    seen: dict[str, dict[str, Any]] = {}
    make = roles.new_client

    def recording(factory: Any, conf: dict[str, Any], role: str, logger: Any = None) -> Any:
        seen[role] = dict(conf)
        return make(factory, conf, role, logger)

    monkeypatch.setattr(roles, "new_client", recording)
    monkeypatch.setenv("STREAMFER_TEST_PASSWORD", "s3cret")
    return seen


def test_every_role_carries_the_kafka_security_settings_and_librdkafka_takes_its_properties(
        made: dict[str, dict[str, Any]]) -> None:
    for role, make in every_role(SASL).items():
        client = make()
        if hasattr(client, "close") and role.endswith("reader"):
            client.close()
    assert set(made) == set(every_role(SASL))
    wanted = {"bootstrap.servers": NOWHERE, **security_properties(SASL)}
    assert wanted["sasl.password"] == "s3cret"
    for role, conf in made.items():
        assert wanted.items() <= conf.items(), role


def test_a_bare_bootstrap_address_is_a_plaintext_cluster(made: dict[str, dict[str, Any]]) -> None:
    assert client_properties(NOWHERE) == {"bootstrap.servers": NOWHERE}
    roles.result_reader(NOWHERE).close()
    assert made["results reader"]["bootstrap.servers"] == NOWHERE
    assert "security.protocol" not in made["results reader"]


def test_the_readers_read_committed_from_assigned_partitions_without_a_group_or_commits(
        made: dict[str, dict[str, Any]]) -> None:
    for make in (roles.result_reader, roles.dead_letter_reader, roles.frame_peeker):
        make(NOWHERE).close()
    groups = set()
    for role in ("results reader", "dead-letter reader", "frame reader"):
        conf = made[role]
        assert (conf["isolation.level"], conf["enable.auto.commit"], conf["enable.partition.eof"]) == \
            ("read_committed", False, True), role
        groups.add(conf["group.id"])
    assert len(groups) == 3  # each tool names itself in the broker's logs


def test_the_replay_and_the_worker_make_their_transactional_producer_from_one_set_of_properties(
        made: dict[str, dict[str, Any]]) -> None:
    settings = load_settings(env={"WORKER_KAFKA_PRODUCER_OVERRIDES": "linger.ms=7"})
    roles.transactional_producer(settings.kafka, "t-1", "streamfer-test", 60_000, max_message_bytes=2_000_000)
    replay = made["producer"]
    worker = producer_config(settings, "t-1", 2_000_000)
    same = ("enable.idempotence", "acks", "transactional.id", "message.max.bytes", "batch.size", "linger.ms")
    assert {k: replay[k] for k in same} == {k: worker[k] for k in same}
    assert replay["linger.ms"] == "7"  # kafka.producer_overrides apply to both, last
    assert replay["message.max.bytes"] == 2_000_000 - roles.RECORD_FRAMING_HEADROOM_BYTES
    assert replay["transaction.timeout.ms"] == replay["message.timeout.ms"] == 60_000


def test_the_frame_producer_raises_librdkafkas_message_limit_only_above_its_default(
        made: dict[str, dict[str, Any]]) -> None:
    roles.frame_producer(NOWHERE, max_message_bytes=500_000)
    assert "message.max.bytes" not in made["frame producer"]
    roles.frame_producer(NOWHERE, max_message_bytes=4_000_000, queue_max_kbytes=32768)
    assert made["frame producer"]["message.max.bytes"] == 4_000_000
    assert made["frame producer"]["queue.buffering.max.kbytes"] == "32768"
    assert made["frame producer"]["enable.idempotence"] is True


def test_a_property_librdkafka_refuses_is_a_config_error_naming_the_kafka_settings(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMFER_TEST_PASSWORD", "s3cret")
    odd = KafkaSettings(bootstrap_servers=NOWHERE, security_protocol="SASL_PLAINTEXT", sasl_mechanism="NOPE",
                        sasl_username="u", sasl_password_env="STREAMFER_TEST_PASSWORD")
    refused = r"kafka settings: librdkafka rejected the admin configuration: .*NOPE"
    with pytest.raises(ConfigError, match=refused) as info:
        roles.admin_client(odd)
    assert "admin_overrides" not in str(info.value)  # no such setting: only the consumer and producer take overrides


# -- no client made elsewhere ----------------------------------------------------------------------------------------
CLIENT_CLASSES = {"Producer", "Consumer", "AdminClient"}


def client_constructions(base: Path) -> list[str]:
    """`path:line` (under `base`) of each call of confluent_kafka's Producer, Consumer or AdminClient, by whatever
    alias, or as an attribute (`confluent_kafka.Producer(...)`)."""
    found = []
    for path in sorted(base.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        aliases = {a.asname or a.name for node in ast.walk(tree)
                   if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("confluent_kafka")
                   for a in node.names if a.name in CLIENT_CLASSES}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if (isinstance(func, ast.Name) and func.id in aliases) or \
                    (isinstance(func, ast.Attribute) and func.attr in CLIENT_CLASSES):
                found.append(f"{path.relative_to(base)}:{node.lineno}")
    return found


def test_no_librdkafka_client_is_made_in_the_worker_outside_its_kafka_package() -> None:
    """Every client is made in worker/kafka/ (through client.new_client), with its role's properties."""
    assert [where for where in client_constructions(ROOT / "worker") if not where.startswith("kafka/")] == []


def test_the_walk_finds_a_client_under_an_alias(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("from confluent_kafka import Consumer as KafkaConsumer\nKafkaConsumer({})\n"
                                   "import confluent_kafka\nconfluent_kafka.Producer({})\n")
    assert client_constructions(tmp_path) == ["m.py:2", "m.py:4"]


# -- no import of the client library elsewhere --------------------------------------------------------------------
# Beside worker/kafka/, the client library is imported by the in-memory kit, whose stand-ins return its own types
# (TopicPartition, KafkaError), and by the command-line tools, which read offsets, watermarks and topics with it.
IMPORTERS_OF_THE_CLIENT_LIBRARY = ("kafka/", "testing/", "tools/")


def client_library_imports(base: Path) -> list[str]:
    """`path:line` (under `base`) of each import of confluent_kafka or one of its modules, at any depth (in a
    function or under TYPE_CHECKING too)."""
    found = []
    for path in sorted(base.rglob("*.py")):
        nodes = sorted((n for n in ast.walk(ast.parse(path.read_text(), filename=str(path)))
                        if isinstance(n, ast.Import | ast.ImportFrom)), key=lambda n: n.lineno)
        for node in nodes:
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            if any(name == "confluent_kafka" or name.startswith("confluent_kafka.") for name in names):
                found.append(f"{path.relative_to(base)}:{node.lineno}")
    return found


def test_only_the_kafka_edge_imports_the_client_library() -> None:
    """The loop, the policies, the runtime and the process assembly reach Kafka through worker/kafka/ only."""
    assert [where for where in client_library_imports(ROOT / "worker")
            if not where.startswith(IMPORTERS_OF_THE_CLIENT_LIBRARY)] == []


def test_the_import_walk_finds_every_form_of_import(tmp_path: Path) -> None:
    (tmp_path / "loop").mkdir()
    (tmp_path / "loop" / "m.py").write_text(
        "import confluent_kafka\n"
        "from confluent_kafka import KafkaException\n"
        "def f():\n    from confluent_kafka.admin import AdminClient\n"
        "import os, confluent_kafka.admin as admin\n"
        "import confluent_kafka_other\nfrom .confluent_kafka import x\n")
    assert client_library_imports(tmp_path) == ["loop/m.py:1", "loop/m.py:2", "loop/m.py:4", "loop/m.py:5"]
