"""bench/gpu_e2e.py, the GPU check's end-to-end section, where no GPU runs it: the schedule it feeds, its ledger,
and a few hundred photo JPEGs through the real loop (source, batcher, executor, delivery, sink, offsets) over the
in-memory Kafka fakes with the builtin model on the CPU, so the section cannot rot between GPU runs."""

from __future__ import annotations

import importlib.util
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))  # appended: never shadows a real module

import gpu_e2e

from worker.codec.schemas import decode_frame
from worker.config import Settings
from worker.frames import Priority, SourceRef
from worker.loop.pipeline import RunSummary

SETTINGS = Settings()
NEEDS_PHOTOS = pytest.mark.skipif(importlib.util.find_spec("skimage") is None,
                                  reason="needs scikit-image's bundled photos (the models extra)")


def test_the_schedule_spreads_frames_over_classes_streams_and_partitions_at_the_offered_rate() -> None:
    t0 = time.time()
    messages = gpu_e2e.schedule(SETTINGS, [b"\xff\xd8a", b"\xff\xd8b"], (224, 224), 100, 50.0, t0)
    assert Counter(m.priority for m in messages) == {Priority.REALTIME: 20, Priority.STANDARD: 40, Priority.BULK: 40}
    assert [m.due for m in messages] == pytest.approx([t0 + i / 50.0 for i in range(100)])
    streams: dict[str, list[tuple[tuple[str, int], int]]] = {}
    for m in messages:
        frame = decode_frame(m.value, SourceRef(*m.tp, 0), m.priority, t0, SETTINGS.limits)
        assert m.tp[0] == gpu_e2e.topic_of(SETTINGS, m.priority)
        assert frame.capture_ts_ms == round(m.due * 1000.0)  # capture time = the intended send time
        streams.setdefault(frame.stream_id, []).append((m.tp, frame.frame_index))
    assert len(streams) == 3 * gpu_e2e.STREAMS_PER_CLASS
    for frames in streams.values():
        assert len({tp for tp, _ in frames}) == 1  # a stream keeps its partition
        assert [index for _, index in frames] == list(range(len(frames)))
    assert {m.tp[1] for m in messages} == set(range(gpu_e2e.PARTITIONS))


def test_a_backlog_is_due_at_once() -> None:
    messages = gpu_e2e.schedule(SETTINGS, [b"\xff\xd8a"], (224, 224), 10, 0.0, 5.0)
    assert {m.due for m in messages} == {5.0}


def test_the_ledger_names_a_frame_answered_twice_and_one_committed_without_an_answer() -> None:
    messages = gpu_e2e.schedule(SETTINGS, [b"\xff\xd8a"], (224, 224), 5, 0.0, time.time())
    offsets: Counter[tuple[str, int]] = Counter()
    answers = []
    for m in messages:  # each partition's frames at offsets 0, 1, ...
        answers.append({"source_topic": m.tp[0], "source_partition": m.tp[1], "source_offset": offsets[m.tp],
                        "status": "OK"})
        offsets[m.tp] += 1

    def faults(results: list[dict]) -> list[str]:
        run = gpu_e2e.Run(messages=messages, results=results, dead_letters=0, committed=dict(offsets),
                          summary=RunSummary(), stopped_at_deadline=False, wall_s=1.0, thread_cpu_s={},
                          gpu_peak_bytes=None)
        return gpu_e2e.ledger_faults(gpu_e2e.ledger(run, SETTINGS))

    assert faults(answers) == []
    assert faults(answers + answers[:1])[0] == "1 duplicates"
    assert "1 lost" in faults(answers[1:])


@pytest.fixture(scope="module")
def toy():
    """The builtin CNN on the CPU, started as the section starts open_nsfw (warm-up of 224x224 and 720p, and the
    cost model's calibration), with batches of at most 8."""
    settings = gpu_e2e.e2e_settings(cuda=False, torch_threads=1, decode="cpu", model="toy", max_batch_size=8)
    executor, costs = gpu_e2e.start_executor(settings, freeze_heap=False)
    yield settings, executor, costs
    executor.close()


def assert_every_frame_answered_once(f: dict, sent: dict[str, int]) -> None:
    book = f["ledger"]
    assert f["ledger_faults"] == [] and book["complete"]
    assert {label: c["sent"] for label, c in book["classes"].items()} == sent
    for c in book["classes"].values():
        assert c["ok"] + c["expired"] == c["sent"] and c["unread"] == 0


@NEEDS_PHOTOS
def test_a_backlog_of_photo_jpegs_through_the_real_loop_is_answered_once_per_frame_and_class(toy) -> None:
    settings, executor, costs = toy
    messages = gpu_e2e.feed(settings, gpu_e2e.photo_jpegs((224, 224), crops=1), (224, 224), 300, 0.0)
    run = gpu_e2e.run_loop(settings, executor, messages, costs, deadline_s=120.0)
    f = gpu_e2e.figures(run, settings, timed=False)
    assert_every_frame_answered_once(f, {"realtime": 60, "standard": 120, "bulk": 120})
    assert run.committed == Counter(m.tp for m in messages)  # every partition committed to its end
    assert f["throughput"]["frames_per_s"] > 0 and 1.0 <= f["mean_batch"] <= 8
    # The loop's and the model's threads are told apart by their names.
    assert f["cpu_ms_per_frame"]["loop"] > 0 and f["cpu_ms_per_frame"]["inference"] > 0


@NEEDS_PHOTOS
def test_a_timed_feed_gets_latencies_per_class_from_capture_time_and_720p_frames_pass_too(toy) -> None:
    settings, executor, costs = toy
    messages = gpu_e2e.feed(settings, gpu_e2e.photo_jpegs((224, 224), crops=1), (224, 224), 150, 150.0)
    f = gpu_e2e.figures(gpu_e2e.run_loop(settings, executor, messages, costs, deadline_s=120.0), settings, timed=True)
    assert_every_frame_answered_once(f, {"realtime": 30, "standard": 60, "bulk": 60})
    for label, latency in f["latency_by_class"].items():
        ok = f["ledger"]["classes"][label]["ok"]
        assert 0 < latency["n"] <= ok and 0 <= latency["p50_ms"] <= latency["p99_ms"]
    # The goal's p99 is over every class together: as many frames as the classes hold, none faster than the fastest.
    assert f["latency"]["n"] == sum(v["n"] for v in f["latency_by_class"].values())
    assert f["latency"]["p99_ms"] >= min(v["p99_ms"] for v in f["latency_by_class"].values())
    assert f["drain_after_load_s"] >= -0.001  # the last frame was answered after it was due (capture times in ms)

    big = gpu_e2e.feed(settings, gpu_e2e.photo_jpegs((1280, 720), crops=1), (1280, 720), 25, 0.0)
    f = gpu_e2e.figures(gpu_e2e.run_loop(settings, executor, big, costs, deadline_s=120.0), settings, timed=False)
    assert_every_frame_answered_once(f, {"realtime": 5, "standard": 10, "bulk": 10})


@pytest.mark.parametrize(("p99", "complete", "verdict"), [
    (42.0, True, "met (p99 42 ms)"), (50.0, True, "NOT met (p99 50 ms)"),
    (12.0, False, "NOT met (p99 12 ms, not all answered)")])
def test_the_device_path_goal_needs_every_frame_answered_and_the_p99_under_50_ms(p99, complete, verdict) -> None:
    f = {"latency": {"p99_ms": p99}, "ledger": {"complete": complete}}
    assert gpu_e2e.goal_verdict(f) == f"goal (all answered, p99 < 50 ms): {verdict}"
