"""A frame's path as one trace, read back from a real Jaeger: `worker produce --traceparent` sends frames in traces of
their own through a real broker to a real worker (tracing on, exporting to Jaeger over OTLP/HTTP), and a downstream
consumer continues each result's trace. Jaeger's query API must return, in one trace id: the producer's send span,
the worker's process span (its child) with queued and send children and a link to its batch's span, and the
downstream consumer's span (a child of the worker's send). A slow frame's exemplar on /metrics names a trace Jaeger
returns.

`./dev tracing-check` builds Jaeger (deploy/jaeger/build.sh, minutes the first time) and runs this module; skipped
otherwise (STREAMFER_JAEGER names the binary)."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import pytest
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from worker.config import Settings, TracingSettings
from worker.frames import Encoding, Priority
from worker.testing import RunningWorker, TestTopics, make_topics, run_worker, wait_for
from worker.tools.jaeger import Jaeger, Span, jaeger_binary, run_jaeger
from worker.tools.publish_frames import publish, synthetic_frames
from worker.tools.read_results import iter_messages
from worker.tracing.producer import FrameSendTracing

BINARY = jaeger_binary() if os.environ.get("STREAMFER_JAEGER") else None
PRODUCER, CONSUMER, INTERNAL = 4, 5, 1  # OTLP span kinds
FRAMES = 4
SLOW_S = 3.0  # the slow frame was captured this long before it was sent: its end to end lands in the 5 s bucket

pytestmark = [
    pytest.mark.integration,
    pytest.mark.tracing,
    pytest.mark.skipif(BINARY is None, reason="needs a Jaeger binary: ./dev tracing-check builds it and runs this "
                                              "(STREAMFER_JAEGER)"),
]


@pytest.fixture(scope="module")
def jaeger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Jaeger]:
    assert BINARY is not None
    with open(tmp_path_factory.mktemp("jaeger") / "jaeger.log", "wb") as log, run_jaeger(BINARY, log) as running:
        yield running


@pytest.fixture(scope="module")
def traced(kafka_bootstrap: str, jaeger: Jaeger, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[TestTopics, RunningWorker, list[dict[str, str]], str]]:
    """A worker tracing to Jaeger (only frames that come with a sampled traceparent: sample_ratio 0), after
    FRAMES frames from `worker produce --traceparent` and one slow frame; the results' headers as a downstream
    consumer read them (it continued each trace), and the slow frame's trace id."""
    topics = make_topics(kafka_bootstrap, f"trace{time.monotonic_ns() % 10**8}")
    worker = run_worker(kafka_bootstrap, topics, tmp_path_factory.mktemp("traced"), settings={
        "tracing": {"endpoint": jaeger.otlp_endpoint, "sample_ratio": 0.0, "service_name": "streamfer-worker"},
        "batching": {"realtime": {"max_wait_ms": 200}}})
    try:
        env = {**os.environ, **topics.env(), "WORKER_KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
               "WORKER_TRACING_ENDPOINT": jaeger.otlp_endpoint}
        produced = subprocess.run([sys.executable, "-m", "worker", "produce", "--topic", topics.realtime,
                                   "--count", str(FRAMES), "--shape", "32x32", "--quiet", "--traceparent",
                                   "--run-id", "traced"], env=env, capture_output=True, text=True, timeout=120)
        assert produced.returncode == 0, produced.stderr
        slow_trace = send_slow_frame(kafka_bootstrap, topics, jaeger)
        headers = consume_results(kafka_bootstrap, topics, jaeger, FRAMES + 1)
        yield topics, worker, headers, slow_trace
    finally:
        worker.stop()


def send_slow_frame(bootstrap: str, topics: TestTopics, jaeger: Jaeger) -> str:
    """One frame captured SLOW_S before it is sent, in a trace of its own; returns that trace's id."""
    sent: list[str] = []
    tracing = FrameSendTracing(Settings(tracing=TracingSettings(endpoint=jaeger.otlp_endpoint)))

    def headers(rec, topic):  # type: ignore[no-untyped-def]
        made = tracing.headers(rec, topic)
        sent.append(dict(made)["traceparent"].decode().split("-")[1])
        return made

    (frame,) = synthetic_frames(1, [(32, 32)], Encoding.JPEG, Priority.REALTIME, "slow", ["t"])
    frame = dataclasses.replace(frame, capture_ts_ms=int((time.time() - SLOW_S) * 1000))
    publish(bootstrap, topics.realtime, [frame], keep_capture_ts=True, headers=headers)
    tracing.shutdown()
    return sent[0]


def consume_results(bootstrap: str, topics: TestTopics, jaeger: Jaeger, count: int) -> list[dict[str, str]]:
    """Reads `count` results as a downstream service would, continuing each one's trace in a `process` span of
    its own (service moderation-consumer, exported to Jaeger); returns each result's headers."""
    provider = TracerProvider(resource=Resource.create({"service.name": "moderation-consumer"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{jaeger.otlp_endpoint}/v1/traces")))
    tracer = provider.get_tracer("moderation-consumer")
    out: list[dict[str, str]] = []
    try:
        for msg in iter_messages(bootstrap, topics.results, count, follow=True, timeout_s=120):
            headers = {k: (v or b"").decode() for k, v in (msg.headers() or [])}
            context = TraceContextTextMapPropagator().extract(headers, context=Context())
            tracer.start_span(f"process {topics.results}", context=context, kind=SpanKind.CONSUMER, attributes={
                "messaging.system": "kafka", "messaging.operation.type": "process",
                "messaging.destination.name": topics.results}).end()
            out.append(headers)
    finally:
        provider.shutdown()
    assert len(out) == count, f"{len(out)} of {count} results"
    return out


def whole_trace(jaeger: Jaeger, trace_id: str, services: set[str]) -> list[Span]:
    """The trace once Jaeger has spans of every one of `services` (each process exports on its own schedule)."""
    found: list[Span] = []

    def complete() -> bool:
        found[:] = jaeger.trace(trace_id)
        return services <= {s.service for s in found} and len(found) >= 5

    wait_for(complete, 60, f"trace {trace_id} with spans of {sorted(services)} in Jaeger")
    return found


def only(spans: list[Span], service: str, name: str) -> Span:
    (span,) = [s for s in spans if s.service == service and s.name == name]
    return span


def test_one_trace_holds_the_producer_the_worker_its_batch_link_and_the_downstream_consumer(
        traced: tuple[TestTopics, RunningWorker, list[dict[str, str]], str], jaeger: Jaeger) -> None:
    topics, _, headers, _ = traced
    trace_ids = {h["traceparent"].split("-")[1] for h in headers}
    assert len(trace_ids) == FRAMES + 1  # every frame its own trace, carried into its result
    for trace_id in sorted(trace_ids):
        spans = whole_trace(jaeger, trace_id, {"streamfer-produce", "streamfer-worker", "moderation-consumer"})
        assert {s.trace_id for s in spans} == {trace_id}
        sent = only(spans, "streamfer-produce", f"send {topics.realtime}")
        process = only(spans, "streamfer-worker", f"process {topics.realtime}")
        queued = only(spans, "streamfer-worker", "queued")
        result_send = only(spans, "streamfer-worker", f"send {topics.results}")
        downstream = only(spans, "moderation-consumer", f"process {topics.results}")
        assert (sent.kind, process.kind, result_send.kind, downstream.kind) == (PRODUCER, CONSUMER, PRODUCER, CONSUMER)
        # The chain: producer -> worker's process -> (queued, send of the result) -> the downstream consumer.
        assert process.parent_span_id == sent.span_id
        assert queued.parent_span_id == process.span_id and result_send.parent_span_id == process.span_id
        assert downstream.parent_span_id == result_send.span_id
        assert process.attributes["messaging.destination.name"] == topics.realtime
        assert queued.start_ns == process.start_ns and queued.end_ns <= process.end_ns
        # The batch: a link from the frame's span to a span of a trace of its own.
        ((batch_trace, batch_span_id),) = process.links
        assert batch_trace != trace_id
        batch_spans = jaeger.trace(batch_trace)
        (batch,) = [s for s in batch_spans if s.span_id == batch_span_id]
        assert batch.service == "streamfer-worker" and batch.name.startswith("batch ") and batch.kind == INTERNAL
        assert batch.attributes["streamfer.batch.size"] >= 1
        assert batch.attributes["streamfer.batch.bucket"] >= batch.attributes["streamfer.batch.size"]
        for key in ("streamfer.model.name", "streamfer.engine", "streamfer.device"):
            assert batch.attributes[key], key
        assert {s.name for s in batch_spans if s.parent_span_id == batch.span_id} == {"preprocess", "inference"}


def test_a_slow_frames_exemplar_on_metrics_names_a_trace_jaeger_returns(
        traced: tuple[TestTopics, RunningWorker, list[dict[str, str]], str], jaeger: Jaeger) -> None:
    topics, worker, _, slow_trace = traced
    request = urllib.request.Request(f"http://127.0.0.1:{worker.port}/metrics",
                                     headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.headers["Content-Type"].startswith("application/openmetrics-text")
        scrape = response.read().decode()
    # The slowest bucket that holds an exemplar: the slow frame's end to end (about SLOW_S), by its trace id.
    exemplars = re.findall(r'^streamfer_end_to_end_seconds_bucket\{le="([^"]+)",priority="realtime"\} \S+ '
                           r'# \{trace_id="([0-9a-f]{32})"\} (\S+)', scrape, re.MULTILINE)
    assert exemplars, scrape[:3000]
    le, trace_id, value = max(exemplars, key=lambda e: float(e[2]))
    assert trace_id == slow_trace and float(value) >= SLOW_S and float(le) == 5.0
    spans = whole_trace(jaeger, trace_id, {"streamfer-produce", "streamfer-worker"})
    process = only(spans, "streamfer-worker", f"process {topics.realtime}")
    assert process.end_ns - process.start_ns < SLOW_S * 1e9  # the time went before the worker read it
