"""The trace picture of docs/troubleshooting.md (docs/images/trace.png), made for real: a frame sent with a
traceparent while no worker reads its topic, a worker that starts afterwards (a restart, a rollout), its result
read by a downstream consumer that continues the trace; the trace as Jaeger's UI shows it, by headless Chromium.

    KAFKA_BOOTSTRAP_SERVERS=... python deploy/jaeger/screenshot.py [--out docs/images/trace.png]

Needs the Jaeger binary (deploy/jaeger/build.sh) and Debian's `chromium`. Prints the trace id and the exemplar line
of /metrics that names it."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from confluent_kafka import Consumer
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from worker.config import Settings, TracingSettings
from worker.frames import Encoding, Priority
from worker.testing import make_topics, run_worker, wait_for
from worker.tools.jaeger import jaeger_binary, run_jaeger
from worker.tools.publish_frames import publish, synthetic_frames
from worker.tracing.producer import FrameSendTracing

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--virtual-time-budget=15000"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images" / "trace.png")
    parser.add_argument("--size", default="1800,470", help="the window, WIDTH,HEIGHT")
    args = parser.parse_args()
    bootstrap = os.environ["KAFKA_BOOTSTRAP_SERVERS"]
    binary = jaeger_binary()
    if binary is None:
        print("no Jaeger binary: run deploy/jaeger/build.sh", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="trace-shot-"))
    with open(work / "jaeger.log", "wb") as log, run_jaeger(binary, log) as jaeger:
        topics = make_topics(bootstrap, f"shot{time.monotonic_ns() % 10**8}")
        sending = FrameSendTracing(Settings(tracing=TracingSettings(endpoint=jaeger.otlp_endpoint)))
        sent: list[str] = []

        def headers(rec, topic):  # type: ignore[no-untyped-def]
            made = sending.headers(rec, topic)
            sent.append(dict(made)["traceparent"].decode().split("-")[1])
            return made

        frames = list(synthetic_frames(8, [(224, 224)], Encoding.JPEG, Priority.REALTIME, "cam", ["acme"]))
        publish(bootstrap, topics.realtime, frames, headers=headers)
        sending.shutdown()
        # The frames wait in Kafka while the worker starts.
        worker = run_worker(bootstrap, topics, work, settings={
            "tracing": {"endpoint": jaeger.otlp_endpoint, "sample_ratio": 0.0},
            "batching": {"realtime": {"max_wait_ms": 20}}})
        try:
            trace_id = sent[-1]
            continue_downstream(bootstrap, topics.results, jaeger.otlp_endpoint, len(frames))
            wait_for(lambda: {"streamfer-produce", "streamfer-worker", "moderation-consumer"}
                     <= {s.service for s in jaeger.trace(trace_id)}, 60, "the whole trace in Jaeger")
            request = urllib.request.Request(f"http://127.0.0.1:{worker.port}/metrics",
                                             headers={"Accept": "application/openmetrics-text; version=1.0.0"})
            with urllib.request.urlopen(request, timeout=10) as response:
                scrape = response.read().decode()
            print(f"trace {trace_id}")
            for line in scrape.splitlines():
                if line.startswith("streamfer_end_to_end_seconds_bucket") and re.search(r"# \{trace_id=", line):
                    print(line)
        finally:
            worker.stop()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        profile = work / "chromium-profile"
        profile.mkdir()
        subprocess.run(["chromium", *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--screenshot={args.out}",
                        f"--window-size={args.size}", f"{jaeger.query_url}/trace/{trace_id}"],
                       check=True, timeout=120, capture_output=True)
    print(f"wrote {args.out}")
    return 0


def continue_downstream(bootstrap: str, topic: str, otlp: str, count: int) -> None:
    """A downstream service's consumer: each result's trace continued in a `process` span of its own."""
    provider = TracerProvider(resource=Resource.create({"service.name": "moderation-consumer"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{otlp}/v1/traces")))
    tracer = provider.get_tracer("moderation-consumer")
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"downstream-{time.monotonic_ns()}",
                         "auto.offset.reset": "earliest", "isolation.level": "read_committed"})
    consumer.subscribe([topic])
    seen, deadline = 0, time.monotonic() + 120
    try:
        while seen < count and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None or msg.error():
                continue
            carrier = {k: (v or b"").decode() for k, v in (msg.headers() or [])}
            context = TraceContextTextMapPropagator().extract(carrier, context=Context())
            tracer.start_span(f"process {topic}", context=context, kind=SpanKind.CONSUMER,
                              attributes={"messaging.system": "kafka", "messaging.operation.type": "process",
                                          "messaging.destination.name": topic}).end()
            seen += 1
    finally:
        consumer.close()
        provider.shutdown()


if __name__ == "__main__":
    sys.exit(main())
