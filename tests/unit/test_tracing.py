"""Tracing (worker/tracing): the real loop over in-memory Kafka fakes and a fake clock, its spans caught by
OpenTelemetry's InMemorySpanExporter. Span structure, links and attributes, the trace context a result carries,
exemplars on /metrics, and tracing off: no spans, no headers."""

from __future__ import annotations

import dataclasses
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from worker.config import (
    BatchingSettings,
    ConfigError,
    ObservabilitySettings,
    Settings,
    TracingSettings,
    load_settings,
)
from worker.frames import BatchOutcome, Encoding, Frame, Priority, Verdict
from worker.kafka.wiring import KafkaClients
from worker.loop.pipeline import Pipeline, build_pipeline
from worker.metrics import Health, Metrics, MetricsServer
from worker.testing import FakeClock, FakeConsumer, FakeProducer, Produced, frame_value
from worker.tracing import TRACING_OFF, Tracing, setup_tracing
from worker.tracing.export import DroppingSpanProcessor

REALTIME = Settings().topics.realtime
P0 = (REALTIME, 0)
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
QUEUED_S = 0.004  # each batch starts this long after the turn that released it
RUN_MS = 3.0


class TimedExecutor:
    """Scores every frame at once; each batch starts QUEUED_S after it was submitted and runs RUN_MS, by the clock."""

    preferred_batch_sizes: tuple[int, ...] = ()
    model_input_hw = None
    memory_policy = None
    model_name = "fake-model"
    model_version = "7"
    device_description = "cpu (1 thread), fp32, eager"
    runner_count = 1

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    def submit(self, frames: Sequence[Frame], shape: tuple[int, int, int],
               priority: Priority = Priority.BULK) -> Future[BatchOutcome]:
        future: Future[BatchOutcome] = Future()
        future.set_result(BatchOutcome(
            verdicts=[(f, Verdict({"nudity": 0.1}, ())) for f in frames], failures=[], batch_size=len(frames),
            preprocess_ms=RUN_MS / 3, inference_ms=RUN_MS * 2 / 3, started_at=self.clock.now + QUEUED_S,
            bucket=8, used_graph=False))
        return future


STARTED: list[Tracing] = []


@pytest.fixture(autouse=True)
def _stop_export_threads() -> Iterator[None]:
    """Each test's tracing is shut down after it: no export thread outlives its test."""
    yield
    while STARTED:
        STARTED.pop().shutdown(1.0)


class World:
    """A pipeline over fakes with tracing as given (`tracing(settings, metrics)`), every produced message kept."""

    def __init__(self, make_tracing: Callable[[Settings, Metrics], Tracing], max_batch_size: int = 4) -> None:
        self.settings = Settings(batching=BatchingSettings(rare_shape_min_count=1, max_batch_size=max_batch_size),
                                 observability=ObservabilitySettings(worker_id="w0", metrics_enabled=False),
                                 tracing=TracingSettings(endpoint="http://127.0.0.1:4318", sample_ratio=0.5))
        self.consumer: FakeConsumer | None = None
        self.producers: list[FakeProducer] = []

        def consumer(conf: dict[str, Any], logger: Any = None) -> FakeConsumer:
            self.consumer = FakeConsumer(conf)
            return self.consumer

        def producer(conf: dict[str, Any], logger: Any = None) -> FakeProducer:
            self.producers.append(FakeProducer(conf))
            return self.producers[-1]

        self.clock = FakeClock()
        self.metrics = Metrics()
        self.tracing = make_tracing(self.settings, self.metrics)
        STARTED.append(self.tracing)
        clients = KafkaClients(consumer=consumer, producer=producer, output_message_limit=lambda settings: None)
        self.pipeline: Pipeline = build_pipeline(self.settings, TimedExecutor(self.clock), self.metrics, Health(),
                                                 self.clock, clients=clients, tracing=self.tracing)
        self.pipeline.source.subscribe(self.pipeline._on_assign, self.pipeline._on_revoke, self.pipeline._on_lost)
        assert self.consumer is not None
        self.consumer.rebalance("assign", [P0])
        self.step()

    def send(self, count: int, headers: dict[int, list[tuple[str, bytes]]] | None = None) -> None:
        assert self.consumer is not None
        start = len(self.consumer.log.get(P0, []))
        self.consumer.append(P0, *(frame_value("cam", start + i) for i in range(count)))
        for i, h in (headers or {}).items():
            self.consumer.headers[(P0, start + i)] = h

    def step(self, turns: int = 1) -> None:
        for _ in range(turns):
            self.clock.now += 0.2  # past realtime's max_wait_ms: every step releases what is pending
            self.pipeline.step()

    def results(self) -> list[Produced]:
        return [m for p in self.producers for m in p.visible if m.topic == self.settings.topics.results]


def in_memory(sample: float = 0.9) -> tuple[InMemorySpanExporter, Callable[[Settings, Metrics], Tracing]]:
    """An exporter and the tracing that exports to it; `sample` is every root draw (traced below the ratio 0.5)."""
    exporter = InMemorySpanExporter()
    return exporter, lambda settings, metrics: setup_tracing(settings, metrics, exporter=exporter,
                                                             sample=lambda: sample)


def spans(world: World, exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    assert world.tracing.flush()
    return list(exporter.get_finished_spans())


def named(found: list[ReadableSpan], prefix: str) -> list[ReadableSpan]:
    return [s for s in found if s.name.startswith(prefix)]


def traceparent(sampled: bool = True) -> list[tuple[str, bytes]]:
    return [("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-{'01' if sampled else '00'}".encode()),
            ("tracestate", b"vendor=x")]


def hex_id(n: int, width: int = 32) -> str:
    return format(n, f"0{width}x")


# -- a frame's spans -----------------------------------------------------------------------------------------------
def test_a_frame_with_a_sampled_traceparent_continues_that_trace_through_process_queued_and_send() -> None:
    exporter, tracing = in_memory(sample=0.9)  # the ratio alone would not trace it: the parent decides
    w = World(tracing)
    w.send(1, {0: traceparent()})
    w.step(3)
    found = spans(w, exporter)
    (process,) = named(found, "process ")
    assert process.name == f"process {REALTIME}" and process.kind is SpanKind.CONSUMER
    assert hex_id(process.context.trace_id) == TRACE_ID
    assert process.parent is not None and hex_id(process.parent.span_id, 16) == PARENT_ID
    attrs = process.attributes or {}
    assert attrs["messaging.system"] == "kafka" and attrs["messaging.operation.type"] == "process"
    assert attrs["messaging.destination.name"] == REALTIME and attrs["messaging.destination.partition.id"] == "0"
    assert attrs["messaging.kafka.offset"] == 0 and attrs["streamfer.frame.id"] == "cam/0"
    (queued,) = named(found, "queued")
    (send,) = named(found, "send ")
    for child in (queued, send):
        assert child.parent is not None and child.parent.span_id == process.context.span_id
        assert child.context.trace_id == process.context.trace_id
    assert send.kind is SpanKind.PRODUCER and send.name == f"send {w.settings.topics.results}"
    # queued: from the frame being read to its batch starting, which the executor put QUEUED_S after release.
    assert process.start_time == queued.start_time
    assert queued.end_time is not None and process.end_time is not None and send.start_time is not None
    assert queued.end_time < process.end_time <= send.start_time


def test_the_result_carries_the_send_spans_context_so_a_downstream_consumer_continues_the_trace() -> None:
    exporter, tracing = in_memory()
    w = World(tracing)
    w.send(1, {0: traceparent()})
    w.step(3)
    (result,) = w.results()
    (send,) = named(spans(w, exporter), "send ")
    assert result.headers["traceparent"] == f"00-{TRACE_ID}-{hex_id(send.context.span_id, 16)}-01"
    assert result.headers["tracestate"] == "vendor=x"


def test_one_batch_span_per_batch_with_its_attributes_linked_from_each_frames_span() -> None:
    exporter, tracing = in_memory(sample=0.1)  # every frame traced at the ratio 0.5
    w = World(tracing, max_batch_size=3)
    w.send(3)
    w.step(3)
    found = spans(w, exporter)
    (batch,) = named(found, "batch ")
    assert batch.name == "batch fake-model" and batch.parent is None
    attrs = batch.attributes or {}
    assert (attrs["streamfer.batch.size"], attrs["streamfer.batch.bucket"], attrs["messaging.batch.message_count"]) \
        == (3, 8, 3)
    assert attrs["streamfer.model.name"] == "fake-model" and attrs["streamfer.model.version"] == "7"
    assert attrs["streamfer.engine"] == "eager" and attrs["streamfer.device"] == "cpu (1 thread), fp32, eager"
    assert attrs["streamfer.batch.priority"] == "realtime" and attrs["streamfer.batch.shape"] == "2x2x3"
    assert batch.end_time is not None and batch.start_time is not None
    assert batch.end_time - batch.start_time == pytest.approx(RUN_MS * 1e6, abs=1e3)
    assert sorted(s.name for s in found if s.parent and s.parent.span_id == batch.context.span_id) \
        == ["inference", "preprocess"]
    processes = named(found, "process ")
    assert len(processes) == 3 and len({p.context.trace_id for p in processes}) == 3  # each frame its own trace
    for process in processes:
        assert process.parent is None  # a root: no context came with the frame
        assert [link.context.span_id for link in process.links] == [batch.context.span_id]
        assert process.context.trace_id != batch.context.trace_id  # linked, not a child


def test_a_frame_without_a_context_is_not_traced_when_the_sampler_says_no() -> None:
    exporter, tracing = in_memory(sample=0.9)
    w = World(tracing)
    w.send(2)
    w.step(3)
    assert spans(w, exporter) == []
    assert [r.headers for r in w.results()] == [{}, {}]


def test_an_unsampled_traceparent_is_not_traced_and_passes_on_unchanged() -> None:
    exporter, tracing = in_memory(sample=0.1)  # the ratio would trace it: the parent's "not sampled" wins
    w = World(tracing)
    w.send(1, {0: traceparent(sampled=False)})
    w.step(3)
    assert spans(w, exporter) == []
    (result,) = w.results()
    assert result.headers == {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-00", "tracestate": "vendor=x"}


def test_an_expired_frame_gets_a_process_span_and_its_result_the_context() -> None:
    exporter, tracing = in_memory()
    w = World(tracing)
    w.send(1, {0: traceparent()})
    w.clock.now += 10.0  # past realtime's max_age_ms before it is read
    w.step(3)
    found = spans(w, exporter)
    (process,) = named(found, "process ")
    assert (process.attributes or {})["streamfer.status"] == "EXPIRED" and not process.links
    (result,) = w.results()
    assert result.headers["traceparent"].startswith(f"00-{TRACE_ID}-")


def test_the_send_span_ends_when_the_result_is_handed_to_the_producer() -> None:
    exporter, tracing = in_memory()
    w = World(tracing)
    w.send(1, {0: traceparent()})
    w.step(3)
    assert w.results()
    assert named(spans(w, exporter), "send ")  # finished: exported


# -- off -------------------------------------------------------------------------------------------------------------
def test_tracing_is_off_without_an_endpoint() -> None:
    assert setup_tracing(Settings()) is TRACING_OFF


def test_off_makes_no_spans_and_leaves_the_results_headers_alone() -> None:
    w = World(lambda settings, metrics: TRACING_OFF)
    w.send(2, {0: traceparent(), 1: traceparent(sampled=False)})
    w.step(3)
    assert [r.headers for r in w.results()] == [{}, {}]
    scrape = openmetrics(w.metrics)
    assert "trace_id" not in scrape


# -- exemplars -------------------------------------------------------------------------------------------------------
def openmetrics(metrics: Metrics, accept: str = "application/openmetrics-text; version=1.0.0") -> str:
    server = MetricsServer(metrics, Health(), "127.0.0.1", 0).start()
    try:
        request = urllib.request.Request(f"http://127.0.0.1:{server.port}/metrics", headers={"Accept": accept})
        with urllib.request.urlopen(request, timeout=10) as response:
            return str(response.read().decode())
    finally:
        server.stop()


def test_a_traced_frames_trace_id_is_the_exemplar_of_its_latency_buckets_in_openmetrics() -> None:
    _, tracing = in_memory(sample=0.9)
    w = World(tracing)
    w.send(2, {1: traceparent()})  # frame 0 is not traced, frame 1 is
    w.step(3)
    scrape = openmetrics(w.metrics)
    exemplars = [line for line in scrape.splitlines() if "# {" in line]
    for metric in ("streamfer_end_to_end_seconds_bucket", "streamfer_queue_wait_seconds_bucket",
                   "streamfer_inference_seconds_bucket", "streamfer_preprocess_seconds_bucket"):
        (line,) = [x for x in exemplars if x.startswith(metric)]
        assert f'# {{trace_id="{TRACE_ID}"}}' in line, line
    assert scrape.rstrip().endswith("# EOF")


def test_the_prometheus_text_format_has_no_exemplars() -> None:
    _, tracing = in_memory()
    w = World(tracing)
    w.send(1, {0: traceparent()})
    w.step(3)
    text = openmetrics(w.metrics, accept="text/plain")
    assert "streamfer_end_to_end_seconds_bucket" in text and "trace_id" not in text


# -- the collector away ----------------------------------------------------------------------------------------------
class FailingExporter(InMemorySpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.FAILURE


class BlockedExporter(InMemorySpanExporter):
    """Hangs in export until released: a collector that stopped answering."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.entered = threading.Event()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.entered.set()
        self.release.wait(30)
        return super().export(spans)


def dropped(metrics: Metrics, reason: str) -> float:
    return metrics.registry.get_sample_value("streamfer_trace_spans_dropped_total", {"reason": reason}) or 0.0


def test_failed_exports_are_counted_as_dropped_spans() -> None:
    w = World(lambda settings, metrics: setup_tracing(settings, metrics, exporter=FailingExporter(),
                                                      sample=lambda: 0.1))
    w.send(2)
    w.step(3)
    w.tracing.flush()
    # Per frame: process, queued and send; per batch: batch, preprocess and inference.
    assert dropped(w.metrics, "export_failed") == 9


def test_a_collector_that_hangs_never_holds_the_loop_back_and_the_overflow_is_counted() -> None:
    exporter = BlockedExporter()
    w = World(lambda settings, metrics: setup_tracing(
        Settings(tracing=TracingSettings(endpoint="http://127.0.0.1:9", sample_ratio=1.0, max_queued_spans=64),
                 observability=settings.observability, batching=settings.batching), metrics,
        exporter=exporter, sample=lambda: 0.1))
    try:
        for _ in range(10):  # 40 frames in batches of 4: 150 spans
            w.send(4)
            w.step(2)
        assert len(w.results()) == 40
        assert dropped(w.metrics, "queue_full") > 0
    finally:
        exporter.release.set()
        w.tracing.shutdown()


def test_the_processor_drops_a_span_on_a_full_queue_without_waiting() -> None:
    counted: list[tuple[str, int]] = []
    exporter = BlockedExporter()
    processor = DroppingSpanProcessor(exporter, max_queued=2, on_dropped=lambda r, n: counted.append((r, n)),
                                      interval_s=3600)
    span: Any = object()
    for _ in range(3):
        processor.on_end(span)
    assert counted == [("queue_full", 1)]
    exporter.release.set()
    processor.shutdown(5.0)
    assert len(exporter.get_finished_spans()) == 2  # what was queued is exported on shutdown
    processor.on_end(span)
    assert counted[-1] == ("shutdown", 1)


# -- settings --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("env", "named_setting"), [
    ({"WORKER_TRACING_ENDPOINT": "127.0.0.1:4318"}, "tracing.endpoint"),
    ({"WORKER_TRACING_ENDPOINT": "grpc://collector:4317"}, "tracing.endpoint"),
    ({"WORKER_TRACING_SAMPLE_RATIO": "1.5"}, "tracing.sample_ratio"),
    ({"WORKER_TRACING_SAMPLE_RATIO": "-0.1"}, "tracing.sample_ratio"),
])
def test_a_bad_endpoint_or_ratio_stops_start_up_naming_the_setting(env: dict[str, str], named_setting: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(env=env)
    assert caught.value.setting == named_setting


def test_tracing_settings_load_from_the_environment() -> None:
    s = load_settings(env={"WORKER_TRACING_ENDPOINT": "http://collector:4318", "WORKER_TRACING_SAMPLE_RATIO": "1",
                           "WORKER_TRACING_RESOURCE_ATTRIBUTES": "deployment.environment=prod,k8s.pod.name=w-1"})
    assert (s.tracing.endpoint, s.tracing.sample_ratio, s.tracing.service_name) \
        == ("http://collector:4318", 1.0, "streamfer-worker")
    assert s.tracing.resource_attributes == {"deployment.environment": "prod", "k8s.pod.name": "w-1"}


def test_spans_carry_the_service_name_the_worker_id_and_the_resource_attributes() -> None:
    exporter = InMemorySpanExporter()
    w = World(lambda settings, metrics: setup_tracing(dataclasses.replace(settings, tracing=TracingSettings(
        endpoint="http://127.0.0.1:4318", service_name="moderation", resource_attributes={"k8s.pod.name": "w-1"})),
        metrics, exporter=exporter))
    w.send(1, {0: traceparent()})
    w.step(3)
    found = spans(w, exporter)
    assert len(found) == 6  # process, queued, send; batch, preprocess, inference
    for span in found:
        assert {k: span.resource.attributes.get(k) for k in ("service.name", "service.instance.id", "k8s.pod.name")} \
            == {"service.name": "moderation", "service.instance.id": "w0", "k8s.pod.name": "w-1"}


# -- worker produce --traceparent ------------------------------------------------------------------------------------
class RecordingProducer:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def produce(self, topic: str, **kwargs: Any) -> None:
        self.sent.append({"topic": topic, **kwargs})
        kwargs["on_delivery"](None, None)

    def poll(self, timeout: float = 0.0) -> int:
        return 0

    def flush(self, timeout: float = 0.0) -> int:
        return 0


def test_worker_produce_traceparent_sends_each_frame_in_a_send_span_of_its_own_trace() -> None:
    from worker.tools.publish_frames import send_frames, synthetic_frames
    from worker.tracing.producer import FrameSendTracing

    exporter = InMemorySpanExporter()
    traced = FrameSendTracing(Settings(), exporter=exporter)
    producer = RecordingProducer()
    frames = synthetic_frames(2, [(8, 8)], Encoding.RAW_RGB8, Priority.REALTIME, "run1", ["t"])
    send_frames(producer, frames, lambda _rec: REALTIME, headers=traced.headers)  # type: ignore[arg-type]
    sends = list(exporter.get_finished_spans())
    assert [s.name for s in sends] == [f"send {REALTIME}"] * 2 and all(s.kind is SpanKind.PRODUCER for s in sends)
    assert len({s.context.trace_id for s in sends}) == 2
    for message, span in zip(producer.sent, sends, strict=True):
        (name, value), = message["headers"]
        assert name == "traceparent"
        version, trace_id, span_id, flags = value.decode().split("-")
        assert (version, trace_id, span_id) == ("00", hex_id(span.context.trace_id), hex_id(span.context.span_id, 16))
        assert int(flags, 16) & 1  # sampled: the worker continues it


def test_worker_produce_sends_no_headers_without_traceparent() -> None:
    from worker.tools.publish_frames import send_frames, synthetic_frames

    producer = RecordingProducer()
    frames = synthetic_frames(1, [(8, 8)], Encoding.RAW_RGB8, Priority.REALTIME, "run1", ["t"])
    send_frames(producer, frames, lambda _rec: REALTIME)  # type: ignore[arg-type]
    assert producer.sent[0]["headers"] is None


def test_shutdown_gives_up_on_a_collector_that_hangs_within_its_timeout() -> None:
    counted: list[tuple[str, int]] = []
    exporter = BlockedExporter()
    processor = DroppingSpanProcessor(exporter, max_queued=8, on_dropped=lambda r, n: counted.append((r, n)),
                                      interval_s=0.01)
    span: Any = object()
    processor.on_end(span)
    assert exporter.entered.wait(10)  # the export thread is stuck in the collector
    processor.on_end(span)
    started = time.monotonic()
    processor.shutdown(0.3)
    assert time.monotonic() - started < 5  # bounded by its timeout, not by the collector
    assert counted == [("shutdown", 1)]  # the span still queued
    exporter.release.set()


def test_a_collector_that_is_gone_is_counted_and_logged_once_not_per_export(caplog: pytest.LogCaptureFixture) -> None:
    from worker.tools.local_broker import free_port

    settings = Settings(tracing=TracingSettings(endpoint=f"http://127.0.0.1:{free_port()}", export_timeout_ms=200),
                        observability=ObservabilitySettings(worker_id="w0"))
    metrics = Metrics()
    tracing = setup_tracing(settings, metrics)
    STARTED.append(tracing)
    exporter_lines = 0
    for _ in range(3):
        w = World(lambda s, m: tracing)
        w.send(1, {0: traceparent()})
        w.step(3)
        caplog.clear()
        tracing.flush()
        exporter_lines += sum(r.name.startswith("opentelemetry.exporter") for r in caplog.records)
    assert dropped(metrics, "export_failed") == 3 * 6  # connection refused: every span of the three frames
    assert exporter_lines <= 1
