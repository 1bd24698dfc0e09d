"""Finished spans to an exporter on a thread of its own, through a bounded queue that drops (and counts) what does
not fit: a collector that is slow or gone costs spans, never the loop's time. OpenTelemetry's BatchSpanProcessor
drops too, but logs a warning per dropped span and counts drops only into OpenTelemetry's own metrics."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from worker.threadnames import name_os_thread

log = logging.getLogger(__name__)

EXPORT_INTERVAL_S = 1.0
MAX_EXPORT_BATCH = 512
# One warning per this many seconds while exports fail (each export's own error is the exporter's to log).
WARN_EVERY_S = 60.0

# reason, spans
DropCounter = Callable[[str, int], None]
# The OTLP exporter's logger, which logs every failed export (one a second while the collector is away).
OTLP_LOGGER = "opentelemetry.exporter.otlp.proto.http.trace_exporter"


class OncePer(logging.Filter):
    """Lets one record through per `interval_s`: the first says why exports fail, the counter says how many."""

    def __init__(self, interval_s: float = WARN_EVERY_S) -> None:
        super().__init__()
        self._interval_s = interval_s
        self._last = float("-inf")

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        if now - self._last < self._interval_s:
            return False
        self._last = now
        return True


def quiet_exporter_logs() -> None:
    """The OTLP exporter's failures logged once a minute (once per process, however many tracings start)."""
    logger = logging.getLogger(OTLP_LOGGER)
    if not any(isinstance(f, OncePer) for f in logger.filters):
        logger.addFilter(OncePer())


class DroppingSpanProcessor(SpanProcessor):
    """Queues finished spans (at most `max_queued`; beyond, a span is dropped as "queue_full") and exports them
    in batches every EXPORT_INTERVAL_S, or as soon as a batch is full; a failed export's spans are dropped as
    "export_failed". `on_dropped(reason, n)` counts them."""

    def __init__(self, exporter: SpanExporter, max_queued: int, on_dropped: DropCounter | None = None,
                 interval_s: float = EXPORT_INTERVAL_S) -> None:
        self._exporter = exporter
        self._max_queued = max_queued
        self._on_dropped = on_dropped or (lambda _reason, _n: None)
        self._interval_s = interval_s
        self._queue: collections.deque[ReadableSpan] = collections.deque()
        self._wake = threading.Event()
        self._export_lock = threading.Lock()
        self._stopping = False
        self._last_warning = float("-inf")
        self._thread = threading.Thread(target=self._run, name="trace-export", daemon=True)
        self._thread.start()

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        return

    def on_end(self, span: ReadableSpan) -> None:
        if self._stopping:
            self._on_dropped("shutdown", 1)
            return
        if len(self._queue) >= self._max_queued:
            self._on_dropped("queue_full", 1)
            return
        self._queue.append(span)  # deque.append is atomic: the loop thread never waits for the export thread
        if len(self._queue) >= MAX_EXPORT_BATCH:
            self._wake.set()

    def _run(self) -> None:
        name_os_thread()
        while not self._stopping:
            self._wake.wait(self._interval_s)
            self._wake.clear()
            self._export_queued()

    def _export_queued(self, deadline: float | None = None) -> bool:
        """Export what is queued, a batch at a time; False if `deadline` (monotonic) came first, also while another
        export (the thread's, to a collector that hangs) holds the exporter."""
        if not self._export_lock.acquire(timeout=-1 if deadline is None else max(0.0, deadline - time.monotonic())):
            return False
        try:
            while self._queue:
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                batch = [self._queue.popleft() for _ in range(min(MAX_EXPORT_BATCH, len(self._queue)))]
                try:
                    result = self._exporter.export(batch)
                except Exception as exc:  # noqa: BLE001 (an exporter's bug must not end the export thread)
                    log.debug("span export raised %s: %s", type(exc).__name__, exc)
                    result = SpanExportResult.FAILURE
                if result is not SpanExportResult.SUCCESS:
                    self._on_dropped("export_failed", len(batch))
                    self._warn(len(batch))
            return True
        finally:
            self._export_lock.release()

    def _warn(self, n: int) -> None:
        now = time.monotonic()
        if now - self._last_warning >= WARN_EVERY_S:
            self._last_warning = now
            log.warning("trace export failed: %d spans dropped (counted in streamfer_trace_spans_dropped_total; "
                        "is the collector at tracing.endpoint up?)", n)

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self._export_queued(time.monotonic() + timeout_millis / 1000.0)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Export what is queued, for at most `timeout_s`, then stop; spans that end afterwards are dropped."""
        if self._stopping:
            return
        self._stopping = True
        self._wake.set()
        deadline = time.monotonic() + timeout_s
        self._thread.join(timeout_s)
        self._export_queued(deadline)
        dropped = len(self._queue)
        if dropped:
            self._queue.clear()
            self._on_dropped("shutdown", dropped)
        self._exporter.shutdown()
