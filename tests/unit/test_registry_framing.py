"""Registry framing (the Confluent wire format) and the writer-schema cache, with a fake registry client: which
messages are framed, how a framed frame resolves, what is dead-lettered and why, and that lookups are cached."""

import io
import json
import time

import fastavro
import pytest
from confluent_kafka.schema_registry import Schema
from confluent_kafka.schema_registry.error import SchemaRegistryError

from worker.codec.schemas import (
    FrameRecord,
    MessageDecodeError,
    ResultContext,
    build_result,
    decode_frame,
    decode_result,
    encode_frame,
    is_registry_framed,
    registry_framing,
)
from worker.config import ConfigError, SchemaRegistrySettings, load_settings
from worker.frames import Encoding, Priority, SourceRef
from worker.kafka.registry import (
    FAILED_LOOKUP_RETRY_S,
    FRAME_SCHEMA_TEXT,
    RESULT_SCHEMA_TEXT,
    UNKNOWN_ID_RETRY_S,
    FrameSerializer,
    WriterSchemaCache,
    client_config,
    schema_id_for,
)

NOW = time.time()
SRC = SourceRef("frames.standard", 0, 7)


def record(**kw):
    base = dict(stream_id="cam-1", frame_index=3, capture_ts_ms=int(NOW * 1000), tenant="t", priority=Priority.BULK,
                width=2, height=2, channels=3, encoding=Encoding.RAW_RGB8, data=bytes(12))
    return FrameRecord(**{**base, **kw})


def frame_schema(extra_fields=(), drop=()):
    schema = json.loads(FRAME_SCHEMA_TEXT)
    schema["fields"] = [f for f in schema["fields"] if f["name"] not in drop] + list(extra_fields)
    return schema


class FakeRegistry:
    """get_schema / register_schema as SchemaRegistryClient answers them, counting requests."""

    def __init__(self, schemas=None, down=False):
        self.schemas = dict(schemas or {})
        self.down = down
        self.requests = 0
        self.registered = {}

    def get_schema(self, schema_id):
        self.requests += 1
        if self.down:
            raise ConnectionError("connection refused")
        if schema_id not in self.schemas:
            raise SchemaRegistryError(404, 40403, f"Schema {schema_id} not found")
        return Schema(json.dumps(self.schemas[schema_id]), "AVRO")

    def register_schema(self, subject, schema):
        self.requests += 1
        if self.down:
            raise ConnectionError("connection refused")
        return self.registered.setdefault(subject, 100 + len(self.registered))


def framed(schema_id, schema, rec):
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema(schema), rec)
    return registry_framing(schema_id) + buf.getvalue()


def avro_record(**kw):
    r = record(**kw)
    return {**r.__dict__, "priority": r.priority.name, "encoding": r.encoding.value}


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


# -- which messages are framed -------------------------------------------------------------------------------
def test_framing_is_the_magic_byte_and_a_big_endian_id():
    assert registry_framing(258) == b"\x00\x00\x00\x01\x02"
    assert is_registry_framed(registry_framing(1) + b"body")


def test_a_plain_frame_with_a_stream_id_is_never_taken_for_a_framed_one():
    assert not is_registry_framed(encode_frame(record(stream_id="c")))
    # The rule's one exception, documented: an empty stream_id's length is the byte 0.
    assert is_registry_framed(encode_frame(record(stream_id="")))


def test_plain_frames_decode_as_before_with_a_registry():
    cache = WriterSchemaCache(FakeRegistry())
    frame = decode_frame(encode_frame(record()), SRC, Priority.STANDARD, NOW, writer_schemas=cache)
    assert (frame.stream_id, frame.frame_index, frame.data) == ("cam-1", 3, bytes(12))
    assert cache.lookups == 0


def test_without_a_registry_a_framed_frame_is_dead_lettered_with_a_pointer_to_the_setting():
    payload = framed(1, frame_schema(), avro_record())
    with pytest.raises(MessageDecodeError, match="set schema_registry.url"):
        decode_frame(payload, SRC, Priority.STANDARD, NOW)


# -- resolution ---------------------------------------------------------------------------------------------
def test_a_framed_frame_of_the_workers_schema_decodes():
    registry = FakeRegistry({5: frame_schema()})
    frame = decode_frame(framed(5, frame_schema(), avro_record()), SRC, Priority.STANDARD, NOW,
                         writer_schemas=WriterSchemaCache(registry))
    assert (frame.stream_id, frame.width, frame.declared_priority) == ("cam-1", 2, Priority.BULK)


def test_a_newer_compatible_writer_schema_resolves_to_the_workers():
    newer = frame_schema([{"name": "camera_model", "type": "string", "default": ""}])
    registry = FakeRegistry({6: newer})
    payload = framed(6, newer, {**avro_record(frame_index=9), "camera_model": "axis-p1448"})
    frame = decode_frame(payload, SRC, Priority.STANDARD, NOW, writer_schemas=WriterSchemaCache(registry))
    assert (frame.stream_id, frame.frame_index) == ("cam-1", 9)


def test_an_older_writer_schema_without_a_defaulted_field_takes_the_readers_default():
    older = frame_schema(drop=("channels",))
    rec = {k: v for k, v in avro_record().items() if k != "channels"}
    frame = decode_frame(framed(2, older, rec), SRC, Priority.STANDARD, NOW,
                         writer_schemas=WriterSchemaCache(FakeRegistry({2: older})))
    assert frame.channels == 3  # frame.avsc's default


def test_an_incompatible_writer_schema_is_dead_lettered_with_the_reason():
    incompatible = frame_schema(drop=("width",))  # the reader's width has no default
    rec = {k: v for k, v in avro_record().items() if k != "width"}
    with pytest.raises(MessageDecodeError, match="schema id 4, which this worker's schema cannot read"):
        decode_frame(framed(4, incompatible, rec), SRC, Priority.STANDARD, NOW,
                     writer_schemas=WriterSchemaCache(FakeRegistry({4: incompatible})))


def test_an_unknown_id_is_dead_lettered_with_the_reason():
    with pytest.raises(MessageDecodeError, match="schema id 77 is unknown to the Schema Registry"):
        decode_frame(framed(77, frame_schema(), avro_record()), SRC, Priority.STANDARD, NOW,
                     writer_schemas=WriterSchemaCache(FakeRegistry()))


def test_a_framed_message_shorter_than_its_header_is_dead_lettered():
    with pytest.raises(MessageDecodeError, match="shorter than its 5-byte header"):
        decode_frame(b"\x00\x00\x01", SRC, Priority.STANDARD, NOW, writer_schemas=WriterSchemaCache(FakeRegistry()))


def test_a_non_avro_schema_id_is_dead_lettered():
    class Protobuf(FakeRegistry):
        def get_schema(self, schema_id):
            return Schema('syntax = "proto3";', "PROTOBUF")

    with pytest.raises(MessageDecodeError, match="is a PROTOBUF schema, not Avro"):
        WriterSchemaCache(Protobuf()).writer_schema(3)


# -- caching ------------------------------------------------------------------------------------------------
def test_a_known_id_is_asked_for_once():
    registry = FakeRegistry({5: frame_schema()})
    cache = WriterSchemaCache(registry)
    for i in range(50):
        decode_frame(framed(5, frame_schema(), avro_record(frame_index=i)), SRC, Priority.STANDARD, NOW,
                     writer_schemas=cache)
    assert registry.requests == 1


def test_an_unknown_id_is_answered_from_memory_until_its_retry_time():
    registry, clock = FakeRegistry(), Clock()
    cache = WriterSchemaCache(registry, clock)
    for _ in range(20):
        with pytest.raises(MessageDecodeError, match="unknown"):
            cache.writer_schema(9)
    assert registry.requests == 1
    registry.schemas[9] = frame_schema()  # registered meanwhile
    clock.now = UNKNOWN_ID_RETRY_S - 0.1
    with pytest.raises(MessageDecodeError):
        cache.writer_schema(9)
    clock.now = UNKNOWN_ID_RETRY_S
    assert cache.writer_schema(9) is not None
    assert registry.requests == 2


def test_an_unreachable_registry_is_asked_again_sooner_and_never_crashes_the_decode():
    registry, clock = FakeRegistry({5: frame_schema()}, down=True), Clock()
    cache = WriterSchemaCache(registry, clock)
    with pytest.raises(MessageDecodeError, match="could not be reached for schema id 5 .*worker dlq replay"):
        cache.writer_schema(5)
    registry.down = False
    clock.now = FAILED_LOOKUP_RETRY_S
    assert cache.writer_schema(5) is not None
    assert registry.requests == 2


# -- results and producers ------------------------------------------------------------------------------------
def test_results_carry_the_framing_and_decode_back_with_the_writer_schema():
    frame = decode_frame(encode_frame(record()), SRC, Priority.STANDARD, NOW)
    ctx = ResultContext("m", "1", "w0", framing=registry_framing(12))
    value = build_result(frame, None, "EXPIRED", ctx, 1.0, 0, 0.0, NOW)
    assert value[:5] == registry_framing(12)
    cache = WriterSchemaCache(FakeRegistry({12: json.loads(RESULT_SCHEMA_TEXT)}))
    assert decode_result(value, cache)["source_offset"] == 7
    plain = build_result(frame, None, "EXPIRED", ResultContext("m", "1", "w0"), 1.0, 0, 0.0, NOW)
    assert value[5:] == plain  # the body is the plain result


def test_the_frame_serializer_registers_once_per_topic_subject():
    registry = FakeRegistry()
    serialize = FrameSerializer(registry)
    a1, a2, b = serialize(record(), "frames.a"), serialize(record(), "frames.a"), serialize(record(), "frames.b")
    assert registry.registered == {"frames.a-value": 100, "frames.b-value": 101}
    assert registry.requests == 2
    assert a1 == a2 == registry_framing(100) + encode_frame(record())
    assert b[:5] == registry_framing(101)


def test_registration_refused_or_unreachable_is_an_operator_error_naming_the_setting():
    class Refusing(FakeRegistry):
        def register_schema(self, subject, schema):
            raise SchemaRegistryError(409, 409, "Incompatible artifact")

    with pytest.raises(Exception, match="HTTP 409") as refused:
        schema_id_for(Refusing(), "r-value", RESULT_SCHEMA_TEXT, True, "http://reg")
    assert refused.value.setting == "schema_registry.url"
    with pytest.raises(Exception, match="cannot reach the Schema Registry at http://reg") as down:
        schema_id_for(FakeRegistry(down=True), "r-value", RESULT_SCHEMA_TEXT, True, "http://reg")
    assert down.value.setting == "schema_registry.url"


def test_without_auto_register_a_schema_not_in_the_registry_names_that_setting():
    class LookupOnly(FakeRegistry):
        def lookup_schema(self, subject, schema):
            raise SchemaRegistryError(404, 40401, f"Subject {subject} not found")

    with pytest.raises(Exception, match="does not have the schema to look up") as missing:
        schema_id_for(LookupOnly(), "r-value", RESULT_SCHEMA_TEXT, False, "http://reg")
    assert missing.value.setting == "schema_registry.auto_register"


# -- settings -----------------------------------------------------------------------------------------------
def test_the_registry_url_is_read_from_its_environment_variable():
    settings = load_settings(env={"WORKER_SCHEMA_REGISTRY_URL": "http://reg:8080/apis/ccompat/v7",
                                  "WORKER_SCHEMA_REGISTRY_TIMEOUT_MS": "2000"})
    assert settings.schema_registry.url == "http://reg:8080/apis/ccompat/v7"
    assert settings.schema_registry.timeout_ms == 2000
    assert load_settings(env={}).schema_registry.url == ""


def test_registry_settings_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="schema_registry.url: must be comma-separated http"):
        load_settings(env={"WORKER_SCHEMA_REGISTRY_URL": "reg:8080"})
    with pytest.raises(ConfigError, match="schema_registry.basic_auth_user_info_file: only used with"):
        load_settings(env={"WORKER_SCHEMA_REGISTRY_BASIC_AUTH_USER_INFO_FILE": "/x"})
    with pytest.raises(ConfigError, match="TLS settings are only used with https"):
        ca = tmp_path / "ca.pem"
        ca.write_text("x")
        load_settings(env={"WORKER_SCHEMA_REGISTRY_URL": "http://reg",
                           "WORKER_SCHEMA_REGISTRY_SSL_CA_LOCATION": str(ca)})


def test_credentials_are_read_when_the_client_is_made_and_never_kept_in_settings(tmp_path):
    secret = tmp_path / "user-info"
    secret.write_text("key:s3cret\n")
    settings = load_settings(env={"WORKER_SCHEMA_REGISTRY_URL": "https://reg",
                                  "WORKER_SCHEMA_REGISTRY_BASIC_AUTH_USER_INFO_FILE": str(secret)})
    assert "s3cret" not in repr(settings)
    assert client_config(settings.schema_registry)["basic.auth.user.info"] == "key:s3cret"
    env_settings = SchemaRegistrySettings(url="https://reg", basic_auth_user_info_env="SR_USER_INFO")
    assert "basic.auth.user.info" in client_config(env_settings)
