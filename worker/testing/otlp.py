"""An OTLP/HTTP trace collector on the loopback address, for tests and benchmarks of `[tracing]`: the body of each
export request is handed to a callback and answered 200 with an empty ExportTraceServiceResponse."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class OtlpReceiver:
    """Serves on a free loopback port from a thread of its own until `stop()` (or the end of a `with`); `endpoint`
    is what `tracing.endpoint` takes. `take` is called from the server's threads, one per request."""

    def __init__(self, take: Callable[[bytes], None]) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                take(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> OtlpReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
