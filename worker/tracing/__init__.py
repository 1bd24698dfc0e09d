"""A frame's path as an OpenTelemetry trace: W3C trace context read from a frame's Kafka headers and written into
its result's, spans for the frame (process, queued, produce) linked to its batch's span, and the trace ids the
latency histograms carry as exemplars.

Off (`tracing.endpoint` empty) the loop holds `TRACING_OFF`, whose hooks return at once: nothing is done per
frame, OpenTelemetry is not imported, and results carry no headers. On, `setup_tracing` returns the OpenTelemetry
implementation (worker/tracing/spans.py). The loop's hooks are three: `Answers` asks for a finished batch's (or
expired frames') traces, and the pipeline tells which outputs it handed to the producer."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING

from worker.tracing.context import (
    TRACE_HEADERS,
    TRACEPARENT,
    TRACESTATE,
    TRACING_OFF,
    FrameTraces,
    Tracing,
    trace_context_of,
    traces_url,
)

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from worker.config import Settings
    from worker.metrics import Metrics

__all__ = ["TRACEPARENT", "TRACESTATE", "TRACE_HEADERS", "TRACING_OFF", "FrameTraces", "Tracing", "setup_tracing",
           "trace_context_of", "traces_url"]


def setup_tracing(settings: Settings, metrics: Metrics | None = None, exporter: SpanExporter | None = None,
                  sample: Callable[[], float] = random.random) -> Tracing:
    """The tracing the settings ask for: TRACING_OFF with `tracing.endpoint` empty (unless an `exporter` is given,
    as tests give OpenTelemetry's InMemorySpanExporter), else spans exported over OTLP/HTTP to the endpoint, their
    drops counted in `metrics`. `sample()` draws the root sampling decision (a frame without a trace context)."""
    if not settings.tracing.endpoint and exporter is None:
        return TRACING_OFF
    from worker.tracing.spans import OtelTracing

    return OtelTracing(settings, metrics, exporter, sample)
