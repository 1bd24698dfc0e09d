"""`worker produce`: frames to an input topic from synthetic shapes, a folder of images, recordings or live
cameras (worker/tools/cameras.py), as the command line's flags say; `worker.cli` parses them."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from worker.config import Settings
from worker.frames import Encoding, Priority

if TYPE_CHECKING:
    from worker.codec.schemas import FrameRecord
    from worker.tracing.producer import FrameSendTracing

log = logging.getLogger("worker")


def produce(args: argparse.Namespace, settings: Settings) -> int:
    """`worker produce`: synthetic frames, a folder, recordings or live cameras to an input topic."""
    from worker.kafka.access import probe_reachable
    from worker.tools.cameras import is_live_source
    from worker.tools.publish_frames import (
        ProducerInputError,
        VideoOptions,
        folder_frames,
        paced,
        parse_shapes,
        parse_size,
        publish,
        random_run_id,
        synthetic_frames,
        video_frames,
    )

    topics = settings.topics
    if args.topic:
        topic = args.topic
    elif args.from_video:
        topic = topics.bulk if args.backfill else topics.realtime
    else:
        topic = topics.standard
    priority = topics.input_topics().get(topic, Priority.STANDARD)
    encoding = Encoding.JPEG if args.encoding == "jpeg" else Encoding.RAW_RGB8
    run_id = args.run_id or random_run_id()
    tenants = [t for t in args.tenants.split(",") if t]
    progress = None if args.quiet else _progress_line
    keep_capture_ts = False
    if args.from_video and not args.backfill and any(is_live_source(s) for s in args.from_video):
        return _produce_live(args, settings, topic, priority, encoding, run_id, tenants[0])
    try:
        if args.from_video:
            options = VideoOptions(fps=args.fps, size=parse_size(args.resize) if args.resize else None,
                                   encoding=encoding, quality=args.quality, max_frames=args.count)
            frames = video_frames(args.from_video, priority, run_id, tenants[0], options)
            # A camera sends each frame when it is captured; a backfill sends as fast as the broker takes them.
            frames = frames if args.backfill else paced(frames)
            keep_capture_ts = True
        elif args.from_folder:
            frames = folder_frames(Path(args.from_folder), encoding, priority, run_id, tenants[0], args.count)
        else:
            frames = synthetic_frames(args.count or 100, parse_shapes(args.shape), encoding, priority, run_id,
                                      tenants)
        probe_reachable(settings)
        encode = _frame_encoder(args, settings)
        traced = _send_tracing(args, settings)
        try:
            report = publish(settings.kafka, topic, frames, args.rate, keep_capture_ts=keep_capture_ts,
                             progress=progress, encode=encode,
                             headers=traced.headers if traced is not None else None)
        finally:
            if traced is not None:
                traced.shutdown()
        if progress is not None:
            print(file=sys.stderr)  # ends the progress line
    except ProducerInputError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"topic": topic, "run_id": run_id, "sent": report.sent, "acknowledged": report.acknowledged,
                      "seconds": round(report.seconds, 3), "max_send_lag_ms": round(report.max_send_lag_ms, 2)}))
    return 0


def _send_tracing(args: argparse.Namespace, settings: Settings) -> FrameSendTracing | None:
    """With --traceparent: each frame's `send` span and header (OpenTelemetry imported only then)."""
    if not args.traceparent:
        return None
    from worker.tracing.producer import FrameSendTracing

    return FrameSendTracing(settings)


def _produce_live(args: argparse.Namespace, settings: Settings, topic: str, priority: Priority, encoding: Encoding,
                  run_id: str, tenant: str) -> int:
    """Live cameras: each read on its own thread, reconnected when it fails, its freshest frames sent as they
    are read (worker/tools/cameras.py); runs until SIGTERM/SIGINT (or --count frames per camera)."""
    from worker.kafka.access import probe_reachable
    from worker.tools.cameras import (
        LIVE_QUEUE_MAX_KBYTES,
        Backoff,
        CameraState,
        FrameFormat,
        LiveCameras,
        LivePolicy,
        is_live_source,
        pyav_opener,
        serve_metrics,
    )
    from worker.tools.publish_frames import ProducerInputError, parse_size, publish, video_stream_ids

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
    try:
        recordings = [s for s in args.from_video if not is_live_source(s)]
        if recordings:
            raise ProducerInputError(f"{recordings[0]!r} is a recording, the other sources live cameras: send "
                                     "recordings in a run of their own (or all with --backfill)")
        if args.rate:
            raise ProducerInputError("--rate does not apply to live cameras: they send as they are read; "
                                     "--fps samples them")
        policy = LivePolicy(open_timeout_s=args.open_timeout, read_timeout_s=args.read_timeout,
                            backoff=Backoff(max_s=args.backoff_max), max_queued=args.max_queued_frames,
                            give_up_after=args.give_up_after)
        size = parse_size(args.resize) if args.resize else None
        options = dict(_key_value(o) for o in args.source_option)
        import av  # noqa: F401
    except ImportError:
        print("\nerror: reading a camera needs PyAV: pip install 'streamfer[models]' (./dev setup does)",
              file=sys.stderr)
        return 2
    except ProducerInputError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 2
    probe_reachable(settings)
    encode = _frame_encoder(args, settings)
    cameras = LiveCameras(args.from_video, video_stream_ids(args.from_video, run_id),
                          pyav_opener(policy, size, options), policy,
                          FrameFormat(priority, tenant, encoding, args.quality), fps=args.fps, max_frames=args.count)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _signum, _frame: cameras.stop())
    if args.metrics_port is not None:
        log.info("camera metrics on port %d", serve_metrics(cameras, args.metrics_port))
    next_summary = [time.monotonic() + args.summary_every]

    def progress(_sent: int, _acknowledged: int) -> None:
        if args.summary_every and time.monotonic() >= next_summary[0]:
            next_summary[0] = time.monotonic() + args.summary_every
            log.info("cameras: %s", json.dumps(cameras.summary()))

    traced = _send_tracing(args, settings)
    try:
        report = publish(settings.kafka, topic, cameras.start().frames(), keep_capture_ts=True,
                         progress=progress, encode=encode, queue_max_kbytes=LIVE_QUEUE_MAX_KBYTES,
                         headers=traced.headers if traced is not None else None)
    finally:
        if traced is not None:
            traced.shutdown()
    summary = cameras.summary()
    print(json.dumps({"topic": topic, "run_id": run_id, "sent": report.sent, "acknowledged": report.acknowledged,
                      "seconds": round(report.seconds, 3), "cameras": summary}), flush=True)
    return 1 if any(c["state"] == CameraState.GIVEN_UP.value for c in summary.values()) else 0


def _frame_encoder(args: argparse.Namespace, settings: Settings) -> Callable[[FrameRecord, str], bytes] | None:
    """The registry's wire format when `--schema-registry` or `schema_registry.url` names one; else None (plain
    Avro bodies)."""
    if not (args.schema_registry or settings.schema_registry.url):
        return None
    from dataclasses import replace

    from worker.kafka.registry import frame_serializer

    registry = settings.schema_registry
    return frame_serializer(replace(registry, url=args.schema_registry or registry.url))


def _key_value(text: str) -> tuple[str, str]:
    from worker.tools.publish_frames import ProducerInputError

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ProducerInputError(f"bad --source-option {text!r}: use KEY=VALUE, e.g. rtsp_transport=udp")
    return key, value


def _progress_line(sent: int, acknowledged: int) -> None:
    print(f"\rsent {sent} frames, {acknowledged} acknowledged by the broker", end="", file=sys.stderr, flush=True)
