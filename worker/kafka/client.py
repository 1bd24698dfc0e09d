"""Where every Kafka client of the worker and its tools starts: bootstrap.servers and the [kafka] security
settings as librdkafka properties (one mapping for every client: the worker's consumer and producer, and each
role of worker.kafka.roles), the principal the cluster will see, and making a client so that a property
librdkafka refuses is a ConfigError naming the setting.

Passwords are read from their file or environment variable only when a client is made; they never enter
`Settings`, logs, errors or metrics.
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Callable, Mapping
from typing import Any

from confluent_kafka import KafkaException

from worker.config import ConfigError, KafkaSettings
from worker.config.librdkafka import SECRET_PROPERTIES

REDACTED = "[redacted]"
# The clients whose properties kafka.<role>_overrides extends.
OVERRIDDEN_ROLES = ("consumer", "producer")

# What makes a librdkafka client from its properties, called as `factory(conf, logger=...)`: confluent_kafka's
# Consumer or Producer, or an in-memory stand-in with the same API (the unit tests' and the GPU check's fakes).
ClientFactory = Callable[..., Any]
# Where a client connects and as whom: the [kafka] section, or a bare bootstrap address (a plaintext broker: the
# test kit's and the benchmarks').
Cluster = KafkaSettings | str


def redact(properties: Mapping[str, Any]) -> dict[str, Any]:
    """A copy fit to print: secret-bearing values replaced."""
    return {k: (REDACTED if k in SECRET_PROPERTIES or "password" in k or "secret" in k else v)
            for k, v in properties.items()}


def read_password(k: KafkaSettings) -> str:
    """The SASL password, from kafka.sasl_password_file or the variable kafka.sasl_password_env names."""
    if k.sasl_password_file:
        return read_secret(k.sasl_password_file)
    if k.sasl_password_env:
        return os.environ.get(k.sasl_password_env, "")
    return ""


def read_secret(path: str) -> str:
    """A secret from its file (a password, `user:password`), read when a client is made, never kept in Settings."""
    with open(path, encoding="utf-8") as fh:
        return fh.read().strip()


def tls_properties(ca_location: str, certificate_location: str, key_location: str,
                   key_password_file: str) -> dict[str, str]:
    """The TLS files as the `ssl.*` properties librdkafka and the Schema Registry client share; unset ones left out."""
    props = {prop: value for prop, value in (("ssl.ca.location", ca_location),
                                            ("ssl.certificate.location", certificate_location),
                                            ("ssl.key.location", key_location)) if value}
    if key_password_file:
        props["ssl.key.password"] = read_secret(key_password_file)
    return props


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
        props.update(tls_properties(k.ssl_ca_location, k.ssl_certificate_location, k.ssl_key_location,
                                    k.ssl_key_password_file))
    return props


def bootstrap_of(cluster: Cluster) -> str:
    return cluster if isinstance(cluster, str) else cluster.bootstrap_servers


def client_properties(cluster: Cluster) -> dict[str, str]:
    """bootstrap.servers plus the security properties: what every client of the worker starts from."""
    security = {} if isinstance(cluster, str) else security_properties(cluster)
    return {"bootstrap.servers": bootstrap_of(cluster), **security}


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


def new_client(factory: ClientFactory, conf: Mapping[str, Any], role: str, logger: logging.Logger | None = None) -> Any:
    """A librdkafka client (`factory`: Consumer, Producer or AdminClient) made from `conf`; librdkafka validates
    every property here, without connecting, so a refused one is a ConfigError naming the [kafka] settings (and
    kafka.<role>_overrides for the consumer and the producer, which take overrides)."""
    try:
        return factory(conf, logger=logger) if logger is not None else factory(conf)
    except KafkaException as exc:
        where = f"kafka.{role}_overrides / kafka settings" if role in OVERRIDDEN_ROLES else "kafka settings"
        raise ConfigError([f"{where}: librdkafka rejected the {role} configuration: {exc.args[0].str()}"]) from None
