"""The scheduler in the real loop (batcher, pipeline, delivery over Kafka fakes, fake clock): realtime
isolation (a reserved in-flight slot, out-of-order collection by class) and priority under overload, the
bug of issue 16 (realtime frames came back EXPIRED while bulk frames were scored)."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
from concurrent.futures import Future
from typing import Any

import pytest

import worker.loop.pipeline as pipeline_module
from worker.codec.schemas import FrameRecord, decode_result, encode_frame
from worker.config import BatchingSettings, ClassSettings, ConfigError, ModelSettings, Settings
from worker.frames import BatchOutcome, Encoding, Frame, Priority
from worker.loop.pipeline import build_pipeline
from worker.runtime import InferenceExecutor
from worker.runtime.models import ModelContract
from worker.testing import FakeExecutor, outcome, wait_for

from .model_factories import StandInRunner
from .test_pipeline import World, sample

TOPICS = Settings().topics
RT, STD, BULK = (TOPICS.realtime, 0), (TOPICS.standard, 0), (TOPICS.bulk, 0)


def frame_at(stream: str, index: int, capture_s: float, side: int = 4) -> bytes:
    return encode_frame(FrameRecord(stream_id=stream, frame_index=index, capture_ts_ms=round(capture_s * 1000),
                                    tenant="t", priority=Priority.REALTIME, width=side, height=side, channels=3,
                                    encoding=Encoding.RAW_RGB8, data=bytes(side * side * 3)))


def results_by_topic(w: World) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for p in w.producers:
        for m in p.visible:
            if m.topic == w.settings.topics.results:
                r = decode_result(m.value)
                out.setdefault(r["source_topic"], []).append(r)
    return out


# -- realtime isolation ---------------------------------------------------------------------------------------
def test_a_realtime_batch_is_dispatched_while_two_bulk_batches_are_in_flight() -> None:
    w = World(hold=True, max_inflight=2)
    w.kafka.append(BULK, *(frame_at("b", i, w.clock.now) for i in range(12)))
    w.assign([RT, STD, BULK])
    w.step(2)
    assert w.executor.priorities == [Priority.BULK, Priority.BULK]  # the limit: the third bulk batch waits

    w.kafka.append(RT, *(frame_at("r", i, w.clock.now) for i in range(4)))
    w.step(2)

    assert w.executor.priorities == [Priority.BULK, Priority.BULK, Priority.REALTIME]
    assert w.pipeline.inflight_batches == 3


def test_a_finished_realtime_batch_is_delivered_while_an_older_bulk_batch_still_runs() -> None:
    w = World(hold=True, max_inflight=2)
    w.kafka.append(BULK, *(frame_at("b", i, w.clock.now) for i in range(4)))
    w.assign([RT, STD, BULK])
    w.step(2)
    w.kafka.append(RT, *(frame_at("r", i, w.clock.now) for i in range(4)))
    w.step(2)

    w.executor.release(lambda f: f.priority == Priority.REALTIME)
    w.step(2)

    got = results_by_topic(w)
    assert len(got.get(TOPICS.realtime, [])) == 4 and TOPICS.bulk not in got


# -- every runner fed ----------------------------------------------------------------------------------------------
def test_with_three_runners_and_a_backlog_two_batches_per_runner_are_in_flight_and_realtime_keeps_its_slot() -> None:
    w = World(executor=FakeExecutor(hold=True, runners=3), max_inflight=0)
    w.kafka.append(BULK, *(frame_at("b", i, w.clock.now) for i in range(40)))
    w.assign([RT, STD, BULK])
    w.step(3)
    assert w.executor.priorities == [Priority.BULK] * 6 and w.pipeline.inflight_batches == 6

    w.kafka.append(RT, *(frame_at("r", i, w.clock.now) for i in range(4)))
    w.step(2)
    assert w.executor.priorities == [Priority.BULK] * 6 + [Priority.REALTIME]


def test_a_set_inflight_limit_that_leaves_a_runner_idle_stops_start_up() -> None:
    w = World(executor=FakeExecutor(runners=3), max_inflight=3)
    settings = dataclasses.replace(w.settings, delivery=dataclasses.replace(w.settings.delivery,
                                                                             max_inflight_batches=2))
    with pytest.raises(ConfigError, match="delivery.max_inflight_batches: 2 leaves runners idle"):
        build_pipeline(settings, w.executor, w.metrics, w.health, w.clock)


def test_with_three_runners_on_a_backlog_the_loop_has_every_runner_running_a_batch() -> None:
    contract = ModelContract.from_settings(ModelSettings(source="model_factories:tiny_model"))
    runners = [StandInRunner(contract) for _ in range(3)]
    for r in runners:
        r.gate.clear()  # each runner holds the batch it gets
    with InferenceExecutor(runners, contract) as executor:
        w = World(executor=executor, max_inflight=0)
        w.kafka.append(BULK, *(frame_at("b", i, w.clock.now) for i in range(40)))
        w.assign([RT, STD, BULK])
        try:
            wait_for(lambda: (w.step(), all(r.entered.is_set() for r in runners))[1], 30,
                     "a batch running on each of the three runners at once")
        finally:
            for r in runners:
                r.gate.set()
        wait_for(lambda: (w.step(), len(results_by_topic(w).get(TOPICS.bulk, [])) == 40)[1], 30,
                 "every bulk frame answered")


# -- an idle runtime ---------------------------------------------------------------------------------------------
def idle_world(release_when_idle: bool = True) -> World:
    batching = BatchingSettings(rare_shape_min_count=1, max_batch_size=4, release_when_idle=release_when_idle)
    w = World(hold=True, max_inflight=2, batching=batching)
    w.assign([RT, STD, BULK])
    return w


def turns(w: World, count: int) -> None:
    """Loop turns with the clock standing still: whatever runs now runs before any class's max_wait_ms."""
    for _ in range(count):
        w.pipeline.step()


def test_with_nothing_running_and_no_input_waiting_a_partial_batch_goes_at_once() -> None:
    w = idle_world()
    w.kafka.append(BULK, *(frame_at("b", i, w.clock.now) for i in range(2)))
    turns(w, 2)  # one poll, one dispatch

    assert [len(b) for b in w.executor.batches] == [2]
    assert sample(w, "streamfer_batch_releases_total", priority="bulk", reason="idle") == 1


def test_with_release_when_idle_off_a_partial_batch_waits_for_its_class_max_wait() -> None:
    w = idle_world(release_when_idle=False)
    w.kafka.append(BULK, *(frame_at("b", i, w.clock.now) for i in range(2)))
    turns(w, 4)
    assert w.executor.batches == []

    w.clock.now += w.settings.batching.bulk.max_wait_ms / 1000.0
    turns(w, 1)
    assert [len(b) for b in w.executor.batches] == [2]


def test_while_a_batch_runs_the_next_one_fills_and_goes_when_the_runtime_is_free() -> None:
    w = idle_world()
    w.kafka.append(BULK, *(frame_at("b", i, w.clock.now) for i in range(2)))
    turns(w, 2)
    w.kafka.append(BULK, frame_at("b", 2, w.clock.now))
    turns(w, 2)
    w.kafka.append(BULK, frame_at("b", 3, w.clock.now))
    turns(w, 2)
    assert [len(b) for b in w.executor.batches] == [2]  # the second slot is free, but the first batch runs

    w.executor.release()
    turns(w, 2)
    assert [len(b) for b in w.executor.batches] == [2, 2]


def test_on_a_backlog_polls_come_back_full_and_nothing_leaves_before_its_batch_fills(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pipeline_module, "POLL_BATCH", 3)
    w = idle_world()
    w.kafka.append(BULK, *(frame_at("b", i, w.clock.now) for i in range(5)))
    turns(w, 3)  # a full poll of 3 (more is waiting: no idle release), then 2, then the full batch of 4 goes

    assert [len(b) for b in w.executor.batches] == [4]  # and the fifth waits: a batch is running


# -- priority under overload -----------------------------------------------------------------------------------
class TimedExecutor:
    """One runner on the fake clock: a batch takes `fixed_s + per_frame_s * n`; the most urgent queued batch runs
    next (like InferenceExecutor). `tick()` finishes what the clock has reached."""

    preferred_batch_sizes: tuple[int, ...] = ()
    model_input_hw: tuple[int, int] | None = None
    memory_policy = None
    model_name = "timed"
    model_version = "1"
    runner_count = 1

    def __init__(self, fixed_s: float, per_frame_s: float) -> None:
        self.fixed_s, self.per_frame_s = fixed_s, per_frame_s
        self.clock: Any = None
        self.queue: list[tuple[int, int, list[Frame], Future[BatchOutcome]]] = []
        self.running: tuple[float, list[Frame], Future[BatchOutcome]] | None = None
        self.seq = itertools.count()
        self.scored: list[tuple[float, Priority, int]] = []  # (finish time, class, frames)

    def submit(self, frames: Any, shape: tuple[int, int, int], priority: Priority = Priority.BULK) -> Future:
        future: Future[BatchOutcome] = Future()
        heapq.heappush(self.queue, (int(priority), next(self.seq), list(frames), future))
        self.tick()
        return future

    def tick(self) -> None:
        now = self.clock.now
        while True:
            if self.running is not None:
                end, frames, future = self.running
                if end > now:
                    return
                self.running = None
                self.scored.append((end, frames[0].priority, len(frames)))
                done = outcome(frames)
                future.set_result(BatchOutcome(done.verdicts, [], len(frames), 0.0,
                                               (self.fixed_s + self.per_frame_s * len(frames)) * 1000.0, end,
                                               len(frames), False))
                start = end
            else:
                start = now
            if not self.queue:
                return
            _, _, frames, future = heapq.heappop(self.queue)
            self.running = (start + self.fixed_s + self.per_frame_s * len(frames), frames, future)


def overload_world() -> tuple[World, TimedExecutor]:
    batching = BatchingSettings(
        max_batch_size=16, rare_shape_min_count=1, max_pending_frames=512,
        realtime=ClassSettings(5, 2_000, 8, latency_budget_ms=250, pending_share=1.0),
        standard=ClassSettings(15, 3_000, 3, latency_budget_ms=1_000, pending_share=0.5),
        bulk=ClassSettings(100, 0, 1, latency_budget_ms=0, pending_share=0.25))
    executor = TimedExecutor(fixed_s=0.002, per_frame_s=0.001)  # ~890 frames/s in batches of 16
    w = World(batching=batching, max_inflight=2, executor=executor)
    executor.clock = w.clock
    return w, executor


def test_under_overload_realtime_is_scored_first_and_bulk_absorbs_the_shortfall():
    """A bulk backlog, then 2.5x capacity for 8 s on all three topics (20% realtime, 40% standard, 40% bulk; the
    fake consumer hands out bulk first, as librdkafka's shared queue can). Realtime (0.5x capacity) must be
    scored; the shortfall falls on bulk (no deadline), then standard; nothing is lost."""
    w, executor = overload_world()
    start = w.clock.now
    w.kafka.append(BULK, *(frame_at("bb", i, start - 5.0) for i in range(2000)))
    w.assign([RT, STD, BULK])
    offered_fps, seconds, dt = 2.5 * 890, 8.0, 0.005
    counters = dict.fromkeys((RT, STD, BULK), 0)
    shares = {RT: 0.2, STD: 0.4, BULK: 0.4}
    sent = dict.fromkeys((RT, STD, BULK), 0.0)
    while w.clock.now < start + seconds:
        w.clock.now += dt
        for tp, share in shares.items():
            sent[tp] += offered_fps * share * dt
            while counters[tp] < int(sent[tp]):
                w.kafka.append(tp, frame_at(tp[0], counters[tp], w.clock.now))
                counters[tp] += 1
        executor.tick()
        w.pipeline.step()
    overload_end = w.clock.now
    for _ in range(40_000):  # the rest drains (bulk has no deadline)
        if sum(len(w.kafka.log[tp]) for tp in counters) == sum(len(p.visible) for p in w.producers):
            break
        w.clock.now += dt
        executor.tick()
        w.pipeline.step()

    got = results_by_topic(w)
    lost = {tp: len(w.kafka.log[tp]) - len(got.get(tp[0], [])) for tp in counters}
    assert lost == dict.fromkeys(counters, 0)
    expired = {tp: sum(r["status"] == "EXPIRED" for r in got[tp[0]]) / len(got[tp[0]]) for tp in counters}
    assert expired[RT] <= 0.05, expired
    assert expired[BULK] == 0.0
    assert expired[STD] >= expired[RT]
    # Model time during the overload went to realtime and standard, not to bulk.
    during = [(p, n) for end, p, n in executor.scored if end <= overload_end]
    model_s = {p: sum(0.002 + 0.001 * n for q, n in during if q == p) for p in Priority}
    assert model_s[Priority.BULK] <= 0.1 * sum(model_s.values()), model_s


@pytest.mark.parametrize("release_when_idle", [True, False])
def test_at_light_load_a_frame_waits_for_the_runtime_not_for_its_class_max_wait(monkeypatch: pytest.MonkeyPatch,
                                                                                release_when_idle: bool) -> None:
    """100 frames/s on the three topics (about a ninth of capacity), the loop turning every millisecond: with an
    idle runtime released at once, no frame waits longer than one running batch and a few turns; without, bulk
    frames wait their 100 ms."""
    batching = BatchingSettings(max_batch_size=16, rare_shape_min_count=1, release_when_idle=release_when_idle)
    executor = TimedExecutor(fixed_s=0.002, per_frame_s=0.001)
    w = World(batching=batching, max_inflight=2, executor=executor)
    executor.clock = w.clock
    w.pipeline.seed_costs([((4, 4, 3), n, 0.002 + 0.001 * n) for n in (1, 2, 4, 8, 16)])  # warm-up's timings
    w.assign([RT, STD, BULK])
    waits: list[float] = []
    submit = executor.submit

    def timed_submit(frames: Any, shape: tuple[int, int, int], priority: Priority = Priority.BULK) -> Future:
        waits.extend(w.clock.now - f.capture_ts_ms / 1000.0 for f in frames)
        return submit(frames, shape, priority)

    monkeypatch.setattr(executor, "submit", timed_submit)
    start, sent = w.clock.now, 0
    topics = itertools.cycle([RT, STD, STD, BULK, BULK])
    while w.clock.now < start + 2.0:
        w.clock.now += 0.001
        if w.clock.now >= start + sent * 0.01:
            w.kafka.append(next(topics), frame_at("s", sent, w.clock.now))
            sent += 1
        executor.tick()
        w.pipeline.step()

    assert len(waits) >= sent - 20
    if release_when_idle:
        assert max(waits) <= 0.006
    else:
        assert max(waits) >= 0.09


# -- p99 tools ------------------------------------------------------------------------------------------------
def test_with_debug_logging_each_batch_gets_one_line_with_its_class_shape_size_and_times(
        caplog: pytest.LogCaptureFixture) -> None:
    w = World()
    w.kafka.append(RT, *(frame_at("r", i, w.clock.now) for i in range(4)))
    w.assign([RT])
    with caplog.at_level(logging.DEBUG, logger="worker.batches"):
        w.step(3)

    lines = [r.getMessage() for r in caplog.records if r.name == "worker.batches"]
    assert len(lines) == 1
    for field in ("class=realtime", "shape=4x4x3", "size=4", "lane=exact", "oldest_wait_ms=", "queued_ms=",
                  "padding=0.000", "predicted_ms=", "measured_ms=2.0"):
        assert field in lines[0]


def test_batch_log_lines_are_off_by_default(caplog: pytest.LogCaptureFixture) -> None:
    w = World()
    w.kafka.append(RT, *(frame_at("r", i, w.clock.now) for i in range(4)))
    w.assign([RT])
    with caplog.at_level(logging.INFO):
        w.step(3)
    assert not [r for r in caplog.records if r.name == "worker.batches"]


def test_the_input_size_distribution_is_kept_per_batch_shape() -> None:
    w = World()
    w.kafka.append(RT, *(frame_at("r", i, w.clock.now) for i in range(4)))
    w.assign([RT])
    w.step(3)
    registry = w.pipeline.metrics.registry
    assert registry.get_sample_value("streamfer_input_pixels_count", {"shape": "4x4"}) == 4
    assert registry.get_sample_value("streamfer_input_pixels_sum", {"shape": "4x4"}) == 4 * 16


def test_each_batch_counts_its_release_reason_and_its_measured_over_predicted_time() -> None:
    w = World()
    w.pipeline.seed_costs([((4, 4, 3), 4, 0.004)])  # predicted 4 ms; the fake executor's batches take 2 ms
    w.kafka.append(RT, *(frame_at("r", i, w.clock.now) for i in range(4)))
    w.assign([RT])
    w.step(3)
    registry = w.pipeline.metrics.registry
    released = {s.labels["reason"]: s.value for m in registry.collect() if m.name == "streamfer_batch_releases"
                for s in m.samples if s.name.endswith("_total") and s.labels["priority"] == "realtime"}
    assert sum(released.values()) == 1
    assert registry.get_sample_value("streamfer_batch_time_ratio_count") == 1
    assert registry.get_sample_value("streamfer_batch_time_ratio_sum") == pytest.approx(0.5)


# -- reading by priority (worker.reading.priority): when reading, not the model, is the bottleneck ---------------
READ_S = 0.001  # loop time per message read: the worker reads at most 1000 messages a second


def reading_bound_world(monkeypatch: pytest.MonkeyPatch, read_by_priority: bool = True) -> World:
    """A near-zero model (FakeExecutor: every batch done at once) and a consumer whose every message costs READ_S of
    the fake clock. The fake consumer hands out bulk first (its topic sorts first), as a librdkafka queue holding
    a bulk fetch ahead of realtime's does."""
    batching = BatchingSettings(max_batch_size=32, rare_shape_min_count=1, read_by_priority=read_by_priority,
                                max_pending_frames=20_000, adaptive_batch_size=False,
                                realtime=ClassSettings(5, 2_000, 8, latency_budget_ms=250, pending_share=1.0),
                                standard=ClassSettings(15, 4_000, 3, latency_budget_ms=1_000, pending_share=0.5))
    # Enough batches in flight, of full size (FakeExecutor's batches all take 2 ms: a cost model would pick 1),
    # that one turn runs all it read (each finishes at once and is collected on the next turn), and room enough
    # that no class fills its share of the batcher: it never holds a backlog, reading is the bottleneck.
    w = World(monkeypatch, batching=batching, max_inflight=16)
    monkeypatch.setattr(pipeline_module, "POLL_BATCH", 100)  # a full poll takes 0.1 s, as ~500 do in the worker
    consume = w.kafka.consume

    def costly(num_messages: int, timeout: float) -> list[Any]:
        out = consume(num_messages, timeout)
        w.clock.now += READ_S * len(out)
        return out

    monkeypatch.setattr(w.kafka, "consume", costly)
    return w


def offer(w: World, shares: dict[tuple[str, int], float], fps: float, seconds: float) -> float:
    """Frames at `fps` over the topics by `shares` (captured as they are offered) while the loop turns; returns when
    the offer ended."""
    start = w.clock.now
    sent = dict.fromkeys(shares, 0)
    while w.clock.now < start + seconds:
        for tp, share in shares.items():
            due = int(fps * share * (w.clock.now - start))
            w.kafka.append(tp, *(frame_at(tp[0], i, w.clock.now) for i in range(sent[tp], due)))
            sent[tp] = max(sent[tp], due)
        w.clock.now += 0.0005  # a turn's own time
        w.pipeline.step()
    return w.clock.now


def drain(w: World, tps: list[tuple[str, int]]) -> None:
    offered = sum(len(w.kafka.log.get(tp, [])) for tp in tps)
    for _ in range(10_000):
        if w.pipeline.summary.results == offered:
            return
        w.clock.now += 0.01
        w.pipeline.step()
    raise AssertionError("the backlog was not drained")


def scored_between(w: World, topic: str, t0: float, t1: float) -> int:
    return sum(1 for r in results_by_topic(w).get(topic, []) if r["status"] == "OK"
               and t0 <= (r["capture_ts_ms"] + r["end_to_end_ms"]) / 1000.0 < t1)


@pytest.mark.parametrize("read_by_priority", [True, False])
def test_when_reading_is_the_bottleneck_realtime_is_read_first(monkeypatch: pytest.MonkeyPatch,
                                                               read_by_priority: bool) -> None:
    """Issue 37 on a fake clock: 2.5x the reading capacity offered for 6 s, realtime a fifth of it (half of
    capacity). Reading by priority: at most 5% of realtime expires and bulk has at most its floor of the frames
    scored; without it the consumer's bulk-first order leaves realtime unread until it expires."""
    w = reading_bound_world(monkeypatch, read_by_priority)
    w.assign([RT, STD, BULK])
    start = w.clock.now
    end = offer(w, {RT: 0.2, STD: 0.4, BULK: 0.4}, fps=2.5 / READ_S, seconds=6.0)
    drain(w, [RT, STD, BULK])

    got = results_by_topic(w)
    assert len(w.results()) == sum(len(w.kafka.log[tp]) for tp in (RT, STD, BULK))  # each frame answered once
    expired = sum(r["status"] == "EXPIRED" for r in got[TOPICS.realtime]) / len(got[TOPICS.realtime])
    scored = {tp: scored_between(w, tp[0], start + 1.0, end) for tp in (RT, STD, BULK)}
    bulk_share = scored[BULK] / sum(scored.values())
    if read_by_priority:
        assert expired <= 0.05, expired
        assert bulk_share <= 0.05 + 32 / sum(scored.values()), scored
        assert sample(w, "streamfer_priority_pauses_total", priority="bulk") >= 1
    else:
        assert expired >= 0.5, expired  # the bug: bulk was read first
        assert sample(w, "streamfer_priority_pauses_total", priority="bulk") == 0


def test_every_class_has_its_reading_by_priority_series_from_the_start() -> None:
    """Dashboards and alerts query these before any pause: each class's series exists, at 0, once the loop is built."""
    registry = World().metrics.registry
    for name in ("streamfer_priority_paused", "streamfer_priority_pauses_total", "streamfer_backlog_unservable"):
        for label in ("realtime", "standard", "bulk"):
            assert registry.get_sample_value(name, {"priority": label}) == 0.0, (name, label)


def test_when_reading_is_the_bottleneck_a_steady_stream_within_capacity_pauses_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    w = reading_bound_world(monkeypatch)
    w.assign([RT, STD, BULK])
    offer(w, {RT: 0.2, STD: 0.4, BULK: 0.4}, fps=0.6 / READ_S, seconds=6.0)
    for label in ("realtime", "standard", "bulk"):
        assert sample(w, "streamfer_priority_pauses_total", priority=label) == 0
    assert w.pipeline.summary.expired == 0


def test_a_frame_already_past_its_deadline_when_read_is_answered_expired_without_a_batch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    w = reading_bound_world(monkeypatch)
    w.kafka.append(RT, *(frame_at("old", i, w.clock.now - 2.5) for i in range(3)))  # realtime max_age: 2 s
    w.kafka.append(RT, frame_at("fresh", 0, w.clock.now))
    w.assign([RT])
    w.step(4)

    got = results_by_topic(w)[TOPICS.realtime]
    assert sorted((r["stream_id"], r["status"]) for r in got) == [("fresh", "OK")] + [("old", "EXPIRED")] * 3
    assert [f.stream_id for batch in w.executor.batches for f in batch] == ["fresh"]
    assert all(r["queued_ms"] == 0.0 for r in got if r["status"] == "EXPIRED")  # answered in the turn it was read
    assert sample(w, "streamfer_frames_expired_total", topic=TOPICS.realtime, tenant="t") == 3


def test_frames_of_a_class_paused_for_priority_already_read_are_batched_not_held(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Bulk frames read before realtime's backlog was seen still get their batch (the batcher serves realtime
    first): held, they filled the batcher's caps, backpressure then paused realtime too, and librdkafka dropped
    realtime's prefetched messages to fetch them again (in the reading-bound overload, realtime scored 13-17%
    less with them held)."""
    batching = BatchingSettings(max_batch_size=16, rare_shape_min_count=1, lower_class_read_floor=0.0,
                                release_when_idle=False, adaptive_batch_size=False)
    w = World(monkeypatch, batching=batching, max_inflight=2, max_uncommitted_frames=40)
    w.kafka.append(BULK, *(frame_at("b", i, w.clock.now) for i in range(2)))
    w.assign([RT, BULK])
    w.pipeline.step()  # bulk read; its partial batch (under 16) is due after bulk's max_wait (100 ms)
    w.kafka.append(RT, *(frame_at("r", i, w.clock.now) for i in range(2_000)))
    monkeypatch.setattr(pipeline_module, "POLL_BATCH", 8)  # realtime's backlog takes many polls
    for _ in range(40):
        w.clock.now += 0.01
        w.pipeline.step()
    assert sample(w, "streamfer_priority_paused", priority="bulk") == 1
    first_bulk = w.executor.priorities.index(Priority.BULK)
    assert w.executor.priorities[:first_bulk] and set(w.executor.priorities[:first_bulk]) == {Priority.REALTIME}

    drain(w, [RT, BULK])
    assert sample(w, "streamfer_priority_paused", priority="bulk") == 0


def test_a_realtime_flood_the_worker_cannot_even_read_in_time_holds_bulk_back_only_until_it_is_past_saving(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Realtime alone at 1.5x what the worker can read: once every realtime frame read for max_age (2 s) was past
    it, and the backlog is more than max_age of reading, holding bulk back saves no realtime frame: bulk reads
    again (realtime's frames are still read, and answered EXPIRED)."""
    w = reading_bound_world(monkeypatch)
    w.assign([RT, BULK])
    start = w.clock.now
    end = offer(w, {RT: 1.5, BULK: 0.3}, fps=1 / READ_S, seconds=12.0)

    assert sample(w, "streamfer_backlog_unservable", priority="realtime") == 1
    assert scored_between(w, RT[0], start + 8.0, end) == 0
    assert scored_between(w, BULK[0], start + 8.0, end) > 0.3 * 4.0 / READ_S  # all of bulk's, and its backlog
