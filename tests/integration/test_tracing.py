"""Tracing through a real broker and a real worker process, in every CI run: the worker exports over OTLP/HTTP to a
receiver in this test (OpenTelemetry's protobuf, decoded here), frames go in with and without a `traceparent`, and
the results come out carrying the trace context. The same path, read back from a real Jaeger: tests/tracing
(`./dev tracing-check`)."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from worker.config import Settings
from worker.frames import Encoding, Priority
from worker.testing import TestTopics, make_topics, run_worker, wait_for
from worker.testing.otlp import OtlpReceiver
from worker.tools.publish_frames import publish, synthetic_frames
from worker.tools.read_results import iter_messages
from worker.tracing.producer import FrameSendTracing

pytestmark = pytest.mark.integration


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    links: tuple[tuple[str, str], ...]
    attributes: dict[str, Any]


@dataclass
class Receiver:
    """An OTLP/HTTP collector on loopback that keeps every span it is sent."""

    spans: list[ReceivedSpan] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        for resource_spans in request.resource_spans:
            service = next((a.value.string_value for a in resource_spans.resource.attributes
                            if a.key == "service.name"), "")
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    attributes = {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in s.attributes}
                    span = ReceivedSpan(service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                        tuple((link.trace_id.hex(), link.span_id.hex()) for link in s.links),
                                        attributes)
                    with self.lock:
                        self.spans.append(span)

    def of_trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, str]]:
    kept = Receiver()
    with OtlpReceiver(kept.take) as server:
        yield kept, server.endpoint


def read_results(bootstrap: str, topics: TestTopics, count: int) -> list[tuple[str, dict[str, str]]]:
    """(stream_id/frame_index key, headers) of `count` results, read_committed from the start."""
    out = [((msg.key() or b"").decode(), {k: (v or b"").decode() for k, v in (msg.headers() or [])})
           for msg in iter_messages(bootstrap, topics.results, count, follow=True, timeout_s=120)]
    assert len(out) == count, f"{len(out)} of {count} results"
    return out


def test_traced_frames_continue_their_trace_through_the_worker_and_untraced_ones_change_nothing(
        kafka_bootstrap: str, receiver: tuple[Receiver, str], tmp_path: Path) -> None:
    kept, endpoint = receiver
    topics = make_topics(kafka_bootstrap, f"otel{time.monotonic_ns() % 10**8}")
    worker = run_worker(kafka_bootstrap, topics, tmp_path, settings={
        "tracing": {"endpoint": endpoint, "sample_ratio": 0.0}})  # only frames sent with a sampled traceparent
    try:
        sent: dict[str, tuple[str, str]] = {}  # stream id -> (trace id, the producer's span id)
        sending = FrameSendTracing(Settings())  # headers only: nothing exported from this side

        def headers(rec, topic):  # type: ignore[no-untyped-def]
            made = sending.headers(rec, topic)
            _, trace_id, span_id, _ = dict(made)["traceparent"].decode().split("-")
            sent[rec.stream_id] = (trace_id, span_id)
            return made

        traced = list(synthetic_frames(3, [(32, 32)], Encoding.JPEG, Priority.REALTIME, "traced", ["t"],
                                       streams_per_shape=3))
        plain = list(synthetic_frames(2, [(32, 32)], Encoding.JPEG, Priority.REALTIME, "plain", ["t"]))
        publish(kafka_bootstrap, topics.realtime, traced, headers=headers)
        publish(kafka_bootstrap, topics.realtime, plain)
        results = read_results(kafka_bootstrap, topics, len(traced) + len(plain))

        for key, result_headers in results:
            if key.startswith("plain"):
                assert result_headers == {}  # no context came, none was started (ratio 0): nothing added
                continue
            trace_id, producer_span = sent[key]
            version, carried_trace, send_span, flags = result_headers["traceparent"].split("-")
            assert (version, carried_trace, int(flags, 16) & 1) == ("00", trace_id, 1)

            def exported(trace_id: str = trace_id) -> bool:
                return {s.name for s in kept.of_trace(trace_id)} >= {
                    f"process {topics.realtime}", "queued", f"send {topics.results}"}

            wait_for(exported, 30, f"the worker's spans of trace {trace_id}")
            spans = {s.name: s for s in kept.of_trace(trace_id)}
            process = spans[f"process {topics.realtime}"]
            assert process.service == "streamfer-worker" and process.parent_span_id == producer_span
            assert spans["queued"].parent_span_id == process.span_id
            assert spans[f"send {topics.results}"].span_id == send_span  # the result carries the send span
            assert spans[f"send {topics.results}"].parent_span_id == process.span_id
            ((batch_trace, batch_span),) = process.links
            wait_for(lambda bt=batch_trace: any(s.name.startswith("batch ") for s in kept.of_trace(bt)), 30,
                     "the batch span")
            (batch,) = [s for s in kept.of_trace(batch_trace) if s.span_id == batch_span]
            assert batch.attributes["streamfer.batch.size"] >= 1 and batch.attributes["streamfer.engine"] == "eager"
        assert not any(s.trace_id not in {t for t, _ in sent.values()} and s.name.startswith("process ")
                       for s in kept.spans)  # the plain frames made no spans

        request = urllib.request.Request(f"http://127.0.0.1:{worker.port}/metrics",
                                         headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        with urllib.request.urlopen(request, timeout=10) as response:
            scrape = response.read().decode()
        named = {line.split('trace_id="')[1][:32] for line in scrape.splitlines()
                 if line.startswith("streamfer_end_to_end_seconds_bucket") and "trace_id=" in line}
        assert named and named <= {t for t, _ in sent.values()}
        dropped = [float(line.split()[-1]) for line in scrape.splitlines()
                   if line.startswith("streamfer_trace_spans_dropped_total")]
        assert dropped == [0.0, 0.0, 0.0]  # queue_full, export_failed, shutdown: the receiver took every export
    finally:
        worker.stop()
