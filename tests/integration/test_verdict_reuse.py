"""Verdict reuse (issue 59) on the real broker: workers (the real pipeline, Kafka clients and delivery, over an
in-process executor that takes a while per batch, so frames wait for their reference) answer each frame once,
commit no frame before its reference, and keep no stream's state past a rebalance that moved its partition."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter, defaultdict
from concurrent.futures import Future
from typing import Any

import pytest
from confluent_kafka import Producer

from tests.integration.helpers import group_commit_history
from tests.integration.test_rebalance_transactions import WAIT_S, InProcessWorker
from worker.codec.schemas import FrameRecord, encode_frame
from worker.config import load_settings
from worker.frames import BatchOutcome, Encoding, Priority
from worker.loop.pipeline import build_pipeline
from worker.metrics import Health, Metrics
from worker.testing import ResultsReader, TestTopics, committed_offsets, end_offsets, make_topics, wait_for
from worker.testing.fakes import FakeExecutor, outcome

PARTITIONS = 2
STREAMS_PER_PARTITION = 2
FRAMES_PER_ROUND = 30  # per stream; a cut every CUT_EVERY frames
CUT_EVERY = 10
SIDE = 16
BATCH_S = 0.05


class SlowExecutor(FakeExecutor):
    """Scores each batch BATCH_S after it was submitted, on a timer thread: the frames read meanwhile that show
    the same picture wait for it in the reuse policy."""

    def submit(self, frames: Any, shape: tuple[int, int, int],
               priority: Priority = Priority.BULK) -> Future[BatchOutcome]:
        frames = list(frames)
        self.batches.append(frames)
        future: Future[BatchOutcome] = Future()
        threading.Timer(BATCH_S, future.set_result, (outcome(frames),)).start()
        return future


def start(bootstrap: str, t: TestTopics, name: str) -> InProcessWorker:
    settings = load_settings(
        env={"WORKER_BATCHING_REALTIME_MAX_AGE_MS": "0", "WORKER_BATCHING_REALTIME_REUSE_MAX_AGE_MS": "60000"},
        overrides={**t.overrides(), "kafka": {"bootstrap_servers": bootstrap, "group_id": t.group,
                                              "session_timeout_ms": 6000},
                   "observability": {"worker_id": f"{t.group}-{name}", "metrics_enabled": False}})
    assert settings.batching.realtime.reuse_max_age_ms == 60_000
    metrics = Metrics(settings=settings)
    return InProcessWorker(name, build_pipeline(settings, SlowExecutor(), metrics, Health()), metrics).start()


def publish(bootstrap: str, t: TestTopics, first: int) -> int:
    """FRAMES_PER_ROUND frames of each stream, from frame `first` on: one grey level a stream, changed every
    CUT_EVERY frames (a cut). Streams are placed on partitions by hand, two a partition."""
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    now_ms = int(time.time() * 1000)
    for partition in range(PARTITIONS):
        for s in range(STREAMS_PER_PARTITION):
            stream = f"p{partition}s{s}"
            for i in range(first, first + FRAMES_PER_ROUND):
                level = 40 + 60 * ((i // CUT_EVERY) % 3) + 10 * s
                producer.produce(t.realtime, encode_frame(FrameRecord(
                    stream_id=stream, frame_index=i, capture_ts_ms=now_ms + 40 * i, tenant="t",
                    priority=Priority.REALTIME, width=SIDE, height=SIDE, channels=3, encoding=Encoding.RAW_RGB8,
                    data=bytes([level]) * (SIDE * SIDE * 3))), key=stream.encode(), partition=partition)
    producer.flush(30)
    return PARTITIONS * STREAMS_PER_PARTITION * FRAMES_PER_ROUND


@pytest.fixture
def topics(kafka_bootstrap: str) -> TestTopics:
    return make_topics(kafka_bootstrap, uuid.uuid4().hex[:8], partitions=PARTITIONS)


def reused(w: InProcessWorker) -> float:
    return w.metrics.registry.get_sample_value("streamfer_frames_reused_total", {"priority": "realtime"}) or 0.0


def scored(w: InProcessWorker) -> float:
    return w.metrics.registry.get_sample_value("streamfer_frames_scored_total", {"priority": "realtime"}) or 0.0


def realtime_owned(w: InProcessWorker) -> int:
    return sum(1 for topic, _ in w.pipeline.assignments.partitions if topic.endswith(".realtime"))


def test_reused_frames_are_answered_once_never_committed_before_their_reference_and_forgotten_on_a_rebalance(
        kafka_bootstrap: str, topics: TestTopics, workers: list[InProcessWorker]) -> None:
    sent = publish(kafka_bootstrap, topics, 0)
    a = start(kafka_bootstrap, topics, "a")
    workers.append(a)
    wait_for(lambda: reused(a) + scored(a) >= sent, WAIT_S, "the first worker answers the backlog")
    assert a.pipeline.admission.reuse.partitions == {(topics.realtime, p) for p in range(PARTITIONS)}

    b = start(kafka_bootstrap, topics, "b")  # a join: one partition moves from a to b
    workers.append(b)
    wait_for(lambda: realtime_owned(a) == realtime_owned(b) == 1, WAIT_S,
             "the two workers share the realtime partitions")
    # The partition a gave up took its streams' state with it.
    assert a.pipeline.admission.reuse.partitions <= a.pipeline.assignments.partitions
    sent += publish(kafka_bootstrap, topics, FRAMES_PER_ROUND)

    results = ResultsReader(kafka_bootstrap, topics).read(sent, timeout_s=WAIT_S)
    wait_for(lambda: committed_at_end(kafka_bootstrap, topics), WAIT_S, "the commits reach the end")
    a.halt()
    b.halt()
    for w in workers:
        assert not w.error, f"{w.name}: {w.error}"

    # Each frame answered once.
    answered = Counter((r["source_partition"], r["source_offset"]) for r in results)
    assert len(answered) == sent and max(answered.values()) == 1
    by_frame = {(r["stream_id"], r["frame_index"]): r for r in results}
    reuses = [r for r in results if r["reused_from_frame"] is not None]
    assert reuses and reused(a) > 0 and reused(b) > 0
    # Every cut scored; a reused frame's reference is a scored frame of its stream, by the same worker (state is
    # never shared), and sits before it in the stream's output order.
    order = {(r["stream_id"], r["frame_index"]): n for n, r in enumerate(results)}
    for r in results:
        if r["frame_index"] % CUT_EVERY == 0:
            assert r["reused_from_frame"] is None, r
    for r in reuses:
        ref = by_frame[(r["stream_id"], r["reused_from_frame"])]
        assert ref["reused_from_frame"] is None and ref["worker_id"] == r["worker_id"]
        assert order[(ref["stream_id"], ref["frame_index"])] < order[(r["stream_id"], r["frame_index"])]
        assert ref["source_offset"] < r["source_offset"] and ref["scores"] == r["scores"]
    # The first frame each worker answered of a stream is scored: b started with nothing of a's.
    first: dict[tuple[str, str], dict[str, Any]] = {}
    for r in results:
        first.setdefault((r["worker_id"], r["stream_id"]), r)
    assert all(r["reused_from_frame"] is None for r in first.values())
    # Commits never ahead of a reused frame's reference: at every commit point, every frame below it was answered,
    # its reference too.
    offset_of = {(r["stream_id"], r["frame_index"]): r["source_offset"] for r in results}
    by_partition: dict[int, set[int]] = defaultdict(set)
    for r in results:
        by_partition[r["source_partition"]].add(r["source_offset"])
    history = group_commit_history(kafka_bootstrap, topics.group)
    for (topic, partition), points in history.items():
        if topic != topics.realtime:
            continue
        for point in points:
            assert set(range(point)) <= by_partition[partition]
            for r in reuses:
                if r["source_partition"] == partition and r["source_offset"] < point:
                    assert offset_of[(r["stream_id"], r["reused_from_frame"])] < point


def committed_at_end(bootstrap: str, t: TestTopics) -> bool:
    committed = committed_offsets(bootstrap, t.group, [t.realtime])
    return all(committed.get(tp) == end for tp, end in end_offsets(bootstrap, [t.realtime]).items())
