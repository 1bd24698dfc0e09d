"""The Confluent wire format against a real Schema Registry (Apicurio Registry, started by the test kit's
`schema_registry` fixture) and a real broker: results a downstream `AvroDeserializer` reads, frames framed,
plain and written with a newer compatible schema all answered, an incompatible schema refused by the registry,
an unknown schema id dead-lettered, and a registry that refuses the results schema stopping start-up (exit 2).
One that cannot be reached is waited for: tests/integration/test_registry_outage.py."""

from __future__ import annotations

import dataclasses
import io
import json
import subprocess
import sys
import time
from pathlib import Path

import fastavro
import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.schema_registry.error import SchemaRegistryError
from confluent_kafka.serialization import MessageField, SerializationContext

from worker.codec.schemas import registry_framing
from worker.errors import OperatorError
from worker.frames import HEADER_ERROR, HEADER_ERROR_TYPE, MESSAGE_DECODE_ERROR, Encoding, Priority
from worker.kafka.registry import FRAME_SCHEMA_TEXT, FrameSerializer, subject_of
from worker.tools.publish_frames import synthetic_frames
from worker.tools.read_results import iter_messages

from .helpers import ledger, start_worker

pytestmark = pytest.mark.integration

# The bound an operator gets: a worker whose registry refuses its schema exits within this long.
EXIT_BOUND_S = 30.0


def client(url: str) -> SchemaRegistryClient:
    return SchemaRegistryClient({"url": url})


def read_back(bootstrap: str, topic: str, url: str, idle_timeout_s: float = 2.0) -> list[dict]:
    """Every message of `topic`, as a downstream consumer with confluent_kafka's own deserializer reads it."""
    deserialize = AvroDeserializer(client(url))
    return [deserialize(m.value(), SerializationContext(topic, MessageField.VALUE))
            for m in iter_messages(bootstrap, topic, idle_timeout_s=idle_timeout_s)]


def newer_frame_schema() -> dict:
    """frame.avsc with a field appended, with a default: what a producer may roll out first."""
    schema = json.loads(FRAME_SCHEMA_TEXT)
    schema["fields"].append({"name": "camera_model", "type": "string", "default": ""})
    return schema


def framed_with(schema_id: int, schema: dict, frame) -> bytes:
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema(schema),
                               {**frame.__dict__, "priority": frame.priority.name, "encoding": frame.encoding.value,
                                "camera_model": "axis-p1448"})
    return registry_framing(schema_id) + buf.getvalue()


def test_plain_framed_and_newer_framed_frames_get_results_a_downstream_avro_deserializer_reads(
        schema_registry, streamfer_worker, streamfer_topics, frame_producer, registry_frame_producer, kafka_bootstrap):
    topics = streamfer_topics
    framed = list(synthetic_frames(6, [(32, 32)], Encoding.RAW_RGB8, Priority.STANDARD, "framed"))
    registry_frame_producer.publish(framed)
    plain = list(synthetic_frames(4, [(32, 32)], Encoding.RAW_RGB8, Priority.STANDARD, "plain"))
    frame_producer.publish(plain)
    # The producer rolls out a newer compatible frame schema first (BACKWARD, as a Confluent registry defaults to).
    registry = client(schema_registry)
    subject = subject_of(topics.standard)
    registry.set_compatibility(subject, "BACKWARD")
    newer_id = registry.register_schema(subject, Schema(json.dumps(newer_frame_schema()), "AVRO"))
    now_ms = int(time.time() * 1000)
    newer = [dataclasses.replace(f, capture_ts_ms=now_ms)
             for f in synthetic_frames(3, [(32, 32)], Encoding.RAW_RGB8, Priority.STANDARD, "newer")]
    for frame in newer:
        frame_producer.send_raw(topics.standard, framed_with(newer_id, newer_frame_schema(), frame),
                                key=frame.stream_id.encode())

    worker = streamfer_worker(settings={"schema_registry": {"url": schema_registry}})
    expected = {(f.stream_id, f.frame_index) for f in framed + plain + newer}
    deadline = time.monotonic() + 120
    results: list[dict] = []
    while set(ledger(results)) != expected and time.monotonic() < deadline:
        results = read_back(kafka_bootstrap, topics.results, schema_registry)
    assert worker.alive(), worker.log()[-3000:]
    assert set(ledger(results)) == expected
    assert max(ledger(results).values()) == 1
    assert all(r["status"] == "OK" and r["source_topic"] == topics.standard for r in results)
    # The results schema is registered under the topic-name strategy's subject.
    assert registry.get_latest_version(subject_of(topics.results)).schema.schema_type == "AVRO"


def test_a_framed_frame_with_an_unknown_schema_id_is_dead_lettered_with_the_reason(
        schema_registry, streamfer_worker, streamfer_topics, frame_producer, results_reader):
    good = list(synthetic_frames(2, [(32, 32)], Encoding.RAW_RGB8, Priority.STANDARD, "good"))
    frame_producer.publish(good)
    unknown = registry_framing(987_654) + b"\x02\x00"
    frame_producer.send_raw(streamfer_topics.standard, unknown, key=b"cam-unknown")

    worker = streamfer_worker(settings={"schema_registry": {"url": schema_registry}})
    deadline = time.monotonic() + 120
    letters: list = []
    while not letters and time.monotonic() < deadline:
        letters = results_reader.dead_letters(idle_timeout_s=1.0)
    assert worker.alive(), worker.log()[-3000:]
    assert len(letters) == 1
    assert letters[0].value == unknown  # the message as it came, for a replay once the id exists
    assert letters[0].headers[HEADER_ERROR_TYPE] == MESSAGE_DECODE_ERROR
    assert "schema id 987654 is unknown to the Schema Registry" in letters[0].headers[HEADER_ERROR]
    # The plain frames beside it were answered: the worker went on (results framed: read back via the registry).
    assert {r["stream_id"] for r in read_back(results_reader.bootstrap, streamfer_topics.results,
                                              schema_registry)} == {f.stream_id for f in good}


def test_an_incompatible_frame_schema_is_refused_by_the_registry_at_registration(schema_registry, unique):
    registry = client(schema_registry)
    topic = f"frames.standard.{unique}"
    serializer = FrameSerializer(registry, schema_registry)
    serializer.framing(topic)  # frame.avsc, registered as a producer does
    registry.set_compatibility(subject_of(topic), "BACKWARD")  # Apicurio's default is NONE
    incompatible = json.loads(FRAME_SCHEMA_TEXT)
    incompatible["fields"].append({"name": "lens", "type": "string"})  # no default: old frames lack it

    with pytest.raises(SchemaRegistryError) as refused:
        registry.register_schema(subject_of(topic), Schema(json.dumps(incompatible), "AVRO"))
    assert refused.value.http_status_code == 409
    # The producer side (`worker produce --schema-registry`) says so as an operator's error.
    with pytest.raises(OperatorError, match="HTTP 409"):
        FrameSerializer(registry, schema_registry, schema_text=json.dumps(incompatible)).framing(topic)


def test_worker_produce_writes_frames_the_registry_resolves(schema_registry, kafka_bootstrap, streamfer_topics):
    topic = streamfer_topics.bulk
    proc = subprocess.run([sys.executable, "-m", "worker", "produce", "-b", kafka_bootstrap, "-t", topic, "-n", "3",
                           "--encoding", "raw", "--shape", "16x16", "-q", "--schema-registry", schema_registry],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    frames = read_back(kafka_bootstrap, topic, schema_registry, idle_timeout_s=1.0)
    assert [(f["width"], f["height"], len(f["data"])) for f in frames] == [(16, 16, 768)] * 3


def test_a_results_schema_the_registry_refuses_stops_start_up_with_exit_2(
        schema_registry, kafka_bootstrap, streamfer_topics, tmp_path):
    registry = client(schema_registry)
    subject = subject_of(streamfer_topics.results)
    older = {"type": "record", "name": "ModerationResult", "namespace": "dev.streamfer",
             "fields": [{"name": "stream_id", "type": "string"}]}
    registry.register_schema(subject, Schema(json.dumps(older), "AVRO"))
    registry.set_compatibility(subject, "BACKWARD")  # the worker's schema adds fields without defaults

    rc, seconds, output = _run(kafka_bootstrap, streamfer_topics, tmp_path, schema_registry)

    assert rc == 2, output[-3000:]
    assert seconds < EXIT_BOUND_S
    assert "schema_registry.url" in output and "HTTP 409" in output and subject in output
    assert "Traceback" not in output


def _run(bootstrap, topics, tmp_path: Path, url: str) -> tuple[int, float, str]:
    log = tmp_path / "worker.log"
    started = time.monotonic()
    proc = start_worker(bootstrap, topics, extra_env={"WORKER_SCHEMA_REGISTRY_URL": url}, log_path=str(log))
    rc = proc.wait(timeout=120)
    return rc, time.monotonic() - started, log.read_text(errors="replace")
