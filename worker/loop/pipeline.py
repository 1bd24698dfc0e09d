"""The worker loop: source -> batcher -> runtime -> delivery. The only module that knows all the stages.

One thread owns the consumer, the batcher, the offset tracker and the producer; the runtime executes batches
on its own threads and hands back futures of `BatchOutcome`s. Every message read ends in exactly one of: a
result (OK or EXPIRED), a dead letter, or (on revocation, or as stale work) being left uncommitted for the
partition's next reading. When an output counts as delivered and what may be committed is decided by
`worker.loop.delivery`; the loop hands it what the Kafka edges returned (the sink's delivery reports, the consumer's
commit outcomes), asks it to commit each turn, and rewinds when it says so.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from worker.batching import Batch, MicroBatcher, batch_shape
from worker.batching.costmodel import CostModel
from worker.codec.schemas import ResultContext
from worker.config import Settings, resolve_inflight_batches
from worker.errors import StreamferError
from worker.frames import TP, BatchOutcome, CommitOutcome, ModelId, Output, Priority
from worker.kafka.consumer import FrameSource
from worker.kafka.producer import ResultSink
from worker.kafka.registry import RegistryLink
from worker.kafka.wiring import KafkaClients
from worker.loop.admission import Admission
from worker.loop.answers import Answers, judge_of
from worker.loop.delivery import AtLeastOnceDelivery, CommitResult, Delivery, ExactlyOnceDelivery
from worker.loop.flow import FlowControl
from worker.loop.inflight import FINISH_CHECK_MIN_S, InFlight
from worker.loop.ports import Executor, Source
from worker.metrics import Health, Metrics
from worker.partitions.dedup import DuplicateFrames
from worker.partitions.lifetime import PartitionStates
from worker.partitions.offsets import OffsetTracker
from worker.tracing import TRACING_OFF, Tracing

log = logging.getLogger(__name__)

POLL_BATCH = 500
IDLE_POLL_S = 0.1
LAG_REFRESH_S = 1.0


def poll_timeout(now: float, due: float | None, running_wait: float | None, outputs_waiting: bool) -> float:
    """How long a turn's poll may block (a message arriving ends it at once): until the batcher's next batch is due,
    at most IDLE_POLL_S; while batches run, at most `running_wait` (InFlight.wait_for_finish: a few turns a batch,
    where a fixed 2 ms slice cost a 500 ms NudeNet batch 250 turns of ~0.2 CPU-ms, 1 CPU-ms a frame on the 2-core
    VM). A batch already due then waits for a slot, which only a finished batch frees, so it does not shorten the
    wait; one that becomes due meanwhile may find realtime's own slot."""
    if outputs_waiting:
        return FINISH_CHECK_MIN_S
    if running_wait is None:
        return IDLE_POLL_S if due is None else min(IDLE_POLL_S, max(0.0, due - now))
    if due is not None and due > now:
        running_wait = min(running_wait, max(FINISH_CHECK_MIN_S, due - now))
    return min(running_wait, IDLE_POLL_S)


class ConsumerLagSeries:
    """The consumer-lag gauge's series of each partition owned (set by update_lag)."""

    def __init__(self, metrics: Metrics) -> None:
        self._gauge = metrics.consumer_lag

    def drop_partitions(self, tps: Collection[TP]) -> None:
        for topic, partition in tps:
            try:
                self._gauge.remove(topic, str(partition))
            except KeyError:
                pass  # never reported


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


class Pipeline:
    """Runs the worker loop until `should_stop()` is true, then drains, commits and closes (build_pipeline)."""

    def __init__(self, settings: Settings, source: Source, delivery: Delivery, executor: Executor,
                 metrics: Metrics, health: Health, clock: Callable[[], float] = time.time,
                 result_framing: bytes = b"", tracing: Tracing = TRACING_OFF) -> None:
        self.settings = settings
        self.source = source
        self.delivery = delivery
        self.executor = executor
        self.metrics = metrics
        self.health = health
        self.clock = clock
        self.assignments = source.assignments
        self.tracker = delivery.tracker
        # Batch times measured here teach the batcher what each size costs (seeded at warm-up by seed_costs).
        # On a CPU device sizes are ranked by the CPU a frame costs: wall time there follows what shares the cores.
        self.cost = CostModel(rank_by_cpu=getattr(executor, "batch_cost_by_cpu", False))
        self.batcher = MicroBatcher(settings.batching, clock, executor.preferred_batch_sizes, self.cost,
                                    executor.memory_policy, executor.model_input_hw)
        self.duplicates = DuplicateFrames(settings.limits.duplicate_window_frames)
        self.flow = FlowControl(settings, source, self.batcher, self.tracker, metrics, clock)
        self.tracing = tracing
        self.answers = Answers(metrics, ResultContext(executor.model_name, executor.model_version,
                                                      settings.observability.worker_id, result_framing), tracing,
                               judge_of(settings))
        self.admission = Admission(settings, self.tracker, self.duplicates, self.batcher, self.answers, self.flow,
                                   metrics)
        # Everything the loop keeps per partition, dropped by one call on revoke, loss and rewind
        # (worker.partitions.lifetime); the source drops its own once the rebalance handlers returned.
        self.partition_state = PartitionStates(read=(self.delivery, self.admission),
                                               owned=(self.duplicates, self.flow, ConsumerLagSeries(metrics)))
        self._counts = RunSummary()
        self._inflight = InFlight(self.batcher, executor, settings.delivery.max_inflight_batches,
                                  settings.batching.release_when_idle, metrics)
        self._input_drained = False  # the last poll took all the consumer had fetched
        self._outputs: list[Output] = []
        # Idle time counts from the first assignment: a worker still joining the group is not idle.
        self._last_activity: float | None = None
        self._last_lag_update = float("-inf")

    def model_promoted(self, model: ModelId) -> None:
        """A rollout's promote took effect at this batch (on the loop's thread): later results name `model`, and
        verdict reuse forgets the old model's verdicts."""
        self.answers.use_model(model)
        self.admission.model_promoted()

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
            self.admission.close()
            self.metrics.ready.set(0)
        return self.summary

    def step(self) -> None:
        """One turn: collect finished batches, expire, dispatch, produce, hand delivery the sink's delivery reports,
        commit, pause or resume, poll (handing delivery the commit outcomes it returns), refresh the lag gauge."""
        self.health.beat()
        self._collect_finished()
        self._expire()
        self._dispatch_due()
        self._emit()
        self._acknowledge()
        self._commit()
        self.flow.apply()
        self._poll_input()
        self._refresh_lag()

    def _poll_input(self) -> None:
        room = self.flow.room()
        now = self.clock()
        timeout = poll_timeout(now, self.batcher.next_due(), self._inflight.wait_for_finish(now), bool(self._outputs))
        polled = self.source.poll(min(POLL_BATCH, max(room, 1)), timeout)
        if polled.commits:
            self.delivery.commits_reported(polled.commits)
        self._input_drained = polled.drained
        self.flow.pinned_frames = polled.pinned_frames
        if polled.frames or polled.dead_letters:
            self._last_activity = self.clock()
        taken = self.admission.take(polled, self.clock())
        self._outputs.extend(taken.outputs)
        self._counts.expired += taken.expired
        self._counts.consumed += len(polled.frames) + len(polled.dead_letters)

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
        self._inflight.dispatch_due(self._input_drained)

    def _collect_finished(self, wait: bool = False) -> None:
        for batch, outcome in self._inflight.finished(wait):
            self._batch_done(batch, outcome)

    def _batch_done(self, batch: Batch, outcome: BatchOutcome) -> None:
        run_s = (outcome.preprocess_ms + outcome.inference_ms) / 1000.0
        if outcome.batch_size:
            self.cost.observe(batch.shape, outcome.batch_size, run_s,
                              cpu_seconds=None if outcome.cpu_ms is None else outcome.cpu_ms / 1000.0)
        if batch.predicted_s:
            self.metrics.batch_time_ratio.observe(run_s / batch.predicted_s)
        self._counts.batches += 1
        self._counts.frames_batched += outcome.batch_size
        self._outputs.extend(self.answers.of_batch(batch, outcome, self.clock()))
        self._outputs.extend(self.admission.verdicts_known(outcome, self.clock()))

    def _expire(self) -> None:
        expired = self.batcher.pop_expired()
        if not expired:
            return
        self._counts.expired += len(expired)
        self._outputs.extend(self.answers.expired(expired, self.clock()))
        self._outputs.extend(self.admission.expired(expired, self.clock()))
        self.flow.record_expired(Counter(f.priority for f in expired))

    # -- producing and committing ---------------------------------------------------------------------------
    def _emit(self) -> None:
        if self._outputs:
            outputs, self._outputs = self._outputs, []
            self.delivery.emit(outputs)
            self.tracing.handed_over(outputs)

    def _acknowledge(self) -> None:
        """The sink's delivery reports, served since the last turn, handed to delivery."""
        self.delivery.serve_reports()
        self.flow.output_backlog = self.delivery.output_backlog()
        self.flow.unacknowledged = self.delivery.unacknowledged

    def _commit(self, final: bool = False) -> None:
        if final:  # all that is done: every output produced acknowledged, and its report handed over
            self.delivery.finish()
            self._acknowledge()
        if self.delivery.commit(final) is CommitResult.REWIND:
            self._rewind()

    def _rewind(self) -> None:
        """Delivery voided what was read since the last commit: drop all of it and read it again. The aborted
        transaction's reports go to delivery first: an output refused in it is dead-lettered when read again."""
        self._acknowledge()
        self.batcher.discard(lambda _frame: True)
        self._inflight.finished(wait=True)  # let them finish; their outputs are stale with the rest
        self._outputs.clear()
        assigned = sorted(self.assignments.partitions)
        self.partition_state.drop_partitions(assigned, rewind=True)
        self.source.seek_to_committed(assigned)

    # -- consumer lag ---------------------------------------------------------------------------------------------
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
        # A cooperative rebalance can hand out an empty increment: ready means owning a partition (Health.assigned).
        self.metrics.ready.set(1 if self.health.ready else 0)

    def _on_revoke(self, tps: list[TP], commits: list[CommitOutcome]) -> None:
        """Inside the source's poll, which gives the partitions up as this returns: deliver and commit what was read
        from them. `commits`, the outcomes served before it, go first: a failed commit is made again in this one."""
        self.metrics.rebalances.labels("revoke").inc()
        self._last_activity = self.clock()
        log.info("partitions revoked: %s", sorted(tps))
        self.delivery.commits_reported(commits)
        revoked = set(tps)
        # Frames not yet in a batch stay uncommitted: the next owner reads them again.
        self.batcher.discard(lambda f: f.source.topic_partition in revoked)
        self._collect_finished(wait=True)
        self._emit()
        self._commit(final=True)
        self.partition_state.drop_partitions(tps)  # their assignment: the source releases it after this

    def _on_lost(self, tps: list[TP]) -> None:
        """Partitions already belong to someone else: drop their state without committing. Their batches still
        running finish as stale work (their epoch ends here), and delivery drops their outputs."""
        self.metrics.rebalances.labels("lost").inc()
        log.warning("partitions lost: %s", sorted(tps))
        lost = set(tps)
        self.batcher.discard(lambda f: f.source.topic_partition in lost)
        self.partition_state.drop_partitions(tps)  # their assignment: the source releases it after this

    def drain(self) -> None:
        """Graceful stop: no new input; run everything pending, deliver, commit."""
        self.source.pause_classes(set(Priority))
        self._expire()
        # Until nothing is pending: a reference that fails sends the frames held for it (verdict reuse) back.
        while self.batcher.pending_frames or self._inflight:
            for batch in self.batcher.flush():
                self._inflight.dispatch(batch)
            self._collect_finished(wait=True)
        self._emit()
        self._commit(final=True)
        summary = self.summary
        log.info("drained: %d results, %d dead letters, %d expired", summary.results, summary.dead_lettered,
                 summary.expired)
        log.debug("batch cost model at exit: %s", {k: {m: round(v, 2) for m, v in d.items()}
                                                   for k, d in self.cost.snapshot().items()})


def build_pipeline(settings: Settings, executor: Executor, metrics: Metrics, health: Health,
                   clock: Callable[[], float] = time.time, clients: KafkaClients = KafkaClients(),
                   registry: RegistryLink | None = None, tracing: Tracing = TRACING_OFF) -> Pipeline:
    """The pipeline with its real parts: a Kafka consumer, producer and the delivery of the configured mode;
    with `registry` (worker.kafka.registry.connect_registry), results in the Confluent wire format and
    registry-framed frames read with their writer schemas; with `tracing` (worker.tracing.setup_tracing), frames'
    spans and results' trace context.

    The worker id names the clients and the transactional id, so it must be resolved (worker.identity) first."""
    if not settings.observability.worker_id:
        raise StreamferError("observability.worker_id is empty: resolve it (worker.identity.worker_identity) before "
                             "building the pipeline")
    # The one place the in-flight limit is resolved: every part reads it from these settings.
    settings = resolve_inflight_batches(settings, executor.runner_count)
    log.info("in-flight batches: %d for %d runner(s), and one more for realtime",
             settings.delivery.max_inflight_batches, executor.runner_count)
    tracing.describe_runtime(executor.model_name, executor.model_version, getattr(executor, "device_description", ""))
    tracker = OffsetTracker()
    source = FrameSource(settings, clock, consumer_factory=clients.consumer,
                         writer_schemas=registry.held_frames(metrics, settings.max_uncommitted_frames)
                         if registry else None)
    health.source = source  # /healthz and /readyz read its assignment and its troubles
    delivery: Delivery
    limit = clients.output_message_limit(settings)
    if settings.delivery.mode == "exactly_once":
        transactional_id = f"{settings.delivery.transactional_id_prefix}-{settings.observability.worker_id}"

        def transactional_sink() -> ResultSink:
            return ResultSink(settings, transactional_id=transactional_id, max_message_bytes=limit,
                              producer_factory=clients.producer, stuck_grace_s=clients.stuck_grace_s)

        delivery = ExactlyOnceDelivery(settings, transactional_sink, source, tracker, source.assignments, metrics)
    else:
        def sink() -> ResultSink:
            return ResultSink(settings, max_message_bytes=limit, producer_factory=clients.producer,
                              stuck_grace_s=clients.stuck_grace_s)

        delivery = AtLeastOnceDelivery(settings, sink, source, tracker, source.assignments, metrics, clock)
    health.outputs = delivery  # and its output partitions that stopped acknowledging
    return Pipeline(settings, source, delivery, executor, metrics, health, clock,
                    result_framing=registry.result_framing if registry else b"", tracing=tracing)
