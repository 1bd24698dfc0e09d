"""Verdict reuse in the worker loop (issue 59), over the in-memory Kafka kit: a reused frame never runs the model
nor takes a batch slot, is answered once with its reference's verdict, and is never committed before it."""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import Any

import pytest

from tests.unit.test_pipeline import World, offsets, sample
from worker.codec.schemas import FrameRecord, decode_result, encode_frame
from worker.config import BatchingSettings, ClassSettings
from worker.frames import MODEL_ERROR, BatchOutcome, Encoding, FrameFailure, Priority
from worker.testing import CAPTURE_TS_MS, FakeExecutor, outcome

RT0 = (World().settings.topics.realtime, 0)
SIDE = 16


def reuse_batching(max_age_ms: float = 1_000) -> BatchingSettings:
    # No expiry (the fake clock runs ahead of the frames' capture times): reuse is the only thing under test.
    return BatchingSettings(rare_shape_min_count=1, max_batch_size=4, realtime=ClassSettings(
        max_wait_ms=5, max_age_ms=0, weight=8, reuse_max_age_ms=max_age_ms))


def picture(stream: str, index: int, level: int, capture_ms: int | None = None) -> bytes:
    """A raw frame of one grey `level`, captured 40 ms after the one before (25 fps)."""
    return encode_frame(FrameRecord(stream_id=stream, frame_index=index,
                                    capture_ts_ms=CAPTURE_TS_MS + 40 * index if capture_ms is None else capture_ms,
                                    tenant="t", priority=Priority.REALTIME, width=SIDE, height=SIDE, channels=3,
                                    encoding=Encoding.RAW_RGB8, data=bytes([level]) * (SIDE * SIDE * 3)))


def results(w: World) -> dict[int, dict[str, Any]]:
    """Every result by frame_index; a frame answered twice fails here."""
    out: dict[int, dict[str, Any]] = {}
    for p in w.producers:
        for m in p.visible:
            if m.topic == w.settings.topics.results:
                r = decode_result(m.value)
                assert r["frame_index"] not in out, f"frame {r['frame_index']} answered twice"
                out[r["frame_index"]] = r
    return out


def ran(w: World) -> list[int]:
    return [f.frame_index for batch in w.executor.batches for f in batch]


@pytest.mark.parametrize("mode", ["at_least_once", "exactly_once"])
def test_an_unchanged_stream_runs_the_model_once_and_every_frame_is_answered_once(mode: str) -> None:
    w = World(mode, batching=reuse_batching())
    w.kafka.append(RT0, *(picture("cam", i, 80) for i in range(10)))
    w.assign([RT0])
    w.step(4)
    assert ran(w) == [0]
    got = results(w)
    assert sorted(got) == list(range(10))
    assert got[0]["reused_from_frame"] is None and got[0]["batch_size"] == 1
    assert all(got[i]["reused_from_frame"] == 0 and got[i]["batch_size"] == 0 and got[i]["status"] == "OK"
               and got[i]["scores"] == got[0]["scores"] for i in range(1, 10))
    assert w.committed(RT0) == 10
    assert sample(w, "streamfer_frames_reused_total", priority="realtime") == 9
    assert sample(w, "streamfer_frames_scored_total", priority="realtime") == 1
    assert sample(w, "streamfer_reuse_streams") == 1


def test_a_cut_is_scored_and_becomes_the_reference_of_the_frames_after_it() -> None:
    w = World(batching=reuse_batching())
    levels = [80, 80, 80, 200, 200, 81, 81]
    w.kafka.append(RT0, *(picture("cam", i, level) for i, level in enumerate(levels)))
    w.assign([RT0])
    w.step(4)
    assert ran(w) == [0, 3, 5]
    assert [results(w)[i]["reused_from_frame"] for i in range(7)] == [None, 0, 0, None, 3, None, 5]


def test_a_frame_older_than_the_maximum_age_from_its_reference_is_scored() -> None:
    w = World(batching=reuse_batching(max_age_ms=100))
    w.kafka.append(RT0, *(picture("cam", i, 80) for i in range(6)))  # 40 ms apart
    w.assign([RT0])
    w.step(4)
    assert ran(w) == [0, 3]


def test_a_reused_frame_is_not_committed_before_its_reference_is_answered() -> None:
    w = World(batching=reuse_batching(), executor=FakeExecutor(hold=True))
    w.kafka.append(RT0, *(picture("cam", i, 80) for i in range(5)))
    w.assign([RT0])
    w.step(4)
    assert results(w) == {} and w.committed(RT0) in (None, 0)
    assert w.pipeline.admission.reuse.held == 4
    w.executor.release()
    w.step(3)
    assert sorted(results(w)) == [0, 1, 2, 3, 4] and w.committed(RT0) == 5
    assert ran(w) == [0]


class FailingExecutor(FakeExecutor):
    """Dead-letters the frames whose index is in `fail` (a model error on that frame alone)."""

    def __init__(self, fail: set[int]) -> None:
        super().__init__()
        self.fail = fail

    def submit(self, frames: Any, shape: tuple[int, int, int],
               priority: Priority = Priority.BULK) -> Future[BatchOutcome]:
        frames = list(frames)
        self.batches.append(frames)
        good = [f for f in frames if f.frame_index not in self.fail]
        future: Future[BatchOutcome] = Future()
        future.set_result(dataclasses.replace(outcome(good), failures=[
            FrameFailure(f, "injected", MODEL_ERROR) for f in frames if f.frame_index in self.fail]))
        return future


def test_frames_held_for_a_reference_that_is_dead_lettered_are_scored_not_lost() -> None:
    w = World(batching=reuse_batching(), executor=FailingExecutor({0}))
    w.kafka.append(RT0, *(picture("cam", i, 80) for i in range(4)))
    w.assign([RT0])
    w.step(5)
    assert ran(w) == [0, 1]  # 1, 2, 3 were held for 0; 0 failed, so 1 became the reference
    assert [m.key for m in w.dead_letters()] == [b"cam"]
    assert sorted(results(w)) == [1, 2, 3]
    assert [results(w)[i]["reused_from_frame"] for i in (1, 2, 3)] == [None, 1, 1]
    assert w.committed(RT0) == 4


def test_a_revoked_partition_leaves_no_reuse_state_and_its_next_reading_scores_again() -> None:
    w = World(batching=reuse_batching())
    w.kafka.append(RT0, *(picture("cam", i, 80) for i in range(3)))
    w.assign([RT0])
    w.step(3)
    assert w.pipeline.admission.reuse.streams == 1
    w.kafka.rebalance("revoke", [RT0])
    w.step()
    assert w.pipeline.admission.reuse.streams == 0 and w.committed(RT0) == 3
    w.kafka.append(RT0, *(picture("cam", i, 80) for i in range(3, 5)))
    w.assign([RT0])
    w.step(3)
    assert ran(w) == [0, 3]


def test_a_lost_partition_drops_its_held_frames_uncommitted() -> None:
    w = World(batching=reuse_batching(), executor=FakeExecutor(hold=True))
    w.kafka.append(RT0, *(picture("cam", i, 80) for i in range(4)))
    w.assign([RT0])
    w.step(3)
    w.kafka.rebalance("lost", [RT0])
    w.step()
    assert w.pipeline.admission.reuse.streams == 0 and w.pipeline.admission.reuse.held == 0
    w.executor.release()  # the stale batch finishes: nothing of the lost partition is answered or committed
    w.step(2)
    assert results(w) == {} and w.committed(RT0) in (None, 0)


def test_a_stop_answers_frames_held_for_a_reference_still_running() -> None:
    w = World(batching=reuse_batching())
    w.kafka.append(RT0, *(picture("cam", i, 80) for i in range(4)))
    w.assign([RT0])
    w.step()  # read and held, the reference pending in the batcher
    w.pipeline.drain()
    assert sorted(results(w)) == [0, 1, 2, 3] and w.committed(RT0) == 4


def test_with_reuse_off_every_frame_is_scored_and_no_stream_is_kept() -> None:
    w = World(batching=reuse_batching(max_age_ms=0))
    w.kafka.append(RT0, *(picture("cam", i, 80) for i in range(5)))
    w.assign([RT0])
    w.step(4)
    assert ran(w) == [0, 1, 2, 3, 4]
    assert all(r["reused_from_frame"] is None for r in results(w).values())
    assert w.pipeline.admission.reuse is None  # no policy at all: no frame pays for it
    assert offsets(w.results(), RT0) == [0, 1, 2, 3, 4]
