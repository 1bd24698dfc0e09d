"""Video in and frames that fit, against a real broker: a generated H.264 clip sent as two concurrent
streams gets exactly one result per sampled frame; a frame over its topic's limit is refused clearly;
`worker topics` makes topics that take a 1080p JPEG."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from worker.codec.schemas import FrameRecord
from worker.frames import Encoding, Priority
from worker.kafka.topics import DEFAULT_MAX_FRAME_BYTES, ensure_topics, topic_message_limits
from worker.tools.publish_frames import FrameTooLargeError, publish
from worker.tools.read_results import read_results

from ..conftest import PROJECT_ROOT
from .helpers import ledger, make_topics, start_worker, uncommitted

pytestmark = pytest.mark.integration
needs_video = pytest.mark.skipif(
    importlib.util.find_spec("av") is None or importlib.util.find_spec("skimage") is None,
    reason="needs the models extra (av, scikit-image): pip install -e '.[models]' or ./dev setup")


def _frame(pixels: np.ndarray, encoding: Encoding, stream: str, quality: int = 95) -> FrameRecord:
    h, w = pixels.shape[:2]
    if encoding is Encoding.JPEG:
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="JPEG", quality=quality)
        data = buf.getvalue()
    else:
        data = pixels.tobytes()
    return FrameRecord(stream_id=stream, frame_index=0, capture_ts_ms=0, tenant="t", priority=Priority.REALTIME,
                       width=w, height=h, channels=3, encoding=encoding, data=data)


def _cli(bootstrap: str, env: dict[str, str], *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "worker", *argv, "-b", bootstrap], cwd=PROJECT_ROOT,
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=180)


@needs_video
def test_a_video_sent_as_two_concurrent_streams_gets_one_result_per_sampled_frame(kafka_bootstrap, unique,
                                                                                  tmp_path):
    from worker.tools.sample_video import make_photo_clip

    clip = make_photo_clip(tmp_path / "pan.mp4", size=(320, 180), fps=10, seconds_per_photo=1.0)
    topics = make_topics(kafka_bootstrap, unique)
    # The same clip twice: two camera streams at once, each sampled at 5 of its 10 frames per second.
    out = _cli(kafka_bootstrap, topics.env(), "produce", "--from-video", str(clip.path), "--from-video",
               str(clip.path), "--fps", "5", "--run-id", unique, "--topic", topics.realtime)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    frames_in_clip = clip.frames_per_photo * len(clip.photos)
    sampled = {(f"{unique}-v{s}-pan", i) for s in (0, 1) for i in range(0, frames_in_clip, 2)}
    assert report["sent"] == report["acknowledged"] == len(sampled)

    worker = start_worker(kafka_bootstrap, topics, exit_when_idle=2.0, log_path=str(tmp_path / "worker.log"))
    assert worker.wait(timeout=180) == 0, (tmp_path / "worker.log").read_text()[-3000:]

    results = read_results(kafka_bootstrap, topics.results, idle_timeout_s=1.0)
    counts = ledger(results)
    assert set(counts) == sampled and max(counts.values()) == 1
    assert all(r["status"] == "OK" and r["source_topic"] == topics.realtime for r in results)
    # Capture times come from the stream's timestamps: 100 ms per frame of a 10 fps clip, in each stream.
    for s in (0, 1):
        capture = {r["frame_index"]: r["capture_ts_ms"] for r in results if r["stream_id"] == f"{unique}-v{s}-pan"}
        assert all(abs(capture[i] - capture[0] - 100 * i) <= 1 for i in capture)
    assert uncommitted(kafka_bootstrap, topics.group, topics.inputs) == {}


def test_a_frame_over_its_topics_limit_is_refused_naming_both_sizes_and_the_fix(kafka_bootstrap, unique):
    topic = f"t{unique}.small"
    ensure_topics(kafka_bootstrap, [topic], 1, configs={topic: {"max.message.bytes": "200000"}})
    raw_720p = _frame(np.zeros((720, 1280, 3), np.uint8), Encoding.RAW_RGB8, f"{unique}-raw")
    with pytest.raises(FrameTooLargeError) as err:
        publish(kafka_bootstrap, topic, [raw_720p])
    message = str(err.value)
    assert "1280x720 raw RGB) is 2,765," in message and "takes at most 200,000 (max.message.bytes)" in message
    assert "--encoding jpeg" in message and "worker topics --max-frame-bytes 3145728" in message


def test_worker_topics_creates_frame_topics_that_take_a_1080p_jpeg(kafka_bootstrap, unique):
    defaults = make_topics(kafka_bootstrap, unique + "d")  # created without a limit: Kafka's default, ~1 MB
    env = {"WORKER_TOPICS_REALTIME": f"t{unique}.realtime", "WORKER_TOPICS_STANDARD": f"t{unique}.standard",
           "WORKER_TOPICS_BULK": f"t{unique}.bulk", "WORKER_TOPICS_RESULTS": f"t{unique}.results",
           "WORKER_TOPICS_DEAD_LETTER": f"t{unique}.dlq", "WORKER_TOPICS_CONTROL": f"t{unique}.control",
           "WORKER_TOPICS_SHADOW_RESULTS": f"t{unique}.results.shadow"}
    out = _cli(kafka_bootstrap, env, "topics", "--partitions", "1")
    assert out.returncode == 0, out.stderr
    assert set(json.loads(out.stdout)["created"]) == set(env.values())
    frame_topics = [env[k] for k in ("WORKER_TOPICS_REALTIME", "WORKER_TOPICS_STANDARD", "WORKER_TOPICS_BULK",
                                     "WORKER_TOPICS_DEAD_LETTER")]
    assert set(topic_message_limits(kafka_bootstrap, frame_topics).values()) == {DEFAULT_MAX_FRAME_BYTES}

    # The worst 1080p JPEG: pure noise at quality 95 (2.4 MB; photos are 0.3-0.7 MB).
    noise = np.random.default_rng(0).integers(0, 256, (1080, 1920, 3), dtype=np.uint8)
    frame = _frame(noise, Encoding.JPEG, f"{unique}-1080p")
    assert len(frame.data) > 2_000_000
    assert publish(kafka_bootstrap, env["WORKER_TOPICS_REALTIME"], [frame]).acknowledged == 1
    with pytest.raises(FrameTooLargeError, match="max.message.bytes"):
        publish(kafka_bootstrap, defaults.realtime, [frame])
