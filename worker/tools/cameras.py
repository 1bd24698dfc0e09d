"""Live cameras (RTSP, MJPEG or HLS over HTTP, anything FFmpeg opens as a live stream): each camera is read on a
thread of its own into a small drop-oldest queue, so a camera that stalls, errors or disconnects delays no other;
it reconnects with capped, jittered exponential backoff under the same `stream_id`, its frame indices keep
increasing, and each frame's capture time is the wall-clock time it was read (never the camera's own clock).

The policy (backoff, stall detection, the fresh queue, wall-clock sampling, capture times, camera states) is pure
and tested with a fake clock; `CameraReader` and `LiveCameras` are the threads around it, and `open_with_pyav`
the only part that touches FFmpeg. Files and `--backfill` do not come here: publish_frames.video_frames sends
every frame of those, in order.
"""

from __future__ import annotations

import collections
import enum
import functools
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np

from worker.codec.schemas import FrameRecord
from worker.frames import Encoding, Priority

log = logging.getLogger("worker.cameras")

# URL schemes read as live cameras; anything else (a path, file://) is a recording.
LIVE_SCHEMES = ("rtsp", "rtsps", "rtmp", "rtmps", "http", "https", "srt", "udp", "tcp")

# librdkafka's local queue for live frames: bounded (32 MiB, about a hundred 1080p JPEGs), so a broker that
# cannot keep up makes the cameras' queues drop their oldest frames instead of memory growing (librdkafka's
# default allows 1 GiB).
LIVE_QUEUE_MAX_KBYTES = 32768

# FFmpeg's options for a live camera (--source-option overrides them): RTSP over TCP, and 0.5 s of stream
# analysis instead of FFmpeg's default, which on an MJPEG RTSP camera made opening take 2.1 s (and sent the
# frames read meanwhile in one burst); 0.5 s opens it in 0.65 s.
LIVE_FFMPEG_OPTIONS = {"rtsp_transport": "tcp", "analyzeduration": "500000"}

T = TypeVar("T")


def is_live_source(source: str) -> bool:
    """A URL with a streaming scheme (rtsp://, http://, ...) is a live camera; a path is a recording."""
    scheme, sep, _ = source.partition("://")
    return bool(sep) and scheme.lower() in LIVE_SCHEMES


# -- policy ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Backoff:
    """Delay before reconnect attempt `failures` (0 after the first failure): initial_s * 2**failures, capped at
    max_s, less up to `jitter` of it at random so cameras that failed together do not reconnect together."""

    initial_s: float = 0.5
    max_s: float = 30.0
    jitter: float = 0.5

    def delay_s(self, failures: int, rand: Callable[[], float]) -> float:
        base = min(self.max_s, self.initial_s * 2.0 ** min(failures, 62))
        return base * (1.0 - self.jitter * rand())


@dataclass(frozen=True)
class LivePolicy:
    """How live cameras are read. `read_timeout_s`: no frame for this long is a stall (the connection is dropped
    and reopened); `open_timeout_s`: connecting (and the first packets) may take this long; `max_queued`: frames
    of one camera waiting to be sent, the oldest dropped beyond it; `give_up_after`: consecutive failed
    connections before a camera is given up (None: never)."""

    open_timeout_s: float = 10.0
    read_timeout_s: float = 5.0
    backoff: Backoff = Backoff()
    max_queued: int = 4
    give_up_after: int | None = None

    def __post_init__(self) -> None:
        from worker.tools.publish_frames import ProducerInputError

        if self.open_timeout_s <= 0 or self.read_timeout_s <= 0:
            raise ProducerInputError("--open-timeout and --read-timeout must be positive seconds")
        if self.max_queued < 1:
            raise ProducerInputError("--max-queued-frames must be at least 1")
        if self.give_up_after is not None and self.give_up_after < 1:
            raise ProducerInputError("--give-up-after must be at least 1 (or left out: never give up)")


def is_stalled(last_frame_at: float | None, connected_at: float, now: float, read_timeout_s: float) -> bool:
    """No frame for longer than the read timeout since the last one (or since connecting)."""
    since = connected_at if last_frame_at is None else max(last_frame_at, connected_at)
    return now - since > read_timeout_s


class FreshQueue(Generic[T]):
    """A camera's frames waiting to be sent: at most `capacity`, the oldest dropped (and counted) to make room,
    so what is sent is the freshest. One reader thread puts, the sender pops; `notify` wakes the sender."""

    def __init__(self, capacity: int, notify: Callable[[], None] = lambda: None) -> None:
        self._items: collections.deque[T] = collections.deque()
        self._capacity = capacity
        self._lock = threading.Lock()
        self._notify = notify
        self.dropped = 0

    def put(self, item: T) -> int:
        """Add `item`; returns how many old items were dropped for it (0 or 1)."""
        with self._lock:
            dropped = 0
            while len(self._items) >= self._capacity:
                self._items.popleft()
                dropped += 1
            self._items.append(item)
            self.dropped += dropped
        self._notify()
        return dropped

    def pop(self) -> T | None:
        with self._lock:
            return self._items.popleft() if self._items else None

    def __len__(self) -> int:
        return len(self._items)


class WallClockSampler:
    """Takes at most `fps` frames per second of wall-clock time (None: every frame). A frame is taken when it
    arrives no earlier than a quarter interval before its due time; after a gap the next is due one interval
    after the frame taken, so a camera that comes back does not send a burst."""

    def __init__(self, fps: float | None) -> None:
        self._interval = 1.0 / fps if fps else 0.0
        self._next_due: float | None = None

    def take(self, now: float) -> bool:
        if not self._interval:
            return True
        if self._next_due is not None and now < self._next_due - self._interval / 4:
            return False
        due = now if self._next_due is None else self._next_due
        self._next_due = due + self._interval
        if self._next_due <= now:
            self._next_due = now + self._interval
        return True


def capture_ts_ms(read_at_s: float, previous_ms: int | None) -> int:
    """A frame's capture time: the wall-clock time it was read (whatever timestamps the camera sends, so a
    camera clock that runs ahead cannot put frames in the future), never before the stream's previous frame."""
    now_ms = int(read_at_s * 1000)
    return now_ms if previous_ms is None else max(now_ms, previous_ms)


class CameraState(enum.Enum):
    CONNECTING = "connecting"
    CONNECTED = "connected"
    STALLED = "stalled"
    DISCONNECTED = "disconnected"
    RECONNECTING = "reconnecting"
    GIVEN_UP = "given up"
    ENDED = "ended"  # --count frames taken
    STOPPED = "stopped"


@dataclass
class CameraStats:
    """One camera's counters and state; written by its reader (and the stall check), read by the summary."""

    stream_id: str
    source: str
    state: CameraState = CameraState.CONNECTING
    read: int = 0
    sent: int = 0
    reconnects: int = 0
    last_frame_at: float | None = None  # monotonic
    connected_at: float = 0.0  # monotonic
    last_error: str = ""
    queue: FreshQueue[FrameRecord] = field(default_factory=lambda: FreshQueue(1))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def dropped(self) -> int:
        return self.queue.dropped

    def change(self, state: CameraState, detail: str = "") -> bool:
        """Move to `state`, logging one line if it is a change; False if it was the state already. A camera that
        gave up, ended or stopped stays so."""
        with self._lock:
            if state is self.state or self.state in (CameraState.GIVEN_UP, CameraState.ENDED, CameraState.STOPPED):
                return False
            self.state = state
        level = logging.WARNING if state in (CameraState.STALLED, CameraState.DISCONNECTED,
                                             CameraState.GIVEN_UP) else logging.INFO
        log.log(level, "camera %s %s%s", self.stream_id, state.value, f": {detail}" if detail else "",
                extra={"stream_id": self.stream_id, "camera_state": state.value, "source": self.source})
        return True

    def summary(self, now: float) -> dict[str, Any]:
        return {"source": redact(self.source), "state": self.state.value, "read": self.read, "sent": self.sent,
                "dropped": self.dropped, "queued": len(self.queue), "reconnects": self.reconnects,
                "seconds_since_last_frame": None if self.last_frame_at is None else round(now - self.last_frame_at, 3),
                "last_error": self.last_error}


def redact(source: str) -> str:
    """The source without a password (rtsp://user:secret@cam/ -> rtsp://user:***@cam/), for logs and summaries."""
    scheme, sep, rest = source.partition("://")
    userinfo, at, host = rest.partition("@")
    if not sep or not at or ":" not in userinfo or "/" in userinfo:
        return source
    return f"{scheme}://{userinfo.split(':', 1)[0]}:***@{host}"


# -- I/O: opening a camera ---------------------------------------------------------------------------------
# A camera opener: given a source, a context manager yielding decoded frames, each a thunk that makes its RGB
# pixels (HWC uint8, already resized): frames not sampled are never converted.
Opener = Callable[[str], AbstractContextManager[Iterator[Callable[[], np.ndarray]]]]


def pyav_opener(policy: LivePolicy, size: tuple[int, int] | None = None,
                options: Mapping[str, str] | None = None) -> Opener:
    """Open a camera with PyAV (FFmpeg): `timeout=(open, read)` makes a silent camera raise instead of blocking;
    FFmpeg `options` over LIVE_FFMPEG_OPTIONS (RTSP over TCP: no lost UDP packets, one port)."""

    @contextmanager
    def open_camera(source: str) -> Iterator[Iterator[Callable[[], np.ndarray]]]:
        import av

        opts = {**LIVE_FFMPEG_OPTIONS, **(options or {})}
        if not source.lower().startswith(("rtsp://", "rtsps://")):
            opts.pop("rtsp_transport", None)
        started = time.monotonic()
        try:
            container = av.open(source, options=opts, timeout=(policy.open_timeout_s, policy.read_timeout_s))
        except av.ExitError:
            raise TimeoutError(f"no answer within {policy.open_timeout_s:g} s (open timeout)") from None
        except av.FFmpegError as exc:
            # FFmpeg's RTSP demuxer reports an interrupted open as "Invalid data" too: say it was the timeout.
            if time.monotonic() - started >= policy.open_timeout_s:
                raise TimeoutError(f"no usable stream within {policy.open_timeout_s:g} s (open timeout): "
                                   f"{exc}") from None
            raise
        try:
            if not container.streams.video:
                raise OSError(f"{redact(source)} has no video stream")
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"

            def frames() -> Iterator[Callable[[], np.ndarray]]:
                try:
                    for frame in container.decode(stream):
                        yield functools.partial(_rgb, frame, size)
                except av.ExitError:  # PyAV's read timeout interrupted FFmpeg
                    raise TimeoutError(f"no data for {policy.read_timeout_s:g} s (read timeout)") from None

            yield frames()
        finally:
            container.close()

    return open_camera


def _rgb(frame: Any, size: tuple[int, int] | None) -> np.ndarray:
    if size:
        frame = frame.reformat(width=size[0], height=size[1])
    return frame.to_ndarray(format="rgb24")


# -- the reader threads and the sender's side --------------------------------------------------------------
@dataclass(frozen=True)
class FrameFormat:
    """What each frame record says besides its pixels."""

    priority: Priority
    tenant: str
    encoding: Encoding = Encoding.JPEG
    quality: int = 85


class CameraReader:
    """Reads one camera until stopped: connect, read frames into its FreshQueue, and on any error or end of
    stream reconnect after a backoff, under the same stream id with frame indices that keep increasing."""

    def __init__(self, stats: CameraStats, opener: Opener, policy: LivePolicy, fmt: FrameFormat,
                 fps: float | None, max_frames: int | None, stop: threading.Event,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic,
                 rand: Callable[[], float] = random.random,
                 wait: Callable[[float], object] | None = None) -> None:
        self.stats = stats
        self._opener = opener
        self._policy = policy
        self._fmt = fmt
        self._sampler = WallClockSampler(fps)
        self._max_frames = max_frames
        self._stop = stop
        self._clock = clock
        self._monotonic = monotonic
        self._rand = rand
        self._wait = wait or stop.wait
        self._next_index = 0
        self._taken = 0
        self._last_capture_ms: int | None = None

    def run(self) -> None:
        failures = 0  # connections in a row that gave no frame
        try:
            while not self._stop.is_set():
                error = "the stream ended"
                got_frames = connected = False
                try:
                    with self._opener(self.stats.source) as frames:
                        connected = True
                        self.stats.connected_at = self._monotonic()
                        self.stats.change(CameraState.CONNECTED, redact(self.stats.source))
                        for frame in frames:
                            got_frames = True
                            if not self._on_frame(frame):
                                return
                except Exception as exc:  # noqa: BLE001 (any camera failure, FFmpeg's or the network's: reconnect)
                    error = _error_text(exc)
                    if connected and isinstance(exc, TimeoutError):  # the opener's read timeout: a stall
                        self.stats.change(CameraState.STALLED, f"no frame for {self._policy.read_timeout_s:g} s")
                if self._stop.is_set():
                    return
                self.stats.last_error = error
                self.stats.change(CameraState.DISCONNECTED, error)
                # A connection that gave frames starts the count (and the backoff) again.
                failures = 0 if got_frames else failures + 1
                if self._policy.give_up_after is not None and failures >= self._policy.give_up_after:
                    self.stats.change(CameraState.GIVEN_UP, f"{failures} connections in a row failed: {error}")
                    return
                delay = self._policy.backoff.delay_s(max(0, failures - 1), self._rand)
                self.stats.reconnects += 1
                self.stats.change(CameraState.RECONNECTING, f"in {delay:.1f} s (reconnect {self.stats.reconnects})")
                self._wait(delay)
        finally:
            self.stats.change(CameraState.STOPPED)

    def _on_frame(self, frame: Callable[[], np.ndarray]) -> bool:
        """Take one decoded frame; False once --count frames were taken."""
        from worker.tools.publish_frames import encode_pixels

        if self._stop.is_set():
            return False
        read_at = self._clock()
        index = self._next_index
        self._next_index += 1
        self.stats.read += 1
        self.stats.last_frame_at = self._monotonic()
        if self.stats.state is CameraState.STALLED:
            self.stats.change(CameraState.CONNECTED, "frames again")
        if not self._sampler.take(read_at):
            return True
        self._last_capture_ms = capture_ts_ms(read_at, self._last_capture_ms)
        pixels = frame()
        h, w = pixels.shape[:2]
        fmt = self._fmt
        self.stats.queue.put(FrameRecord(
            stream_id=self.stats.stream_id, frame_index=index, capture_ts_ms=self._last_capture_ms,
            tenant=fmt.tenant, priority=fmt.priority, width=w, height=h, channels=3, encoding=fmt.encoding,
            data=encode_pixels(pixels, fmt.encoding, fmt.quality)))
        self._taken += 1
        if self._max_frames is not None and self._taken >= self._max_frames:
            self.stats.change(CameraState.ENDED, f"{self._taken} frames taken (--count)")
            return False
        return True


def _error_text(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text.replace("\n", " ")[:300]


class LiveCameras:
    """Every camera on its own reader thread, and `frames()`: what the sender sends, one frame per camera in
    turn, freshest first-come. Stop with `stop()` (SIGTERM): readers stop, and what they had read is still
    yielded before `frames()` ends."""

    def __init__(self, sources: Sequence[str], stream_ids: Sequence[str], opener: Opener, policy: LivePolicy,
                 fmt: FrameFormat, fps: float | None = None, max_frames: int | None = None,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic,
                 rand: Callable[[], float] = random.random) -> None:
        self.policy = policy
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._monotonic = monotonic
        self.cameras = [CameraStats(sid, src, queue=FreshQueue(policy.max_queued, self._ready.set))
                        for src, sid in zip(sources, stream_ids, strict=True)]
        self._readers = [CameraReader(stats, opener, policy, fmt, fps, max_frames, self._stop, clock, monotonic,
                                      rand) for stats in self.cameras]
        self._threads = [threading.Thread(target=r.run, name=f"camera-{r.stats.stream_id}", daemon=True)
                         for r in self._readers]

    def start(self) -> LiveCameras:
        for stats in self.cameras:
            stats.connected_at = self._monotonic()
            log.info("camera %s connecting to %s", stats.stream_id, redact(stats.source))
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        """Ask every reader to stop (safe from a signal handler); `frames()` ends once their queues are empty."""
        self._stop.set()
        self._ready.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def frames(self, idle_wait_s: float = 0.1) -> Iterator[FrameRecord]:
        """The cameras' frames, one per camera in turn, as they come; ends when stopped (after the frames
        already read) or when every reader has finished."""
        while True:
            self._ready.clear()
            sent_any = False
            for stats in self.cameras:
                rec = stats.queue.pop()
                if rec is not None:
                    stats.sent += 1
                    sent_any = True
                    yield rec
            self.check_stalls()
            if sent_any:
                continue
            if (self._stop.is_set() or not any(t.is_alive() for t in self._threads)) and \
                    not any(len(s.queue) for s in self.cameras):
                self.join(timeout_s=1.0)
                return
            self._ready.wait(idle_wait_s)

    def check_stalls(self) -> None:
        """Mark a connected camera that has sent nothing for the read timeout as stalled (its reader is stuck
        in a read that PyAV's timeout will end)."""
        now = self._monotonic()
        for stats in self.cameras:
            if stats.state is CameraState.CONNECTED and is_stalled(stats.last_frame_at, stats.connected_at, now,
                                                                   self.policy.read_timeout_s):
                stats.change(CameraState.STALLED, f"no frame for {self.policy.read_timeout_s:g} s")

    def join(self, timeout_s: float) -> None:
        deadline = self._monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - self._monotonic()))

    def summary(self) -> dict[str, dict[str, Any]]:
        now = self._monotonic()
        return {s.stream_id: s.summary(now) for s in self.cameras}


# -- metrics -----------------------------------------------------------------------------------------------
def serve_metrics(cameras: LiveCameras, port: int, host: str = "0.0.0.0") -> int:
    """Serve the cameras' counters as Prometheus metrics on `port` (0: a free one); returns the port."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class CameraCollector:
        def collect(self) -> Iterator[Any]:
            now = cameras._monotonic()
            counters = {"read": "Frames read from the camera", "sent": "Frames handed to the Kafka producer",
                        "dropped": "Frames dropped unsent (the oldest, when sending could not keep up)",
                        "reconnects": "Reconnect attempts"}
            for name, help_text in counters.items():
                family = CounterMetricFamily(f"streamfer_camera_{name if name == 'reconnects' else 'frames_' + name}",
                                             help_text, labels=["stream_id"])
                for s in cameras.cameras:
                    family.add_metric([s.stream_id], getattr(s, name))
                yield family
            age = GaugeMetricFamily("streamfer_camera_seconds_since_last_frame",
                                    "Seconds since the camera's last frame (since start: no frame yet)",
                                    labels=["stream_id"])
            up = GaugeMetricFamily("streamfer_camera_connected", "1 while the camera is connected and sending",
                                   labels=["stream_id"])
            for s in cameras.cameras:
                since = s.last_frame_at if s.last_frame_at is not None else s.connected_at
                age.add_metric([s.stream_id], now - since)
                up.add_metric([s.stream_id], 1.0 if s.state is CameraState.CONNECTED else 0.0)
            yield age
            yield up

    registry = CollectorRegistry()
    registry.register(CameraCollector())
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)
