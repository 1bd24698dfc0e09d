"""Live cameras against real servers: GStreamer's RTSP server (a subprocess of the system Python, see
tests/servers/rtsp_server.py), an MJPEG-over-HTTP camera, a camera that never sends and one that sends garbage.

Three RTSP cameras go through `worker produce` to the real broker while one is stopped and restarted; the others
are read straight from `LiveCameras` (the sender is the test: a fake sink), where the test is about the reader.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka import Consumer

from worker.codec.schemas import FrameRecord, read_frame_record
from worker.frames import Encoding, Priority
from worker.tools.cameras import Backoff, FrameFormat, LiveCameras, LivePolicy, pyav_opener

from ..conftest import PROJECT_ROOT
from ..servers.mjpeg import MjpegCamera, RawTcpCamera
from .helpers import make_topics, wait_for

pytestmark = pytest.mark.integration
SYSTEM_PYTHON = "/usr/bin/python3"
RTSP_SERVER = PROJECT_ROOT / "tests" / "servers" / "rtsp_server.py"
FPS = 10
INTERVAL_S = 1.0 / FPS
# Scheduling jitter on a shared two-core machine, on top of one frame interval of delay.
JITTER_S = 0.05
FMT = FrameFormat(Priority.REALTIME, "tenant", Encoding.JPEG)
FAST = LivePolicy(open_timeout_s=1.5, read_timeout_s=1.0, backoff=Backoff(initial_s=0.2, max_s=1.0), max_queued=4)


@functools.cache
def _rtsp_server_missing() -> str | None:
    try:
        out = subprocess.run([SYSTEM_PYTHON, "-c", "import gi; gi.require_version('GstRtspServer', '1.0'); "
                              "from gi.repository import GstRtspServer"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{SYSTEM_PYTHON} cannot run: {exc}"
    if out.returncode:
        return ("no GStreamer RTSP server for the system Python: apt-get install python3-gi "
                "gir1.2-gst-rtsp-server-1.0 gstreamer1.0-plugins-base gstreamer1.0-plugins-good")
    return None


@pytest.fixture
def rtsp_server() -> None:
    """Skips, saying what to install, where the system Python has no GStreamer RTSP server."""
    missing = _rtsp_server_missing()
    if missing:
        pytest.skip(missing)


needs_av = pytest.mark.skipif(importlib.util.find_spec("av") is None,
                              reason="needs PyAV: pip install -e '.[models]' or ./dev setup")


class RtspCamera:
    """One camera: a gst-rtsp-server process serving /cam; `stop()` kills it, `start()` brings it back on the
    same port."""

    def __init__(self, port: int = 0) -> None:
        self.port = port
        self.proc: subprocess.Popen[str] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"rtsp://127.0.0.1:{self.port}/cam"

    def start(self) -> None:
        self.proc = subprocess.Popen([SYSTEM_PYTHON, str(RTSP_SERVER), "--port", str(self.port), "--fps", str(FPS),
                                      "cam"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # the server prints "ready PORT" once it listens, or exits
        assert line.startswith("ready "), f"RTSP server did not start (exit {self.proc.poll()})"
        self.port = int(line.split()[1])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class Ledger:
    """Frames of the topic as a consumer reads them: stream -> [(frame_index, capture_s)]."""

    def __init__(self, bootstrap: str, topic: str, unique: str) -> None:
        self.frames: dict[str, list[tuple[int, float]]] = {}
        self._stop = threading.Event()
        self._consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"ledger{unique}",
                                   "auto.offset.reset": "earliest", "enable.auto.commit": False})
        self._consumer.subscribe([topic])
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            msg = self._consumer.poll(0.2)
            if msg is None or msg.error():
                continue
            rec = read_frame_record(msg.value())
            self.frames.setdefault(rec.stream_id, []).append((rec.frame_index, rec.capture_ts_ms / 1000.0))

    def count_after(self, stream: str, t: float) -> int:
        return sum(1 for _, c in self.frames.get(stream, []) if c > t)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._consumer.close()


def rate(captures: list[float], start: float, end: float) -> float:
    return sum(1 for c in captures if start <= c < end) / (end - start)


def max_gap(captures: list[float], start: float, end: float) -> float:
    window = sorted(c for c in captures if start <= c <= end)
    return max((b - a for a, b in zip(window, window[1:], strict=False)), default=float("inf"))


@needs_av
@pytest.mark.usefixtures("rtsp_server")
def test_three_cameras_one_restarted_the_others_keep_their_rate_and_it_resumes_its_stream(
        kafka_bootstrap: str, unique: str, tmp_path: Path) -> None:
    started = time.time()
    cams = [RtspCamera() for _ in range(3)]
    topics = make_topics(kafka_bootstrap, unique, partitions=1)
    ledger = Ledger(kafka_bootstrap, topics.realtime, unique)
    stderr = tmp_path / "produce.log"
    producer = subprocess.Popen(
        [sys.executable, "-m", "worker", "produce", "-b", kafka_bootstrap, "--topic", topics.realtime,
         "--run-id", unique, "--read-timeout", "1", "--open-timeout", "1.5", "--backoff-max", "1",
         "--summary-every", "0", *(a for c in cams for a in ("--from-video", c.url))],
        cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=stderr.open("w"), text=True, env=os.environ.copy())
    streams = [f"{unique}-v{i}-cam" for i in range(3)]
    try:
        wait_for(lambda: all(len(ledger.frames.get(s, [])) >= 1 for s in streams), 60, "frames from every camera")
        steady = time.time() + 1.0  # after the first connection's frames
        wait_for(lambda: all(ledger.count_after(s, steady) >= 3 * FPS for s in streams), 60, "3 s of every camera")
        fault = time.time()
        cams[1].stop()
        wait_for(lambda: "v1-cam disconnected" in stderr.read_text(), 30, "the stopped camera reported")
        wait_for(lambda: all(ledger.count_after(s, fault) >= 4 * FPS for s in (streams[0], streams[2])), 60,
                 "4 s of the other two during the fault")
        restart = time.time()
        cams[1].start()
        wait_for(lambda: ledger.count_after(streams[1], restart) >= 1, 60, "the restarted camera's frames")
        back = min(c for _, c in ledger.frames[streams[1]] if c > restart)
        wait_for(lambda: all(ledger.count_after(s, back) >= 3 * FPS for s in streams), 60, "3 s after it is back")
        end = time.time()
        producer.send_signal(signal.SIGTERM)
        out, _ = producer.communicate(timeout=60)
    finally:
        if producer.poll() is None:
            producer.kill()
        for cam in cams:
            cam.stop()
    assert producer.returncode == 0, stderr.read_text()[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    wait_for(lambda: sum(len(v) for v in ledger.frames.values()) >= summary["sent"], 30, "every sent frame read")
    ledger.close()
    assert summary["sent"] == summary["acknowledged"] == sum(len(v) for v in ledger.frames.values())

    log = stderr.read_text()
    for state in ("disconnected", "reconnecting", "connected"):
        assert f"camera {streams[1]} {state}" in log
    indices = [i for i, _ in ledger.frames[streams[1]]]
    assert indices == sorted(set(indices)), "frame indices keep increasing across the reconnect, unrepeated"
    assert summary["cameras"][streams[1]]["reconnects"] >= 1
    # Capture time is the wall-clock time the producer read the frame: within the test's run, never ahead.
    assert all(started <= c <= time.time() for s in streams for _, c in ledger.frames[s])

    rows = []
    for s in streams:
        caps = [c for _, c in ledger.frames[s]]
        rows.append((s.rsplit("-", 2)[-2], rate(caps, steady, fault), rate(caps, fault, restart),
                     rate(caps, back, end), max_gap(caps, fault, restart)))
    reconnect_s = back - restart
    outage_s = back - max(c for _, c in ledger.frames[streams[1]] if c < restart)
    print(f"\nframes sent per second, cameras at {FPS} fps (camera v1 stopped for {restart - fault:.1f} s)")
    print(f"{'camera':<8}{'before':>8}{'during':>8}{'after':>8}{'max gap during (ms)':>22}")
    for name, before, during, after, gap in rows:
        gap_ms = "-" if gap == float("inf") else f"{gap * 1000:.0f}"
        print(f"{name:<8}{before:>8.2f}{during:>8.2f}{after:>8.2f}{gap_ms:>22}")
    print(f"reconnect time (server back -> first frame): {reconnect_s:.2f} s; outage {outage_s:.2f} s")

    for name, before, during, after, gap in rows:
        if name == "v1":
            assert during == 0.0 and after >= FPS - 1
            continue
        # The other two: delayed by at most one frame interval while v1 was away, at their rate throughout.
        assert gap <= 2 * INTERVAL_S + JITTER_S, (name, gap)
        assert abs(during - before) <= 1.0 and during >= FPS - 1, (name, before, during)


def _drain(cameras: LiveCameras, until: Callable[[dict[str, list[float]]], bool], deadline_s: float,
           on_frame: Callable[[FrameRecord], None] = lambda rec: None) -> dict[str, list[float]]:
    """The test as the sender: pull frames until `until()` holds; capture times per stream."""
    seen: dict[str, list[float]] = {}
    deadline = time.monotonic() + deadline_s
    for rec in cameras.frames(idle_wait_s=0.05):
        seen.setdefault(rec.stream_id, []).append(rec.capture_ts_ms / 1000.0)
        on_frame(rec)
        if until(seen) or time.monotonic() > deadline:
            cameras.stop()
    return seen


@needs_av
@pytest.mark.usefixtures("rtsp_server")
def test_a_silent_camera_and_a_garbage_camera_delay_no_other_and_each_is_reported(
        caplog: pytest.LogCaptureFixture) -> None:
    good = RtspCamera()
    silent, garbage = RawTcpCamera(garbage=False), RawTcpCamera(garbage=True)
    cameras = LiveCameras([good.url, f"rtsp://127.0.0.1:{silent.port}/cam", f"http://127.0.0.1:{garbage.port}/x"],
                          ["good", "silent", "garbage"], pyav_opener(FAST), FAST, FMT)
    try:
        with caplog.at_level("INFO", logger="worker.cameras"):
            cameras.start()
            seen = _drain(cameras, lambda seen: len(seen.get("good", [])) >= 6 * FPS
                          and all(c.reconnects >= 2 for c in cameras.cameras[1:]), 60)
    finally:
        cameras.stop()
        good.stop()
        silent.close()
        garbage.close()
    summary = cameras.summary()
    steady = seen["good"][0] + 1.0  # past the frames read while FFmpeg probed the stream
    assert max_gap(seen["good"], steady, seen["good"][-1]) <= 2 * INTERVAL_S + JITTER_S
    assert set(seen) == {"good"}
    assert "open timeout" in summary["silent"]["last_error"] and silent.connections >= 2
    # Garbage fails however FFmpeg reads it (no format found, or one guessed and its packets refused).
    assert summary["garbage"]["last_error"] and summary["garbage"]["read"] == 0 and garbage.connections >= 2
    messages = [r.getMessage() for r in caplog.records]
    for name in ("silent", "garbage"):
        assert any(m.startswith(f"camera {name} disconnected") for m in messages)
        assert any(m.startswith(f"camera {name} reconnecting") for m in messages)


@needs_av
def test_an_mjpeg_http_camera_that_freezes_is_reported_stalled_and_resumes_its_stream(
        caplog: pytest.LogCaptureFixture) -> None:
    cam = MjpegCamera(fps=FPS)
    cameras = LiveCameras([cam.url], ["mjpeg"], pyav_opener(FAST), FAST, FMT)
    indices: list[int] = []

    def on_frame(rec: FrameRecord) -> None:
        indices.append(rec.frame_index)
        if len(indices) == 2 * FPS:
            cam.freeze()  # the open connection goes silent; a new one gets frames

    try:
        with caplog.at_level("INFO", logger="worker.cameras"):
            cameras.start()
            _drain(cameras, lambda seen: cameras.cameras[0].reconnects >= 1 and len(indices) >= 4 * FPS, 60,
                   on_frame)
    finally:
        cameras.stop()
        cam.close()
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("camera mjpeg stalled: no frame for 1 s") for m in messages), messages
    assert any(m.startswith("camera mjpeg disconnected: no data for 1 s (read timeout)") for m in messages), messages
    assert indices == sorted(set(indices)) and len(indices) >= 4 * FPS
    assert cam.connections >= 2


@needs_av
def test_a_sender_that_cannot_keep_up_holds_memory_bounded_sends_fresh_frames_and_counts_drops() -> None:
    cam = MjpegCamera(fps=50)
    policy = LivePolicy(open_timeout_s=2, read_timeout_s=2, max_queued=3)
    cameras = LiveCameras([cam.url], ["fast"], pyav_opener(policy), policy, FMT)
    stats = cameras.cameras[0]
    ages: list[float] = []
    longest = [0]

    def slow_send(rec: FrameRecord) -> None:  # a producer (or Kafka) at 5 frames a second, 10x slower than the camera
        ages.append(time.time() - rec.capture_ts_ms / 1000.0)
        longest[0] = max(longest[0], len(stats.queue))
        threading.Event().wait(0.2)

    try:
        cameras.start()
        _drain(cameras, lambda seen: stats.dropped >= 100 and len(ages) >= 15, 60, slow_send)
    finally:
        cameras.stop()
        cam.close()
    cameras.join(timeout_s=10)
    assert longest[0] <= policy.max_queued
    assert stats.read == stats.sent + stats.dropped + len(stats.queue)  # every frame read is sent or counted
    assert stats.dropped >= 100
    # What is sent is fresh: at most the queue's worth of send intervals old, however long it has run.
    assert max(ages[5:]) <= (policy.max_queued + 1) * 0.2 + 0.2, ages
