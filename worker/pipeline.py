"""Wires source -> batcher -> runtime -> sink -> commits. The only module that knows all the stages.

One thread owns the consumer, the batcher, the offset tracker and the producer; the runtime executes
batches on its own threads and hands back futures. Every message read ends in exactly one of: a result
(OK or EXPIRED), a dead letter, or (on revocation) being left uncommitted for the next owner. Offsets are
committed per partition only up to the first message that has not ended, after each batch.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from confluent_kafka import KafkaException

from worker.batching import Batch, MicroBatcher
from worker.config import Settings
from worker.frames import DeadLetter, Frame, Priority, SourceRef, Verdict
from worker.metrics import Health, Metrics
from worker.offsets import OffsetTracker
from worker.schemas import encode_result, reencode_frame
from worker.sink import ResultSink, SinkError, TransactionStuckError
from worker.source import TP, FrameSource

log = logging.getLogger(__name__)

POLL_BATCH = 500
# How long the loop blocks in poll while batches run: bounds the delay between a batch finishing and
# its results being produced.
INFLIGHT_POLL_S = 0.002
IDLE_POLL_S = 0.1
LAG_REFRESH_S = 1.0
COMMIT_FAILURE_LOG_INTERVAL_S = 10.0


class Executor(Protocol):
    """What the pipeline needs from the runtime (worker.runtime.InferenceExecutor)."""

    preferred_batch_sizes: tuple[int, ...]
    model_name: str
    model_version: str

    def submit(self, frames: Sequence[Frame], shape: tuple[int, int, int]) -> Future[Any]: ...


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


@dataclass
class _Output:
    """A message to produce for one source offset: a result or a dead letter."""

    source: SourceRef
    key: bytes | None
    value: bytes
    tenant: str
    status: str  # "OK", "EXPIRED" or "DLQ"
    dead_letter: DeadLetter | None = None


class Pipeline:
    """Runs the worker loop until `should_stop()` is true, then drains, commits and closes."""

    def __init__(self, settings: Settings, executor: Executor, metrics: Metrics, health: Health,
                 clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.executor = executor
        self.metrics = metrics
        self.health = health
        self.clock = clock
        self.exactly_once = settings.delivery.mode == "exactly_once"
        self.tracker = OffsetTracker()
        self.batcher = MicroBatcher(settings.batching, clock, executor.preferred_batch_sizes)
        self.summary = RunSummary()
        self._inflight: deque[tuple[Batch, Future[Any]]] = deque()
        self._outputs: list[_Output] = []
        self._awaiting_ack: dict[SourceRef, _Output] = {}
        # Exactly-once: outputs waiting for their partition's commit point to pass them, by partition and offset.
        self._held: dict[TP, dict[int, _Output]] = {}
        self._last_commit = 0.0
        # Idle time counts from the first assignment: a worker still joining the group is not idle.
        self._last_activity: float | None = None
        self._last_lag_update = 0.0
        self._commits_in_flight: deque[float] = deque()
        self._last_commit_failure_log = float("-inf")
        self._commit_failures_unlogged = 0
        self.source = FrameSource(settings, clock, on_commit_done=self._commit_done)
        self._transactional_id = f"{settings.delivery.transactional_id_prefix}-{settings.observability.worker_id}" \
            if self.exactly_once else None
        self.sink = ResultSink(settings, on_done=self._acknowledged, transactional_id=self._transactional_id)

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
            self.sink.close()
            self.health.assigned = False
            self.metrics.ready.set(0)
        return self.summary

    def step(self) -> None:
        """One turn: collect finished batches, expire, dispatch, produce, commit, pause, poll."""
        self.health.beat()
        self._collect_finished()
        self._expire()
        self._dispatch_due()
        self._emit()
        self.sink.poll(0)
        if self.sink.fatal_error:
            raise SinkError(self.sink.fatal_error)
        self._commit_if_due()
        self._apply_backpressure()
        self._poll_input()
        if self.clock() - self._last_lag_update >= LAG_REFRESH_S:
            self.update_lag()

    def _poll_input(self) -> None:
        room = max(0, self.settings.batching.max_pending_frames - self.batcher.pending_frames)
        if self._inflight or self._outputs:
            timeout = INFLIGHT_POLL_S
        else:
            due = self.batcher.next_due()
            timeout = IDLE_POLL_S if due is None else min(IDLE_POLL_S, max(0.0, due - self.clock()))
        polled = self.source.poll(min(POLL_BATCH, max(room, 1)), timeout)
        if polled.redelivered:
            self.metrics.redelivered.inc(polled.redelivered)
        if polled.frames or polled.dead_letters:
            self._last_activity = self.clock()
        # Track in each partition's offset order (the tracker refuses an offset below one already read).
        read = [f.source for f in polled.frames]
        if polled.dead_letters:
            read = sorted(read + [d.source for d in polled.dead_letters])
        for ref in read:
            self.tracker.track(ref.topic_partition, ref.offset)
        for frame in polled.frames:
            self.metrics.frames_consumed.labels(frame.source.topic, frame.tenant).inc()
            self.batcher.add(frame)
        for dl in polled.dead_letters:
            self.metrics.frames_consumed.labels(dl.source.topic, "unknown").inc()
            self._outputs.append(_Output(dl.source, dl.key, dl.payload, "unknown", "DLQ", dl))
        self.summary.consumed += len(polled.frames) + len(polled.dead_letters)
        self._update_gauges()

    def _idle_for(self) -> float:
        if self._last_activity is None:
            return 0.0
        busy = (self.batcher.pending_frames or self._inflight or self._outputs or self.tracker.in_flight()
                or any(self._held.values()))
        if busy:
            self._last_activity = self.clock()
            return 0.0
        return self.clock() - self._last_activity

    # -- batches -------------------------------------------------------------------------------------------
    def _dispatch_due(self) -> None:
        while len(self._inflight) < self.settings.delivery.max_inflight_batches:
            batch = self.batcher.pop_batch()
            if batch is None:
                return
            self._dispatch(batch)

    def _dispatch(self, batch: Batch) -> None:
        self.metrics.batch_size.labels(batch.priority.label, batch.lane).observe(batch.size)
        self.metrics.padding_waste.observe(batch.padding_waste)
        self._inflight.append((batch, self.executor.submit(batch.frames, batch.shape)))

    def _collect_finished(self, wait: bool = False) -> None:
        while self._inflight and (wait or self._inflight[0][1].done()):
            batch, future = self._inflight.popleft()
            outcome = future.result()  # the executor isolates bad frames; an exception here is a bug: crash
            self._batch_done(batch, outcome)

    def _batch_done(self, batch: Batch, outcome: Any) -> None:
        now = self.clock()
        self.summary.batches += 1
        self.summary.frames_batched += outcome.batch_size
        self.metrics.preprocess_latency.observe(outcome.preprocess_ms / 1000.0)
        self.metrics.inference_latency.observe(outcome.inference_ms / 1000.0)
        for frame, verdict in outcome.verdicts:
            queued_s = max(0.0, outcome.started_at - frame.received_at)
            self.metrics.queue_wait.labels(frame.priority.label).observe(queued_s)
            self.metrics.end_to_end_latency.labels(frame.priority.label).observe(
                max(0.0, now - frame.capture_ts_ms / 1000.0))
            for label in verdict.flagged_labels:
                self.metrics.frames_flagged.labels(label).inc()
            self._outputs.append(self._result(frame, verdict, "OK", queued_s * 1000.0, outcome.batch_size,
                                              outcome.preprocess_ms + outcome.inference_ms, now))
        for failure in outcome.failures:
            frame = failure.frame
            dl = DeadLetter(source=frame.source, reason=failure.reason, error_type=failure.error_type,
                            payload=reencode_frame(frame), key=frame.stream_id.encode())
            self._outputs.append(_Output(frame.source, dl.key, dl.payload, frame.tenant, "DLQ", dl))

    def _expire(self) -> None:
        now = self.clock()
        for frame in self.batcher.pop_expired():
            self.metrics.frames_expired.labels(frame.source.topic, frame.tenant).inc()
            self.summary.expired += 1
            self._outputs.append(self._result(frame, None, "EXPIRED", (now - frame.received_at) * 1000.0, 0, 0.0, now))

    def _result(self, frame: Frame, verdict: Verdict | None, status: str, queued_ms: float, batch_size: int,
                inference_ms: float, now: float) -> _Output:
        record = {
            "stream_id": frame.stream_id,
            "frame_index": frame.frame_index,
            "tenant": frame.tenant,
            "status": status,
            "model_name": self.executor.model_name,
            "model_version": self.executor.model_version,
            "scores": dict(verdict.scores) if verdict else {},
            "flagged": verdict.flagged if verdict else False,
            "flagged_labels": list(verdict.flagged_labels) if verdict else [],
            "source_topic": frame.source.topic,
            "source_partition": frame.source.partition,
            "source_offset": frame.source.offset,
            "capture_ts_ms": frame.capture_ts_ms,
            "queued_ms": queued_ms,
            "batch_size": batch_size,
            "inference_ms": inference_ms,
            "end_to_end_ms": max(0.0, now * 1000.0 - frame.capture_ts_ms),
            "worker_id": self.settings.observability.worker_id,
        }
        # Keyed by stream so a stream's results stay ordered within one output partition.
        return _Output(frame.source, frame.stream_id.encode(), encode_result(record), frame.tenant, status)

    # -- producing and committing ---------------------------------------------------------------------------
    def _emit(self) -> None:
        if not self._outputs:
            return
        outputs, self._outputs = self._outputs, []
        if self.exactly_once:
            self._emit_transaction(outputs)
            return
        for out in outputs:
            self._awaiting_ack[out.source] = out
            if out.dead_letter is not None:
                self.sink.send_dead_letter(out.dead_letter)
            else:
                self.sink.send_result(out.source, out.key or b"", out.value)

    def _emit_transaction(self, outputs: list[_Output]) -> None:
        """Exactly-once: outputs up to each partition's commit point, with those offsets, in one transaction.

        An output beyond its partition's commit point (an earlier frame is still batching or running) is
        held back: committing its result while its offset is not committed would let the next owner of the
        partition, after a crash, produce that frame's result a second time.
        """
        for out in outputs:
            tp = out.source.topic_partition
            if self.tracker.is_in_flight(tp, out.source.offset):  # else stale: its partition was given up
                self._held.setdefault(tp, {})[out.source.offset] = out
                self.tracker.mark_done(tp, out.source.offset)
        points = self.tracker.commit_points()
        if not points:
            return
        releasable = [out for tp, point in points.items()
                      for _offset, out in sorted(o for o in self._held.get(tp, {}).items() if o[0] < point)]
        started = time.monotonic()
        try:
            self.sink.begin()
            for out in releasable:
                if out.dead_letter is not None:
                    self.sink.send_dead_letter(out.dead_letter)
                else:
                    self.sink.send_result(out.source, out.key or b"", out.value)
            self.sink.commit_transaction(points, self.source.group_metadata(),
                                         self.settings.delivery.transaction_call_timeout_ms / 1000.0)
        except TransactionStuckError as exc:
            self._replace_stuck_sink(exc)
            return
        except KafkaException as exc:
            err = exc.args[0]
            if not err.txn_requires_abort():
                raise
            self.metrics.commits.labels("aborted").inc()
            log.warning("transaction aborted (%s): rewinding to the committed offsets", err.str())
            try:
                self.sink.abort(self.settings.delivery.transaction_call_timeout_ms / 1000.0)
            except TransactionStuckError as stuck:
                self._replace_stuck_sink(stuck)
                return
            self._rewind()
            return
        for out in releasable:
            del self._held[out.source.topic_partition][out.source.offset]
            self._count(out)
        self.tracker.mark_committed(points)
        self.metrics.commits.labels("ok").inc()
        self.metrics.commit_latency.observe(time.monotonic() - started)
        self.summary.commits += 1

    def _replace_stuck_sink(self, exc: TransactionStuckError) -> None:
        """A transaction call is stuck inside librdkafka (or its outcome is unknown): start a producer with the
        same transactional id, which fences the stuck one and aborts its open transaction, then read again
        from the committed offsets. Nothing of the stuck transaction is visible to a read_committed reader."""
        self.metrics.commits.labels("timed_out").inc()
        log.error("%s: replacing the transactional producer and rewinding to the committed offsets", exc)
        self.sink.close()
        self.sink = ResultSink(self.settings, on_done=self._acknowledged, transactional_id=self._transactional_id)
        self._rewind()

    def _rewind(self) -> None:
        """After an aborted transaction: drop everything read since the last commit and read it again."""
        self.batcher.discard(lambda _frame: True)
        while self._inflight:
            _batch, future = self._inflight.popleft()
            future.result()  # let it finish; its outputs are dropped with the rest
        self._outputs.clear()
        self._held.clear()
        assigned = sorted(self.source.assignment)
        for tp in assigned:
            self.tracker.forget(tp)
        self.source.seek_to_committed(assigned)

    def _acknowledged(self, source: SourceRef) -> None:
        """Delivery report (at-least-once): the broker has the message, so the offset is done."""
        if self.exactly_once:
            return  # done was recorded when the message joined the transaction
        out = self._awaiting_ack.pop(source, None)
        if out is not None:
            self._count(out)
            self._mark_done(source)

    def _count(self, out: _Output) -> None:
        if out.dead_letter is not None:
            self.summary.dead_lettered += 1
            self.metrics.frames_dead_lettered.labels(out.source.topic, out.dead_letter.error_type).inc()
        else:
            self.summary.results += 1
            self.metrics.results_produced.labels(self.settings.topics.results, out.tenant, out.status).inc()

    def _mark_done(self, source: SourceRef) -> None:
        # An ack can arrive after its partition was lost (forgotten, or even assigned to us again and the
        # offset not read yet): only an offset in flight now is ours to mark.
        if self.tracker.is_in_flight(source.topic_partition, source.offset):
            self.tracker.mark_done(source.topic_partition, source.offset)

    def _commit_if_due(self, final: bool = False) -> None:
        """Commit the watermark after a batch: asynchronously in the loop (a synchronous commit would stall
        it for a broker round trip per batch), synchronously before partitions are given up."""
        if self.exactly_once:
            return
        now = self.clock()
        interval = self.settings.delivery.commit_interval_ms / 1000.0
        if not final and now - self._last_commit < interval:
            return
        points = self.tracker.commit_points()
        if not points:
            return
        # librdkafka reports every commit, synchronous ones too, to the commit callback, in order.
        self._commits_in_flight.append(time.monotonic())
        try:
            self.source.commit(points, asynchronous=not final)
        except KafkaException as exc:  # counted by the callback; retried next turn
            log.warning("offset commit failed (will retry): %s", exc)
            return
        self.tracker.mark_committed(points)
        self._last_commit = now
        self.summary.commits += 1

    def _commit_done(self, failed: list[TP], reason: str | None) -> None:
        """Outcome of a commit, served by a poll; a failed partition's commit point is offered again."""
        if self._commits_in_flight:
            self.metrics.commit_latency.observe(time.monotonic() - self._commits_in_flight.popleft())
        if not failed:
            self.metrics.commits.labels("ok").inc()
            return
        self.metrics.commits.labels("error").inc()
        # During a rebalance every commit fails for a moment: one line per interval, with a count.
        now = time.monotonic()
        if now - self._last_commit_failure_log >= COMMIT_FAILURE_LOG_INTERVAL_S:
            more = f" ({self._commit_failures_unlogged} more since the last report)" if self._commit_failures_unlogged else ""
            log.warning("asynchronous offset commit failed for %s (will retry): %s%s", sorted(failed), reason, more)
            self._last_commit_failure_log = now
            self._commit_failures_unlogged = 0
        else:
            self._commit_failures_unlogged += 1
        for tp in failed:
            self.tracker.commit_failed(tp)

    # -- flow control -----------------------------------------------------------------------------------------
    def _apply_backpressure(self) -> None:
        self.source.pause_classes(self.batcher.classes_to_pause())
        self.metrics.paused_partitions.set(self.source.paused_partitions)

    def _update_gauges(self) -> None:
        self.metrics.inflight_frames.set(self.tracker.in_flight())
        self.metrics.inflight_bytes.set(self.batcher.pending_bytes)

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
        self.health.assigned = bool(self.source.assignment)
        self.metrics.ready.set(1 if self.health.ready else 0)

    def _on_revoke(self, tps: list[TP]) -> None:
        """Finish what was read from the revoked partitions, commit it, then let them go."""
        self.metrics.rebalances.labels("revoke").inc()
        self._last_activity = self.clock()
        log.info("partitions revoked: %s", sorted(tps))
        revoked = set(tps)
        # Frames not yet in a batch stay uncommitted: the next owner reads them again.
        self.batcher.discard(lambda f: f.source.topic_partition in revoked)
        self._finish_inflight()
        if not self.exactly_once:
            self._commit_if_due(final=True)
        self._release(tps)
        self.health.assigned = bool(self.source.assignment - revoked)

    def _on_lost(self, tps: list[TP]) -> None:
        """Partitions already belong to someone else: drop their state without committing."""
        self.metrics.rebalances.labels("lost").inc()
        log.warning("partitions lost: %s", sorted(tps))
        lost = set(tps)
        self.batcher.discard(lambda f: f.source.topic_partition in lost)
        # Let running batches finish and drop their outputs for these partitions: a late output would
        # duplicate the new owner's (and could be mistaken for a re-read offset if they come back to us).
        self._collect_finished(wait=True)
        self._outputs = [o for o in self._outputs if o.source.topic_partition not in lost]
        self._release(tps)
        self.health.assigned = bool(self.source.assignment - lost)

    def _release(self, tps: list[TP]) -> None:
        for topic, partition in tps:
            self.tracker.forget((topic, partition))
            # Exactly-once outputs still held behind a gap: the next owner redoes those frames.
            self._held.pop((topic, partition), None)
            try:
                self.metrics.consumer_lag.remove(topic, str(partition))
            except KeyError:
                pass  # never reported

    def _finish_inflight(self) -> None:
        """Wait for running batches, produce everything pending and wait for the broker's acks."""
        self._collect_finished(wait=True)
        self._emit()
        if not self.exactly_once:
            remaining = self.sink.flush(30.0)
            if remaining:
                log.warning("%d results still unacknowledged after 30s; their offsets stay uncommitted", remaining)

    def drain(self) -> None:
        """Graceful stop: no new input; run everything pending, produce, commit."""
        self.source.pause_classes(set(Priority))
        self._expire()
        for batch in self.batcher.flush():
            self._dispatch(batch)
        self._finish_inflight()
        self._commit_if_due(final=True)
        log.info("drained: %d results, %d dead letters, %d expired", self.summary.results,
                 self.summary.dead_lettered, self.summary.expired)
