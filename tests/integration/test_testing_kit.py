"""The test kit's pieces the benchmarks stand on, against the real broker and worker: a second consumer of the
same published frames, a worker with its own defaults started without waiting, commits awaited, frames published
open loop."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from worker.frames import Encoding, Priority
from worker.testing import (
    FrameProducer,
    ResultsReader,
    end_offsets,
    ledger,
    make_topics,
    run_worker,
    synthetic_frames,
    wait_committed,
)

pytestmark = pytest.mark.integration


def test_a_second_consumer_of_the_same_inputs_reads_the_backlog_again_into_its_own_results(
        kafka_bootstrap: str, tmp_path: Path) -> None:
    first = make_topics(kafka_bootstrap, uuid.uuid4().hex[:8])
    frames = synthetic_frames(40, [(32, 32), (48, 32)], Encoding.RAW_RGB8, Priority.BULK, "kit",
                              streams_per_shape=3)
    report = FrameProducer(kafka_bootstrap, first).publish(frames)
    assert report.sent == 40 and report.acknowledged == 40
    second = make_topics(kafka_bootstrap, uuid.uuid4().hex[:8], inputs_of=first)
    assert second.inputs == first.inputs and second.results != first.results and second.group != first.group
    ends = end_offsets(kafka_bootstrap, second.inputs)

    # The worker's own defaults (not the tests'), started without waiting for /readyz, as a benchmark times it.
    worker = run_worker(kafka_bootstrap, second, tmp_path, env={"WORKER_BATCHING_REALTIME_MAX_AGE_MS": "0",
                                                                "WORKER_BATCHING_STANDARD_MAX_AGE_MS": "0"},
                        ready=False, test_env=False)
    try:
        assert worker.alive()
        assert wait_committed(kafka_bootstrap, second.group, ends, 120, alive=worker.alive, first=True)
        assert wait_committed(kafka_bootstrap, second.group, ends, 120, alive=worker.alive)
    finally:
        assert worker.stop() == 0
    assert not worker.alive()
    results = ResultsReader(kafka_bootstrap, second).read_all(idle_timeout_s=1.0)
    assert ledger(results) == {(f.stream_id, f.frame_index): 1 for f in frames}
    assert ResultsReader(kafka_bootstrap, first).read_all(idle_timeout_s=1.0) == []  # nobody consumed `first`


def test_waiting_for_commits_gives_up_when_the_consumer_is_gone(kafka_bootstrap: str) -> None:
    topics = make_topics(kafka_bootstrap, uuid.uuid4().hex[:8])
    FrameProducer(kafka_bootstrap, topics).publish(synthetic_frames(5, [(32, 32)], Encoding.RAW_RGB8,
                                                                    Priority.STANDARD, "kit"))
    ends = end_offsets(kafka_bootstrap, topics.inputs)
    t0 = time.monotonic()
    assert not wait_committed(kafka_bootstrap, topics.group, ends, 60, alive=lambda: False)
    assert time.monotonic() - t0 < 30
    assert not wait_committed(kafka_bootstrap, topics.group, ends, 0.5)


def test_open_loop_publishing_is_paced_and_reports_each_frames_send_delay(kafka_bootstrap: str) -> None:
    topics = make_topics(kafka_bootstrap, uuid.uuid4().hex[:8])
    producer = FrameProducer(kafka_bootstrap, topics)
    frames = synthetic_frames(20, [(32, 32)], Encoding.RAW_RGB8, Priority.REALTIME, "kit")
    report = producer.publish(frames, rate_fps=40.0)
    assert report.sent == 20 and len(report.send_delays_ms) == 20
    assert report.seconds >= 19 / 40.0  # paced: frame i is due at i / rate
    again = producer.publish(frames[:3])  # the same producer, kept
    assert again.sent == 3
