"""The checks run once when settings load: every field against the bounds its `setting` declares (`bound_problems`,
no code per field), and here what a bound cannot say: checks across fields, of strings, lists and tables, and of
the [kafka] and [schema_registry] security settings. Each problem names the field as it is written in the config
file and says what it accepts. The values derived from valid settings are in worker/config/derived.py."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Mapping

from worker.config.derived import parse_size
from worker.config.fields import field_doc
from worker.config.librdkafka import (
    PROTECTED_CONSUMER_PROPERTIES,
    PROTECTED_PRODUCER_PROPERTIES,
    SECRET_PROPERTIES,
    SECURITY_PROPERTIES,
)
from worker.config.model import ModelSettings
from worker.config.policy import model_label_thresholds, policy_problems
from worker.config.sections import MAX_METRIC_TENANTS, KafkaSettings, SchemaRegistrySettings, TracingSettings
from worker.config.settings import Settings
from worker.frames import Priority

log = logging.getLogger("worker.config")

# The [kafka] security settings (docs/security.md), checked by validate_security. The librdkafka properties an
# override may not set are the Kafka edge's (worker/config/librdkafka.py).
SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
# What Kafka accepts as a group.instance.id (the broker refuses a JoinGroup with any other).
GROUP_INSTANCE_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,249}")


def group_instance_id_problem(worker_id: str) -> str | None:
    """Why `worker_id` cannot be a static member's group.instance.id, or None when it can."""
    if GROUP_INSTANCE_ID_RE.fullmatch(worker_id):
        return None
    return (f"observability.worker_id: {worker_id!r} is, with kafka.static_membership (the default), the consumer's "
            "group.instance.id, which Kafka allows only as 1-249 letters, digits, '.', '_' or '-'; rename it, or set "
            "kafka.static_membership = false")



def validate(s: Settings) -> list[str]:
    """Every problem of `s`; each names the field as it is written in the config file."""
    p: list[str] = []

    def need(ok: bool, message: str) -> None:
        if not ok:
            p.append(message)

    k = s.kafka
    need(bool(k.bootstrap_servers.strip()), "kafka.bootstrap_servers: must not be empty (host:port[,host:port])")
    need(bool(k.group_id.strip()), "kafka.group_id: must not be empty")
    need(k.max_poll_interval_ms >= k.session_timeout_ms,
         "kafka.max_poll_interval_ms: must be >= kafka.session_timeout_ms")
    # Kafka's rule for heartbeat.interval.ms: a third of the session at most, so two heartbeats can be lost before
    # the coordinator takes the member's partitions away.
    need(k.heartbeat_interval_ms * 3 <= k.session_timeout_ms,
         f"kafka.heartbeat_interval_ms: must be at most kafka.session_timeout_ms / 3 "
         f"({k.session_timeout_ms // 3} with a session of {k.session_timeout_ms} ms), got {k.heartbeat_interval_ms}")
    checks = (("consumer_overrides", k.consumer_overrides, PROTECTED_CONSUMER_PROPERTIES),
              ("producer_overrides", k.producer_overrides, PROTECTED_PRODUCER_PROPERTIES))
    for field_name, overrides, protected in checks:
        for key in sorted(overrides):
            if key in protected:
                p.append(f"kafka.{field_name}: {key!r} is managed by the worker ({protected[key]})")
    p.extend(validate_security(k))

    t = s.topics
    names = [t.realtime, t.standard, t.bulk, t.results, t.dead_letter]
    need(all(n.strip() for n in names), "topics: no topic name may be empty")
    need(len(set(names)) == len(names), "topics: input, results and dead_letter topics must all differ")
    routed = [*names, *t.routes(), t.control]
    need(bool(t.control.strip()), "topics.control: must not be empty")
    need(len(set(routed)) == len(routed),
         "topics.review / topics.flagged / topics.control: must differ from each other and from the input, results "
         "and dead_letter topics")

    b = s.batching
    need(all(1 <= x <= b.largest_batch_size for x in b.preferred_batch_sizes),
         "batching.preferred_batch_sizes: each must be 1..the largest max_batch_size of any class")
    need(b.tensor_dtype_bytes in (1, 2, 4, 8), "batching.tensor_dtype_bytes: must be 1, 2, 4 or 8")
    need(b.fallback_max_batch_size <= b.max_batch_size,
         "batching.fallback_max_batch_size: must be <= batching.max_batch_size")
    need(b.max_pending_frames >= b.largest_batch_size,
         "batching.max_pending_frames: must be >= the largest max_batch_size of any class")
    for prio in Priority:
        c = b.for_class(prio)
        need(c.max_age_ms == 0 or c.max_age_ms >= c.max_wait_ms,
             f"batching.{prio.label}.max_age_ms: must be 0 (no expiry) or >= its max_wait_ms")
    need(b.standard.pending_share + b.bulk.pending_share < 1,
         "batching.standard.pending_share + batching.bulk.pending_share: must be < 1, so realtime always has room")
    need(all(w >= 1 for w in b.tenant_weights.values()), "batching.tenant_weights: each weight must be >= 1")

    m = s.model
    need(bool(m.source.strip()),
         "model.source: must be 'builtin', a preset (opennsfw, nudenet), a model file, or 'module:function'")
    need(len(m.labels) >= 1 and len(set(m.labels)) == len(m.labels), "model.labels: must be non-empty and unique")
    need(set(m.thresholds) <= set(m.labels),
         f"model.thresholds: unknown labels {sorted(set(m.thresholds) - set(m.labels))} (labels: {list(m.labels)})")
    need(all(0.0 <= v <= 1.0 for v in m.thresholds.values()), "model.thresholds: each must be in [0, 1]")
    need(set(m.never_flag) <= set(m.labels),
         f"model.never_flag: unknown labels {sorted(set(m.never_flag) - set(m.labels))} (labels: {list(m.labels)})")
    need(not set(m.labels) <= set(m.never_flag), "model.never_flag: lists every label, so no frame could be flagged")
    need(all(s.strip() for s in m.allowed_sources), "model.allowed_sources: an empty prefix would allow every source")
    need(bool(m.cache_dir.strip()), "model.cache_dir: must not be empty")
    need(len(m.input_size) in (0, 2) and all(x > 0 for x in m.input_size),
         "model.input_size: must be empty (any size) or [height, width] > 0")
    need(len(m.mean) in (1, 3),
         f"model.mean: has {len(m.mean)} values; give 3 for an RGB/BGR model or 1 for a greyscale one")
    need(len(m.mean) == len(m.std) and all(x > 0 for x in m.std), "model.mean / model.std: same length, std > 0")
    need(m.channel_order == "RGB" or len(m.mean) == 3, "model.channel_order: BGR needs a 3-channel model (3 means)")
    need(m.resize == "stretch" or len(m.input_size) == 2,
         f"model.resize: {m.resize!r} needs model.input_size = [height, width] to resize and crop to")
    need(m.resize_shorter_side == 0 or (m.resize_shorter_side >= max(m.input_size or (0,))),
         "model.resize_shorter_side: must be 0 (= the larger of model.input_size) or >= both of model.input_size")
    need(m.resize != "stretch_crop" or (len(m.resize_to) == 2 and len(m.input_size) == 2
                                        and all(a >= b for a, b in zip(m.resize_to, m.input_size))),
         "model.resize_to: stretch_crop needs [height, width], each >= model.input_size's")
    p.extend(model_output_problems(m, "model"))

    r = s.runtime
    need(r.device == "auto" or r.device == "cpu" or r.device.startswith("cuda"),
         "runtime.device: must be auto, cpu, cuda or cuda:N")
    need(len(r.graph_batch_sizes) >= 1 and all(x >= 1 for x in r.graph_batch_sizes),
         "runtime.graph_batch_sizes: must list at least one size >= 1")
    need(all(parse_size(x) is not None for x in r.warmup_shapes),
         "runtime.warmup_shapes: each must be WIDTHxHEIGHT with positive integers, e.g. 1280x720")

    d = s.delivery
    need(bool(d.transactional_id_prefix.strip()), "delivery.transactional_id_prefix: must not be empty")
    need(d.max_uncommitted_frames == 0 or d.max_uncommitted_frames >= b.largest_batch_size,
         "delivery.max_uncommitted_frames: must be 0 (derived) or >= the largest max_batch_size of any class")

    o = s.observability
    need(o.worker_slot < 0 or not o.worker_id,
         "observability.worker_slot: names the slot of the default worker id; with observability.worker_id set it "
         "would be ignored, so unset one of them")
    instance_id_problem = group_instance_id_problem(o.worker_id) if o.worker_id and s.kafka.static_membership else None
    need(instance_id_problem is None, instance_id_problem or "")
    need(len(o.metric_tenants) <= MAX_METRIC_TENANTS, f"observability.metric_tenants: at most {MAX_METRIC_TENANTS}")
    need(all(0 < len(t.encode()) <= s.limits.max_identifier_bytes for t in o.metric_tenants),
         "observability.metric_tenants: each must be a non-empty tenant of at most limits.max_identifier_bytes bytes")

    p.extend(validate_schema_registry(s.schema_registry))
    p.extend(validate_tracing(s.tracing))
    p.extend(policy_problems(s.policy, model_label_thresholds(s.models or (s.model,))))
    p.extend(bound_problems(s, named=p))
    return p


def model_output_problems(m: ModelSettings, where: str) -> list[str]:
    """The detector and cascade settings of one model (`where`: "model" or "models.<name>") that depend on each
    other; their bounds are the fields' own."""
    p = []
    if m.output == "detections" and len(m.input_size) != 2:
        p.append(f"{where}.output: \"detections\" needs {where}.input_size = [height, width] (boxes are mapped back "
                 "through the resize to it)")
    if (m.run_if_model or m.run_if_label) and where == "model":
        p.append("model.run_if_model / run_if_label: a cascade needs a model set ([models.<name>] tables)")
    return p


def bound_problems(value: object, named: list[str], where: str = "") -> list[str]:
    """Every field outside the bounds its `setting` declares (ge/gt/le/lt), with the field's hint, except those a
    problem in `named` already names: a check across fields above (e.g. `0 or >= the largest max_batch_size`) says
    more about the field than its bound alone."""
    out: list[str] = []
    for f in dataclasses.fields(value):  # type: ignore[arg-type]
        current, path = getattr(value, f.name), f"{where}{f.name}"
        if dataclasses.is_dataclass(current):
            out.extend(bound_problems(current, named, f"{path}."))
            continue
        entry = field_doc(f)
        numeric = isinstance(current, int | float) and not isinstance(current, bool)
        if numeric and not entry.holds(current) and not any(p.split(":", 1)[0] == path for p in named):
            out.append(entry.bound_problem(path))
    return out


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


def validate_schema_registry(r: SchemaRegistrySettings, environ: Mapping[str, str] | None = None) -> list[str]:
    """Problems with the [schema_registry] settings; with an empty url, every other one must stay unset."""
    env = os.environ if environ is None else environ
    p: list[str] = []
    files = ("basic_auth_user_info_file", "ssl_ca_location", "ssl_certificate_location", "ssl_key_location",
             "ssl_key_password_file")
    if not r.url.strip():
        for name in (*files, "basic_auth_user_info_env"):
            if getattr(r, name):
                p.append(f"schema_registry.{name}: only used with schema_registry.url set")
        return p
    urls = [u.strip() for u in r.url.split(",")]
    if not all(re.fullmatch(r"https?://[^\s/]+(/\S*)?", u) for u in urls):
        p.append("schema_registry.url: must be comma-separated http:// or https:// URLs, e.g. "
                 "http://registry:8080/apis/ccompat/v7")
    if r.basic_auth_user_info_file and r.basic_auth_user_info_env:
        p.append("schema_registry.basic_auth_user_info_file: set at most one of it and "
                 "schema_registry.basic_auth_user_info_env")
    elif r.basic_auth_user_info_env and ":" not in env.get(r.basic_auth_user_info_env, ""):
        p.append(f"schema_registry.basic_auth_user_info_env: the environment variable {r.basic_auth_user_info_env} "
                 "is not set, or not user:password")
    for name in files:
        value = getattr(r, name)
        if value:
            p.extend(_file_problems(f"schema_registry.{name}", value, secret=name != "ssl_ca_location",
                                    allow_dir=name == "ssl_ca_location"))
    tls = ("ssl_ca_location", "ssl_certificate_location", "ssl_key_location", "ssl_key_password_file")
    if any(getattr(r, name) for name in tls) and not all(u.startswith("https://") for u in urls):
        p.append("schema_registry.ssl_*: TLS settings are only used with https:// URLs in schema_registry.url")
    if bool(r.ssl_certificate_location) != bool(r.ssl_key_location):
        p.append("schema_registry.ssl_certificate_location: a client certificate needs its key "
                 "(schema_registry.ssl_key_location), and a key its certificate")
    if r.ssl_key_password_file and not r.ssl_key_location:
        p.append("schema_registry.ssl_key_password_file: only used with schema_registry.ssl_key_location")
    return p


def validate_tracing(t: TracingSettings) -> list[str]:
    """Problems with the [tracing] settings: caught at start-up, not by the exporter's first failing request."""
    p: list[str] = []
    if t.endpoint and not re.fullmatch(r"https?://[^\s/:]+(:\d{1,5})?(/\S*)?", t.endpoint):
        p.append(f"tracing.endpoint: {t.endpoint!r} is not an http:// or https:// URL of an OTLP/HTTP collector, "
                 "e.g. http://127.0.0.1:4318 (empty: tracing off)")
    if not t.service_name.strip():
        p.append("tracing.service_name: must not be empty (it is the service.name of every span)")
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
