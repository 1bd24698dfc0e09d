"""Model rollouts, pure (issue 69): the swap between batches over the testing kit's fakes (the real loop across a
promote), shadow and canary scoring, and a worker's rollout state machine with an injected loader."""

from __future__ import annotations

import dataclasses
import gc
import threading
import weakref
from collections.abc import Callable
from typing import Any

import pytest

from worker.config import ObservabilitySettings, Settings
from worker.control.records import (
    MODELS,
    ControlRecord,
    DesiredModels,
    ModelRef,
    RolloutReport,
)
from worker.frames import BatchOutcome, Frame, Priority, SourceRef, Verdict
from worker.loop.pipeline import build_pipeline
from worker.metrics import Health, Metrics
from worker.rollout.manager import Rollout, compare_shadow
from worker.rollout.plan import (
    CANARY,
    FAILED,
    LOADING,
    SERVING,
    SHADOW,
    WARMING,
    in_share,
)
from worker.rollout.swap import SwappableExecutor
from worker.testing import FakeClock, FakeExecutor, InMemoryKafka, frame_value

OLD = ModelRef("builtin", "streamfer-moderation-cnn", "1")
NEW = ModelRef("builtin", "streamfer-moderation-cnn", "2")


def models_record(revision: int, models: DesiredModels, group: str = "g") -> ControlRecord:
    return ControlRecord(MODELS, group, revision, 1_700_000_000_000, "ops@host", models=models)


def frame(stream: str, index: int = 0) -> Frame:
    from worker.frames import Encoding

    return Frame(stream_id=stream, frame_index=index, tenant="t", priority=Priority.STANDARD, capture_ts_ms=0, width=2,
                 height=2, channels=3, encoding=Encoding.RAW_RGB8, data=bytes(12), source=SourceRef("in", 0, index))


def fake(version: str, hold: bool = False) -> FakeExecutor:
    ex = FakeExecutor(hold=hold)
    ex.model_version = version
    return ex


def run_now(fn: Callable[[], None]) -> None:
    fn()


# -- the swap between batches ---------------------------------------------------------------------------------------
def test_a_promote_takes_effect_between_batches_and_the_old_model_closes_after_its_last():
    old, new = fake("1", hold=True), fake("2")
    closes: list[Any] = []
    swap = SwappableExecutor(old, OLD, closer=lambda close: closes.append(close) or close())
    first = swap.submit([frame("a", 0), frame("b", 0)], (2, 2, 3), Priority.REALTIME)
    swap.set_candidate(new, NEW, "", 0.0)
    swap.promote(new, NEW)
    assert swap.model_version == "1" and not old.closed  # nothing changes until the loop's next batch
    second = swap.submit([frame("a", 1)], (2, 2, 3))
    assert swap.model_version == "2" and len(new.batches) == 1 and len(old.batches) == 1
    assert not old.closed and not first.done()  # the batch already dispatched still runs on the old model
    old.release()
    assert first.result().scored_by == (("fake", "1"),) * 2 and second.result().scored_by == (("fake", "2"),)
    assert old.closed and len(closes) == 1 and not new.closed
    swap.close()
    assert new.closed


def test_the_replaced_model_is_unreferenced_after_its_last_batch():
    """Nothing of the swap keeps a replaced model alive: its memory can be freed."""
    old, new = fake("1", hold=True), fake("2")
    swap = SwappableExecutor(old, OLD, closer=run_now)
    first = swap.submit([frame("a")], (2, 2, 3))
    swap.promote(new, NEW)
    swap.submit([frame("a", 1)], (2, 2, 3)).result()
    gone = weakref.ref(old)
    old.release()
    first.result()
    del old, first
    gc.collect()
    assert gone() is None


def test_a_canary_answers_its_share_of_streams_with_the_candidate():
    old, new = fake("1"), fake("2")
    swap = SwappableExecutor(old, OLD)
    swap.set_candidate(new, NEW, CANARY, 0.3)
    frames = [frame(f"s{i}", 0) for i in range(200)]
    outcome = swap.submit(frames, (2, 2, 3)).result()
    by_stream = {f.stream_id: m for (f, _), m in zip(outcome.verdicts, outcome.scored_by, strict=True)}
    assert len(by_stream) == 200
    assert all((m == ("fake", "2")) == in_share(s, 0.3) for s, m in by_stream.items())
    assert 0.2 < sum(m == ("fake", "2") for m in by_stream.values()) / 200 < 0.4


def test_shadow_scores_the_share_again_and_is_skipped_while_the_worker_is_behind():
    old, new = fake("1", hold=True), fake("2")
    shadowed: list[list[Frame]] = []
    skipped: list[int] = []
    swap = SwappableExecutor(old, OLD, on_shadow=lambda frames, p, s, m: shadowed.append(list(frames)),
                             on_skipped=skipped.append)
    swap.set_candidate(new, NEW, SHADOW, 0.5)
    frames = [frame(f"s{i}", 0) for i in range(40)]
    picked = [f for f in frames if in_share(f.stream_id, 0.5)]
    first = swap.submit(frames, (2, 2, 3))
    assert new.batches == [picked]  # the candidate scores the share (the primary every frame)
    swap.submit(frames, (2, 2, 3))  # a shadow batch still waits for its comparison: skipped, counted
    swap.submit(frames, (2, 2, 3))
    assert skipped == [len(picked), len(picked)] and len(new.batches) == 1
    old.release()
    assert first.result().scored_by == (("fake", "1"),) * 40  # the primary's results are the primary's
    assert shadowed == [picked]


def test_shadow_comparison_counts_agreement_and_differences_per_label():
    metrics = Metrics()
    frames = [frame("a"), frame("b")]
    primary = BatchOutcome([(frames[0], Verdict({"n": 0.9}, ("n",))), (frames[1], Verdict({"n": 0.1}, ()))], [], 2,
                           1.0, 1.0, 0.0, 2, False)
    shadow = BatchOutcome([(frames[0], Verdict({"n": 0.8}, ("n",))), (frames[1], Verdict({"n": 0.6}, ("n",)))], [], 2,
                          1.0, 1.0, 0.0, 2, False)
    compare_shadow(frames, primary, shadow, metrics)
    assert metrics.shadow_agreement.labels("n", "agree")._value.get() == 1
    assert metrics.shadow_agreement.labels("n", "disagree")._value.get() == 1
    assert metrics.shadow_frames.labels("scored")._value.get() == 2
    assert metrics.shadow_score_difference.labels("n")._sum.get() == pytest.approx(0.4)


def test_the_loop_answers_every_frame_once_across_a_promote_and_names_the_model_of_each():
    """The real Pipeline over the testing kit: frames before the promote carry version 1, after it version 2."""
    settings = Settings(observability=ObservabilitySettings(worker_id="w0"))
    kafka, clock = InMemoryKafka(), FakeClock()
    old, new = fake("1"), fake("2")
    swap = SwappableExecutor(old, OLD, closer=run_now)
    tp = (settings.topics.standard, 0)
    kafka.send(tp, *(frame_value("cam-1", i) for i in range(10)))  # before the consumer: assigned at its first poll
    pipeline = build_pipeline(settings, swap, Metrics(), Health(), clock, clients=kafka.clients)
    swap.on_swap = lambda held: pipeline.answers.use_model(held.model)
    promoted = [False]

    def step() -> bool:
        clock.advance(0.1)
        results = kafka.results()
        if len(results) >= 10 and not promoted[0]:
            promoted[0] = True
            swap.promote(new, NEW)
            kafka.send(tp, *(frame_value("cam-1", i) for i in range(10, 20)))
        return len(results) == 20

    pipeline.run(should_stop=step)
    got = kafka.results()
    versions = {(r["frame_index"]): r["model_version"] for r in got}
    assert sorted(versions) == list(range(20)) and len(got) == 20
    assert all(versions[i] == "1" for i in range(10)) and all(versions[i] == "2" for i in range(10, 20))
    assert old.closed and not new.closed


# -- a worker's rollout ---------------------------------------------------------------------------------------------
class Loads:
    """A loader that hands out FakeExecutors, or fails with a reason, as told."""

    def __init__(self) -> None:
        self.loaded: list[ModelRef] = []
        self.fail: dict[ModelRef, str] = {}
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, ref: ModelRef, warming: Callable[[], None]) -> Any:
        self.loaded.append(ref)
        if ref in self.fail:
            raise RuntimeError(self.fail[ref])
        warming()
        return fake(ref.version)


def rollout_of(loads: Loads, metrics: Metrics | None = None, allowed: tuple[str, ...] = ()) -> tuple[
        SwappableExecutor, Rollout, list[RolloutReport]]:
    swap = SwappableExecutor(fake("1"), OLD, closer=run_now)
    reports: list[RolloutReport] = []
    rollout = Rollout(swap, OLD, allowed, loads, reports.append, metrics, spawn=run_now)
    return swap, rollout, reports


def test_a_rollout_loads_the_candidate_then_shadows_then_promotes_between_batches():
    loads, metrics = Loads(), Metrics()
    swap, rollout, reports = rollout_of(loads, metrics)
    rollout.apply(None)
    assert rollout.state == SERVING and loads.loaded == []
    rollout.apply(models_record(1, DesiredModels(None, NEW, SHADOW, 0.2)))
    assert [r.state for r in reports] == [LOADING, WARMING, SHADOW]
    assert swap.candidate is not None and swap.mode == SHADOW and swap.share == 0.2
    assert reports[-1].candidate == "fake:2" and reports[-1].serving == "fake:1"
    rollout.apply(models_record(2, DesiredModels(NEW)))  # promote
    assert swap.promoting and rollout.state == SHADOW  # reported once the loop takes it
    swap.submit([frame("a")], (2, 2, 3))
    assert rollout.state == SERVING and reports[-1].serving == "fake:2" and reports[-1].revision == 2
    assert loads.loaded == [NEW]  # the promote used the candidate already warm
    assert metrics.rollout_changes.labels("promoted")._value.get() == 1


def test_a_failed_candidate_leaves_the_primary_serving_and_is_not_retried_at_its_revision():
    loads, metrics = Loads(), Metrics()
    loads.fail[NEW] = "model.source '/m/x.pt': not a TorchScript file (corrupt)"
    swap, rollout, reports = rollout_of(loads, metrics)
    record = models_record(1, DesiredModels(None, NEW, CANARY, 0.5))
    rollout.apply(record)
    assert rollout.state == FAILED and "corrupt" in rollout.reason and swap.candidate is None
    assert rollout.problem is not None and "revision 1 failed" in rollout.problem and "corrupt" in rollout.problem
    assert metrics.rollout_failed._value.get() == 1 and reports[-1].state == FAILED
    rollout.apply(record)  # read again (a follower's re-read): not loaded again
    assert loads.loaded == [NEW]
    del loads.fail[NEW]
    rollout.apply(models_record(2, DesiredModels(None, NEW, CANARY, 0.5)))  # a new revision is tried
    assert rollout.state == CANARY and loads.loaded == [NEW, NEW] and rollout.problem is None
    assert metrics.rollout_failed._value.get() == 0


def test_a_source_outside_allowed_sources_is_refused_without_loading():
    loads = Loads()
    _swap, rollout, _ = rollout_of(loads)
    rollout.apply(models_record(1, DesiredModels(None, ModelRef("/tmp/evil.pt", "e", "1"), SHADOW, 0.1)))
    assert rollout.state == FAILED and "allowed_sources" in rollout.reason and loads.loaded == []


def test_an_abort_withdraws_the_candidate_and_closes_it():
    loads = Loads()
    swap, rollout, reports = rollout_of(loads)
    rollout.apply(models_record(1, DesiredModels(None, NEW, SHADOW, 0.2)))
    candidate = swap.candidate
    assert candidate is not None
    rollout.apply(models_record(2, DesiredModels(None)))
    assert swap.candidate is None and candidate.executor.closed and rollout.state == SERVING
    assert reports[-1].state == SERVING and reports[-1].candidate == ""


def test_a_late_worker_loads_a_primary_it_does_not_serve_and_promotes_it():
    """A worker started with the file's model, the group already on another primary (no candidate)."""
    loads = Loads()
    swap, rollout, _ = rollout_of(loads)
    rollout.apply(models_record(3, DesiredModels(NEW)))
    assert loads.loaded == [NEW] and swap.promoting
    swap.submit([frame("a")], (2, 2, 3))
    assert swap.serving.ref == NEW and rollout.state == SERVING


def reuse_pipeline(swap: SwappableExecutor, *first: bytes) -> tuple[Any, InMemoryKafka, FakeClock, Any]:
    """The real Pipeline over the testing kit with verdict reuse on for realtime frames (200 ms), `first` sent to
    its realtime partition before the consumer (assigned at its first poll)."""
    from tests.unit.test_pipeline_reuse import reuse_batching

    settings = Settings(observability=ObservabilitySettings(worker_id="w0"), batching=reuse_batching(max_age_ms=200))
    kafka, clock = InMemoryKafka(), FakeClock()
    kafka.send((settings.topics.realtime, 0), *first)
    pipeline = build_pipeline(settings, swap, Metrics(), Health(), clock, clients=kafka.clients)
    swap.on_swap = lambda held: pipeline.model_promoted(held.model)
    return pipeline, kafka, clock, (settings.topics.realtime, 0)


def test_after_a_promote_no_frame_is_answered_with_the_old_models_verdict():
    from tests.unit.test_pipeline_reuse import CAPTURE_TS_MS, picture

    old, new = fake("1"), fake("2")
    swap = SwappableExecutor(old, OLD, closer=run_now)
    # cam 1-2 reuse cam 0's verdict
    pipeline, kafka, clock, tp = reuse_pipeline(swap, *(picture("cam", i, 80) for i in range(3)),
                                                picture("other", 0, 80))
    stage = [0]

    def step() -> bool:
        clock.advance(0.1)
        done = len(kafka.results())
        if stage[0] == 0 and done == 4:
            swap.promote(new, NEW)  # takes effect at the next batch: other's frame 1, past reuse's 200 ms
            kafka.send(tp, picture("other", 1, 80, capture_ms=CAPTURE_TS_MS + 300))
            stage[0] = 1
        elif stage[0] == 1 and done == 5:
            # Within 200 ms of cam 0, the same picture: reusing cam 0's verdict would answer with the old model's.
            kafka.send(tp, picture("cam", 3, 80, capture_ms=CAPTURE_TS_MS + 150))
            stage[0] = 2
        return done == 6

    pipeline.run(should_stop=step)
    got = {(r["stream_id"], r["frame_index"]): r for r in kafka.results()}
    assert [(r["stream_id"], r["frame_index"], r["reused_from_frame"], r["model_version"]) for r in
            sorted(got.values(), key=lambda r: (r["model_version"], r["stream_id"], r["frame_index"]))] == [
        ("cam", 0, None, "1"), ("cam", 1, 0, "1"), ("cam", 2, 0, "1"), ("other", 0, None, "1"),
        ("cam", 3, None, "2"), ("other", 1, None, "2")]


def test_a_reused_result_names_the_model_that_scored_its_reference():
    """A canary stream's frames are scored by the candidate: its reused frames name the candidate too."""
    from tests.unit.test_pipeline_reuse import picture

    old, new = fake("1"), fake("2")
    swap = SwappableExecutor(old, OLD, closer=run_now)
    swap.set_candidate(new, NEW, CANARY, 0.5)
    canary = next(f"cam-{i}" for i in range(100) if in_share(f"cam-{i}", 0.5))
    pipeline, kafka, clock, _ = reuse_pipeline(swap, *(picture(canary, i, 80) for i in range(4)))

    def step() -> bool:
        clock.advance(0.1)
        return len(kafka.results()) == 4

    pipeline.run(should_stop=step)
    got = {r["frame_index"]: r for r in kafka.results()}
    assert [got[i]["reused_from_frame"] for i in range(4)] == [None, 0, 0, 0]
    assert [got[i]["model_version"] for i in range(4)] == ["2"] * 4 and not old.batches


def test_a_promote_forgets_known_verdicts_but_keeps_references_in_flight():
    import numpy as np

    from worker.reuse.policy import Decision, FrameReuse

    def at(stream: str, index: int, offset: int) -> Frame:
        return dataclasses.replace(frame(stream, index), source=SourceRef("in", 0, offset))

    reuse = FrameReuse({Priority.STANDARD: 1_000}, change_threshold=0.1)
    thumb = np.zeros((4, 4), np.float32)
    known, in_flight = at("known", 0, 0), at("flying", 0, 1)
    assert reuse.offer(known, thumb) is Decision.SCORE and reuse.offer(in_flight, thumb) is Decision.SCORE
    reuse.scored(known, Verdict({"n": 0.5}, ()), ("fake", "1"))
    assert reuse.offer(at("flying", 1, 2), thumb) is Decision.HELD
    reuse.forget_verdicts()
    assert reuse.offer(at("known", 1, 3), thumb) is Decision.SCORE  # scored by the model now serving
    held = reuse.scored(in_flight, Verdict({"n": 0.2}, ()), ("fake", "2"))
    assert [(r.frame.frame_index, r.model) for r in held] == [(1, ("fake", "2"))]
