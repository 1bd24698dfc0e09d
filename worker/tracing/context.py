"""What the loop holds of tracing whether it is on or off: the W3C header names, a batch's frame traces, the
`Tracing` hooks (`TRACING_OFF` does nothing) and the header helpers; OpenTelemetry itself is in spans.py."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from worker.frames import BatchOutcome, Frame, Headers, Output

if TYPE_CHECKING:
    from worker.batching import Batch

# The W3C trace context headers (https://www.w3.org/TR/trace-context/), as Kafka header names.
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
TRACE_HEADERS = frozenset({TRACEPARENT, TRACESTATE})


@dataclass(frozen=True)
class FrameTraces:
    """What tracing made of some answered frames, in their order: each one's trace id (hex) where it was sampled
    (the exemplar the latency histograms carry), else None; and the headers its result is produced with."""

    trace_ids: Sequence[str | None]
    headers: Sequence[Headers]

    @property
    def first_trace_id(self) -> str | None:
        """A sampled frame's trace id, for a histogram observed once per batch (preprocess, inference)."""
        return next((t for t in self.trace_ids if t is not None), None)


class Tracing:
    """Tracing off: every hook returns at once (the loop holds one instance, TRACING_OFF)."""

    enabled = False

    def describe_runtime(self, model: str, version: str, device: str) -> None:
        """The model and device every batch span names (set once the runtime is known)."""

    def answer_batch(self, batch: Batch, outcome: BatchOutcome, now: float) -> FrameTraces | None:
        """Spans of a finished batch and of its scored frames (`outcome.verdicts`, in order); None when none of
        them is traced or carries a trace context."""
        return None

    def answer_expired(self, frames: Sequence[Frame], now: float) -> FrameTraces | None:
        """Spans of frames that expired before running; None when none of them is traced or carries a context."""
        return None

    def handed_over(self, outputs: Sequence[Output]) -> None:
        """The outputs were handed to the producer: their produce spans end."""

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Export what is queued now (tests, shutdown); False if it did not finish in time."""
        return True

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Export what is queued (for at most `timeout_s`) and stop the exporter."""


TRACING_OFF = Tracing()


def traces_url(endpoint: str) -> str:
    """Where OTLP/HTTP spans are posted: `<endpoint>/v1/traces`, or the endpoint itself when it names that path."""
    base = endpoint.rstrip("/")
    return base if base.endswith("/v1/traces") else base + "/v1/traces"


def trace_context_of(headers: Headers) -> Headers:
    """The W3C trace context headers among a message's (traceparent, then tracestate), as they came."""
    return tuple(h for h in headers if h[0] in TRACE_HEADERS)
