"""How every client of the worker reaches the cluster: the [kafka] security settings as librdkafka properties
(one mapping for the consumer, producer, admin client, results reader, `worker produce` and `worker topics`),
the ACLs the worker needs, and a start-up probe that finds a wrong password or a missing ACL in seconds.

Passwords are read from their file or environment variable only when a client is made; they never enter
`Settings`, logs, errors or metrics.
"""

from __future__ import annotations

import logging
import os
import ssl
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from worker.config import ConfigError
from worker.kafka_errors import AUTHORIZATION, UNKNOWN_TOPIC, BrokerAccessError, Identity, access_error, cause_of

if TYPE_CHECKING:
    from confluent_kafka.admin import AclBinding

    from worker.config import KafkaSettings, Settings

log = logging.getLogger(__name__)

SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
# librdkafka properties that carry a secret: refused in the overrides (each has a setting that reads it from a
# file or an environment variable) and never printed.
SECRET_PROPERTIES = frozenset({"sasl.password", "ssl.key.password", "ssl.keystore.password", "ssl.key.pem",
                               "ssl_key", "sasl.oauthbearer.client.secret", "sasl.oauthbearer.config",
                               "ssl.certificate.pem", "ssl.ca.pem"})
# Properties that have a [kafka] setting of their own now; an override would fight it.
SECURITY_PROPERTIES = {
    "security.protocol": "kafka.security_protocol",
    "sasl.mechanism": "kafka.sasl_mechanism",
    "sasl.mechanisms": "kafka.sasl_mechanism",
    "sasl.username": "kafka.sasl_username",
    "sasl.password": "kafka.sasl_password_file or kafka.sasl_password_env",
    "ssl.ca.location": "kafka.ssl_ca_location",
    "ssl.certificate.location": "kafka.ssl_certificate_location",
    "ssl.key.location": "kafka.ssl_key_location",
    "ssl.key.password": "kafka.ssl_key_password_file",
}
REDACTED = "[redacted]"
PROBE_TIMEOUT_S = 20.0


def redact(properties: Mapping[str, Any]) -> dict[str, Any]:
    """A copy fit to print: secret-bearing values replaced."""
    return {k: (REDACTED if k in SECRET_PROPERTIES or "password" in k or "secret" in k else v)
            for k, v in properties.items()}


def read_password(k: KafkaSettings) -> str:
    """The SASL password, from kafka.sasl_password_file or the variable kafka.sasl_password_env names."""
    if k.sasl_password_file:
        return _read_secret(k.sasl_password_file)
    if k.sasl_password_env:
        return os.environ.get(k.sasl_password_env, "")
    return ""


def _read_secret(path: str) -> str:
    with open(path, encoding="utf-8") as fh:
        return fh.read().strip()


def security_properties(k: KafkaSettings) -> dict[str, str]:
    """The [kafka] security settings as librdkafka properties (secrets read now, from their files)."""
    protocol = k.security_protocol.upper()
    props: dict[str, str] = {}
    if protocol == "PLAINTEXT":
        return props
    props["security.protocol"] = protocol
    if protocol.startswith("SASL"):
        props["sasl.mechanism"] = k.sasl_mechanism
        props["sasl.username"] = k.sasl_username
        props["sasl.password"] = read_password(k)
    if protocol.endswith("SSL"):
        for prop, value in (("ssl.ca.location", k.ssl_ca_location),
                            ("ssl.certificate.location", k.ssl_certificate_location),
                            ("ssl.key.location", k.ssl_key_location)):
            if value:
                props[prop] = value
        if k.ssl_key_password_file:
            props["ssl.key.password"] = _read_secret(k.ssl_key_password_file)
    return props


def client_properties(k: KafkaSettings) -> dict[str, str]:
    """bootstrap.servers plus the security properties: what every client of the worker starts from."""
    return {"bootstrap.servers": k.bootstrap_servers, **security_properties(k)}


def principal_of(k: KafkaSettings) -> str:
    """The principal the cluster will see, as ACLs name it (User:<name>; User:<certificate subject> for TLS
    client certificates; User:ANONYMOUS otherwise)."""
    protocol = k.security_protocol.upper()
    if protocol.startswith("SASL") and k.sasl_username:
        return f"User:{k.sasl_username}"
    if protocol == "SSL" and k.ssl_certificate_location:
        subject = _certificate_subject(k.ssl_certificate_location)
        return f"User:{subject}" if subject else f"User:<subject of {k.ssl_certificate_location}>"
    return "User:ANONYMOUS"


def _certificate_subject(path: str) -> str:
    try:
        decoded = ssl._ssl._test_decode_cert(path)  # type: ignore[attr-defined]  # the stdlib's only PEM reader
    except (OSError, ssl.SSLError, AttributeError):
        return ""
    # Kafka's default principal builder: the RFC 2253 subject, most specific first.
    parts = [f"{name}={value}" for rdn in reversed(decoded.get("subject", ())) for name, value in rdn]
    short = {"commonName": "CN", "organizationName": "O", "organizationalUnitName": "OU", "countryName": "C",
             "localityName": "L", "stateOrProvinceName": "ST"}
    return ",".join(f"{short.get(p.split('=', 1)[0], p.split('=', 1)[0])}={p.split('=', 1)[1]}" for p in parts)


def validate_security(k: KafkaSettings, environ: Mapping[str, str] | None = None) -> list[str]:
    """Problems with the [kafka] security settings (coherent combination, files present and readable)."""
    env = os.environ if environ is None else environ
    p: list[str] = []
    protocol = k.security_protocol.upper()
    if protocol not in SECURITY_PROTOCOLS:
        return [f"kafka.security_protocol: must be one of {', '.join(SECURITY_PROTOCOLS)}"]
    sasl, tls = protocol.startswith("SASL"), protocol.endswith("SSL")
    if sasl:
        if k.sasl_mechanism not in SASL_MECHANISMS:
            p.append(f"kafka.sasl_mechanism: must be one of {', '.join(SASL_MECHANISMS)} with {protocol}")
        if not k.sasl_username.strip():
            p.append(f"kafka.sasl_username: must be set with {protocol}")
        if bool(k.sasl_password_file) == bool(k.sasl_password_env):
            p.append(f"kafka.sasl_password_file: with {protocol}, set exactly one of kafka.sasl_password_file "
                     "and kafka.sasl_password_env")
        elif k.sasl_password_file:
            p.extend(_file_problems("kafka.sasl_password_file", k.sasl_password_file, secret=True))
        elif not env.get(k.sasl_password_env):
            p.append(f"kafka.sasl_password_env: the environment variable {k.sasl_password_env} is not set or empty")
    else:
        for name in ("sasl_username", "sasl_password_file", "sasl_password_env"):
            if getattr(k, name):
                p.append(f"kafka.{name}: only used with kafka.security_protocol SASL_PLAINTEXT or SASL_SSL "
                         f"(it is {protocol})")
    tls_files = ("ssl_ca_location", "ssl_certificate_location", "ssl_key_location", "ssl_key_password_file")
    if tls:
        for name in tls_files:
            value = getattr(k, name)
            if value:
                p.extend(_file_problems(f"kafka.{name}", value, secret=name != "ssl_ca_location",
                                        allow_dir=name == "ssl_ca_location"))
        if bool(k.ssl_certificate_location) != bool(k.ssl_key_location):
            p.append("kafka.ssl_certificate_location: a client certificate needs its key (kafka.ssl_key_location), "
                     "and a key its certificate")
        if k.ssl_key_password_file and not k.ssl_key_location:
            p.append("kafka.ssl_key_password_file: only used with kafka.ssl_key_location")
        if protocol == "SSL" and not k.ssl_certificate_location:
            log.debug("SSL without a client certificate: the broker sees User:ANONYMOUS")
    else:
        for name in tls_files:
            if getattr(k, name):
                p.append(f"kafka.{name}: only used with kafka.security_protocol SSL or SASL_SSL (it is {protocol})")
    for field_name, overrides in (("consumer_overrides", k.consumer_overrides),
                                  ("producer_overrides", k.producer_overrides)):
        for key in sorted(overrides):
            if key in SECURITY_PROPERTIES:
                p.append(f"kafka.{field_name}: {key!r} has a setting of its own ({SECURITY_PROPERTIES[key]}); "
                         "secrets are read from files or environment variables, never written in the settings")
            elif key in SECRET_PROPERTIES:
                p.append(f"kafka.{field_name}: {key!r} carries a secret and is refused in the overrides; use the "
                         "kafka.sasl_* / kafka.ssl_* settings, which read secrets from files")
    return p


def _file_problems(setting: str, path: str, secret: bool, allow_dir: bool = False) -> list[str]:
    if allow_dir and os.path.isdir(path):
        return []
    if not os.path.isfile(path):
        return [f"{setting}: {path} is not a file"]
    if not os.access(path, os.R_OK):
        return [f"{setting}: {path} is not readable by this user"]
    if secret and os.path.getsize(path) == 0:
        return [f"{setting}: {path} is empty"]
    return []


# -- ACLs ------------------------------------------------------------------------------------------------------
def worker_acls(settings: Settings, principal: str | None = None, host: str = "*") -> list[AclBinding]:
    """The ACLs a worker needs, as docs/security.md lists them: READ on the input topics and the group, WRITE on
    the results and dead-letter topics, and for exactly-once WRITE on its transactional ids (by prefix).
    READ and WRITE imply DESCRIBE; WRITE on a topic implies IDEMPOTENT_WRITE (Kafka >= 3.0)."""
    from confluent_kafka.admin import AclBinding, AclOperation, AclPermissionType, ResourcePatternType, ResourceType

    who = principal or principal_of(settings.kafka)
    allow = AclPermissionType.ALLOW

    def acl(rtype: ResourceType, name: str, op: AclOperation,
            pattern: ResourcePatternType = ResourcePatternType.LITERAL) -> AclBinding:
        return AclBinding(rtype, name, pattern, who, host, op, allow)

    t = settings.topics
    out = [acl(ResourceType.TOPIC, name, AclOperation.READ) for name in (t.realtime, t.standard, t.bulk)]
    out.append(acl(ResourceType.GROUP, settings.kafka.group_id, AclOperation.READ))
    out += [acl(ResourceType.TOPIC, name, AclOperation.WRITE) for name in (t.results, t.dead_letter)]
    if settings.delivery.mode == "exactly_once":
        out.append(acl(ResourceType.TRANSACTIONAL_ID, f"{settings.delivery.transactional_id_prefix}-",
                       AclOperation.WRITE, ResourcePatternType.PREFIXED))
    return out


# -- the start-up probe --------------------------------------------------------------------------------------------
def probe_reachable(settings: Settings, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Connect and log in with the [kafka] settings: BrokerAccessError on a refusal, False when no broker
    answered within the timeout, True otherwise. For the command-line tools and the worker's start-up."""
    return _reach(_probe_admin(settings), settings, time.monotonic() + timeout_s)


def _probe_admin(settings: Settings) -> Any:
    from confluent_kafka.admin import AdminClient

    identity = Identity.of(settings)
    refusals: list[Any] = []
    conf: dict[str, Any] = {**client_properties(settings.kafka), "log_level": 3,
                            "error_cb": lambda err: refusals.append(access_error(err, identity))}
    admin: Any = AdminClient(conf, logger=log)
    admin.refusals = refusals
    return admin


def _reach(admin: Any, settings: Settings, deadline: float) -> bool:
    from confluent_kafka import KafkaException

    identity = Identity.of(settings)
    # librdkafka reports a refused login through the error callback only, served by poll().
    while True:
        try:
            admin.list_topics(timeout=1.0)
            return True
        except KafkaException as exc:
            found = access_error(exc, identity)
            if found is not None:
                raise found from None
        admin.poll(0)
        refused = [r for r in admin.refusals if r is not None and r.cause != UNKNOWN_TOPIC]
        if refused:
            raise refused[0]
        if time.monotonic() >= deadline:
            log.warning("no broker of %s answered within the start-up probe; carrying on (the clients retry)",
                        settings.kafka.bootstrap_servers)
            return False


def probe_access(settings: Settings, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Check, with the worker's own credentials, that the cluster lets it in and that it may read its input
    topics and group and write its output topics. Raises BrokerAccessError on a refusal; an unreachable
    cluster only logs (the worker's clients keep retrying, and /healthz reports it)."""
    from confluent_kafka import KafkaException, TopicCollection
    from confluent_kafka.admin import AclOperation

    identity = Identity.of(settings)
    admin = _probe_admin(settings)
    deadline = time.monotonic() + timeout_s
    if not _reach(admin, settings, deadline):
        return
    # 2. The topics and the group, with the operations the worker needs on each.
    t = settings.topics
    wanted = {name: AclOperation.READ for name in (t.realtime, t.standard, t.bulk)}
    wanted.update({t.results: AclOperation.WRITE, t.dead_letter: AclOperation.WRITE})
    missing: dict[str, BrokerAccessError] = {}
    while True:
        missing.clear()
        futures = admin.describe_topics(TopicCollection(list(wanted)), include_authorized_operations=True,
                                        request_timeout=max(1.0, deadline - time.monotonic()))
        for name, fut in futures.items():
            op = wanted[name].name
            try:
                ops = fut.result()
            except KafkaException as exc:
                err = access_error(exc, identity, topic=name, operation=op)
                if err is None:
                    log.warning("start-up probe: could not describe topic %s (%s)", name, exc.args[0].str())
                    continue
                if err.cause == UNKNOWN_TOPIC:
                    missing[name] = err
                    continue
                raise err from None
            allowed = ops.authorized_operations
            if allowed is not None and wanted[name] not in allowed and AclOperation.ALL not in allowed:
                acl = f"ACL: {op} on topic {name} for principal {identity.principal}"
                raise BrokerAccessError(f"Kafka would deny the worker {op} on topic {name!r}; grant {acl}",
                                        AUTHORIZATION, acl)
        # A topic being created alongside the worker (a compose topics job) gets until the deadline.
        if not missing or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    if missing:
        raise next(iter(missing.values()))
    futures = admin.describe_consumer_groups([settings.kafka.group_id], include_authorized_operations=True,
                                             request_timeout=max(1.0, deadline - time.monotonic()))
    for fut in futures.values():
        try:
            group = fut.result()
        except KafkaException as exc:
            err = access_error(exc, identity)
            if err is not None and cause_of(exc) == AUTHORIZATION:
                raise err from None
            log.warning("start-up probe: could not describe group %s (%s)", settings.kafka.group_id, exc)
            continue
        allowed = group.authorized_operations
        if allowed is not None and AclOperation.READ not in allowed and AclOperation.ALL not in allowed:
            acl = f"ACL: READ on group {settings.kafka.group_id} for principal {identity.principal}"
            raise BrokerAccessError(f"Kafka would deny the worker its consumer group; grant {acl}",
                                    AUTHORIZATION, acl)


def new_client(factory: Any, conf: Mapping[str, Any], role: str, logger: logging.Logger | None = None) -> Any:
    """A librdkafka client (`factory`: Consumer or Producer) made from `conf`; librdkafka validates every property
    here, without connecting, so a refused one is a ConfigError naming kafka.<role>_overrides."""
    from confluent_kafka import KafkaException

    try:
        return factory(conf, logger=logger) if logger is not None else factory(conf)
    except KafkaException as exc:
        raise ConfigError([f"kafka.{role}_overrides / kafka settings: librdkafka rejected the {role} "
                           f"configuration: {exc.args[0].str()}"]) from None
