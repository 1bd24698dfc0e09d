"""Verdict reuse (issue 59, worker/reuse/policy.py): what it spares and what it costs, on H.264 clips of real photos.

1. accuracy: a clip made here with PyAV (libx264) from scikit-image's photos, per photo: a static camera with
   sensor noise (Gaussian, sigma 3 per channel, every frame), a 3-frame flash of another photo in its middle, an
   object entering (a square of another photo, 5% of the frame, for 6 frames), a slow pan (2 px a frame), then a
   cut to the next photo; 25 fps, 1280x720, decoded and sent as JPEG as
   `worker produce --from-video` does. Every frame is scored by open_nsfw; the reuse policy then runs over the
   frames in order (a reused frame gets its reference's verdict) for several change thresholds. Per threshold:
   the share of frames reused, verdict agreement with scoring every frame (the preset's threshold 0.5, and a
   stricter one at the clip's median nsfw score, where decisions flip easily), the largest and p99 nsfw-score
   difference on a reused frame, and the cuts, flashes, objects entering or leaving reused (must be 0).
2. thumbnail cost: worker.reuse.thumbnail.thumbnail (libjpeg-turbo's 1/8 grayscale decode, area-averaged) against the
   full RGB decode the runtime gives a frame, per 720p and 1080p JPEG, median of repeats.
3. throughput: the worker's loop (worker.loop.pipeline over the in-memory Kafka kit, the real open_nsfw runtime) on a
   static-camera workload (4 streams of noisy 720p JPEG at 25 fps), reuse on (1000 ms) against off, interleaved
   rounds in one process: frames/s and process CPU-ms per frame.

    python bench/reuse.py [--quick] [--rounds 3] [--frames 120]

Prints tables and writes bench/results/reuse.json.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import simplejpeg
from common import table, write_json
from PIL import Image

from worker.batching import batch_shape
from worker.codec.schemas import FrameRecord, encode_frame
from worker.config import Settings, load_settings
from worker.frames import Encoding, Frame, Priority, SourceRef, Verdict
from worker.loop.pipeline import build_pipeline
from worker.metrics import Health, Metrics
from worker.photos import PHOTOS, photo
from worker.reuse.policy import Decision, FrameReuse
from worker.reuse.thumbnail import change, thumbnail
from worker.runtime.decode import check_frame, decode_pixels
from worker.runtime.start import start_runtime
from worker.testing import InMemoryKafka

FPS = 25
SIZE = (1280, 720)
NOISE_SIGMA = 3.0
STATIC_FRAMES = 40
PAN_FRAMES = 40
PAN_PX_PER_FRAME = 2
FLASH_FRAMES = 3
OBJECT_AT, OBJECT_FRAMES, OBJECT_SHARE = 30, 6, 0.05  # an object of 5% of the frame, for 6 frames
THRESHOLDS = (2.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0)
MAX_AGE_MS = 1000.0
JPEG_QUALITY = 90


def _crop(img: np.ndarray, left: int, width: int, height: int) -> np.ndarray:
    h, w = img.shape[:2]
    scale = max(width * 1.3 / w, height * 1.05 / h)
    big = np.asarray(Image.fromarray(img).resize((round(w * scale), round(h * scale)), Image.Resampling.BILINEAR))
    top = (big.shape[0] - height) // 2
    return np.ascontiguousarray(big[top:top + height, left:left + width])


def scenario(rng: np.random.Generator) -> tuple[list[np.ndarray], dict[int, str], list[int]]:
    """The clip's pictures; the frames that start a new picture (a cut, a flash, the flash's end), which must be
    scored; and the photo each frame shows (a reused frame's reference must show the same one)."""
    width, height = SIZE
    out: list[np.ndarray] = []
    events: dict[int, str] = {}
    shown: list[int] = []
    for n, name in enumerate(PHOTOS):
        base = _crop(photo(name), 0, width, height)
        flash = _crop(photo(PHOTOS[(n + 2) % len(PHOTOS)]), 0, width, height)
        # An object enters: a square of another photo pasted in a corner, OBJECT_SHARE of the frame.
        entered = base.copy()
        side = round((OBJECT_SHARE * width * height) ** 0.5)
        entered[40:40 + side, 40:40 + side] = np.asarray(Image.fromarray(photo(PHOTOS[(n + 1) % len(PHOTOS)]))
                                                        .resize((side, side), Image.Resampling.BILINEAR))
        if n:
            events[len(out)] = "cut"
        for i in range(STATIC_FRAMES):
            mid = STATIC_FRAMES // 2
            if mid <= i < mid + FLASH_FRAMES:
                if i == mid:
                    events[len(out)] = "flash"
                picture = flash
                shown.append((n + 2) % len(PHOTOS))
            elif OBJECT_AT <= i < OBJECT_AT + OBJECT_FRAMES:
                if i == OBJECT_AT:
                    events[len(out)] = "object enters"
                picture = entered
                shown.append(100 + n)
            else:
                if i == mid + FLASH_FRAMES:
                    events[len(out)] = "flash end"
                if i == OBJECT_AT + OBJECT_FRAMES:
                    events[len(out)] = "object leaves"
                picture = base
                shown.append(n)
            noisy = picture.astype(np.float32) + rng.normal(0, NOISE_SIGMA, picture.shape).astype(np.float32)
            out.append(np.clip(noisy, 0, 255).astype(np.uint8))
        for i in range(PAN_FRAMES):
            out.append(_crop(photo(name), (i + 1) * PAN_PX_PER_FRAME, width, height))
            shown.append(n)
    return out, events, shown


def h264_jpeg_frames(pictures: list[np.ndarray], directory: Path, stream: str = "cam") -> list[Frame]:
    """The pictures through H.264 (libx264, crf 23) and back, each sent as a JPEG frame 40 ms after the last."""
    import av

    path = directory / "reuse-clip.mp4"
    width, height = SIZE
    with av.open(str(path), "w") as container:
        vs = container.add_stream("libx264", rate=FPS, options={"preset": "ultrafast", "crf": "23"})
        vs.width, vs.height, vs.pix_fmt = width, height, "yuv420p"
        for pixels in pictures:
            for packet in vs.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in vs.encode():
            container.mux(packet)
    frames = []
    with av.open(str(path)) as container:
        for i, vf in enumerate(container.decode(video=0)):
            frames.append(jpeg_frame(vf.to_ndarray(format="rgb24"), i, stream))
    return frames


def jpeg_frame(pixels: np.ndarray, index: int, stream: str, priority: Priority = Priority.STANDARD) -> Frame:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=JPEG_QUALITY)
    h, w, _ = pixels.shape
    return Frame(stream_id=stream, frame_index=index, tenant="t", priority=priority,
                 capture_ts_ms=1_800_000_000_000 + index * 1000 // FPS, width=w, height=h, channels=3,
                 encoding=Encoding.JPEG, data=buf.getvalue(), source=SourceRef("bench", 0, index))


def score_all(executor: Any, frames: list[Frame], batch: int = 8) -> list[Verdict]:
    verdicts: list[Verdict] = []
    shape = batch_shape(frames[0].shape, executor.model_input_hw)
    for start in range(0, len(frames), batch):
        out = executor.submit(frames[start:start + batch], shape, Priority.STANDARD).result()
        assert not out.failures, out.failures
        verdicts += [v for _, v in out.verdicts]
    return verdicts


def simulate(frames: list[Frame], thumbs: list[np.ndarray], verdicts: list[Verdict], threshold: float,
             max_age_ms: float = MAX_AGE_MS) -> list[int | None]:
    """Each frame's reference frame_index under the policy (None: scored). Decisions do not depend on when
    verdicts come back (a held frame gets the reference it was held for), so each is known at once here."""
    reuse = FrameReuse({Priority.STANDARD: max_age_ms}, threshold)
    refs: list[int | None] = []
    for frame, thumb, verdict in zip(frames, thumbs, verdicts, strict=True):
        decision = reuse.offer(frame, thumb)
        if decision is Decision.SCORE:
            reuse.scored(frame, verdict)
            refs.append(None)
        else:
            assert not isinstance(decision, Decision)
            refs.append(decision.reference)
    return refs


def thumbnails(frames: list[Frame]) -> list[np.ndarray]:
    thumbs = [thumbnail(f) for f in frames]
    assert all(t is not None for t in thumbs)
    return [t for t in thumbs if t is not None]


def accuracy(executor: Any, frames: list[Frame], must_score: dict[int, str], shown: list[int]) -> dict[str, Any]:
    verdicts = score_all(executor, frames)
    nsfw = np.array([v.scores["nsfw"] for v in verdicts])
    strict = float(np.median(nsfw))
    thumbs = thumbnails(frames)
    # The change of every frame from the frame before: what noise, pans and cuts look like to the metric.
    steps = [change(a, b) for a, b in zip(thumbs, thumbs[1:], strict=False)]
    in_static = [i for i in range(1, len(frames)) if (i % (STATIC_FRAMES + PAN_FRAMES)) < STATIC_FRAMES
                 and shown[i] == shown[i - 1]]
    static = [steps[i - 1] for i in in_static]
    events = [steps[i - 1] for i in must_score]
    # The model's own jitter: how much the nsfw score moves between consecutive frames of one static picture
    # (sensor noise alone), against which a reused frame's score difference is to be read.
    jitter = [abs(nsfw[i] - nsfw[i - 1]) for i in in_static]
    rows = []
    for threshold in THRESHOLDS:
        refs = simulate(frames, thumbs, verdicts, threshold)
        reused = [(i, r) for i, r in enumerate(refs) if r is not None]
        diffs = [abs(nsfw[i] - nsfw[r]) for i, r in reused]
        agree = sum((nsfw[i] >= 0.5) == (nsfw[r] >= 0.5) for i, r in reused)
        agree_strict = sum((nsfw[i] >= strict) == (nsfw[r] >= strict) for i, r in reused)
        missed = sorted(f"{i} ({must_score[i]})" for i, _ in reused if i in must_score)
        wrong_picture = sorted(i for i, r in reused if shown[r] != shown[i])
        rows.append({"threshold": threshold, "reused_share": len(reused) / len(frames),
                     "agreement": (len(frames) - len(reused) + agree) / len(frames),
                     "agreement_strict": (len(frames) - len(reused) + agree_strict) / len(frames),
                     "max_score_diff": max(diffs, default=0.0),
                     "p99_score_diff": float(np.percentile(diffs, 99)) if diffs else 0.0,
                     "events_reused": missed, "reused_from_another_picture": wrong_picture})
    return {"frames": len(frames), "events": len(must_score), "strict_threshold": strict,
            "nsfw_score_range": [float(nsfw.min()), float(nsfw.max())],
            "static_step_change": {"median": statistics.median(static), "max": max(static)},
            "event_change": {"min": min(events), "median": statistics.median(events)},
            "model_jitter_static": {"median": statistics.median(jitter), "max": max(jitter)},
            "thresholds": rows}


def thumbnail_cost(repeats: int) -> list[dict[str, Any]]:
    rows = []
    for size in ((1280, 720), (1920, 1080)):
        frame = jpeg_frame(_crop(photo("astronaut"), 0, *size), 0, "cost")
        parts: dict[str, Callable[[], Any]] = {
            "full_decode": lambda f=frame: decode_pixels(f), "thumbnail": lambda f=frame: thumbnail(f),
            "check_walk": lambda f=frame: check_frame(f),
            "scaled_decode": lambda f=frame: simplejpeg.decode_jpeg(f.data, colorspace="GRAY", min_height=1,
                                                                      min_width=1)}
        times: dict[str, list[float]] = {k: [] for k in parts}
        for _ in range(repeats):  # interleaved: a busy moment of the shared cores falls on every part alike
            for k, fn in parts.items():
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
        row: dict[str, Any] = {"size": f"{size[0]}x{size[1]}", "jpeg_bytes": len(frame.data)}
        for k, ts in times.items():
            row[f"{k}_ms"] = statistics.median(ts) * 1000
            row[f"{k}_min_ms"] = min(ts) * 1000
        row["ratio"] = row["thumbnail_min_ms"] / row["full_decode_min_ms"]
        rows.append(row)
    return rows


def static_workload(per_stream: int, streams: int, rng: np.random.Generator) -> list[list[Frame]]:
    out = []
    for s in range(streams):
        base = _crop(photo(PHOTOS[s % len(PHOTOS)]), 0, *SIZE).astype(np.float32)
        out.append([jpeg_frame(np.clip(base + rng.normal(0, NOISE_SIGMA, base.shape), 0, 255).astype(np.uint8), i,
                               f"cam{s}") for i in range(per_stream)])
    return out


def loop_round(executor: Any, settings: Settings, workload: list[list[Frame]], reuse_ms: float) -> dict[str, Any]:
    s = load_settings(env={"WORKER_BATCHING_STANDARD_REUSE_MAX_AGE_MS": str(reuse_ms),
                           "WORKER_BATCHING_STANDARD_MAX_AGE_MS": "0"},
                      overrides={"model": {"source": "opennsfw"}, "observability": {"worker_id": "bench",
                                                                                     "metrics_enabled": False}})
    kafka = InMemoryKafka()
    total = 0
    captured_ms = int(time.time() * 1000) - 60_000  # in the past (no deadline here), 40 ms apart
    for stream in workload:
        kafka.send((s.topics.standard, 0), *(encode_frame(FrameRecord(
            stream_id=f.stream_id, frame_index=f.frame_index, capture_ts_ms=captured_ms + 40 * f.frame_index,
            tenant="t",
            priority=Priority.STANDARD, width=f.width, height=f.height, channels=3, encoding=Encoding.JPEG,
            data=f.data)) for f in stream))
        total += len(stream)
    pipeline = build_pipeline(s, executor, Metrics(), Health(), clients=kafka.clients)
    cpu0, t0 = time.process_time(), time.perf_counter()
    pipeline.run(lambda: pipeline.delivery.results + pipeline.delivery.dead_lettered >= total)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    results = kafka.results()
    assert len(results) == total, (len(results), total)
    reused = sum(r["reused_from_frame"] is not None for r in results)
    return {"reuse_max_age_ms": reuse_ms, "change_threshold": s.batching.reuse_change_threshold,
            "frames": total, "reused": reused, "wall_s": wall,
            "frames_per_s": total / wall, "cpu_ms_per_frame": cpu * 1000 / total}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--frames", type=int, default=120, help="frames per throughput round (4 streams)")
    args = p.parse_args(argv)
    rng = np.random.default_rng(59)
    settings = load_settings(overrides={"model": {"source": "opennsfw"},
                                        "observability": {"worker_id": "bench", "metrics_enabled": False}})
    executor = start_runtime(settings, calibrate=False).executor
    out: dict[str, Any] = {}
    try:
        pictures, must_score, shown = scenario(rng)
        with tempfile.TemporaryDirectory() as tmp:
            frames = h264_jpeg_frames(pictures, Path(tmp))
        acc = out["accuracy"] = accuracy(executor, frames, must_score, shown)
        table(f"verdict reuse on {acc['frames']} frames of H.264 photo clips ({acc['events']} cuts, flashes, objects), "
              f"max age {MAX_AGE_MS:.0f} ms",
              ["threshold", "reused", "agree@0.5", f"agree@{acc['strict_threshold']:.3f}", "max diff", "p99 diff",
               "events reused", "other picture"],
              [(r["threshold"], f"{r['reused_share']:.1%}", f"{r['agreement']:.2%}", f"{r['agreement_strict']:.2%}",
                f"{r['max_score_diff']:.4f}", f"{r['p99_score_diff']:.4f}", len(r["events_reused"]),
                len(r["reused_from_another_picture"]))
               for r in acc["thresholds"]],
              note=f"frame-to-frame change: static (noise) median {acc['static_step_change']['median']:.2f} max "
                   f"{acc['static_step_change']['max']:.2f}; cuts/flashes/ends min {acc['event_change']['min']:.2f} "
                   f"median {acc['event_change']['median']:.2f}; nsfw scores {acc['nsfw_score_range']}; "
                   f"the model's own "
                   f"score jitter between consecutive static frames median "
                   f"{acc['model_jitter_static']['median']:.4f} max {acc['model_jitter_static']['max']:.4f}")
        cost = out["thumbnail_cost"] = thumbnail_cost(20 if args.quick else 60)
        table("thumbnail against full decode, ms per frame: min (median) of interleaved repeats",
              ["size", "jpeg bytes", "full RGB decode", "thumbnail", "of which check walk", "1/8 gray decode",
               "thumb/full"],
              [(r["size"], r["jpeg_bytes"], *(f"{r[k + '_min_ms']:.2f} ({r[k + '_ms']:.2f})" for k in
                                               ("full_decode", "thumbnail", "check_walk", "scaled_decode")),
                f"{r['ratio']:.1%}") for r in cost],
              note="the thumbnail includes the same structure walk (check_frame) the runtime makes again before its "
                   "full decode")
        per_stream = max(1, args.frames // 4)
        workload = static_workload(per_stream, 4, rng)
        rounds: list[dict[str, Any]] = []
        loop_round(executor, settings, [s[:4] for s in workload], 0.0)  # warm the loop's first-call costs
        for n in range(args.rounds):
            for reuse_ms in ((0.0, MAX_AGE_MS) if n % 2 == 0 else (MAX_AGE_MS, 0.0)):
                rounds.append({"round": n, **loop_round(executor, settings, workload, reuse_ms)})
        out["throughput"] = rounds
        summary = []
        for reuse_ms in (0.0, MAX_AGE_MS):
            mine = [r for r in rounds if r["reuse_max_age_ms"] == reuse_ms]
            fps = [r["frames_per_s"] for r in mine]
            cpu = [r["cpu_ms_per_frame"] for r in mine]
            summary.append({"reuse_max_age_ms": reuse_ms, "reused_share": mine[0]["reused"] / mine[0]["frames"],
                            "frames_per_s": statistics.median(fps), "frames_per_s_range": [min(fps), max(fps)],
                            "cpu_ms_per_frame": statistics.median(cpu), "cpu_ms_range": [min(cpu), max(cpu)]})
        out["throughput_summary"] = summary
        table(f"loop throughput, open_nsfw on this CPU, static camera (4 streams x {per_stream} noisy 720p JPEG), "
              f"{args.rounds} interleaved rounds, median (min-max)",
              ["reuse_max_age_ms", "reused", "frames/s", "CPU-ms/frame"],
              [(int(r["reuse_max_age_ms"]), f"{r['reused_share']:.1%}",
                f"{r['frames_per_s']:.1f} ({r['frames_per_s_range'][0]:.1f}-{r['frames_per_s_range'][1]:.1f})",
                f"{r['cpu_ms_per_frame']:.1f} ({r['cpu_ms_range'][0]:.1f}-{r['cpu_ms_range'][1]:.1f})")
               for r in summary])
    finally:
        executor.close()
    print(write_json("reuse", out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
