"""The Schema Registry edge (the Confluent API, e.g. Apicurio's `/apis/ccompat/v7`): the client made from
`[schema_registry]`, the results schema registered (or looked up) at start under the topic-name subject
strategy, and the frames' writer schemas looked up by id, once each.

Secrets (basic auth user info, the key's password) are read from their files or environment variable only when
the client is made; they never enter `Settings`, logs or errors.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fastavro
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError

from worker.codec.schemas import (
    SCHEMA_DIR,
    FrameRecord,
    MessageDecodeError,
    _without_logical_types,
    encode_frame,
    registry_framing,
)
from worker.config import ConfigError, SchemaRegistrySettings, Settings
from worker.errors import OperatorError
from worker.kafka.client import read_secret, tls_properties
from worker.kafka.schemahold import SchemaHold
from worker.kafka.schemalookups import HeldFrames, RegistryLookups, RegistryOutage
from worker.metrics import Metrics

log = logging.getLogger(__name__)

# A request is tried twice (librdkafka-style retries would stretch "unreachable" to tens of seconds).
MAX_RETRIES = 1
RETRY_WAIT_MS = 100
# WriterSchemaCache (tools): how long an id the registry did not know (HTTP 404) is answered from memory before it
# is asked again: a flood of messages with an unknown id costs one request per id per this, not one per message.
UNKNOWN_ID_RETRY_S = 30.0
# The same for a lookup that failed otherwise (registry unreachable, HTTP 5xx): asked again sooner.
FAILED_LOOKUP_RETRY_S = 5.0
# Ids remembered as failed, at most (oldest forgotten first): random ids in hostile input stay bounded.
MAX_FAILED_IDS = 10_000


def subject_of(topic: str) -> str:
    """The topic-name subject strategy (Confluent's default): a topic's message values are `<topic>-value`."""
    return f"{topic}-value"


def _schema_text(name: str) -> str:
    return json.dumps(json.loads((SCHEMA_DIR / name).read_text(encoding="utf-8")))


FRAME_SCHEMA_TEXT = _schema_text("frame.avsc")
RESULT_SCHEMA_TEXT = _schema_text("moderation_result.avsc")


def client_config(r: SchemaRegistrySettings, max_retries: int = MAX_RETRIES) -> dict[str, Any]:
    """SchemaRegistryClient's configuration from [schema_registry] (secrets read now, from their files)."""
    conf: dict[str, Any] = {"url": r.url, "timeout": r.timeout_ms / 1000.0, "max.retries": max_retries,
                            "retries.wait.ms": RETRY_WAIT_MS, "retries.max.wait.ms": RETRY_WAIT_MS}
    if r.basic_auth_user_info_file:
        conf["basic.auth.user.info"] = read_secret(r.basic_auth_user_info_file)
    elif r.basic_auth_user_info_env:
        conf["basic.auth.user.info"] = os.environ.get(r.basic_auth_user_info_env, "")
    conf.update(tls_properties(r.ssl_ca_location, r.ssl_certificate_location, r.ssl_key_location,
                               r.ssl_key_password_file))
    return conf


def new_registry_client(r: SchemaRegistrySettings, max_retries: int = MAX_RETRIES) -> SchemaRegistryClient:
    """The client; a configuration it refuses is a ConfigError (its message names no secret)."""
    try:
        return SchemaRegistryClient(client_config(r, max_retries))
    except (ValueError, TypeError, OSError) as exc:
        raise ConfigError([f"schema_registry.url: the registry client refused the [schema_registry] settings: "
                           f"{type(exc).__name__}"]) from None


class RegistryUnreachable(OperatorError):
    """The registry could not be reached, or answered HTTP 408, 429 or 5xx: worth asking again (the worker's start
    waits for it); a tool that does not wait exits 2 with this message."""


def _transient(status: int) -> bool:
    return status in (408, 429) or status >= 500


def _refusal(exc: Exception, what: str, url: str, auto_register: bool) -> OperatorError:
    """The operator's error for a registry that refused or could not answer `what` at start."""
    if not isinstance(exc, SchemaRegistryError):
        return RegistryUnreachable(f"schema_registry.url: cannot reach the Schema Registry at {url} to {what} "
                             f"({type(exc).__name__}: {exc}); check the URL and that the registry is up (each "
                             f"request gives up after schema_registry.timeout_ms)", setting="schema_registry.url")
    status = exc.http_status_code
    if _transient(status):
        return RegistryUnreachable(f"schema_registry.url: the Schema Registry at {url} could not {what} now: HTTP "
                                   f"{status} ({exc.error_message})", setting="schema_registry.url")
    if status == 409:
        return OperatorError(f"schema_registry.url: the Schema Registry at {url} refused to {what}: "
                             f"{exc.error_message} (HTTP 409: incompatible with the subject's latest version under "
                             f"its compatibility rule). Keep the worker's schema, or change the subject's "
                             f"compatibility: see Schema evolution in docs/configuration.md",
                             setting="schema_registry.url")
    if status in (401, 403):
        return OperatorError(f"schema_registry.basic_auth_user_info_file: the Schema Registry at {url} refused to "
                             f"{what}: HTTP {status} ({exc.error_message}); check the credentials and their rights",
                             setting="schema_registry.basic_auth_user_info_file")
    if status == 404 and not auto_register:
        return OperatorError(f"schema_registry.auto_register: the Schema Registry at {url} does not have the schema "
                             f"to {what}; register it (see Schema evolution in docs/configuration.md) or set "
                             f"schema_registry.auto_register = true", setting="schema_registry.auto_register")
    return OperatorError(f"schema_registry.url: the Schema Registry at {url} could not {what}: HTTP {status} "
                         f"({exc.error_message}); is it a Confluent-API registry (Apicurio: .../apis/ccompat/v7)?",
                         setting="schema_registry.url")


def schema_id_for(client: Any, subject: str, schema_text: str, auto_register: bool, url: str) -> int:
    """The id of `schema_text` under `subject`: registered (idempotent: an already registered schema gets its id),
    or only looked up; OperatorError naming the setting when the registry refuses or cannot be reached."""
    schema = Schema(schema_text, "AVRO")
    what = f"{'register' if auto_register else 'look up'} the schema under subject {subject}"
    try:
        if auto_register:
            return int(client.register_schema(subject, schema))
        found = client.lookup_schema(subject, schema).schema_id
    except Exception as exc:  # noqa: BLE001 (SchemaRegistryError, or the HTTP client's transport/TLS errors)
        raise _refusal(exc, what, url, auto_register) from None
    if found is None:
        raise OperatorError(f"schema_registry.url: the Schema Registry at {url} answered the look-up of the schema "
                            f"under subject {subject} without an id", setting="schema_registry.url")
    return int(found)


class LookupFailed(Exception):
    """A writer-schema lookup that failed: `transient` (the registry unreachable, a timeout, HTTP 5xx or 429, a
    refusal such as 401/403 that is the deployment's to fix): the frames wait and it is asked again; else
    permanent (an unknown id, a schema this worker cannot read): the frames are dead letters with `reason`."""

    def __init__(self, reason: str, transient: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.transient = transient


def fetch_writer_schema(client: Any, schema_id: int) -> Any:
    """One request for a writer schema by id: the parsed fastavro schema (logical types dropped like
    FRAME_READ_SCHEMA's), or LookupFailed saying why and whether asking again may help."""
    try:
        registered = client.get_schema(schema_id)
    except SchemaRegistryError as exc:
        if exc.http_status_code == 404:
            raise LookupFailed(f"registry schema id {schema_id} is unknown to the Schema Registry (the producer "
                               "wrote with an id from another registry, or it was deleted)", transient=False) from None
        raise LookupFailed(f"the Schema Registry could not give schema id {schema_id}: HTTP "
                           f"{exc.http_status_code} ({exc.error_message})", transient=True) from None
    except Exception as exc:  # noqa: BLE001 (the HTTP client's transport errors, timeouts)
        raise LookupFailed(f"the Schema Registry could not be reached for schema id {schema_id} "
                           f"({type(exc).__name__})", transient=True) from None
    schema_type = getattr(registered, "schema_type", None) or "AVRO"
    if schema_type != "AVRO":
        raise LookupFailed(f"registry schema id {schema_id} is a {schema_type} schema, not Avro", transient=False)
    if getattr(registered, "references", None):
        raise LookupFailed(f"registry schema id {schema_id} references other schemas, which this worker does "
                           "not resolve: register the frame schema self-contained", transient=False)
    try:
        return fastavro.parse_schema(_without_logical_types(json.loads(registered.schema_str)))
    except Exception as exc:  # noqa: BLE001 (json and fastavro's SchemaParseError, ValueError...)
        raise LookupFailed(f"registry schema id {schema_id} is not a valid Avro schema ({exc})",
                           transient=False) from None


class WriterSchemaCache:
    """Writer schemas by registry id, looked up synchronously, for tools that read registry-framed messages
    (results, dead letters): each id is asked for once and kept (a registry id names one schema forever); an id
    that failed is answered from memory for a while (UNKNOWN_ID_RETRY_S, FAILED_LOOKUP_RETRY_S). The worker's
    loop never waits for the registry: it holds frames instead (worker.kafka.schemalookups)."""

    def __init__(self, client: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client
        self._clock = clock
        self._schemas: dict[int, Any] = {}
        self._failed: OrderedDict[int, tuple[str, float]] = OrderedDict()
        self.lookups = 0  # requests made (the registry client's own cache aside): for tests and logs

    def writer_schema(self, schema_id: int) -> Any:
        schema = self._schemas.get(schema_id)
        if schema is not None:
            return schema
        failed = self._failed.get(schema_id)
        if failed is not None and self._clock() < failed[1]:
            raise MessageDecodeError(failed[0])
        self.lookups += 1
        try:
            schema = fetch_writer_schema(self._client, schema_id)
        except LookupFailed as exc:
            reason = exc.reason + ("; replay it with `worker dlq replay` once the registry answers"
                                   if exc.transient else "")
            retry_s = FAILED_LOOKUP_RETRY_S if exc.transient else UNKNOWN_ID_RETRY_S
            self._failed[schema_id] = (reason, self._clock() + retry_s)
            self._failed.move_to_end(schema_id)
            while len(self._failed) > MAX_FAILED_IDS:
                self._failed.popitem(last=False)
            raise MessageDecodeError(reason) from None
        self._failed.pop(schema_id, None)
        self._schemas[schema_id] = schema
        log.info("registry schema id %d resolved (writer schema of framed messages)", schema_id)
        return schema


@dataclass(frozen=True)
class RegistryLink:
    """What the worker takes from the registry at start: the results' 5-byte framing, fixed for the process (so
    producing results never needs the registry), and a client for the frames' writer-schema lookups."""

    result_framing: bytes
    settings: SchemaRegistrySettings
    # Lookups retry on the hold policy's backoff, not the client's (worker.kafka.schemahold).
    lookup_client: Any

    def held_frames(self, metrics: Metrics, passed_frames_max: int,
                    clock: Callable[[], float] = time.monotonic) -> HeldFrames:
        """The consumer's writer schemas: looked up off the loop, frames held meanwhile (worker.kafka.schemalookups);
        `passed_frames_max`: see worker.kafka.schemahold.SchemaHold."""
        client = self.lookup_client
        return HeldFrames(RegistryLookups(lambda schema_id: fetch_writer_schema(client, schema_id)),
                          SchemaHold(self.settings.max_held_bytes_per_partition, passed_frames_max, clock),
                          RegistryOutage(self.settings.url, clock), metrics)


# Start-up: the wait between tries to reach a registry that does not answer, doubling up to the max.
CONNECT_BACKOFF_INITIAL_S = 1.0
CONNECT_BACKOFF_MAX_S = 30.0


def connect_registry(settings: Settings, waiting: Callable[[str | None], None] = lambda why: None,
                     should_stop: Callable[[], bool] = lambda: False, sleep: Callable[[float], None] = time.sleep,
                     clock: Callable[[], float] = time.monotonic) -> RegistryLink | None:
    """With schema_registry.url set: the results schema registered (or looked up) under `<topics.results>-value`.
    A registry that cannot be reached (or answers HTTP 5xx/429) is tried again with backoff, `waiting(why)` told
    each time (None once it answered): /readyz shows it. A refusal (401/403, an incompatible schema, a missing one
    with auto_register = false) is an OperatorError: exit 2. None without a registry: plain Avro in and out."""
    r = settings.schema_registry
    if not r.url:
        return None
    client = new_registry_client(r)
    subject = subject_of(settings.topics.results)
    failures = 0
    while True:
        try:
            schema_id = schema_id_for(client, subject, RESULT_SCHEMA_TEXT, r.auto_register, r.url)
            break
        except RegistryUnreachable as exc:
            failures += 1
            wait_s = min(CONNECT_BACKOFF_MAX_S, CONNECT_BACKOFF_INITIAL_S * 2.0 ** min(failures - 1, 16))
            if failures == 1:
                log.warning("%s; waiting for it (asked again with backoff up to %.0fs)", exc, CONNECT_BACKOFF_MAX_S)
            waiting(f"the Schema Registry at {r.url}, which does not answer (try {failures}; next in {wait_s:.0f}s)")
            deadline = clock() + wait_s
            while clock() < deadline:
                if should_stop():
                    raise
                sleep(min(0.1, max(0.0, deadline - clock())))
    waiting(None)
    if failures:
        log.info("schema registry %s answered after %d failed tries", r.url, failures)
    log.info("schema registry %s: results schema id %d under subject %s", r.url, schema_id, subject)
    return RegistryLink(registry_framing(schema_id), r, new_registry_client(r, max_retries=0))


class FrameSerializer:
    """Frames in the Confluent wire format for a producer: the worker's frame schema registered under each
    topic's subject once (topic-name strategy), then the id's 5 bytes before each plain body."""

    def __init__(self, client: Any, url: str = "", auto_register: bool = True,
                 schema_text: str = FRAME_SCHEMA_TEXT) -> None:
        self._client = client
        self._url = url
        self._auto_register = auto_register
        self._schema_text = schema_text
        self._framing: dict[str, bytes] = {}

    def framing(self, topic: str) -> bytes:
        framing = self._framing.get(topic)
        if framing is None:
            schema_id = schema_id_for(self._client, subject_of(topic), self._schema_text, self._auto_register,
                                      self._url)
            framing = self._framing[topic] = registry_framing(schema_id)
        return framing

    def __call__(self, frame: FrameRecord, topic: str) -> bytes:
        return self.framing(topic) + encode_frame(frame)


def frame_serializer(r: SchemaRegistrySettings) -> FrameSerializer:
    """A FrameSerializer for the registry [schema_registry] names (`worker produce --schema-registry`)."""
    return FrameSerializer(new_registry_client(r), r.url, r.auto_register)
