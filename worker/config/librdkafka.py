"""The librdkafka properties the worker owns: those its delivery guarantees depend on, those with a [kafka] setting
of their own, and those that carry a secret. worker/kafka/client.py makes every client from them; the config
validation refuses overrides of them when settings load (worker/config/validate.py).

Tables only, importing nothing: the config imports them, and everything imports the config, so this module
stays below both (importing confluent_kafka or worker.config here would make an import cycle, and load
confluent_kafka into every pure policy module that reads its settings)."""

# librdkafka properties the worker's delivery guarantees depend on: an override would silently break them.
# Each maps to what to do instead.
PROTECTED_CONSUMER_PROPERTIES = {
    "bootstrap.servers": "use kafka.bootstrap_servers",
    "group.id": "use kafka.group_id",
    "group.instance.id": "the worker id is the instance id (kafka.static_membership, observability.worker_id)",
    "session.timeout.ms": "use kafka.session_timeout_ms",
    "max.poll.interval.ms": "use kafka.max_poll_interval_ms",
    "heartbeat.interval.ms": "use kafka.heartbeat_interval_ms",
    "enable.auto.commit": "the worker commits only offsets whose frames are done",
    "enable.auto.offset.store": "the worker commits only offsets whose frames are done",
    "isolation.level": "the worker never reads aborted (transactional) frames",
    "partition.assignment.strategy": "the rebalance handling is written for cooperative-sticky",
    "auto.offset.reset": ("a partition with no committed offset is read from its beginning, so nothing is "
                          "skipped; to skip a backlog, reset the group's offsets with kafka-consumer-groups "
                          "--reset-offsets --to-latest"),
}
PROTECTED_PRODUCER_PROPERTIES = {
    "bootstrap.servers": "use kafka.bootstrap_servers",
    "enable.idempotence": "at-least-once needs an idempotent producer (retries never duplicate)",
    "acks": "a result counts as delivered only when all in-sync replicas have it",
    "transactional.id": "set delivery.transactional_id_prefix (the worker id is appended)",
}

# librdkafka properties that carry a secret: refused in the overrides (each has a setting that reads it from a
# file or an environment variable) and never printed.
SECRET_PROPERTIES = frozenset({"sasl.password", "ssl.key.password", "ssl.keystore.password", "ssl.key.pem",
                               "ssl_key", "sasl.oauthbearer.client.secret", "sasl.oauthbearer.config",
                               "ssl.certificate.pem", "ssl.ca.pem"})
# Properties that have a [kafka] setting of their own; an override would fight it.
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
