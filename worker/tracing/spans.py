"""Tracing on: OpenTelemetry spans of each traced frame, made when the frame is answered, with the times the loop
recorded (read, batch start and end, answer), so nothing is done per frame while it waits or runs.

Per traced frame (OpenTelemetry messaging conventions, Kafka):
- `process <topic>` (CONSUMER), from the frame being read to its answer, a child of the frame's own `traceparent`
  (or a new trace's root); linked to its batch's span;
- `queued` (INTERNAL), its child: from being read to its batch starting to run;
- `send <results topic>` (PRODUCER), its child: from the answer to the result being handed to the producer; its
  context is the result's `traceparent`, which a downstream consumer continues.
Per batch with a traced frame: `batch <model>` (INTERNAL, a root of its own, with `preprocess` and `inference`
children), whose attributes name the batch size, padded bucket, shape, model, engine and device.

Sampling is decided here, once per frame, parent-based: a frame whose `traceparent` is sampled is traced, one whose
`traceparent` is not sampled is not (its result still carries its context unchanged), any other is traced with
probability `tracing.sample_ratio`. A frame not traced costs a scan of its headers and one random draw."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import Link, Span, SpanKind, get_current_span, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from worker.frames import BatchOutcome, Frame, Headers, Output, SourceRef
from worker.tracing.context import TRACE_HEADERS, TRACEPARENT, FrameTraces, Tracing, trace_context_of, traces_url
from worker.tracing.export import DroppingSpanProcessor, quiet_exporter_logs

if TYPE_CHECKING:
    from worker.batching import Batch
    from worker.config import Settings
    from worker.metrics import Metrics

log = logging.getLogger(__name__)

INSTRUMENTATION = "streamfer.worker"
# Produce spans waiting for their result to be handed to the producer; beyond this many (outputs dropped by a
# rewind or a revocation never are), the oldest end where they are.
MAX_SENDING = 10_000
_PROPAGATOR = TraceContextTextMapPropagator()


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _carrier(headers: Headers) -> dict[str, str]:
    return {name: value.decode("latin-1") for name, value in headers if name in TRACE_HEADERS and value is not None}


class OtelTracing(Tracing):
    """Spans of traced frames and their batches, exported by a DroppingSpanProcessor (never blocks the loop)."""

    enabled = True

    def __init__(self, settings: Settings, metrics: Metrics | None, exporter: SpanExporter | None,
                 sample: Callable[[], float]) -> None:
        t = settings.tracing
        self._ratio = t.sample_ratio
        self._sample = sample
        self._group = settings.kafka.group_id
        self._results_topic = settings.topics.results
        resource = Resource.create({"service.name": t.service_name, "service.instance.id":
                                    settings.observability.worker_id or "", **t.resource_attributes})
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=traces_url(t.endpoint), timeout=t.export_timeout_ms / 1000.0)
            quiet_exporter_logs()
        dropped = metrics.trace_spans_dropped if metrics is not None else None
        self._processor = DroppingSpanProcessor(
            exporter, t.max_queued_spans,
            on_dropped=(lambda reason, n: dropped.labels(reason).inc(n)) if dropped is not None else None)
        # Every span started here is of a frame already decided to be traced (or of its batch): sample them all.
        self._provider = TracerProvider(sampler=ALWAYS_ON, resource=resource, shutdown_on_exit=False)
        self._provider.add_span_processor(self._processor)
        self._tracer = self._provider.get_tracer(INSTRUMENTATION)
        self._runtime: dict[str, str] = {}
        self._sending: dict[SourceRef, Span] = {}

    def describe_runtime(self, model: str, version: str, device: str) -> None:
        self._runtime = {"streamfer.model.name": model, "streamfer.model.version": version,
                         "streamfer.device": device}

    # -- sampling ------------------------------------------------------------------------------------------
    def _decide(self, frame: Frame) -> Context | Headers:
        """The frame's parent context when it is traced (an empty Context: a new trace), or, when it is not, the
        trace context headers its result passes on unchanged (empty without any)."""
        headers = frame.headers
        if headers and any(name == TRACEPARENT for name, _ in headers):
            context = _PROPAGATOR.extract(_carrier(headers))
            parent = get_current_span(context).get_span_context()
            if parent.is_valid:
                return context if parent.trace_flags.sampled else trace_context_of(headers)
        return Context() if self._ratio > 0.0 and self._sample() < self._ratio else ()

    # -- the hooks -----------------------------------------------------------------------------------------
    def answer_batch(self, batch: Batch, outcome: BatchOutcome, now: float) -> FrameTraces | None:
        decisions = [self._decide(frame) for frame, _ in outcome.verdicts]
        if not any(isinstance(d, Context) or d for d in decisions):
            return None
        link: Link | None = None
        if any(isinstance(d, Context) for d in decisions):
            link = Link(self._batch_span(batch, outcome).get_span_context(), {"streamfer.link": "batch"})
        ids: list[str | None] = []
        headers: list[Headers] = []
        for (frame, _), decision in zip(outcome.verdicts, decisions, strict=True):
            if isinstance(decision, Context):
                trace_id, sent = self._frame_spans(frame, decision, "OK", outcome.started_at, now, link)
                ids.append(trace_id)
                headers.append(sent)
            else:
                ids.append(None)
                headers.append(decision)
        return FrameTraces(ids, headers)

    def answer_expired(self, frames: Sequence[Frame], now: float) -> FrameTraces | None:
        decisions = [self._decide(frame) for frame in frames]
        if not any(isinstance(d, Context) or d for d in decisions):
            return None
        ids: list[str | None] = []
        headers: list[Headers] = []
        for frame, decision in zip(frames, decisions, strict=True):
            if isinstance(decision, Context):
                _, sent = self._frame_spans(frame, decision, "EXPIRED", now, now, None)
                headers.append(sent)
            else:
                headers.append(decision)
            ids.append(None)  # no latency histogram observes an expired frame
        return FrameTraces(ids, headers)

    def handed_over(self, outputs: Sequence[Output]) -> None:
        if not self._sending:
            return
        for out in outputs:
            span = self._sending.pop(out.source, None)
            if span is not None:
                span.end()

    def flush(self, timeout_s: float = 5.0) -> bool:
        return self._processor.force_flush(int(timeout_s * 1000))

    def shutdown(self, timeout_s: float = 5.0) -> None:
        for span in self._sending.values():
            span.end()
        self._sending.clear()
        self._processor.shutdown(timeout_s)

    # -- spans ---------------------------------------------------------------------------------------------
    def _batch_span(self, batch: Batch, outcome: BatchOutcome) -> Span:
        start = outcome.started_at
        pre_end = start + outcome.preprocess_ms / 1000.0
        end = pre_end + outcome.inference_ms / 1000.0
        model = self._runtime.get("streamfer.model.name", "model")
        attributes = {
            **self._runtime,
            "messaging.batch.message_count": batch.size,
            "streamfer.batch.size": outcome.batch_size,
            "streamfer.batch.bucket": outcome.bucket,
            "streamfer.batch.shape": "x".join(str(n) for n in batch.shape),
            "streamfer.batch.priority": batch.priority.label,
            "streamfer.batch.lane": str(batch.lane),
            "streamfer.batch.reason": str(batch.reason),
            "streamfer.batch.padding_waste": float(batch.padding_waste),
            "streamfer.engine": "cuda_graph" if outcome.used_graph else "eager",
            "streamfer.preprocess_ms": outcome.preprocess_ms,
            "streamfer.inference_ms": outcome.inference_ms,
        }
        span = self._tracer.start_span(f"batch {model}", context=Context(), kind=SpanKind.INTERNAL,
                                       attributes=attributes, start_time=_ns(start))
        inside = set_span_in_context(span)
        self._tracer.start_span("preprocess", context=inside, start_time=_ns(start)).end(end_time=_ns(pre_end))
        self._tracer.start_span("inference", context=inside, start_time=_ns(pre_end)).end(end_time=_ns(end))
        span.end(end_time=_ns(end))
        return span

    def _frame_spans(self, frame: Frame, parent: Context, status: str, queued_until: float, now: float,
                     link: Link | None) -> tuple[str, Headers]:
        """The frame's process span and its queued and produce children; returns its trace id (hex) and the
        result's headers (the produce span's context)."""
        source = frame.source
        process = self._tracer.start_span(
            f"process {source.topic}", context=parent, kind=SpanKind.CONSUMER, links=[link] if link else None,
            start_time=_ns(frame.received_at), attributes={
                "messaging.system": "kafka",
                "messaging.operation.type": "process",
                "messaging.operation.name": "process",
                "messaging.destination.name": source.topic,
                "messaging.destination.partition.id": str(source.partition),
                "messaging.kafka.offset": source.offset,
                "messaging.kafka.message.key": frame.stream_id,
                "messaging.consumer.group.name": self._group,
                "streamfer.frame.id": frame.frame_id,
                "streamfer.tenant": frame.tenant,
                "streamfer.priority": frame.priority.label,
                "streamfer.status": status,
            })
        inside = set_span_in_context(process)
        self._tracer.start_span("queued", context=inside, start_time=_ns(frame.received_at),
                                attributes={"streamfer.priority": frame.priority.label}
                                ).end(end_time=_ns(max(frame.received_at, queued_until)))
        send = self._tracer.start_span(
            f"send {self._results_topic}", context=inside, kind=SpanKind.PRODUCER, start_time=_ns(now), attributes={
                "messaging.system": "kafka",
                "messaging.operation.type": "send",
                "messaging.operation.name": "send",
                "messaging.destination.name": self._results_topic,
                "messaging.kafka.message.key": frame.stream_id,
                "streamfer.status": status,
            })
        process.end(end_time=_ns(now))
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, set_span_in_context(send))
        self._remember_sending(source, send)
        trace_id = format(process.get_span_context().trace_id, "032x")
        return trace_id, tuple((name, value.encode("latin-1")) for name, value in carrier.items())

    def _remember_sending(self, source: SourceRef, span: Span) -> None:
        if len(self._sending) >= MAX_SENDING:
            oldest = next(iter(self._sending))
            self._sending.pop(oldest).end()
        previous = self._sending.pop(source, None)
        if previous is not None:
            previous.end()
        self._sending[source] = span
