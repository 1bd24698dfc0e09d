"""`worker produce --traceparent`: each frame sent in a `send <topic>` PRODUCER span of its own trace, whose context
the frame's `traceparent` header carries, so the worker continues the trace (worker/tracing/spans.py). The spans
are exported to `tracing.endpoint` when it is set; without one the headers still carry valid, sampled contexts."""

from __future__ import annotations

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from worker.codec.schemas import FrameRecord
from worker.config import Settings
from worker.frames import Headers
from worker.tracing.context import traces_url
from worker.tracing.export import DroppingSpanProcessor

_PROPAGATOR = TraceContextTextMapPropagator()


class FrameSendTracing:
    """Makes each frame's headers (`headers(frame, topic)`, for worker.tools.publish_frames.send_frames); call
    `shutdown()` after the last frame to export the spans still queued."""

    def __init__(self, settings: Settings, exporter: SpanExporter | None = None) -> None:
        t = settings.tracing
        self._provider = TracerProvider(resource=Resource.create({"service.name": "streamfer-produce",
                                                                  **t.resource_attributes}), shutdown_on_exit=False)
        if exporter is not None:
            self._provider.add_span_processor(SimpleSpanProcessor(exporter))
        elif t.endpoint:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            otlp = OTLPSpanExporter(endpoint=traces_url(t.endpoint), timeout=t.export_timeout_ms / 1000.0)
            self._provider.add_span_processor(DroppingSpanProcessor(otlp, t.max_queued_spans))
        self._tracer = self._provider.get_tracer("streamfer.produce")

    def headers(self, frame: FrameRecord, topic: str) -> Headers:
        span = self._tracer.start_span(f"send {topic}", context=Context(), kind=SpanKind.PRODUCER, attributes={
            "messaging.system": "kafka", "messaging.operation.type": "send", "messaging.operation.name": "send",
            "messaging.destination.name": topic, "messaging.kafka.message.key": frame.stream_id,
            "streamfer.frame.id": f"{frame.stream_id}/{frame.frame_index}"})
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, set_span_in_context(span))
        span.end()
        return tuple((name, value.encode("latin-1")) for name, value in carrier.items())

    def shutdown(self) -> None:
        self._provider.shutdown()
