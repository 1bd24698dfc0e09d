"""Which Kafka client errors an operator must fix (credentials, ACLs, TLS, missing topics) and which the client
rides out by itself (a broker restarting, a leader moving), and the one-line error that says what to change.

A worker that cannot authenticate or is not authorised retries forever otherwise (librdkafka treats both as
retriable), so a supervisor sees a live process that does nothing, or a crash loop. Classifying by the
`KafkaError` code lets the worker stop with exit code 2 and one line naming the setting or the ACL.
Pure apart from reading error objects: no clients are made here.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

# Also the names the loop catches the Kafka edge's errors by (worker.loop.delivery): only worker/kafka/ imports
# the client library.
from confluent_kafka import KafkaError, KafkaException

from worker.config import Settings
from worker.errors import OperatorError
from worker.kafka.client import principal_of

AUTHENTICATION = "authentication"
AUTHORIZATION = "authorization"
UNKNOWN_TOPIC = "unknown_topic"
TLS = "tls"

AUTHENTICATION_CODES = frozenset({KafkaError._AUTHENTICATION, KafkaError.SASL_AUTHENTICATION_FAILED,
                                  KafkaError.ILLEGAL_SASL_STATE, KafkaError.UNSUPPORTED_SASL_MECHANISM})
AUTHORIZATION_CODES = {
    KafkaError.TOPIC_AUTHORIZATION_FAILED: "TOPIC",
    KafkaError.GROUP_AUTHORIZATION_FAILED: "GROUP",
    KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED: "TRANSACTIONAL_ID",
    KafkaError.CLUSTER_AUTHORIZATION_FAILED: "CLUSTER",
}
UNKNOWN_TOPIC_CODES = frozenset({KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC})
TLS_CODES = frozenset({KafkaError._SSL})
# A PLAINTEXT client talking to a TLS or SASL listener (or the reverse) only sees the connection drop;
# librdkafka then adds this hint to its transport error.
_PROTOCOL_MISMATCH_HINT = "incorrect security.protocol"


class BrokerAccessError(OperatorError):
    """The cluster refuses this worker (credentials, ACLs, TLS, a missing topic): no restart helps.

    `cause` is one of AUTHENTICATION, AUTHORIZATION, UNKNOWN_TOPIC, TLS; `setting` names the setting or the
    ACL to change; `kafka_error` keeps librdkafka's error."""

    def __init__(self, message: str, cause: str, setting: str | None = None,
                 kafka_error: KafkaError | None = None) -> None:
        super().__init__(message, setting=setting)
        self.cause = cause
        self.kafka_error = kafka_error


def cause_of(err: KafkaError | KafkaException | None) -> str | None:
    """AUTHENTICATION, AUTHORIZATION, UNKNOWN_TOPIC or TLS for an error an operator must fix; None when the
    client retries it by itself (or there is no error)."""
    err = _unwrap(err)
    if err is None:
        return None
    code = err.code()
    if code in AUTHENTICATION_CODES:
        return AUTHENTICATION
    if code in AUTHORIZATION_CODES:
        return AUTHORIZATION
    if code in UNKNOWN_TOPIC_CODES:
        return UNKNOWN_TOPIC
    if code in TLS_CODES:
        return TLS
    if code == KafkaError._TRANSPORT and _PROTOCOL_MISMATCH_HINT in (err.str() or ""):
        return TLS
    return None


@dataclass(frozen=True)
class Identity:
    """Who the worker is to the cluster, to name in messages: the principal and the settings that make it."""

    principal: str = "User:ANONYMOUS"
    security_protocol: str = "PLAINTEXT"
    group_id: str = ""
    transactional_id: str | None = None
    # Named when a consumer error does not say which input topic it is about.
    input_topics: tuple[str, ...] = ()

    @classmethod
    def of(cls, settings: Settings, transactional_id: str | None = None) -> Identity:
        """From the worker's settings."""
        k = settings.kafka
        return cls(principal=principal_of(k), security_protocol=k.security_protocol.upper(), group_id=k.group_id,
                   transactional_id=transactional_id, input_topics=tuple(settings.topics.input_topics()))


def access_error(err: KafkaError | KafkaException | None, identity: Identity = Identity(),
                 topic: str | None = None, operation: str | None = None) -> BrokerAccessError | None:
    """The BrokerAccessError for an operator-fixable error, else None. `topic` and `operation` (READ, WRITE)
    say what the worker was doing, so a missing ACL can be named exactly."""
    kerr = _unwrap(err)
    cause = cause_of(kerr)
    if kerr is None or cause is None:
        return None
    detail = kerr.str()
    if cause == AUTHENTICATION:
        what = "the SASL username, password or mechanism"
        return BrokerAccessError(f"Kafka refused the worker's credentials ({identity.principal}): {detail}; check "
                                 f"{what} (kafka.sasl_username, kafka.sasl_password_file / kafka.sasl_password_env, "
                                 "kafka.sasl_mechanism)", cause, "kafka.sasl_password", kerr)
    if cause == TLS:
        return BrokerAccessError(f"TLS or protocol mismatch with the Kafka listener ({identity.security_protocol}): "
                                 f"{detail}; check kafka.security_protocol and kafka.ssl_ca_location / "
                                 "kafka.ssl_certificate_location / kafka.ssl_key_location", cause,
                                 "kafka.security_protocol", kerr)
    if cause == UNKNOWN_TOPIC:
        name = topic or "?"
        return BrokerAccessError(f"Kafka topic {name!r} does not exist (or {identity.principal} may not DESCRIBE "
                                 f"it): {detail}; create it (worker topics) or fix the [topics] settings", cause,
                                 f"topic {name}", kerr)
    resource = AUTHORIZATION_CODES[kerr.code()]
    if resource == "TOPIC":
        where = f"topic {topic}" if topic else (f"topics {', '.join(identity.input_topics)}"
                                                if operation == "READ" and identity.input_topics else "topic ?")
        acl = f"ACL: {operation or 'WRITE'} on {where} for principal {identity.principal}"
    elif resource == "GROUP":
        acl = f"ACL: READ on group {identity.group_id or '?'} for principal {identity.principal}"
    elif resource == "TRANSACTIONAL_ID":
        acl = (f"ACL: WRITE and DESCRIBE on transactional id {identity.transactional_id or '?'} for principal "
               f"{identity.principal}")
    else:
        acl = f"ACL: IDEMPOTENT_WRITE on the cluster for principal {identity.principal}"
    return BrokerAccessError(f"Kafka denied the worker: {detail}; grant {acl}", cause, acl, kerr)


def classify_producer_error(err: KafkaError | KafkaException | None, topic: str | None = None,
                            identity: Identity = Identity()) -> BrokerAccessError | None:
    """For the producer's delivery reports and transactional calls: the error to raise, or None to retry."""
    return access_error(err, identity, topic=topic, operation="WRITE")


def classify_consumer_error(err: KafkaError | KafkaException | None, identity: Identity = Identity(),
                            topic: str | None = None) -> BrokerAccessError | None:
    """For the consumer's error callback and message errors: the error to raise, or None to let it retry."""
    return access_error(err, identity, topic=topic, operation="READ")


def _unwrap(err: KafkaError | KafkaException | None) -> KafkaError | None:
    if isinstance(err, KafkaException):
        first = err.args[0] if err.args else None
        return first if isinstance(first, KafkaError) else None
    return err


# -- what the worker knows of its connection to the cluster (for /healthz) ------------------------------------
@dataclass
class BrokerStatus:
    """The client side's view of the cluster, fed by the consumer's error and statistics callbacks.

    `problem` is set while no broker is reachable (`_ALL_BROKERS_DOWN`) or the worker is refused; a
    statistics report with a broker UP, or a fetched message, clears it. Refusals are reported at once,
    an unreachable cluster only after `unreachable_limit_s` (a broker restart is not a reason to restart
    every worker)."""

    unreachable_limit_s: float = 45.0
    clock: Callable[[], float] = time.monotonic
    problem: str | None = None
    since: float | None = None
    refused: bool = False
    _streak_start: float | None = field(default=None, repr=False)

    def on_error(self, err: KafkaError) -> None:
        code = err.code()
        if cause_of(err) in (AUTHENTICATION, TLS, AUTHORIZATION):
            self.refused = True
            self._set(f"refused by the cluster: {err.str()}")
        elif code in (KafkaError._ALL_BROKERS_DOWN, KafkaError._TRANSPORT, KafkaError._RESOLVE):
            self._set(f"no broker reachable: {err.str()}")

    def on_stats(self, stats_json: str) -> None:
        try:
            brokers = json.loads(stats_json).get("brokers", {})
        except (ValueError, AttributeError):
            return
        if any(b.get("state") == "UP" and b.get("nodeid", -1) >= 0 for b in brokers.values()):
            self.clear()

    def clear(self) -> None:
        self.problem, self.since, self.refused = None, None, False

    def _set(self, problem: str) -> None:
        if self.since is None:
            self.since = self.clock()
        self.problem = problem

    def unhealthy_reason(self) -> str | None:
        """Why /healthz should fail now, or None."""
        if self.problem is None or self.since is None:
            return None
        failing_for = self.clock() - self.since
        if self.refused or failing_for >= self.unreachable_limit_s:
            return f"{self.problem} (for {failing_for:.0f}s)"
        return None


@dataclass
class RefusalStreak:
    """Decides when a run of authentication or TLS refusals is an operator's problem rather than a moment
    (a broker coming up, a password being rotated): refusals with no gap above `gap_s` lasting `grace_s`.
    Authorization errors are the broker's considered answer and count at once."""

    grace_s: float = 5.0
    gap_s: float = 15.0
    clock: Callable[[], float] = time.monotonic
    _first: float | None = None
    _last: float | None = None

    def refusal(self, error: BrokerAccessError) -> bool:
        """Record a refusal; True when the worker should stop on it."""
        if error.cause in (AUTHORIZATION, UNKNOWN_TOPIC):
            return True
        now = self.clock()
        if self._last is None or now - self._last > self.gap_s:
            self._first = now
        self._last = now
        return now - (self._first or now) >= self.grace_s

    def reset(self) -> None:
        self._first = self._last = None
