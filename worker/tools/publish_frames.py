"""Publishing frames: synthetic ones (for the demo, tests and benchmarks), images from a folder, or the
frames of videos (files or any URL FFmpeg opens, several streams at once). Frame ids are
`<stream_id>/<frame_index>`, unique per run, so a verifier can check that every frame got exactly one result.

A frame must fit its topic's `max.message.bytes`: `publish` reads the limit from the broker and refuses a
larger frame before sending it, saying both sizes and the fix.
"""

from __future__ import annotations

import heapq
import io
import itertools
import random
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from confluent_kafka import KafkaError, KafkaException

from worker.codec.schemas import FrameRecord, encode_frame
from worker.frames import Encoding, Headers, Priority
from worker.kafka.client import Cluster
from worker.kafka.roles import frame_producer
from worker.kafka.topics import topic_message_limits

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp"}


DEFAULT_JPEG_QUALITY = 85
# Bytes a record adds to its value in a Kafka record batch (batch header, record header, key), rounded up.
RECORD_OVERHEAD_BYTES = 256


class ProducerInputError(ValueError):
    """Bad producer arguments (shape syntax, missing folder, no video decoder, unreadable video)."""


class FrameTooLargeError(ProducerInputError):
    """An encoded frame is larger than its topic accepts; the message names both sizes and the fix."""


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


def parse_size(text: str) -> tuple[int, int]:
    """'1280x720' -> (1280, 720) as (width, height)."""
    (size,) = parse_shapes(text)
    return size


def encode_pixels(pixels: np.ndarray, encoding: Encoding, quality: int = DEFAULT_JPEG_QUALITY) -> bytes:
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


@dataclass(frozen=True)
class VideoOptions:
    """How video frames are sampled and encoded: at most `fps` frames per second of video (None: every frame),
    optionally resized to `size` (width, height), JPEG at `quality` (or raw RGB)."""

    fps: float | None = None
    size: tuple[int, int] | None = None
    encoding: Encoding = Encoding.JPEG
    quality: int = DEFAULT_JPEG_QUALITY
    max_frames: int | None = None  # per stream


def video_stream_ids(sources: Sequence[str], run_id: str) -> list[str]:
    """One stream id per source, unique even when the same file is given twice: `<run>-v<i>-<name>`."""
    ids = []
    for i, source in enumerate(sources):
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(source.split("?", 1)[0].rstrip("/")).stem or "video")
        ids.append(f"{run_id}-v{i}-{name}")
    return ids


def video_frames(sources: Sequence[str | Path], priority: Priority, run_id: str, tenant: str,
                 options: VideoOptions = VideoOptions(), start_wall: float | None = None) -> Iterator[FrameRecord]:
    """Frames of several videos (files or URLs FFmpeg opens, decoded with PyAV) as concurrent streams.

    The streams are interleaved by presentation time; each frame keeps its decoder index as `frame_index` and
    gets `capture_ts_ms` = `start_wall` + its time in its stream (so `paced` can send it when it is due).
    """
    try:
        import av  # noqa: F401
    except ImportError:
        raise ProducerInputError("reading a video needs PyAV: pip install 'streamfer[models]' (./dev setup does), "
                                 "or pip install av") from None
    names = [str(s) for s in sources]
    start = time.time() if start_wall is None else start_wall
    streams = [_one_video(src, sid, priority, tenant, options, start)
               for src, sid in zip(names, video_stream_ids(names, run_id), strict=True)]
    yield from heapq.merge(*streams, key=lambda rec: rec.capture_ts_ms)


def _one_video(source: str, stream_id: str, priority: Priority, tenant: str, options: VideoOptions,
               start_wall: float) -> Iterator[FrameRecord]:
    import av

    try:
        container = av.open(source)
    except (av.FFmpegError, OSError) as exc:
        raise ProducerInputError(f"cannot open video {source!r}: {exc}") from None
    with container:
        if not container.streams.video:
            raise ProducerInputError(f"{source!r} has no video stream")
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        rate = float(stream.average_rate or stream.guessed_rate or 25)
        first_t: float | None = None
        next_due = 0.0
        sent = 0
        for index, frame in enumerate(container.decode(stream)):
            t = frame.time if frame.time is not None else index / rate
            first_t = t if first_t is None else first_t
            rel = t - first_t
            if options.fps and rel + 1e-6 < next_due:
                continue
            if options.fps:
                next_due += 1.0 / options.fps
                next_due = max(next_due, rel)  # a gap in the video does not cause a burst after it
            if options.size:
                frame = frame.reformat(width=options.size[0], height=options.size[1])
            pixels = frame.to_ndarray(format="rgb24")
            h, w = pixels.shape[:2]
            yield FrameRecord(stream_id=stream_id, frame_index=index, capture_ts_ms=int((start_wall + rel) * 1000),
                              tenant=tenant, priority=priority, width=w, height=h, channels=3,
                              encoding=options.encoding, data=encode_pixels(pixels, options.encoding, options.quality))
            sent += 1
            if options.max_frames is not None and sent >= options.max_frames:
                break


def paced(frames: Iterable[FrameRecord], clock: Callable[[], float] = time.time,
          sleep: Callable[[float], None] = time.sleep) -> Iterator[FrameRecord]:
    """Yield each frame no earlier than its `capture_ts_ms` (a camera's pace); late frames go at once."""
    for rec in frames:
        delay = rec.capture_ts_ms / 1000.0 - clock()
        if delay > 0:
            sleep(delay)
        yield rec


def frame_message_limit(topic_limit: int | None) -> int | None:
    """The frame producer's own message limit for a topic taking `topic_limit` bytes a record: room for the
    largest frame the topic takes, which check_frame_fits measures with the same overhead."""
    return None if topic_limit is None else topic_limit + RECORD_OVERHEAD_BYTES


def check_frame_fits(rec: FrameRecord, value: bytes, topic: str, limit: int | None) -> None:
    """Refuse a frame larger than its topic takes, before librdkafka or the broker does so less clearly."""
    size = len(value) + len(rec.stream_id) + RECORD_OVERHEAD_BYTES
    if limit is None or size <= limit:
        return
    kind = "JPEG" if rec.encoding is Encoding.JPEG else "raw RGB"
    raise FrameTooLargeError(
        f"frame {rec.stream_id}/{rec.frame_index} ({rec.width}x{rec.height} {kind}) is {size:,} bytes as a Kafka "
        f"record, but topic {topic!r} takes at most {limit:,} (max.message.bytes). Send JPEG (--encoding jpeg, "
        f"or a lower --quality), make it smaller (--resize), or raise the topic's limit: `worker topics "
        f"--max-frame-bytes {_round_up_mib(size)}` (creates the frame topics, or raises their limit), or "
        f"`kafka-configs --alter --entity-type topics --entity-name {topic} --add-config "
        f"max.message.bytes={_round_up_mib(size)}`"
    )


def _round_up_mib(n: int) -> int:
    mib = 1 << 20
    return -(-n // mib) * mib


@dataclass
class PublishReport:
    sent: int
    seconds: float
    # Open loop only: actual minus intended send time of each frame, ms, sorted (OpenMessaging's "send delay";
    # large values mean the generator itself fell behind).
    send_delays_ms: list[float] = field(default_factory=list)
    acknowledged: int = 0

    @property
    def max_send_lag_ms(self) -> float:
        return self.send_delays_ms[-1] if self.send_delays_ms else 0.0


def send_frames(producer: Any, frames: Iterable[FrameRecord], topic_of: Callable[[FrameRecord], str],
                rate_fps: float | None = None, stop: Callable[[], bool] = lambda: False,
                clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
                keep_capture_ts: bool = False, limits: dict[str, int] | None = None,
                progress: Callable[[int, int], None] | None = None,
                encode: Callable[[FrameRecord, str], bytes] | None = None,
                headers: Callable[[FrameRecord, str], Headers] | None = None) -> PublishReport:
    """Produce frames as fast as possible, or open loop at `rate_fps`: frame i is due at start + i / rate, and
    its `capture_ts_ms` is that *intended* time, so a late send (generator or broker hiccup) shows up in the
    end-to-end latency instead of hiding it (no coordinated omission). With `keep_capture_ts` the records'
    own capture times are sent (video: the stream's timestamps). A frame over its topic's limit in `limits`
    raises FrameTooLargeError. `progress(sent, acknowledged)` is called about once a second. `encode(frame, topic)`
    makes each message (default: a plain Avro body; worker.kafka.registry.FrameSerializer: registry-framed);
    `headers(frame, topic)` its headers (worker.tracing.producer.FrameSendTracing: a `traceparent`).
    Waits for every acknowledgement."""
    errors: list[str] = []
    acked = [0]

    def delivered(err, _msg) -> None:
        if err is not None:
            errors.append(_delivery_error(err))
        else:
            acked[0] += 1

    start = clock()
    sent = 0
    delays: list[float] = []
    next_progress = start + 1.0
    for i, rec in enumerate(frames):
        if stop():
            break
        intended = start + i / rate_fps if rate_fps else clock()
        if rate_fps:
            delay = intended - clock()
            if delay > 0:
                sleep(delay)
            delays.append((clock() - intended) * 1000.0)
        if not keep_capture_ts:
            rec = FrameRecord(**{**rec.__dict__, "capture_ts_ms": int(intended * 1000)})
        topic = topic_of(rec)
        value = encode(rec, topic) if encode is not None else encode_frame(rec)
        check_frame_fits(rec, value, topic, (limits or {}).get(topic))
        while True:
            try:
                producer.produce(topic, key=rec.stream_id.encode(), value=value, on_delivery=delivered,
                                 headers=list(headers(rec, topic)) if headers is not None else None)
                break
            except BufferError:
                producer.poll(0.05)  # local queue full: serve acknowledgements to make room
            except KafkaException as exc:  # refused locally: librdkafka's own message.max.bytes
                if exc.args[0].code() != KafkaError.MSG_SIZE_TOO_LARGE:
                    raise
                raise FrameTooLargeError(f"frame {rec.stream_id}/{rec.frame_index} is {len(value):,} bytes: "
                                         f"{_TOO_LARGE_FIX}") from None
        producer.poll(0)
        sent += 1
        if progress is not None and clock() >= next_progress:
            progress(sent, acked[0])
            next_progress = clock() + 1.0
    remaining = producer.flush(60)
    if progress is not None:
        progress(sent, acked[0])
    if remaining or errors:
        raise RuntimeError(f"{sent} frames sent, {acked[0]} acknowledged, {remaining} unacknowledged, "
                           f"{len(errors)} failed: {errors[:3]}")
    return PublishReport(sent=sent, seconds=clock() - start, send_delays_ms=sorted(delays), acknowledged=acked[0])


_TOO_LARGE_FIX = ("a frame is larger than the topic's (or this producer's) message limit; send JPEG, --resize, or "
                  "raise the topic's max.message.bytes (worker topics --max-frame-bytes)")


def _delivery_error(err: KafkaError) -> str:
    return f"{err.str()}: {_TOO_LARGE_FIX}" if err.code() == KafkaError.MSG_SIZE_TOO_LARGE else err.str()


def publish(cluster: Cluster, topic: str, frames: Iterable[FrameRecord], rate_fps: float | None = None,
            clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep,
            keep_capture_ts: bool = False, progress: Callable[[int, int], None] | None = None,
            encode: Callable[[FrameRecord, str], bytes] | None = None,
            queue_max_kbytes: int | None = None,
            headers: Callable[[FrameRecord, str], Headers] | None = None) -> PublishReport:
    """Publish frames to one topic with a producer of their own (see send_frames), refusing frames larger than
    the topic's max.message.bytes. `queue_max_kbytes`: bound the producer's local queue (live cameras)."""
    limits = topic_message_limits(cluster, [topic])
    producer = frame_producer(cluster, frame_message_limit(limits.get(topic)), queue_max_kbytes)
    # Connect before the clock starts, so the producer's own start-up is not charged to the frames' latency.
    producer.list_topics(topic, timeout=30)
    return send_frames(producer, frames, lambda _rec: topic, rate_fps, clock=clock, sleep=sleep,
                       keep_capture_ts=keep_capture_ts, limits=limits, progress=progress, encode=encode,
                       headers=headers)


def random_run_id() -> str:
    return f"run{random.randrange(16**6):06x}"
