"""Small real servers for the live-camera tests, run in the test process: an MJPEG-over-HTTP camera
(multipart/x-mixed-replace, as IP cameras serve it), a camera that accepts connections and never sends, and
one that sends garbage. Each listens on a free loopback port and stops with `close()`."""

from __future__ import annotations

import io
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
from PIL import Image

BOUNDARY = "streamferframe"


def jpeg(index: int, size: tuple[int, int] = (160, 120)) -> bytes:
    """A JPEG whose colour changes with `index`."""
    w, h = size
    pixels = np.full((h, w, 3), (index * 37) % 256, np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=80)
    return buf.getvalue()


class MjpegCamera:
    """Serves `/video` as an endless multipart/x-mixed-replace stream of JPEGs at `fps` to each connection."""

    def __init__(self, fps: float = 10.0) -> None:
        self.fps = fps
        self.connections = 0
        self._frozen_upto = 0
        self._stop = threading.Event()
        camera = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                camera.connections += 1
                me = camera.connections
                self.send_response(200)
                self.send_header("Content-Type", f"multipart/x-mixed-replace; boundary={BOUNDARY}")
                self.end_headers()
                next_at = time.monotonic()
                index = 0
                try:
                    while not camera._stop.is_set():
                        if me <= camera._frozen_upto:  # frozen: the connection stays open, silent
                            camera._stop.wait(0.05)
                            continue
                        body = jpeg(index)
                        self.wfile.write(f"--{BOUNDARY}\r\nContent-Type: image/jpeg\r\n"
                                         f"Content-Length: {len(body)}\r\n\r\n".encode() + body + b"\r\n")
                        self.wfile.flush()
                        index += 1
                        next_at += 1.0 / camera.fps
                        camera._stop.wait(max(0.0, next_at - time.monotonic()))
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/video"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def freeze(self) -> None:
        """The connections open now stop sending (and stay open); later ones are served as usual."""
        self._frozen_upto = self.connections

    def close(self) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()


class RawTcpCamera:
    """Accepts connections on a loopback port; `garbage=False` never sends a byte (a stalled camera),
    `garbage=True` answers every connection with random bytes until it is closed."""

    def __init__(self, garbage: bool) -> None:
        self.garbage = garbage
        self.connections = 0
        self._stop = threading.Event()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        self._held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            self._held.append(conn)
            if self.garbage:
                threading.Thread(target=self._spew, args=(conn,), daemon=True).start()

    def _spew(self, conn: socket.socket) -> None:
        try:
            while not self._stop.is_set():
                conn.sendall(os.urandom(4096))
                self._stop.wait(0.01)
        except OSError:
            pass

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        for conn in self._held:
            conn.close()
