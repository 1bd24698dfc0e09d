"""The worker loop: source -> batcher -> runtime -> delivery. The only module that knows all the stages.

One thread owns the consumer, the batcher, the offset tracker and the producer; the runtime executes batches
on its own threads and hands back futures of `BatchOutcome`s. Every message read ends in exactly one of: a
result (OK or EXPIRED), a dead letter, or (on revocation, or as stale work) being left uncommitted for the
partition's next reading. When an output counts as delivered and what may be committed is decided by
`worker.delivery`; the loop asks it after each turn and rewinds when it says so.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from confluent_kafka import Consumer, Producer

from worker.assignment import TP, Assignments
from worker.batching import Batch, MicroBatcher, batch_shape
from worker.config import Settings, resolve_inflight_batches
from worker.costmodel import CostModel
from worker.dedup import DuplicateFrames, duplicate_reason
from worker.delivery import AtLeastOnceDelivery, CommitResult, Delivery, ExactlyOnceDelivery
from worker.frames import DUPLICATE_FRAME, BatchOutcome, DeadLetter, Frame, Output, Priority, Status, Verdict
from worker.intake import IntakeDecision, PriorityIntake
from worker.kafka_client import ClientFactory
from worker.memorypolicy import BatchSizeLimit
from worker.metrics import Children, Health, Metrics
from worker.offsets import OffsetTracker
from worker.schemas import ResultContext, build_result, reencode_frame
from worker.sink import STUCK_GRACE_S, DoneCallback, RejectedCallback, ResultSink, output_message_limit
from worker.source import FrameSource, Polled, RebalanceHandler

if TYPE_CHECKING:
    from prometheus_client import Counter as PromCounter

log = logging.getLogger(__name__)
# One DEBUG line per finished batch (class, shape, size, waits, padding, predicted and measured time): enable
# with observability.log_level = "DEBUG", or this logger alone, when chasing a p99.
batch_log = logging.getLogger("worker.batches")

POLL_BATCH = 500
# How long the loop blocks in poll while batches run: bounds the delay between a batch finishing and
# its results being produced.
INFLIGHT_POLL_S = 0.002
IDLE_POLL_S = 0.1
LAG_REFRESH_S = 1.0
# How often the classes' backlogs in Kafka are summed for reading by priority (positions and cached watermarks:
# no broker request, ~15 us for nine partitions).
BACKLOG_REFRESH_S = 0.01


class Executor(Protocol):
    """What the pipeline needs from the runtime (worker.runtime.InferenceExecutor)."""

    preferred_batch_sizes: tuple[int, ...]
    # The model's fixed input (height, width), or None when it takes each batch's own size.
    model_input_hw: tuple[int, int] | None
    model_name: str
    model_version: str

    @property
    def memory_policy(self) -> BatchSizeLimit | None:
        """Device memory peaks per shape measured at warm-up (CUDA), or None: a cap on each shape's batch size."""

    @property
    def runner_count(self) -> int:
        """Runners that execute batches at once: the loop keeps each of them fed."""

    def submit(self, frames: Sequence[Frame], shape: tuple[int, int, int],
               priority: Priority = Priority.BULK) -> Future[BatchOutcome]: ...


class Source(Protocol):
    """What the pipeline needs from the consumer side (worker.source.FrameSource)."""

    assignments: Assignments

    @property
    def paused_partitions(self) -> int: ...

    def subscribe(self, on_assign: RebalanceHandler, on_revoke: RebalanceHandler,
                  on_lost: RebalanceHandler) -> None: ...

    def poll(self, max_messages: int, timeout_s: float) -> Polled: ...

    def pause_classes(self, classes: set[Priority]) -> None: ...

    def seek_to_committed(self, tps: list[TP]) -> None: ...

    def caught_up(self) -> bool: ...

    def lag(self) -> dict[TP, int]: ...

    def close(self) -> None: ...


@dataclass
class RunSummary:
    consumed: int = 0
    results: int = 0
    expired: int = 0
    dead_lettered: int = 0
    batches: int = 0
    commits: int = 0
    frames_batched: int = 0

    @property
    def mean_batch_size(self) -> float:
        return self.frames_batched / self.batches if self.batches else 0.0


# The loop's phases, in order; with `time_phases` each one's time is summed in `Pipeline.phase_times`.
PHASES = ("collect", "expire", "dispatch", "emit", "deliver", "commit", "backpressure", "poll", "lag")


@dataclass
class PhaseTimes:
    """Wall and loop-thread CPU seconds spent in each phase of the loop, and how often it ran (for benchmarks)."""

    wall: dict[str, float]
    cpu: dict[str, float]
    calls: dict[str, int]

    @classmethod
    def zero(cls) -> PhaseTimes:
        return cls(dict.fromkeys(PHASES, 0.0), dict.fromkeys(PHASES, 0.0), dict.fromkeys(PHASES, 0))

    def copy(self) -> PhaseTimes:
        return PhaseTimes(dict(self.wall), dict(self.cpu), dict(self.calls))


class Pipeline:
    """Runs the worker loop until `should_stop()` is true, then drains, commits and closes."""

    def __init__(self, settings: Settings, source: Source, delivery: Delivery, executor: Executor,
                 metrics: Metrics, health: Health, clock: Callable[[], float] = time.time,
                 time_phases: bool = False) -> None:
        # One in-flight limit for the runners the executor has (build_pipeline resolved it already).
        self.settings = settings = resolve_inflight_batches(settings, executor.runner_count)
        self.source = source
        self.delivery = delivery
        self.executor = executor
        self.metrics = metrics
        self.health = health
        self.clock = clock
        self.assignments = source.assignments
        self.tracker = delivery.tracker
        # Batch times measured here teach the batcher what each size costs (seeded at warm-up by seed_costs).
        self.cost = CostModel()
        self.batcher = MicroBatcher(settings.batching, clock, executor.preferred_batch_sizes, self.cost,
                                    executor.memory_policy, executor.model_input_hw)
        self.duplicates = DuplicateFrames(settings.limits.duplicate_window_frames)
        # Reading by priority (worker.intake): which classes to pause so a more urgent backlog is read first.
        self.intake = PriorityIntake(settings.batching, clock) if settings.batching.read_by_priority else None
        self._intake_decision = IntakeDecision()
        self._class_of_topic = settings.topics.input_topics()
        self._max_age_s = {p: settings.batching.for_class(p).max_age_ms / 1000.0 for p in Priority}
        self._backlog: dict[Priority, int] = {}
        self._backlog_at = float("-inf")
        self._result_context = ResultContext(executor.model_name, executor.model_version,
                                             settings.observability.worker_id)
        # The labelled metrics the loop touches per frame or per batch, each label set looked up once.
        self._consumed = Children(metrics.frames_consumed)
        self._expired = Children(metrics.frames_expired)
        self._flagged = Children(metrics.frames_flagged)
        self._queue_wait = Children(metrics.queue_wait)
        self._end_to_end = Children(metrics.end_to_end_latency)
        self._input_pixels = Children(metrics.input_pixels)
        self._batch_size = Children(metrics.batch_size)
        self._releases = Children(metrics.batch_releases)
        self._priority_paused = Children(metrics.priority_paused)
        self._priority_pauses = Children(metrics.priority_pauses)
        self._unservable = Children(metrics.backlog_unservable)
        self._counts = RunSummary()
        self._inflight: deque[tuple[Batch, Future[BatchOutcome]]] = deque()
        self._input_drained = False  # the last poll took all the consumer had fetched
        self._outputs: list[Output] = []
        self._paused_classes: set[Priority] = set()
        # Idle time counts from the first assignment: a worker still joining the group is not idle.
        self._last_activity: float | None = None
        self._last_lag_update = float("-inf")
        self.phase_times: PhaseTimes | None = PhaseTimes.zero() if time_phases else None
        self._phases: tuple[tuple[str, Callable[[], None]], ...] = (
            ("collect", self._collect_finished), ("expire", self._expire), ("dispatch", self._dispatch_due),
            ("emit", self._emit), ("deliver", self.delivery.poll), ("commit", self._commit),
            ("backpressure", self._apply_backpressure), ("poll", self._poll_input), ("lag", self._refresh_lag))

    @property
    def summary(self) -> RunSummary:
        c = self._counts
        return RunSummary(consumed=c.consumed, results=self.delivery.results, expired=c.expired,
                          dead_lettered=self.delivery.dead_lettered, batches=c.batches,
                          commits=self.delivery.commits, frames_batched=c.frames_batched)

    @property
    def inflight_batches(self) -> int:
        """Batches submitted to the runtime and not yet collected."""
        return len(self._inflight)

    # -- the loop ----------------------------------------------------------------------------------------
    def run(self, should_stop: Callable[[], bool], exit_when_idle_s: float | None = None) -> RunSummary:
        self.source.subscribe(self._on_assign, self._on_revoke, self._on_lost)
        log.info("worker started: topics=%s mode=%s", list(self.settings.topics.input_topics()),
                 self.settings.delivery.mode)
        try:
            while not should_stop():
                self.step()
                if exit_when_idle_s is not None and self._idle_for() >= exit_when_idle_s:
                    if self.source.caught_up():
                        log.info("idle for %.1fs and caught up: exiting", exit_when_idle_s)
                        break
                    self._last_activity = self.clock()  # input still to come (or still locked): wait again
            self.drain()
        finally:
            self.source.close()
            self.delivery.close()
            self.health.assigned = False
            self.metrics.ready.set(0)
        return self.summary

    def step(self) -> None:
        """One turn: collect finished batches, expire, dispatch, produce, commit, pause, poll."""
        self.health.beat()
        timings = self.phase_times
        for name, phase in self._phases:
            if timings is None:
                phase()
            else:
                w0, c0 = time.perf_counter(), time.thread_time()
                phase()
                timings.wall[name] += time.perf_counter() - w0
                timings.cpu[name] += time.thread_time() - c0
                timings.calls[name] += 1

    def _intake_room(self) -> int:
        """Frames the loop may read now: the batcher's room (no class still reading past its share), and what is
        left under the uncommitted cap."""
        uncommitted_room = self.settings.max_uncommitted_frames - self.tracker.uncommitted()
        room = min(self.batcher.poll_room(self._paused_classes), uncommitted_room)
        decision = self._intake_decision
        # While a class reads its floor share, polls stay small so it does not pass its share by much (not while
        # backpressure keeps it paused anyway: small polls would only slow the others down).
        if decision.poll_limit is not None and not decision.floor_reading <= self._paused_classes:
            room = min(room, decision.poll_limit)
        return max(0, room)

    def _poll_input(self) -> None:
        room = self._intake_room()
        if self._inflight or self._outputs:
            timeout = INFLIGHT_POLL_S
        else:
            due = self.batcher.next_due()
            timeout = IDLE_POLL_S if due is None else min(IDLE_POLL_S, max(0.0, due - self.clock()))
        polled = self.source.poll(min(POLL_BATCH, max(room, 1)), timeout)
        self._input_drained = polled.drained
        if polled.redelivered:
            self.metrics.redelivered.inc(polled.redelivered)
        if polled.committed_offset_waits:
            self.metrics.committed_offset_waits.inc(polled.committed_offset_waits)
        if polled.frames or polled.dead_letters:
            self._last_activity = self.clock()
        # Track in each partition's offset order (the tracker refuses an offset below one already read).
        read = [f.source for f in polled.frames]
        if polled.dead_letters:
            read = sorted(read + [d.source for d in polled.dead_letters])
        for ref in read:
            self.tracker.track(ref.topic_partition, ref.offset)
        if polled.frames:
            self._count_by_tenant(self._consumed, polled.frames)
        now = self.clock()
        late: list[Frame] = []
        oldest: dict[Priority, int] = {}  # capture_ts_ms of the oldest frame read, per class
        for frame in polled.frames:
            if frame.capture_ts_ms < oldest.get(frame.priority, frame.capture_ts_ms + 1):
                oldest[frame.priority] = frame.capture_ts_ms
            # A replayed frame is a new copy on purpose: its replay count is part of its identity (worker/dedup.py).
            identity = (frame.stream_id, frame.frame_index, frame.replay_count)
            first = self.duplicates.first_offset(frame.source.topic_partition, identity, frame.source.offset)
            if first is not None:
                self._outputs.append(self._dead_letter(frame, DUPLICATE_FRAME, duplicate_reason(identity, first)))
            elif self._past_deadline(frame, now):
                late.append(frame)  # answered EXPIRED at the cost of reading it: no batcher, no runtime
            else:
                self.batcher.add(frame)
        if late:
            self._answer_expired(late, now)
        if polled.dead_letters:
            for topic, n in Counter(dl.source.topic for dl in polled.dead_letters).items():
                self._consumed.labels(topic, "unknown").inc(n)
            self._outputs.extend(Output.of_dead_letter(dl) for dl in polled.dead_letters)
        if self.intake is not None:
            by_class = Counter(f.priority for f in polled.frames)
            by_class.update(self._class_of_topic[dl.source.topic] for dl in polled.dead_letters)
            self.intake.record_read(by_class, Counter(f.priority for f in late),
                                    {p: ms / 1000.0 for p, ms in oldest.items()},
                                    polled.drained if len(self._paused_classes) < len(Priority) else None)
        self._counts.consumed += len(polled.frames) + len(polled.dead_letters)
        self.metrics.inflight_frames.set(self.tracker.in_flight())
        self.metrics.uncommitted_frames.set(self.tracker.uncommitted())
        self.metrics.inflight_bytes.set(self.batcher.pending_bytes)

    def _count_by_tenant(self, counter: Children[PromCounter], frames: Sequence[Frame]) -> None:
        """One increment per (topic, tenant label) of `frames`; tenants are labelled in the order first seen, as
        frame by frame."""
        for (topic, tenant), n in Counter((f.source.topic, f.tenant) for f in frames).items():
            counter.labels(topic, self.metrics.tenant_label(tenant)).inc(n)

    def _idle_for(self) -> float:
        if self._last_activity is None:
            return 0.0
        if self.batcher.pending_frames or self._inflight or self._outputs or self.tracker.in_flight() \
                or self.delivery.busy:
            self._last_activity = self.clock()
            return 0.0
        return self.clock() - self._last_activity

    def seed_costs(self, measured: Sequence[tuple[tuple[int, int, int], int, float]]) -> None:
        """Warm-up timings (frame shape, batch size, seconds) for the cost model, before the first real batch; kept
        under the batch shape the batcher gives such frames (the model's fixed input when it has one)."""
        for shape, n, seconds in measured:
            self.cost.observe(batch_shape(shape, self.executor.model_input_hw), n, seconds, calibration=True)
        if measured:
            log.info("batch cost model seeded: %s", {k: {m: round(v, 2) for m, v in d.items()}
                                                      for k, d in self.cost.snapshot().items()})

    # -- batches -------------------------------------------------------------------------------------------
    def _dispatch_due(self) -> None:
        limit = self.settings.delivery.max_inflight_batches
        while len(self._inflight) < limit:
            batch = self.batcher.pop_batch()
            if batch is None:
                break
            self._dispatch(batch)
        # Nothing runs and no input is waiting: holding frames for a fuller batch would leave the runtime idle.
        if not self._inflight and self._input_drained and self.settings.batching.release_when_idle:
            batch = self.batcher.pop_batch(idle=True)
            if batch is not None:
                self._dispatch(batch)
        # One slot beyond the limit is realtime's alone: a due realtime batch never waits for a lower class's
        # batch to free a slot (the executor then runs it before their queued batches).
        if len(self._inflight) >= limit and not any(b.priority == Priority.REALTIME for b, _ in self._inflight):
            batch = self.batcher.pop_batch(max_priority=Priority.REALTIME)
            if batch is not None:
                self._dispatch(batch)

    def _dispatch(self, batch: Batch) -> None:
        self._batch_size.labels(batch.priority.label, batch.lane).observe(batch.size)
        self._releases.labels(batch.priority.label, batch.reason).inc()
        self.metrics.padding_waste.observe(batch.padding_waste)
        self._inflight.append((batch, self.executor.submit(batch.frames, batch.shape, batch.priority)))

    def _collect_finished(self, wait: bool = False) -> None:
        """Collect finished batches: any class's as soon as it is done, one class's in submission order (so a
        stream's results keep their order), so a realtime batch never waits behind a running bulk batch."""
        if wait:
            while self._inflight:
                batch, future = self._inflight.popleft()
                self._batch_done(batch, future.result())
            return
        if not any(future.done() for _, future in self._inflight):
            return
        blocked: set[Priority] = set()
        kept: deque[tuple[Batch, Future[BatchOutcome]]] = deque()
        for batch, future in self._inflight:
            if batch.priority not in blocked and future.done():
                # The executor isolates bad frames; an exception here is a bug: crash.
                self._batch_done(batch, future.result())
            else:
                blocked.add(batch.priority)
                kept.append((batch, future))
        self._inflight = kept

    def _batch_done(self, batch: Batch, outcome: BatchOutcome) -> None:
        now = self.clock()
        run_s = (outcome.preprocess_ms + outcome.inference_ms) / 1000.0
        if outcome.batch_size:
            self.cost.observe(batch.shape, outcome.batch_size, run_s)
        if batch.predicted_s:
            self.metrics.batch_time_ratio.observe(run_s / batch.predicted_s)
        if batch_log.isEnabledFor(logging.DEBUG):
            oldest = min((f.received_at for f in batch.frames), default=now)
            batch_log.debug("batch class=%s shape=%dx%dx%d size=%d lane=%s reason=%s oldest_wait_ms=%.1f "
                            "queued_ms=%.1f padding=%.3f predicted_ms=%s measured_ms=%.1f", batch.priority.label,
                            *batch.shape, batch.size, batch.lane, batch.reason,
                            (batch.released_at - oldest) * 1000.0, (outcome.started_at - batch.released_at) * 1000.0,
                            batch.padding_waste,
                            "-" if batch.predicted_s is None else f"{batch.predicted_s * 1000.0:.1f}", run_s * 1000.0)
        pixels = self._input_pixels.labels(f"{batch.shape[0]}x{batch.shape[1]}")
        for frame in batch.frames:
            pixels.observe(frame.height * frame.width)
        self._counts.batches += 1
        self._counts.frames_batched += outcome.batch_size
        self.metrics.preprocess_latency.observe(outcome.preprocess_ms / 1000.0)
        self.metrics.inference_latency.observe(outcome.inference_ms / 1000.0)
        run_ms = outcome.preprocess_ms + outcome.inference_ms
        # A batch's frames are of its class.
        queue_wait = self._queue_wait.labels(batch.priority.label)
        end_to_end = self._end_to_end.labels(batch.priority.label)
        flagged: Counter[str] = Counter()
        for frame, verdict in outcome.verdicts:
            queued_s = max(0.0, outcome.started_at - frame.received_at)
            queue_wait.observe(queued_s)
            end_to_end.observe(max(0.0, now - frame.capture_ts_ms / 1000.0))
            if verdict.flagged_labels:
                flagged.update(verdict.flagged_labels)
            self._outputs.append(self._result(frame, verdict, Status.OK, queued_s * 1000.0, outcome.batch_size,
                                              run_ms, now))
        for label, n in flagged.items():
            self._flagged.labels(label).inc(n)
        for failure in outcome.failures:
            self._outputs.append(self._dead_letter(failure.frame, failure.error_type, failure.reason))

    @staticmethod
    def _dead_letter(frame: Frame, error_type: str, reason: str) -> Output:
        dl = DeadLetter(source=frame.source, reason=reason, error_type=error_type, payload=reencode_frame(frame),
                        key=frame.stream_id.encode(), headers=frame.headers)
        return Output.of_dead_letter(dl, frame.tenant)

    def _expire(self) -> None:
        expired = self.batcher.pop_expired()
        if not expired:
            return
        self._answer_expired(expired, self.clock())
        if self.intake is not None:
            self.intake.record_expired(Counter(f.priority for f in expired))

    def _past_deadline(self, frame: Frame, now: float) -> bool:
        """The batcher's expiry rule (capture + class max_age_ms < now), applied as a frame is read."""
        max_age_s = self._max_age_s[frame.priority]
        return max_age_s > 0 and frame.capture_ts_ms / 1000.0 + max_age_s < now

    def _answer_expired(self, frames: Sequence[Frame], now: float) -> None:
        self._count_by_tenant(self._expired, frames)
        self._counts.expired += len(frames)
        for frame in frames:
            self._outputs.append(self._result(frame, None, Status.EXPIRED, (now - frame.received_at) * 1000.0,
                                              0, 0.0, now))

    def _result(self, frame: Frame, verdict: Verdict | None, status: Status, queued_ms: float, batch_size: int,
                run_ms: float, now: float) -> Output:
        value = build_result(frame, verdict, status.value, self._result_context, queued_ms, batch_size, run_ms, now)
        # Keyed by stream so a stream's results stay ordered within one output partition.
        return Output(frame.source, frame.stream_id.encode(), value, frame.tenant, status, headers=frame.headers)

    # -- producing and committing ---------------------------------------------------------------------------
    def _emit(self) -> None:
        if self._outputs:
            outputs, self._outputs = self._outputs, []
            self.delivery.emit(outputs)

    def _commit(self, final: bool = False) -> None:
        if self.delivery.commit(final) is CommitResult.REWIND:
            self._rewind()

    def _rewind(self) -> None:
        """Delivery voided what was read since the last commit: drop all of it and read it again."""
        self.batcher.discard(lambda _frame: True)
        while self._inflight:
            _batch, future = self._inflight.popleft()
            future.result()  # let it finish; its outputs are stale with the rest
        self._outputs.clear()
        assigned = sorted(self.assignments.partitions)
        self.delivery.release(assigned)
        self.source.seek_to_committed(assigned)

    # -- flow control -----------------------------------------------------------------------------------------
    def _apply_backpressure(self) -> None:
        """Pause what the batcher has no room for; pause everything while the uncommitted cap is reached (commits
        are failing: what more the worker read, a lost session would answer again)."""
        if self.intake is not None:
            self._read_by_priority()
        if self.tracker.uncommitted() >= self.settings.max_uncommitted_frames:
            self._paused_classes = set(Priority)
        else:
            self._paused_classes = self.batcher.classes_to_pause() | self._intake_decision.paused
        self.source.pause_classes(self._paused_classes)
        self.metrics.paused_partitions.set(self.source.paused_partitions)

    def _read_by_priority(self) -> None:
        """Ask the intake policy which classes to pause for a more urgent class's backlog in Kafka."""
        assert self.intake is not None
        now = self.clock()
        if now - self._backlog_at >= BACKLOG_REFRESH_S:
            self._backlog_at = now
            backlog: Counter[Priority] = Counter()
            for (topic, _partition), lag in self.source.lag().items():
                backlog[self._class_of_topic[topic]] += lag
            self._backlog = dict(backlog)
        before = self._intake_decision
        decision = self._intake_decision = self.intake.decide(self._backlog)
        self.batcher.hold(self._held(decision.paused))
        if decision == before:
            return
        for p in Priority:
            if (p in decision.paused) != (p in before.paused):
                self._priority_paused.labels(p.label).set(1 if p in decision.paused else 0)
                if p in decision.paused:
                    self._priority_pauses.labels(p.label).inc()
            if (p in decision.unservable) != (p in before.unservable):
                self._unservable.labels(p.label).set(1 if p in decision.unservable else 0)

    def _held(self, paused: frozenset[Priority]) -> frozenset[Priority]:
        """The paused classes whose frames already read get no batches either, so the loop's time goes to the more
        urgent class: the least urgent first, while their frames stay within a quarter of the uncommitted cap (held
        frames are not committed, and the rest of the cap is what the more urgent class reads ahead with)."""
        budget = self.settings.max_uncommitted_frames // 4
        held: set[Priority] = set()
        for p in sorted(paused, reverse=True):
            budget -= self.batcher.pending_of(p)
            if budget < 0:
                break
            held.add(p)
        return frozenset(held)

    def _refresh_lag(self) -> None:
        if self.clock() - self._last_lag_update >= LAG_REFRESH_S:
            self.update_lag()

    def update_lag(self) -> None:
        """Refresh the consumer-lag gauge from cached watermarks (on the loop thread: the consumer is not shared)."""
        self._last_lag_update = self.clock()
        for (topic, partition), lag in self.source.lag().items():
            self.metrics.consumer_lag.labels(topic, str(partition)).set(lag)

    # -- rebalances -------------------------------------------------------------------------------------------
    def _on_assign(self, tps: list[TP]) -> None:
        self.metrics.rebalances.labels("assign").inc()
        self._last_activity = self.clock()
        log.info("partitions assigned: %s", sorted(tps))
        # A cooperative rebalance can hand out an empty increment: ready means owning a partition.
        self.health.assigned = bool(self.assignments.partitions)
        self.metrics.ready.set(1 if self.health.ready else 0)

    def _on_revoke(self, tps: list[TP]) -> None:
        """Finish what was read from the revoked partitions, deliver and commit it, then let them go."""
        self.metrics.rebalances.labels("revoke").inc()
        self._last_activity = self.clock()
        log.info("partitions revoked: %s", sorted(tps))
        revoked = set(tps)
        # Frames not yet in a batch stay uncommitted: the next owner reads them again.
        self.batcher.discard(lambda f: f.source.topic_partition in revoked)
        self._collect_finished(wait=True)
        self._emit()
        self._commit(final=True)
        self._release(tps)
        self.health.assigned = bool(self.assignments.partitions - revoked)

    def _on_lost(self, tps: list[TP]) -> None:
        """Partitions already belong to someone else: drop their state without committing. Their batches still
        running finish as stale work (their epoch ends here), and delivery drops their outputs."""
        self.metrics.rebalances.labels("lost").inc()
        log.warning("partitions lost: %s", sorted(tps))
        lost = set(tps)
        self.batcher.discard(lambda f: f.source.topic_partition in lost)
        self._release(tps)
        self.health.assigned = bool(self.assignments.partitions - lost)

    def _release(self, tps: list[TP]) -> None:
        self.assignments.release(tps)
        self.delivery.release(tps)
        self.duplicates.release(tps)
        for topic, partition in tps:
            try:
                self.metrics.consumer_lag.remove(topic, str(partition))
            except KeyError:
                pass  # never reported

    def drain(self) -> None:
        """Graceful stop: no new input; run everything pending, deliver, commit."""
        self.source.pause_classes(set(Priority))
        self._expire()
        for batch in self.batcher.flush():
            self._dispatch(batch)
        self._collect_finished(wait=True)
        self._emit()
        self._commit(final=True)
        summary = self.summary
        log.info("drained: %d results, %d dead letters, %d expired", summary.results, summary.dead_lettered,
                 summary.expired)
        log.debug("batch cost model at exit: %s", {k: {m: round(v, 2) for m, v in d.items()}
                                                   for k, d in self.cost.snapshot().items()})


@dataclass(frozen=True)
class KafkaClients:
    """How the loop reaches Kafka: librdkafka's clients and the broker's topic limits by default; the unit tests
    and the GPU check pass in-memory stand-ins (tests/unit/kafka_fakes.py) to run the real loop without a broker."""

    consumer: ClientFactory = Consumer
    producer: ClientFactory = Producer
    # The smallest max.message.bytes of the output topics, or None to keep librdkafka's defaults.
    output_message_limit: Callable[[Settings], int | None] = output_message_limit
    # How long a transactional call may block past its own timeout before its producer is replaced.
    stuck_grace_s: float = STUCK_GRACE_S


def build_pipeline(settings: Settings, executor: Executor, metrics: Metrics, health: Health,
                   clock: Callable[[], float] = time.time, time_phases: bool = False,
                   clients: KafkaClients = KafkaClients()) -> Pipeline:
    """The pipeline with its real parts: a Kafka consumer, producer and the delivery of the configured mode."""
    settings = resolve_inflight_batches(settings, executor.runner_count)
    log.info("in-flight batches: %d for %d runner(s), and one more for realtime",
             settings.delivery.max_inflight_batches, executor.runner_count)
    assignments = Assignments()
    tracker = OffsetTracker()
    source = FrameSource(settings, clock, assignments, consumer_factory=clients.consumer)
    delivery: Delivery
    limit = clients.output_message_limit(settings)
    if settings.delivery.mode == "exactly_once":
        transactional_id = f"{settings.delivery.transactional_id_prefix}-{settings.observability.worker_id}"

        def transactional_sink(on_done: DoneCallback, on_rejected: RejectedCallback) -> ResultSink:
            return ResultSink(settings, on_done, on_rejected, transactional_id=transactional_id,
                              max_message_bytes=limit, producer_factory=clients.producer,
                              stuck_grace_s=clients.stuck_grace_s)

        delivery = ExactlyOnceDelivery(settings, transactional_sink, source, tracker, assignments, metrics)
    else:
        def sink(on_done: DoneCallback, on_rejected: RejectedCallback) -> ResultSink:
            return ResultSink(settings, on_done, on_rejected, max_message_bytes=limit,
                              producer_factory=clients.producer, stuck_grace_s=clients.stuck_grace_s)

        at_least_once = AtLeastOnceDelivery(settings, sink, source, tracker, assignments, metrics, clock)
        source.on_commit_done = at_least_once.commit_reported
        delivery = at_least_once
    return Pipeline(settings, source, delivery, executor, metrics, health, clock, time_phases)
