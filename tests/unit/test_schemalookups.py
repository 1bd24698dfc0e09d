"""The worker loop over the in-memory kit with a registry that hangs, fails or refuses: writer-schema lookups run
off the loop, frames that need one are held on their partition (never dead-lettered for a transient failure)
while every other partition flows, no commit passes a held frame, and they are answered in order once the
registry answers (worker/kafka/schemalookups.py, worker/kafka/schemahold.py)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka.schema_registry.error import SchemaRegistryError

from worker.codec.schemas import registry_framing
from worker.config import DeliverySettings, ObservabilitySettings, SchemaRegistrySettings, Settings
from worker.frames import HEADER_ERROR, HEADER_ERROR_TYPE, MESSAGE_DECODE_ERROR
from worker.kafka.registry import FRAME_SCHEMA_TEXT, RegistryLink
from worker.kafka.schemalookups import RegistryOutage
from worker.loop.pipeline import Pipeline, build_pipeline
from worker.metrics import Health, Metrics
from worker.testing import FakeClock, FakeExecutor, InMemoryKafka, abortable, frame_value, ledger

SETTINGS = Settings(observability=ObservabilitySettings(worker_id="w0"))
FRAMED = (SETTINGS.topics.bulk, 0)
PLAIN = (SETTINGS.topics.bulk, 1)
# How long a test awaits a condition that needs the lookup thread (real time: it is a thread).
AWAIT_S = 10.0


@dataclass
class Registered:
    schema_str: str = FRAME_SCHEMA_TEXT
    schema_type: str = "AVRO"
    references: list[Any] = field(default_factory=list)


class FakeRegistryClient:
    """get_schema as SchemaRegistryClient answers it: blocked while `frozen` is clear (a registry that accepts and
    never answers), raising `error` while it is set, else the frame schema (or 404 for ids not in `known`)."""

    def __init__(self, known: frozenset[int] = frozenset({5})) -> None:
        self.frozen = threading.Event()
        self.frozen.set()  # set: not frozen
        self.error: Exception | None = None
        self.known = known
        self.requests = 0

    def get_schema(self, schema_id: int) -> Registered:
        self.requests += 1
        self.frozen.wait()
        if self.error is not None:
            raise self.error
        if schema_id not in self.known:
            raise SchemaRegistryError(404, 40403, "Schema not found")
        return Registered()


def loop(client: FakeRegistryClient, max_held_bytes: int = 1 << 20, settings: Settings = SETTINGS
         ) -> tuple[Pipeline, InMemoryKafka, Metrics, FakeClock]:
    kafka, clock, metrics = InMemoryKafka(), FakeClock(), Metrics()
    kafka.send(FRAMED, *(registry_framing(5) + frame_value("framed", i) for i in range(6)))
    kafka.send(PLAIN, *(frame_value("plain", i) for i in range(6)))
    link = RegistryLink(b"", SchemaRegistrySettings(url="http://registry.invalid",
                                                    max_held_bytes_per_partition=max_held_bytes), client)
    pipeline = build_pipeline(settings, FakeExecutor(), metrics, Health(), clock, clients=kafka.clients,
                              registry=link)
    pipeline.source.subscribe(pipeline._on_assign, pipeline._on_revoke, pipeline._on_lost)
    return pipeline, kafka, metrics, clock


def turn_until(pipeline: Pipeline, clock: FakeClock, done: Any, what: str) -> None:
    deadline = time.monotonic() + AWAIT_S
    while not done():
        assert time.monotonic() < deadline, f"not within {AWAIT_S}s: {what}"
        pipeline.step()
        clock.advance(0.01)


def streams(kafka: InMemoryKafka) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for r in kafka.results():
        out.setdefault(r["stream_id"], []).append(r["frame_index"])
    return out


def held(metrics: Metrics) -> float:
    return metrics.registry.get_sample_value("streamfer_frames_held_for_schema") or 0.0


def test_a_hung_registry_holds_framed_frames_while_plain_frames_are_answered_and_committed() -> None:
    client = FakeRegistryClient()
    client.frozen.clear()
    pipeline, kafka, metrics, clock = loop(client)
    try:
        turn_until(pipeline, clock, lambda: len(kafka.results()) == 6 and kafka.committed.get(PLAIN) == 6,
                   "the plain partition answered and committed")
        for _ in range(50):  # the loop turns on while the lookup hangs
            pipeline.step()
        assert streams(kafka) == {"plain": list(range(6))}
        assert kafka.dead_letters() == []
        assert kafka.committed.get(FRAMED, 0) == 0  # no commit passes a held frame
        assert held(metrics) == 6
        turn_until(pipeline, clock, lambda: client.requests == 1, "one lookup, hanging")

        client.frozen.set()
        turn_until(pipeline, clock, lambda: "framed" in streams(kafka) and len(streams(kafka)["framed"]) == 6,
                   "the held frames answered")
        assert streams(kafka)["framed"] == list(range(6))  # in order
        turn_until(pipeline, clock, lambda: kafka.committed.get(FRAMED) == 6, "the framed partition committed")
        assert ledger(kafka.results()) == {(stream, i): 1 for stream in ("plain", "framed") for i in range(6)}
        assert kafka.dead_letters() == [] and held(metrics) == 0
        assert metrics.registry.get_sample_value("streamfer_schema_lookups_total", {"outcome": "found"}) == 1
    finally:
        client.frozen.set()
        pipeline.source.close()


def test_unframed_frames_on_a_partition_holding_framed_ones_are_answered_and_its_commit_stops_at_the_first_held(
        ) -> None:
    client = FakeRegistryClient()
    client.frozen.clear()
    kafka, clock, metrics = InMemoryKafka(), FakeClock(), Metrics()
    mixed = (SETTINGS.topics.bulk, 2)
    # Offsets 0, 2, 4, 6, 8 unframed ("plain"), 1, 3, 5, 7, 9 framed with an id the worker has never seen.
    kafka.send(mixed, *(registry_framing(5) + frame_value("framed", i // 2) if i % 2 else frame_value("plain", i // 2)
                        for i in range(10)))
    link = RegistryLink(b"", SchemaRegistrySettings(url="http://registry.invalid"), client)
    pipeline = build_pipeline(SETTINGS, FakeExecutor(), metrics, Health(), clock, clients=kafka.clients,
                              registry=link)
    pipeline.source.subscribe(pipeline._on_assign, pipeline._on_revoke, pipeline._on_lost)
    try:
        turn_until(pipeline, clock, lambda: len(kafka.results()) == 5, "the unframed frames answered")
        for _ in range(50):  # commits run on while the lookup hangs
            pipeline.step()
            clock.advance(0.1)
        assert streams(kafka) == {"plain": list(range(5))}
        assert held(metrics) == 5
        assert kafka.committed.get(mixed) == 1  # up to the earliest held offset, never past it
        client.frozen.set()
        turn_until(pipeline, clock, lambda: kafka.committed.get(mixed) == 10, "the partition committed to its end")
        assert streams(kafka)["framed"] == list(range(5))  # in order among themselves
        assert ledger(kafka.results()) == {(stream, i): 1 for stream in ("plain", "framed") for i in range(5)}
        assert kafka.dead_letters() == []
    finally:
        client.frozen.set()
        pipeline.source.close()


def test_a_long_outage_pauses_a_partition_past_whose_held_frame_the_uncommitted_cap_flowed_and_no_other() -> None:
    """Unframed frames answered past a held one cannot be committed: at the uncommitted cap their partition pauses,
    not every partition (as the cap itself would)."""
    client = FakeRegistryClient()
    client.frozen.clear()
    settings = Settings(observability=ObservabilitySettings(worker_id="w0"),
                        delivery=DeliverySettings(max_uncommitted_frames=64))
    kafka, clock, metrics = InMemoryKafka(), FakeClock(), Metrics()
    kafka.send(FRAMED, registry_framing(5) + frame_value("framed", 0), *(frame_value("behind", i) for i in range(200)))
    kafka.send(PLAIN, *(frame_value("plain", i) for i in range(200)))
    link = RegistryLink(b"", SchemaRegistrySettings(url="http://registry.invalid"), client)
    pipeline = build_pipeline(settings, FakeExecutor(), metrics, Health(), clock, clients=kafka.clients,
                              registry=link)
    pipeline.source.subscribe(pipeline._on_assign, pipeline._on_revoke, pipeline._on_lost)
    try:
        turn_until(pipeline, clock, lambda: kafka.committed.get(PLAIN) == 200, "the other partition committed")
        assert kafka.consumer is not None and FRAMED in kafka.consumer.paused
        behind = len(streams(kafka).get("behind", []))
        assert 64 <= behind < 200  # paused at the cap (within one poll), not read to its end
        assert kafka.committed.get(FRAMED, 0) == 0
        client.frozen.set()
        turn_until(pipeline, clock, lambda: kafka.committed.get(FRAMED) == 201, "the held partition committed")
        assert ledger(kafka.results()) == {("framed", 0): 1} | {(s, i): 1 for s in ("behind", "plain")
                                                                 for i in range(200)}
        assert kafka.dead_letters() == []
    finally:
        client.frozen.set()
        pipeline.source.close()


def test_a_registry_failing_for_a_transient_reason_is_asked_again_and_nothing_is_dead_lettered() -> None:
    client = FakeRegistryClient()
    client.error = SchemaRegistryError(503, 50301, "Service Unavailable")
    pipeline, kafka, metrics, clock = loop(client)
    try:
        turn_until(pipeline, clock, lambda: client.requests >= 2, "a second lookup after the backoff")
        assert kafka.dead_letters() == []
        assert "framed" not in streams(kafka)
        assert metrics.registry.get_sample_value("streamfer_schema_lookups_total", {"outcome": "transient"}) >= 1
        assert pipeline.source.held_for_schemas is not None
        assert "not answering" in (pipeline.source.held_for_schemas.problem() or "")
        client.error = None
        turn_until(pipeline, clock, lambda: len(streams(kafka).get("framed", [])) == 6, "the held frames answered")
        assert kafka.dead_letters() == []
        assert pipeline.source.held_for_schemas.problem() is None
        assert metrics.registry.get_sample_value("streamfer_schema_registry_unanswered_seconds") == 0
    finally:
        pipeline.source.close()


def test_an_unknown_id_is_a_permanent_answer_and_its_frames_are_dead_letters_with_the_reason() -> None:
    client = FakeRegistryClient(known=frozenset())
    pipeline, kafka, _metrics, clock = loop(client)
    try:
        turn_until(pipeline, clock, lambda: len(kafka.dead_letters()) == 6 and len(kafka.results()) == 6,
                   "the framed frames dead-lettered, the plain ones answered")
        letters = kafka.dead_letters()
        assert [m.headers[HEADER_ERROR] for m in letters] == [
            "registry schema id 5 is unknown to the Schema Registry (the producer wrote with an id from another "
            "registry, or it was deleted)"] * 6
        assert {m.headers[HEADER_ERROR_TYPE] for m in letters} == {MESSAGE_DECODE_ERROR}
        assert streams(kafka) == {"plain": list(range(6))}
        assert client.requests == 1  # one answer for all six
    finally:
        pipeline.source.close()


def test_a_partition_holding_its_byte_bound_is_paused() -> None:
    client = FakeRegistryClient()
    client.frozen.clear()
    pipeline, kafka, _metrics, clock = loop(client, max_held_bytes=1)
    try:
        turn_until(pipeline, clock, lambda: len(kafka.results()) == 6, "the plain partition answered")
        assert kafka.consumer is not None and FRAMED in kafka.consumer.paused
        assert PLAIN not in kafka.consumer.paused
        client.frozen.set()
        turn_until(pipeline, clock, lambda: len(streams(kafka).get("framed", [])) == 6, "the held frames answered")
        assert FRAMED not in kafka.consumer.paused
    finally:
        client.frozen.set()
        pipeline.source.close()


def test_a_revoked_partition_drops_its_held_frames_uncommitted() -> None:
    client = FakeRegistryClient()
    client.frozen.clear()
    pipeline, kafka, metrics, clock = loop(client)
    try:
        turn_until(pipeline, clock, lambda: held(metrics) == 6, "the framed frames held")
        assert kafka.consumer is not None
        kafka.consumer.rebalance("revoke", [FRAMED])
        turn_until(pipeline, clock, lambda: FRAMED not in pipeline.assignments, "the partition revoked")
        assert held(metrics) == 0
        client.frozen.set()
        for _ in range(20):
            pipeline.step()
        assert "framed" not in streams(kafka) and kafka.dead_letters() == []
        assert kafka.committed.get(FRAMED, 0) == 0  # the next owner reads them again
    finally:
        client.frozen.set()
        pipeline.source.close()


def test_a_held_frame_released_past_its_max_age_is_answered_expired() -> None:
    client = FakeRegistryClient()
    client.frozen.clear()
    kafka, clock, metrics = InMemoryKafka(), FakeClock(), Metrics()
    realtime = (SETTINGS.topics.realtime, 0)
    kafka.send(realtime, *(registry_framing(5) + frame_value("late", i) for i in range(3)))
    link = RegistryLink(b"", SchemaRegistrySettings(url="http://registry.invalid"), client)
    pipeline = build_pipeline(SETTINGS, FakeExecutor(), metrics, Health(), clock, clients=kafka.clients,
                              registry=link)
    pipeline.source.subscribe(pipeline._on_assign, pipeline._on_revoke, pipeline._on_lost)
    try:
        turn_until(pipeline, clock, lambda: held(metrics) == 3, "the realtime frames held")
        clock.advance(SETTINGS.batching.realtime.max_age_ms / 1000.0)  # the registry stays away past their deadline
        client.frozen.set()
        turn_until(pipeline, clock, lambda: len(kafka.results()) == 3, "the held frames answered")
        assert [(r["frame_index"], r["status"]) for r in kafka.results()] == [(0, "EXPIRED"), (1, "EXPIRED"),
                                                                              (2, "EXPIRED")]
        assert kafka.dead_letters() == []
    finally:
        client.frozen.set()
        pipeline.source.close()


def test_exactly_once_commits_up_to_a_held_frame_and_a_rewind_drops_and_rereads_it() -> None:
    client = FakeRegistryClient()
    client.frozen.clear()
    settings = Settings(observability=ObservabilitySettings(worker_id="w0"),
                        delivery=DeliverySettings(mode="exactly_once"))
    pipeline, kafka, metrics, clock = loop(client, settings=settings)
    try:
        turn_until(pipeline, clock, lambda: kafka.committed.get(PLAIN) == 6 and held(metrics) == 6,
                   "the plain partition committed in a transaction, the framed one held")
        assert kafka.committed.get(FRAMED, 0) == 0
        # A transaction that must abort rewinds every partition to its committed offset: the held frames are
        # dropped with the rest and read (and held) again, never answered twice.
        assert kafka.consumer is not None
        seeks = len(kafka.consumer.seeks)
        kafka.producers[-1].commit_errors.append(abortable())
        kafka.send(PLAIN, frame_value("plain", 6))
        turn_until(pipeline, clock, lambda: kafka.committed.get(PLAIN) == 7, "the plain partition after the rewind")
        assert (FRAMED, 0) in kafka.consumer.seeks[seeks:]  # rewound: read again from its committed offset
        assert held(metrics) == 6
        client.frozen.set()
        turn_until(pipeline, clock, lambda: kafka.committed.get(FRAMED) == 6, "the framed partition committed")
        assert ledger(kafka.results()) == {(stream, i): 1 for stream in ("plain", "framed") for i in range(6)} | {
            ("plain", 6): 1}
        assert kafka.dead_letters() == []
    finally:
        client.frozen.set()
        pipeline.source.close()


def test_an_outage_is_counted_from_the_first_request_left_unanswered_not_from_the_last_answer() -> None:
    clock = FakeClock()
    outage = RegistryOutage("http://registry", clock)
    clock.advance(3 * 24 * 3600.0)  # days with nothing to look up
    asked_at = clock.now
    clock.advance(5.0)  # the request's timeout
    outage.failed("ReadTimeout", asked_at)
    assert outage.unanswered_s() == 5.0
    clock.advance(10.0)
    outage.failed("ReadTimeout", clock.now - 5.0)  # a retry: the same outage
    assert outage.unanswered_s() == 15.0
    outage.answered()
    assert outage.unanswered_s() == 0.0
