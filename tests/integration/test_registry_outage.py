"""A Schema Registry outage costs neither data nor other traffic (issue 58), on the real broker and a real
registry (Apicurio, the kit's LocalSchemaRegistry, a process of this test's own so it can be frozen).

The registry is frozen (SIGSTOP: it accepts connections and never answers, as in a long pause or behind a dead
proxy) for longer than twice its timeout while frames framed with a writer-schema id the worker has never seen
and plain realtime frames flow, and plain frames follow the framed ones on their very partition. None of the
framed frames may be dead-lettered and all are answered once it resumes; the realtime frames' latency stays inside
their 2 s max age; the plain frames behind the held ones are answered while the registry is still frozen (an
unframed frame is never held); /readyz and /metrics tell the story. And a worker starting while the registry is
away waits for it, saying so on /readyz."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Producer
from confluent_kafka.schema_registry import Schema

from worker.codec.schemas import FRAMING_BYTES, decode_result, encode_frame
from worker.frames import Encoding, Priority
from worker.kafka.registry import subject_of
from worker.testing import TestTopics, run_worker, synthetic_frames, wait_for
from worker.tools.local_broker import free_port
from worker.tools.read_results import iter_messages
from worker.tools.schema_registry import LocalSchemaRegistry, SchemaRegistryUnavailable

from .test_schema_registry import client, framed_with, newer_frame_schema, read_back

pytestmark = pytest.mark.integration

TIMEOUT_MS = 1_000  # schema_registry.timeout_ms: the freeze lasts more than twice it
FREEZE_S = 6.0
FRAMED = 30
REALTIME_FPS = 20
REALTIME_MAX_AGE_MS = 2_000
SAME_PARTITION = 20  # plain frames sent after the framed ones to their partition, at SAME_PARTITION_FPS
SAME_PARTITION_FPS = 10


@pytest.fixture
def own_registry(tmp_path: Path) -> Iterator[LocalSchemaRegistry]:
    """A registry process for this test alone: freezing the session's would stall other tests."""
    registry = LocalSchemaRegistry(tmp_path / "registry")
    try:
        registry.start()
    except SchemaRegistryUnavailable as exc:
        pytest.skip(str(exc))
    try:
        yield registry
    finally:
        os.kill(registry.pid, signal.SIGCONT)  # never leave it frozen
        registry.stop()


def sample(metrics: str, name: str, labels: str = "") -> float:
    """A sample's value from a /metrics exposition (0 when absent)."""
    for line in metrics.splitlines():
        if line.startswith(f"{name}{labels} ") or (not labels and line.startswith(f"{name} ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def read_back_while_frozen(bootstrap: str, topic: str) -> list[dict]:
    """The results as the worker wrote them, read with its own results schema past their framing: a downstream
    deserializer would ask the frozen registry for the id, and wait."""
    return [decode_result(m.value()[FRAMING_BYTES:]) for m in iter_messages(bootstrap, topic, idle_timeout_s=0.5)]


def test_a_frozen_registry_holds_framed_frames_and_never_slows_plain_ones(
        own_registry: LocalSchemaRegistry, kafka_bootstrap: str, streamfer_topics: TestTopics, frame_producer,
        results_reader, tmp_path: Path) -> None:
    topics, url = streamfer_topics, own_registry.url
    worker = run_worker(kafka_bootstrap, topics, tmp_path, settings={
        "schema_registry": {"url": url, "timeout_ms": TIMEOUT_MS},
        "batching": {"realtime": {"max_age_ms": REALTIME_MAX_AGE_MS}}})
    try:
        # A writer schema the worker has never seen, registered just before the outage.
        registry = client(url)
        schema = newer_frame_schema()
        writer_id = registry.register_schema(subject_of(topics.standard), Schema(json.dumps(schema), "AVRO"))
        framed = synthetic_frames(FRAMED, [(32, 32)], Encoding.RAW_RGB8, Priority.STANDARD, "framed")
        realtime = synthetic_frames(int(REALTIME_FPS * (FREEZE_S + 2)), [(32, 32)], Encoding.RAW_RGB8,
                                    Priority.REALTIME, "plain")
        behind = synthetic_frames(SAME_PARTITION, [(32, 32)], Encoding.RAW_RGB8, Priority.STANDARD, "behind")

        os.kill(own_registry.pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        publisher = threading.Thread(target=frame_producer.publish, args=(realtime, REALTIME_FPS), daemon=True)
        publisher.start()
        producer = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})
        now_ms = int(time.time() * 1000)
        for frame in framed:
            frame = dataclasses.replace(frame, capture_ts_ms=now_ms)
            producer.produce(topics.standard, framed_with(writer_id, schema, frame), key=frame.stream_id.encode(),
                             partition=0)
        assert producer.flush(30) == 0

        def publish_behind() -> None:
            """Plain frames on the framed ones' partition, after them: they must not wait for the registry."""
            for frame in behind:
                frame = dataclasses.replace(frame, capture_ts_ms=int(time.time() * 1000))
                producer.produce(topics.standard, encode_frame(frame), key=frame.stream_id.encode(), partition=0)
                producer.poll(0)
                time.sleep(1 / SAME_PARTITION_FPS)  # the send rate, not a wait for a condition
            producer.flush(30)

        behind_publisher = threading.Thread(target=publish_behind, daemon=True)
        behind_publisher.start()

        # While it is frozen: the framed frames are held, /readyz (still 200) and /metrics say why.
        def held_and_said() -> bool:
            metrics = worker.metrics()
            status, body = worker.get("/readyz")
            return (sample(metrics, "streamfer_frames_held_for_schema") >= FRAMED
                    and status == 200 and "schema registry not answering" in body
                    and sample(metrics, "streamfer_schema_registry_unanswered_seconds") > 0)

        wait_for(held_and_said, FREEZE_S - (time.monotonic() - frozen_at), "the framed frames held, and said so")
        behind_keys = {(f.stream_id, f.frame_index) for f in behind}
        answered_behind: list[dict] = []

        def behind_answered() -> bool:
            answered_behind[:] = [r for r in read_back_while_frozen(kafka_bootstrap, topics.results)
                                  if (r["stream_id"], r["frame_index"]) in behind_keys]
            return len(answered_behind) == SAME_PARTITION

        # Still frozen (until SIGCONT below, however long this takes): the plain frames behind the held ones on
        # their partition are answered all the same.
        wait_for(behind_answered, 30, "the plain frames behind the held ones answered while the registry is frozen",
                 interval_s=0.5)
        assert {r["status"] for r in answered_behind} == {"OK"}
        assert max(r["end_to_end_ms"] for r in answered_behind) < REALTIME_MAX_AGE_MS
        time.sleep(max(0.0, FREEZE_S - (time.monotonic() - frozen_at)))  # the freeze itself
        os.kill(own_registry.pid, signal.SIGCONT)
        publisher.join(timeout=60)

        expected = {(f.stream_id, f.frame_index) for f in framed + realtime + behind}
        results: list[dict] = []

        def all_answered() -> bool:
            results[:] = read_back(kafka_bootstrap, topics.results, url, idle_timeout_s=1.0)
            return {(r["stream_id"], r["frame_index"]) for r in results} >= expected

        wait_for(all_answered, 120, "every frame answered after the registry resumed", interval_s=0.5)
        assert results_reader.dead_letters(idle_timeout_s=1.0) == []  # none dead-lettered for the outage
        by_status = {(r["stream_id"], r["frame_index"]): r["status"] for r in results}
        assert {by_status[(f.stream_id, f.frame_index)] for f in framed} == {"OK"}
        expired = [key for key in by_status if key[0].startswith("plain") and by_status[key] == "EXPIRED"]
        assert expired == [], f"{len(expired)} realtime frames expired at a {REALTIME_MAX_AGE_MS} ms max age"
        plain_ms = sorted(r["end_to_end_ms"] for r in results if r["stream_id"].startswith("plain"))
        print(f"realtime end-to-end during and after the freeze: {len(plain_ms)} frames, p50 "
              f"{plain_ms[len(plain_ms) // 2]:.0f} ms, p99 {plain_ms[int(len(plain_ms) * 0.99)]:.0f} ms, "
              f"max {plain_ms[-1]:.0f} ms")

        metrics = worker.metrics()
        assert sample(metrics, "streamfer_schema_lookups_total", '{outcome="transient"}') >= 1
        assert sample(metrics, "streamfer_schema_lookups_total", '{outcome="found"}') == 1
        assert sample(metrics, "streamfer_schema_lookups_total", '{outcome="permanent"}') == 0
        assert sample(metrics, "streamfer_frames_held_for_schema") == 0
        assert sample(metrics, "streamfer_schema_registry_unanswered_seconds") == 0
        assert worker.get("/readyz") == (200, "ready\n")
        log = worker.log()
        assert log.count("does not answer (") == 1, log[-3000:]  # one line per outage ...
        assert log.count("answers again after") == 1, log[-3000:]  # ... and one per recovery
    finally:
        os.kill(own_registry.pid, signal.SIGCONT)
        worker.stop()


def test_a_worker_starting_while_the_registry_is_away_waits_and_says_why(
        kafka_bootstrap: str, streamfer_topics: TestTopics, tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}/apis/ccompat/v7"  # nothing listens there (yet)
    worker = run_worker(kafka_bootstrap, streamfer_topics, tmp_path, ready=False,
                        settings={"schema_registry": {"url": url, "timeout_ms": TIMEOUT_MS}})
    try:
        def waiting() -> bool:
            status, body = worker.get("/readyz")
            return status == 503 and f"waiting for the Schema Registry at {url}" in body

        wait_for(waiting, 60, "/readyz saying start-up waits for the registry")
        wait_for(lambda: "(try 3;" in worker.get("/readyz")[1], 30, "a third try, after backoff")
        assert worker.alive(), worker.log()[-3000:]
        assert worker.log().count("waiting for it (asked again with backoff") == 1  # one line, not one per try
    finally:
        worker.process.send_signal(signal.SIGTERM)
        rc = worker.process.wait(timeout=30)
    assert rc == 2, worker.log()[-3000:]  # stopped while waiting: the operator's message says why
    assert "Traceback" not in worker.log()
