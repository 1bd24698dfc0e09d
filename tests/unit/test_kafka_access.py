"""Security settings, their one mapping to librdkafka properties, and the classification of Kafka errors into
what an operator must fix (exit 2, one line naming the setting or ACL) and what the client rides out."""

from __future__ import annotations

from pathlib import Path

import pytest
from confluent_kafka import KafkaError, KafkaException

from tests.integration.helpers import http_get
from tests.unit.test_health import SourceStub
from worker.config import ConfigError, load_settings
from worker.errors import OperatorError
from worker.kafka.client import client_properties, principal_of, redact, security_properties
from worker.kafka.errors import (
    AUTHENTICATION,
    AUTHORIZATION,
    TLS,
    BrokerAccessError,
    BrokerStatus,
    Identity,
    RefusalStreak,
    cause_of,
    classify_consumer_error,
    classify_producer_error,
)
from worker.metrics import Health, Metrics, MetricsServer
from worker.testing import FakeClock

SECRET = "s3cr3t-value"


@pytest.fixture
def password_file(tmp_path: Path) -> Path:
    path = tmp_path / "password"
    path.write_text(SECRET + "\n")
    return path


def sasl_env(password_file: Path, **extra: str) -> dict[str, str]:
    return {"WORKER_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT", "WORKER_KAFKA_SASL_USERNAME": "svc",
            "WORKER_KAFKA_SASL_PASSWORD_FILE": str(password_file), **extra}


# -- settings -------------------------------------------------------------------------------------------------------
def test_sasl_settings_map_to_librdkafka_properties_with_the_password_read_from_its_file(password_file: Path) -> None:
    s = load_settings(env=sasl_env(password_file, WORKER_KAFKA_BOOTSTRAP_SERVERS="b:9093"))
    assert client_properties(s.kafka) == {"bootstrap.servers": "b:9093", "security.protocol": "SASL_PLAINTEXT",
                                          "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "svc",
                                          "sasl.password": SECRET}


def test_the_password_can_come_from_a_named_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAFKA_PW", SECRET)
    s = load_settings(env={"WORKER_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "WORKER_KAFKA_SASL_USERNAME": "svc",
                           "WORKER_KAFKA_SASL_PASSWORD_ENV": "KAFKA_PW", "WORKER_KAFKA_SASL_MECHANISM": "PLAIN"})
    assert security_properties(s.kafka)["sasl.password"] == SECRET
    assert security_properties(s.kafka)["sasl.mechanism"] == "PLAIN"


def test_no_password_appears_in_the_settings_or_their_repr(password_file: Path) -> None:
    s = load_settings(env=sasl_env(password_file))
    assert SECRET not in repr(s)
    assert principal_of(s.kafka) == "User:svc"


def test_plaintext_adds_no_security_properties() -> None:
    assert security_properties(load_settings(env={}).kafka) == {}


@pytest.mark.parametrize("env, problem", [
    ({"WORKER_KAFKA_SECURITY_PROTOCOL": "SASL"}, "kafka.security_protocol"),
    ({"WORKER_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "WORKER_KAFKA_SASL_USERNAME": "svc"}, "kafka.sasl_password_file"),
    ({"WORKER_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "WORKER_KAFKA_SASL_PASSWORD_ENV": "UNSET_VARIABLE_X",
      "WORKER_KAFKA_SASL_USERNAME": "svc"}, "kafka.sasl_password_env"),
    ({"WORKER_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "WORKER_KAFKA_SASL_PASSWORD_FILE": "/nonexistent/pw",
      "WORKER_KAFKA_SASL_USERNAME": "svc"}, "kafka.sasl_password_file: /nonexistent/pw is not a file"),
    ({"WORKER_KAFKA_SASL_USERNAME": "svc"}, "kafka.sasl_username: only used with"),
    ({"WORKER_KAFKA_SSL_CA_LOCATION": "/etc/hostname"}, "kafka.ssl_ca_location: only used with"),
    ({"WORKER_KAFKA_SECURITY_PROTOCOL": "SSL", "WORKER_KAFKA_SSL_CERTIFICATE_LOCATION": "/etc/hostname"},
     "kafka.ssl_certificate_location: a client certificate needs its key"),
])
def test_incoherent_or_unreadable_security_settings_stop_start_up(env: dict[str, str], problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(env=env)
    assert problem in str(info.value)


def test_a_sasl_mechanism_outside_the_supported_ones_is_refused(password_file: Path) -> None:
    with pytest.raises(ConfigError, match="kafka.sasl_mechanism"):
        load_settings(env=sasl_env(password_file, WORKER_KAFKA_SASL_MECHANISM="GSSAPI"))


def test_secrets_and_security_properties_in_overrides_are_refused_without_echoing_them() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(env={"WORKER_KAFKA_CONSUMER_OVERRIDES": f"sasl.password={SECRET},security.protocol=SSL",
                           "WORKER_KAFKA_PRODUCER_OVERRIDES": f"ssl.key.password={SECRET}"})
    text = str(info.value)
    assert "kafka.consumer_overrides: 'sasl.password'" in text
    assert "kafka.consumer_overrides: 'security.protocol' has a setting of its own" in text
    assert "kafka.producer_overrides: 'ssl.key.password'" in text
    assert SECRET not in text


def test_an_unparseable_override_is_not_echoed() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(env={"WORKER_KAFKA_CONSUMER_OVERRIDES": f"sasl.password{SECRET}"})
    assert SECRET not in str(info.value)


def test_redact_hides_secret_bearing_properties() -> None:
    shown = redact({"sasl.password": SECRET, "ssl.key.password": SECRET, "sasl.username": "svc"})
    assert SECRET not in repr(shown) and shown["sasl.username"] == "svc"


# -- classification -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("code, cause", [
    (KafkaError._AUTHENTICATION, AUTHENTICATION), (KafkaError.SASL_AUTHENTICATION_FAILED, AUTHENTICATION),
    (KafkaError.TOPIC_AUTHORIZATION_FAILED, AUTHORIZATION), (KafkaError.GROUP_AUTHORIZATION_FAILED, AUTHORIZATION),
    (KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED, AUTHORIZATION),
    (KafkaError.CLUSTER_AUTHORIZATION_FAILED, AUTHORIZATION), (KafkaError._SSL, TLS),
    (KafkaError._TRANSPORT, None), (KafkaError._ALL_BROKERS_DOWN, None), (KafkaError.NOT_LEADER_FOR_PARTITION, None),
    (KafkaError.REQUEST_TIMED_OUT, None), (KafkaError.COORDINATOR_NOT_AVAILABLE, None),
])
def test_errors_an_operator_must_fix_are_told_from_those_the_client_retries(code: int, cause: str | None) -> None:
    assert cause_of(KafkaError(code, "x")) == cause
    assert cause_of(KafkaException(KafkaError(code, "x"))) == cause


def test_a_transport_error_hinting_at_the_wrong_protocol_is_a_tls_problem() -> None:
    err = KafkaError(KafkaError._TRANSPORT, "Disconnected while requesting ApiVersion: might be caused by "
                                            "incorrect security.protocol configuration")
    assert cause_of(err) == TLS


def test_a_refused_write_names_the_acl_to_grant_in_one_line() -> None:
    err = classify_producer_error(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED, "Topic authorization failed"),
                                  "moderation.results", Identity(principal="User:x"))
    assert isinstance(err, BrokerAccessError) and isinstance(err, OperatorError)
    assert err.setting == "ACL: WRITE on topic moderation.results for principal User:x"
    assert "\n" not in str(err)


def test_a_refused_login_names_the_password_setting() -> None:
    err = classify_consumer_error(KafkaError(KafkaError._AUTHENTICATION, "SASL authentication error"),
                                  Identity(principal="User:x"))
    assert err is not None and err.setting == "kafka.sasl_password" and "User:x" in str(err)


def test_a_refused_group_and_transactional_id_name_their_acls() -> None:
    identity = Identity(principal="User:x", group_id="g", transactional_id="streamfer-w0")
    group = classify_consumer_error(KafkaError(KafkaError.GROUP_AUTHORIZATION_FAILED), identity)
    txn = classify_producer_error(KafkaError(KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED), None, identity)
    assert group is not None and group.setting == "ACL: READ on group g for principal User:x"
    assert txn is not None and "transactional id streamfer-w0" in str(txn.setting)


def test_transient_errors_are_not_operator_errors() -> None:
    assert classify_producer_error(KafkaError(KafkaError._MSG_TIMED_OUT), "t") is None
    assert classify_consumer_error(KafkaError(KafkaError._ALL_BROKERS_DOWN)) is None


# -- refusal streaks and health -------------------------------------------------------------------------------------
def _refusal(code: int) -> BrokerAccessError:
    err = classify_consumer_error(KafkaError(code, "x"))
    assert err is not None
    return err


def test_a_login_refused_for_the_grace_period_stops_the_worker_but_a_moment_does_not() -> None:
    clock = FakeClock(100.0)
    streak = RefusalStreak(grace_s=5.0, gap_s=15.0, clock=clock)
    assert not streak.refusal(_refusal(KafkaError._AUTHENTICATION))
    clock.now += 3
    assert not streak.refusal(_refusal(KafkaError._AUTHENTICATION))
    clock.now += 30  # a long quiet gap: a new streak
    assert not streak.refusal(_refusal(KafkaError._AUTHENTICATION))
    clock.now += 5
    assert streak.refusal(_refusal(KafkaError._AUTHENTICATION))


def test_an_authorization_refusal_stops_the_worker_at_once() -> None:
    assert RefusalStreak(clock=FakeClock(100.0)).refusal(_refusal(KafkaError.GROUP_AUTHORIZATION_FAILED))


def test_health_fails_at_once_when_refused_and_after_the_limit_when_unreachable() -> None:
    clock = FakeClock(100.0)
    status = BrokerStatus(unreachable_limit_s=10.0, clock=clock)
    status.on_error(KafkaError(KafkaError._ALL_BROKERS_DOWN, "1/1 brokers are down"))
    assert status.unhealthy_reason() is None
    clock.now += 11
    assert "no broker reachable" in (status.unhealthy_reason() or "")
    status.on_stats('{"brokers": {"b1": {"nodeid": 1, "state": "UP"}}}')
    assert status.unhealthy_reason() is None
    status.on_error(KafkaError(KafkaError._AUTHENTICATION, "SASL authentication error"))
    assert "refused" in (status.unhealthy_reason() or "")


def test_healthz_reports_the_cluster_problem_with_503() -> None:
    clock = FakeClock(100.0)
    status = BrokerStatus(unreachable_limit_s=10.0, clock=clock)
    health = Health(clock=clock, source=SourceStub(cluster_problem=status.unhealthy_reason))
    server = MetricsServer(Metrics(), health, "127.0.0.1", 0).start()
    try:
        assert http_get(server.port, "/healthz")[0] == 200
        status.on_error(KafkaError(KafkaError._AUTHENTICATION, "SASL authentication error"))
        code, body = http_get(server.port, "/healthz")
        assert code == 503 and body.startswith("kafka: refused by the cluster")
        assert http_get(server.port, "/readyz")[0] == 503
    finally:
        server.stop()
