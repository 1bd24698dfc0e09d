"""The worker against a secured broker (SASL/SCRAM over TLS, ACLs enforced by the StandardAuthorizer), run through
`worker run` as an operator would: with the right credentials and ACLs every frame is answered; a wrong password
or a missing ACL stops it with exit code 2 and one line naming what to fix, in both delivery modes, within 30 s;
no password ever appears in its output."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka.admin import AclBindingFilter, AclOperation, AclPermissionType, ResourcePatternType, ResourceType

from worker.cli import main
from worker.config import load_settings
from worker.frames import Encoding, Priority
from worker.kafka.access import worker_acls
from worker.kafka.roles import frame_producer
from worker.kafka.topics import ensure_topics
from worker.tools.local_broker import ADMIN_USER, WORKER_USER, LocalKafka
from worker.tools.publish_frames import send_frames, synthetic_frames
from worker.tools.read_results import read_results

from .helpers import TestTopics as Topics
from .helpers import ledger, start_worker

pytestmark = pytest.mark.integration

MODES = ("at_least_once", "exactly_once")
# The bound an operator gets: a refused worker exits within this long of being started.
EXIT_BOUND_S = 30.0
FRAMES_PER_TOPIC = 20


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKafka]:
    """A broker of this module's own with a SASL_SSL client listener, SCRAM users and ACLs enforced."""
    broker = LocalKafka(tmp_path_factory.mktemp("secured-kafka"), heap_mb=320, security="sasl_ssl")
    broker.start()
    yield broker
    broker.destroy()


def _topics(broker: LocalKafka, unique: str) -> Topics:
    t = Topics(realtime=f"s{unique}.realtime", standard=f"s{unique}.standard", bulk=f"s{unique}.bulk",
                   results=f"s{unique}.results", dead_letter=f"s{unique}.dlq", group=f"g{unique}")
    ensure_topics(broker.kafka_settings(), [t.realtime, t.standard, t.bulk, t.results, t.dead_letter], 3)
    return t


def _settings(broker: LocalKafka, topics: Topics, mode: str) -> object:
    env = {**broker.worker_env(), **topics.env(), "WORKER_DELIVERY_MODE": mode,
           "WORKER_DELIVERY_TRANSACTIONAL_ID_PREFIX": f"sec-{topics.group}",
           "WORKER_KAFKA_BOOTSTRAP_SERVERS": broker.state().bootstrap_servers}  # type: ignore[union-attr]
    return load_settings(env=env)


def _grant(broker: LocalKafka, topics: Topics, mode: str, without: AclOperation | None = None,
           on: str | None = None) -> None:
    acls = worker_acls(_settings(broker, topics, mode), principal=f"User:{WORKER_USER}")
    broker.create_acls([a for a in acls if not (a.operation == without and a.name == on)])


def _publish(broker: LocalKafka, topics: Topics, unique: str) -> set[tuple[str, int]]:
    producer = frame_producer(broker.kafka_settings())
    sent: set[tuple[str, int]] = set()
    for priority, topic in zip(Priority, topics.inputs):
        frames = list(synthetic_frames(FRAMES_PER_TOPIC, [(32, 32)], Encoding.RAW_RGB8, priority, unique))
        send_frames(producer, iter(frames), lambda _rec, t=topic: t)
        sent |= {(f.stream_id, f.frame_index) for f in frames}
    return sent


def _run(broker: LocalKafka, topics: Topics, mode: str, log: Path, env: dict[str, str] | None = None,
         exit_when_idle: float | None = 2.0) -> tuple[int, float, str]:
    """`worker run` as a subprocess; its exit code, how long it ran, and everything it printed."""
    extra = {**broker.worker_env(), "WORKER_DELIVERY_MODE": mode,
             "WORKER_DELIVERY_TRANSACTIONAL_ID_PREFIX": f"sec-{topics.group}", **(env or {})}
    started = time.monotonic()
    proc = start_worker(broker.state().bootstrap_servers, topics, extra_env=extra,  # type: ignore[union-attr]
                        exit_when_idle=exit_when_idle, log_path=str(log))
    try:
        rc = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return rc, time.monotonic() - started, log.read_text(errors="replace")


def _passwords(broker: LocalKafka) -> list[str]:
    return [broker.password_file(u).read_text().strip() for u in ("admin", WORKER_USER)]


def _assert_no_secret(broker: LocalKafka, output: str, *extra: str) -> None:
    for secret in [*_passwords(broker), *extra]:
        assert secret not in output, "a password appeared in the worker's output"


def _error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error: ")]


@pytest.mark.parametrize("mode", MODES)
def test_scram_sha_512_over_sasl_ssl_with_the_worker_acls_answers_every_frame(
        secured: LocalKafka, unique: str, tmp_path: Path, mode: str) -> None:
    topics = _topics(secured, unique)
    _grant(secured, topics, mode)
    sent = _publish(secured, topics, unique)

    rc, _seconds, output = _run(secured, topics, mode, tmp_path / "worker.log")

    assert rc == 0, output[-3000:]
    counts = ledger(read_results(secured.kafka_settings(), topics.results, idle_timeout_s=1.0))
    assert set(counts) == sent
    assert max(counts.values()) == 1
    _assert_no_secret(secured, output)


def test_scram_sha_256_credentials_answer_every_frame(secured: LocalKafka, unique: str, tmp_path: Path) -> None:
    topics = _topics(secured, unique)
    _grant(secured, topics, "at_least_once")
    sent = _publish(secured, topics, unique)

    rc, _seconds, output = _run(secured, topics, "at_least_once", tmp_path / "worker.log",
                                env={"WORKER_KAFKA_SASL_MECHANISM": "SCRAM-SHA-256"})

    assert rc == 0, output[-3000:]
    counts = ledger(read_results(secured.kafka_settings(), topics.results, idle_timeout_s=1.0))
    assert set(counts) == sent


def test_the_tools_reach_the_secured_cluster_with_the_kafka_settings_as_the_worker_does(
        secured: LocalKafka, unique: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`worker results`, `worker lag` and `worker dlq show` make their clients from the same [kafka] settings as the
    worker (as the super user here: the worker's own ACLs do not let it read its results)."""
    topics = _topics(secured, unique)
    _grant(secured, topics, "at_least_once")
    sent = _publish(secured, topics, unique)
    rc, _seconds, output = _run(secured, topics, "at_least_once", tmp_path / "worker.log")
    assert rc == 0, output[-3000:]
    for key, value in {**secured.worker_env(user=ADMIN_USER), **topics.env(),
                       "WORKER_KAFKA_BOOTSTRAP_SERVERS": secured.kafka_settings().bootstrap_servers}.items():
        monkeypatch.setenv(key, value)
    capsys.readouterr()

    assert main(["results", "--topic", topics.results, "--count", str(len(sent))]) == 0
    results = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert set(ledger(results)) == sent
    assert main(["lag", "--json"]) == 0
    (group,) = json.loads(capsys.readouterr().out)["groups"]
    assert group["group"] == topics.group and all(p["lag"] == 0 for p in group["partitions"])
    assert main(["dlq", "show", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["total"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_a_wrong_password_exits_2_within_30s_naming_the_password_setting(
        secured: LocalKafka, unique: str, tmp_path: Path, mode: str) -> None:
    topics = _topics(secured, unique)
    _grant(secured, topics, mode)
    wrong = tmp_path / "wrong.password"
    wrong.write_text("not-the-password-" + unique)

    rc, seconds, output = _run(secured, topics, mode, tmp_path / "worker.log", exit_when_idle=None,
                               env={"WORKER_KAFKA_SASL_PASSWORD_FILE": str(wrong)})

    assert rc == 2, output[-3000:]
    assert seconds < EXIT_BOUND_S
    lines = _error_lines(output)
    print(f"[{mode}] exit {rc} after {seconds:.1f} s: {lines}")
    assert len(lines) == 1, output[-3000:]
    assert "kafka.sasl_password" in lines[0] and "User:streamfer" in lines[0]
    assert "Traceback" not in output
    _assert_no_secret(secured, output, wrong.read_text())


@pytest.mark.parametrize("mode", MODES)
def test_no_write_acl_on_the_results_topic_exits_2_within_30s_naming_the_acl(
        secured: LocalKafka, unique: str, tmp_path: Path, mode: str) -> None:
    topics = _topics(secured, unique)
    _grant(secured, topics, mode, without=AclOperation.WRITE, on=topics.results)
    _publish(secured, topics, unique)

    rc, seconds, output = _run(secured, topics, mode, tmp_path / "worker.log", exit_when_idle=None)

    assert rc == 2, output[-3000:]
    assert seconds < EXIT_BOUND_S
    lines = _error_lines(output)
    print(f"[{mode}] exit {rc} after {seconds:.1f} s: {lines}")
    assert len(lines) == 1, output[-3000:]
    assert f"ACL: WRITE on topic {topics.results} for principal User:streamfer" in lines[0]
    assert "Traceback" not in output
    _assert_no_secret(secured, output)


def test_no_read_acl_on_the_group_exits_2_naming_the_acl(secured: LocalKafka, unique: str, tmp_path: Path) -> None:
    topics = _topics(secured, unique)
    _grant(secured, topics, "at_least_once", without=AclOperation.READ, on=topics.group)

    rc, seconds, output = _run(secured, topics, "at_least_once", tmp_path / "worker.log", exit_when_idle=None)

    assert rc == 2, output[-3000:]
    assert seconds < EXIT_BOUND_S
    assert f"ACL: READ on group {topics.group} for principal User:streamfer" in _error_lines(output)[0]


def test_acls_can_be_granted_and_removed_by_principal(secured: LocalKafka, unique: str) -> None:
    topics = _topics(secured, unique)
    _grant(secured, topics, "exactly_once")
    principal = f"User:{WORKER_USER}"
    removed = secured.delete_acls([AclBindingFilter(ResourceType.TOPIC, topics.results, ResourcePatternType.LITERAL,
                                                    principal, None, AclOperation.ANY, AclPermissionType.ANY)])
    assert removed == 1
    assert len(worker_acls(_settings(secured, topics, "exactly_once"), principal)) == 9  # type: ignore[arg-type]
    # 3 READ input topics, READ group, WRITE results and dead letters, READ and WRITE control, WRITE transactional ids


def test_read_acls_revoked_under_a_running_worker_stop_it_with_exit_2(
        secured: LocalKafka, unique: str, tmp_path: Path) -> None:
    """A refusal after start-up (an ACL removed while it runs) is classified from the consumer's errors."""
    topics = _topics(secured, unique)
    _grant(secured, topics, "at_least_once")
    sent = _publish(secured, topics, unique)
    log = tmp_path / "worker.log"
    extra = {**secured.worker_env(), "WORKER_DELIVERY_MODE": "at_least_once"}
    bootstrap = secured.state().bootstrap_servers  # type: ignore[union-attr]
    proc = start_worker(bootstrap, topics, extra_env=extra, log_path=str(log))
    try:
        read_results(secured.kafka_settings(), topics.results, until=lambda rs: len(rs) >= len(sent), timeout_s=120)
        principal = f"User:{WORKER_USER}"
        removed = secured.delete_acls([AclBindingFilter(ResourceType.TOPIC, name, ResourcePatternType.LITERAL,
                                                        principal, None, AclOperation.READ, AclPermissionType.ANY)
                                       for name in topics.inputs])
        assert removed == 3
        revoked = time.monotonic()
        rc = proc.wait(timeout=120)
        seconds = time.monotonic() - revoked
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = log.read_text(errors="replace")
    lines = _error_lines(output)
    print(f"[revoked] exit {rc} {seconds:.1f} s after the ACLs went: {lines}")
    assert rc == 2, output[-3000:]
    assert len(lines) == 1 and "ACL: READ on topic" in lines[0] and principal in lines[0]
    assert "Traceback" not in output


def test_no_transactional_id_acl_exits_2_in_exactly_once(secured: LocalKafka, unique: str, tmp_path: Path) -> None:
    """Found by init_transactions in the sink (the start-up probe cannot describe transactional ids)."""
    topics = _topics(secured, unique)
    _grant(secured, topics, "exactly_once", without=AclOperation.WRITE, on=f"sec-{topics.group}-")

    rc, seconds, output = _run(secured, topics, "exactly_once", tmp_path / "worker.log", exit_when_idle=None)

    lines = _error_lines(output)
    print(f"[exactly_once] exit {rc} after {seconds:.1f} s: {lines}")
    assert rc == 2, output[-3000:]
    assert seconds < EXIT_BOUND_S
    assert len(lines) == 1 and "ACL: WRITE and DESCRIBE on transactional id" in lines[0]
    assert "Traceback" not in output


def test_a_worker_principal_is_refused_writing_the_control_topic(secured: LocalKafka, unique: str) -> None:
    """Issue 69: only an operator's principal writes the control topic (docs/security.md); the worker's principal,
    granted READ alone, reads the operator's rollout and is refused writing one of its own."""
    from confluent_kafka.admin import AclBinding

    from worker.control.records import MODELS, ControlRecord, DesiredModels, ModelRef, models_key
    from worker.errors import OperatorError
    from worker.kafka.control import CONTROL_READER_GROUP, ControlReader, ControlWriter
    from worker.kafka.topics import CONTROL_TOPIC_CONFIG

    control, group, results = f"s{unique}.control", f"g{unique}", f"s{unique}.results"
    ensure_topics(secured.kafka_settings(), [control], 1, configs={control: CONTROL_TOPIC_CONFIG})
    ensure_topics(secured.kafka_settings(), [results], 1)
    worker_principal = f"User:{WORKER_USER}"
    secured.create_acls([
        *(AclBinding(ResourceType.TOPIC, control, ResourcePatternType.LITERAL, worker_principal, "*", op,
                     AclPermissionType.ALLOW) for op in (AclOperation.READ, AclOperation.DESCRIBE)),
        # As a worker's: WRITE on its results (which also lets its idempotent producer get an id, KIP-679).
        AclBinding(ResourceType.TOPIC, results, ResourcePatternType.LITERAL, worker_principal, "*",
                   AclOperation.WRITE, AclPermissionType.ALLOW),
        # The reader joins no group, but librdkafka looks up its group's coordinator (worker.kafka.control).
        AclBinding(ResourceType.GROUP, CONTROL_READER_GROUP, ResourcePatternType.LITERAL, worker_principal, "*",
                   AclOperation.DESCRIBE, AclPermissionType.ALLOW)])
    bootstrap = secured.state().bootstrap_servers  # type: ignore[union-attr]
    common = {"WORKER_KAFKA_BOOTSTRAP_SERVERS": bootstrap, "WORKER_TOPICS_CONTROL": control,
              "WORKER_KAFKA_GROUP_ID": group}
    operator = load_settings(env={**secured.worker_env(user=ADMIN_USER), **common})
    worker = load_settings(env={**secured.worker_env(), **common})
    record = ControlRecord(MODELS, group, 1, 1, "ops", models=DesiredModels(None, ModelRef("opennsfw"), "shadow", 0.1))

    writer = ControlWriter(operator)
    writer.write(models_key(group), record)
    writer.close()
    reader = ControlReader(worker)
    try:
        reader.read_to_end(60)
    finally:
        reader.close()
    assert reader.state.models is not None and reader.state.models.revision == 1

    forged = ControlWriter(worker)
    with pytest.raises(OperatorError, match="(?i)authoriz"):
        forged.write(models_key(group), ControlRecord(MODELS, group, 2, 2, "w0", models=DesiredModels(
            ModelRef("/tmp/evil.pt"))), timeout_s=30)
