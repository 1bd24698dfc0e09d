"""A real trace backend for tests, benchmarks and a look by hand: Jaeger v2 all-in-one (v1.75.0 of its Go module),
built from the Go module proxy by deploy/jaeger/build.sh into ~/.cache/streamfer/jaeger, run with
deploy/jaeger/config.yaml: OTLP/HTTP in, traces in memory, the query API and UI out, every port on loopback.

Run it by hand with `python -m worker.tools.jaeger` (prints its URLs, stops on Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from worker.tools.local_broker import free_port, serve_until_stopped

JAEGER_VERSION = "v1.75.0"
ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "deploy" / "jaeger" / "config.yaml"
BUILD = ROOT / "deploy" / "jaeger" / "build.sh"
DEFAULT_BINARY = Path(os.environ.get("STREAMFER_JAEGER_CACHE", Path.home() / ".cache" / "streamfer" / "jaeger")) \
    / f"jaeger-{JAEGER_VERSION}"
# Where a built jaeger-ui may be put for the UI the Go module's binary lacks (its assets come from jaeger-ui's own
# npm project, which this project does not build): STREAMFER_JAEGER_UI, else here.
DEFAULT_UI = Path(os.environ.get("STREAMFER_JAEGER_CACHE", Path.home() / ".cache" / "streamfer" / "jaeger")) \
    / f"ui-{JAEGER_VERSION}"
START_TIMEOUT_S = 60.0


def jaeger_binary() -> Path | None:
    """The binary `STREAMFER_JAEGER` names, else the one deploy/jaeger/build.sh leaves in its cache; None if absent."""
    named = os.environ.get("STREAMFER_JAEGER")
    path = Path(named) if named else DEFAULT_BINARY
    return path if path.is_file() and os.access(path, os.X_OK) else None


def ui_assets() -> Path | None:
    """A built jaeger-ui (its `build/` folder, with index.html) for Jaeger's UI, or None: `STREAMFER_JAEGER_UI`, else
    DEFAULT_UI. Only the docs' trace picture needs it; the tests read traces from the query API."""
    named = os.environ.get("STREAMFER_JAEGER_UI")
    path = Path(named) if named else DEFAULT_UI
    return path if (path / "index.html").is_file() else None


@dataclass(frozen=True)
class Span:
    """One span as Jaeger's query API (v3, OTLP JSON) returns it; ids in hex."""

    service: str
    name: str
    kind: int  # OTLP: 1 internal, 2 server, 3 client, 4 producer, 5 consumer
    trace_id: str
    span_id: str
    parent_span_id: str
    links: tuple[tuple[str, str], ...]  # (trace id, span id)
    attributes: dict[str, Any]
    start_ns: int
    end_ns: int


def _value(v: dict[str, Any]) -> Any:
    for key in ("stringValue", "boolValue", "doubleValue"):
        if key in v:
            return v[key]
    if "intValue" in v:
        return int(v["intValue"])
    return v


def _attributes(items: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {a["key"]: _value(a["value"]) for a in items or []}


@dataclass(frozen=True)
class Jaeger:
    """A running Jaeger: `otlp_endpoint` for [tracing] endpoint, `query_url` for its API and UI."""

    otlp_endpoint: str
    query_url: str

    def trace(self, trace_id: str) -> list[Span]:
        """The spans Jaeger holds of a trace (empty while it has none)."""
        try:
            with urllib.request.urlopen(f"{self.query_url}/api/v3/traces/{trace_id}", timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return []
            raise
        spans = []
        for resource_spans in body.get("result", {}).get("resourceSpans", []):
            service = _attributes(resource_spans.get("resource", {}).get("attributes")).get("service.name", "")
            for scope in resource_spans.get("scopeSpans", []):
                for s in scope.get("spans", []):
                    spans.append(Span(
                        service=service, name=s["name"], kind=int(s.get("kind", 0)), trace_id=s["traceId"],
                        span_id=s["spanId"], parent_span_id=s.get("parentSpanId", ""),
                        links=tuple((link["traceId"], link["spanId"]) for link in s.get("links", [])),
                        attributes=_attributes(s.get("attributes")), start_ns=int(s["startTimeUnixNano"]),
                        end_ns=int(s["endTimeUnixNano"])))
        return spans

    def services(self) -> list[str]:
        with urllib.request.urlopen(f"{self.query_url}/api/services", timeout=10) as response:
            return list(json.load(response).get("data") or [])


@contextmanager
def run_jaeger(binary: Path, log: IO[bytes] | None = None) -> Iterator[Jaeger]:
    """Jaeger on free loopback ports until the block ends; raises RuntimeError if it does not answer in time."""
    ports = {name: str(free_port()) for name in ("JAEGER_OTLP_HTTP_PORT", "JAEGER_QUERY_PORT",
                                                 "JAEGER_QUERY_GRPC_PORT", "JAEGER_METRICS_PORT")}
    ui = ui_assets()
    env = {**os.environ, **ports, "JAEGER_UI_ASSETS": str(ui) if ui else ""}
    process = subprocess.Popen([str(binary), "--config", str(CONFIG)], env=env,
                               stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT, cwd=str(CONFIG.parent))
    jaeger = Jaeger(f"http://127.0.0.1:{ports['JAEGER_OTLP_HTTP_PORT']}",
                    f"http://127.0.0.1:{ports['JAEGER_QUERY_PORT']}")
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"jaeger exited with {process.returncode} at start (config {CONFIG})")
            try:
                jaeger.services()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"jaeger did not answer on {jaeger.query_url} in {START_TIMEOUT_S:.0f}s") \
                        from None
                time.sleep(0.2)
        yield jaeger
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def main() -> int:
    argparse.ArgumentParser(description=__doc__).parse_args()
    binary = jaeger_binary()
    if binary is None:
        print(f"no Jaeger binary: run {BUILD} (or set STREAMFER_JAEGER)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with run_jaeger(binary) as jaeger:
        print(json.dumps({"otlp_endpoint": jaeger.otlp_endpoint, "ui": jaeger.query_url}), flush=True)
        serve_until_stopped()
    return 0


if __name__ == "__main__":
    sys.exit(main())
