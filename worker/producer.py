"""Publishing frames: synthetic ones (for the demo, tests and benchmarks), images from a folder, or the
frames of a video file. Frame ids are `<stream_id>/<frame_index>`, unique per run, so a verifier can
check that every frame got exactly one result.
"""

from __future__ import annotations

import io
import itertools
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
from confluent_kafka import Producer

from worker.frames import Encoding, Priority
from worker.schemas import FrameRecord, encode_frame

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp"}


class ProducerInputError(ValueError):
    """Bad producer arguments (shape syntax, missing folder, no video decoder)."""


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'64x48,32x32' -> [(64, 48), (32, 32)] as (width, height)."""
    shapes = []
    for part in text.split(","):
        part = part.strip().lower()
        try:
            w, h = (int(x) for x in part.split("x"))
        except ValueError:
            raise ProducerInputError(f"bad shape {part!r}: use WIDTHxHEIGHT, e.g. 64x48") from None
        if w <= 0 or h <= 0:
            raise ProducerInputError(f"bad shape {part!r}: width and height must be positive")
        shapes.append((w, h))
    if not shapes:
        raise ProducerInputError("no shapes given")
    return shapes


@dataclass(frozen=True)
class FrameSpec:
    stream_id: str
    frame_index: int
    tenant: str
    width: int
    height: int


def _now_ms() -> int:
    """A record's capture time until `send_frames` stamps it with the send time; valid (the worker
    dead-letters a capture time of 0) for a record decoded without being sent."""
    return int(time.time() * 1000)


def synthetic_pixels(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """A smooth random image (so JPEG compresses it like a real frame), HWC uint8."""
    small = rng.integers(0, 256, size=(max(1, height // 8), max(1, width // 8), 3), dtype=np.uint8)
    big = np.repeat(np.repeat(small, 8, axis=0), 8, axis=1)[:height, :width]
    if big.shape[:2] != (height, width):
        big = np.pad(big, ((0, height - big.shape[0]), (0, width - big.shape[1]), (0, 0)), mode="edge")
    return np.ascontiguousarray(big)


def encode_pixels(pixels: np.ndarray, encoding: Encoding, quality: int = 85) -> bytes:
    if encoding is Encoding.RAW_RGB8:
        return pixels.tobytes()
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def synthetic_frames(count: int, shapes: Sequence[tuple[int, int]], encoding: Encoding, priority: Priority,
                     run_id: str, tenants: Sequence[str] = ("tenant-a", "tenant-b", "tenant-c"),
                     streams_per_shape: int = 2, seed: int = 7) -> Iterator[FrameRecord]:
    """Deterministic frames cycling over shapes, streams and tenants. Pixel data is made once per shape."""
    rng = np.random.default_rng(seed)
    payloads = {shape: encode_pixels(synthetic_pixels(rng, *shape), encoding) for shape in shapes}
    counters: dict[str, int] = {}
    for i in range(count):
        w, h = shapes[i % len(shapes)]
        stream = f"{run_id}-{priority.label}-{w}x{h}-s{(i // len(shapes)) % streams_per_shape}"
        index = counters.get(stream, 0)
        counters[stream] = index + 1
        yield FrameRecord(stream_id=stream, frame_index=index, capture_ts_ms=_now_ms(),
                          tenant=tenants[i % len(tenants)], priority=priority, width=w, height=h, channels=3,
                          encoding=encoding, data=payloads[(w, h)])


def folder_frames(folder: Path, encoding: Encoding, priority: Priority, run_id: str, tenant: str,
                  count: int | None = None) -> Iterator[FrameRecord]:
    """Frames from the images in a folder (cycled until `count`)."""
    from PIL import Image

    files = sorted(p for p in Path(folder).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise ProducerInputError(f"no images ({', '.join(sorted(IMAGE_SUFFIXES))}) in {folder}")
    cycle = itertools.cycle(files) if count is not None else iter(files)
    for index, path in enumerate(itertools.islice(cycle, count)):
        pixels = np.asarray(Image.open(path).convert("RGB"))
        h, w = pixels.shape[:2]
        yield FrameRecord(stream_id=f"{run_id}-{Path(folder).name}", frame_index=index, capture_ts_ms=_now_ms(),
                          tenant=tenant, priority=priority, width=w, height=h, channels=3, encoding=encoding,
                          data=encode_pixels(pixels, encoding))


def video_frames(path: Path, encoding: Encoding, priority: Priority, run_id: str, tenant: str,
                 count: int | None = None) -> Iterator[FrameRecord]:
    """Frames of a video file, decoded with PyAV (`pip install av`)."""
    try:
        import av  # type: ignore[import-not-found]
    except ImportError:
        raise ProducerInputError("reading a video needs PyAV: pip install av") from None
    with av.open(str(path)) as container:
        for index, frame in enumerate(container.decode(video=0)):
            if count is not None and index >= count:
                break
            pixels = frame.to_ndarray(format="rgb24")
            h, w = pixels.shape[:2]
            yield FrameRecord(stream_id=f"{run_id}-{Path(path).stem}", frame_index=index, capture_ts_ms=_now_ms(),
                              tenant=tenant, priority=priority, width=w, height=h, channels=3, encoding=encoding,
                              data=encode_pixels(pixels, encoding))


# Frame producers: idempotent (a retry never duplicates a frame), small linger, compressed.
FRAME_PRODUCER_CONFIG = {"enable.idempotence": True, "linger.ms": 5, "compression.type": "lz4"}


def frame_producer(bootstrap_servers: str, logger: Any = None) -> Producer:
    conf: dict[str, Any] = {"bootstrap.servers": bootstrap_servers, **FRAME_PRODUCER_CONFIG}
    return Producer(conf, logger=logger) if logger is not None else Producer(conf)


@dataclass
class PublishReport:
    sent: int
    seconds: float
    # Open loop only: actual minus intended send time of each frame, ms, sorted (OpenMessaging's "send delay";
    # large values mean the generator itself fell behind).
    send_delays_ms: list[float] = field(default_factory=list)

    @property
    def max_send_lag_ms(self) -> float:
        return self.send_delays_ms[-1] if self.send_delays_ms else 0.0


def send_frames(producer: Producer, frames: Iterable[FrameRecord], topic_of: Callable[[FrameRecord], str],
                rate_fps: float | None = None, stop: Callable[[], bool] = lambda: False,
                clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep) -> PublishReport:
    """Produce frames as fast as possible, or open loop at `rate_fps`: frame i is due at start + i / rate, and
    its `capture_ts_ms` is that *intended* time, so a late send (generator or broker hiccup) shows up in the
    end-to-end latency instead of hiding it (no coordinated omission). Waits for every acknowledgement."""
    errors: list[str] = []

    def delivered(err, _msg) -> None:  # noqa: ANN001 (librdkafka callback)
        if err is not None:
            errors.append(err.str())

    start = clock()
    sent = 0
    delays: list[float] = []
    for i, rec in enumerate(frames):
        if stop():
            break
        intended = start + i / rate_fps if rate_fps else clock()
        if rate_fps:
            delay = intended - clock()
            if delay > 0:
                sleep(delay)
            delays.append((clock() - intended) * 1000.0)
        value = encode_frame(FrameRecord(**{**rec.__dict__, "capture_ts_ms": int(intended * 1000)}))
        while True:
            try:
                producer.produce(topic_of(rec), key=rec.stream_id.encode(), value=value, on_delivery=delivered)
                break
            except BufferError:
                producer.poll(0.05)  # local queue full: serve acknowledgements to make room
        producer.poll(0)
        sent += 1
    remaining = producer.flush(60)
    if remaining or errors:
        raise RuntimeError(f"{remaining} frames unacknowledged, {len(errors)} failed: {errors[:3]}")
    return PublishReport(sent=sent, seconds=clock() - start, send_delays_ms=sorted(delays))


def publish(bootstrap_servers: str, topic: str, frames: Iterable[FrameRecord], rate_fps: float | None = None,
            clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep) -> PublishReport:
    """Publish frames to one topic with a producer of their own (see send_frames)."""
    producer = frame_producer(bootstrap_servers)
    # Connect before the clock starts, so the producer's own start-up is not charged to the frames' latency.
    producer.list_topics(topic, timeout=30)
    return send_frames(producer, frames, lambda _rec: topic, rate_fps, clock=clock, sleep=sleep)


def random_run_id() -> str:
    return f"run{random.randrange(16**6):06x}"
