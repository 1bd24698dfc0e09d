"""The commit protocol: when an output counts as delivered, and which offsets may then be committed.

One class per delivery mode behind one small interface, so the loop never asks which mode it runs in:
- `AtLeastOnceDelivery`: outputs are produced at once; an offset is done when the broker acknowledged its
  output; the watermark is committed after each batch (asynchronously), flushed and committed synchronously
  before partitions are given up.
- `ExactlyOnceDelivery`: outputs are held until their partition's commit point passes them, then produced in
  one transaction together with those offsets; an aborted or stuck transaction is reported as `REWIND`, and
  the loop reads again from the committed offsets.

The loop hands delivery what the Kafka edges returned: the sink's delivery reports (`acknowledge`) and the
consumer's commit outcomes (`commits_reported`); nothing here is called back. Work of a partition epoch that is no
longer current (see worker.partitions.assignment) is dropped here, in one place.
An output the client or broker refuses (too large, invalid) is replaced by a reference-only dead letter, so no
single input can stop its partition.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import deque
from collections.abc import Callable, Collection

from prometheus_client import Counter

from worker.config import Settings
from worker.errors import OperatorError
from worker.frames import OUTPUT_REJECTED, TP, CommitOutcome, DeadLetter, Output, SourceRef, Status
from worker.kafka.errors import KafkaError, KafkaException, classify_producer_error
from worker.kafka.producer import DeliveryReports, MessageRejected, Refusal, ResultSink, TransactionStuckError
from worker.loop.ports import Source
from worker.metrics import Children, Metrics
from worker.partitions.assignment import Assignments
from worker.partitions.donemeta import CommitMetadata
from worker.partitions.offsets import OffsetTracker

log = logging.getLogger(__name__)

COMMIT_FAILURE_LOG_INTERVAL_S = 10.0
# (tenant, status) pairs whose results_produced child is remembered; past it the memory starts afresh.
MAX_TENANT_CHILDREN = 1024
# An asynchronous commit whose outcome librdkafka has not reported after this long (its request timeout, 60 s, is
# long past) no longer holds back the next one.
COMMIT_OUTCOME_WAIT_S = 120.0
FINAL_FLUSH_TIMEOUT_S = 30.0


class CommitResult(enum.Enum):
    NOTHING = "nothing"  # nothing new to commit, or not due yet
    COMMITTED = "committed"  # requested (at-least-once: asynchronously) or committed (exactly-once)
    REWIND = "rewind"  # what was read since the last commit is void: read it again from the committed offsets


# Makes the producer of results and dead letters: once, and again when a stuck transactional one is replaced.
SinkFactory = Callable[[], ResultSink]


class DeliveryError(OperatorError):
    """Even a reference-only dead letter cannot be produced: the dead-letter topic refuses it."""


class Delivery:
    """Shared by both modes: the stale-work filter, counting, replacing refused outputs."""

    def __init__(self, settings: Settings, sink_factory: SinkFactory, committer: Source,
                 tracker: OffsetTracker, assignments: Assignments, metrics: Metrics) -> None:
        self.settings = settings
        self._sink_factory = sink_factory
        self.committer = committer
        self.tracker = tracker
        self.assignments = assignments
        self.metrics = metrics
        # Counted per acknowledged output: each label set looked up once.
        self._produced = Children(metrics.results_produced)
        # (tenant, status) -> its results_produced child: counted per acknowledged result, so its labels (the
        # tenant's label among them) are worked out once per tenant, not per frame. Bounded: tenants are input.
        self._produced_by: dict[tuple[str, Status], Counter] = {}
        self._dead_lettered = Children(metrics.frames_dead_lettered)
        self.results = 0
        self.dead_lettered = 0
        # Messages handed to the sink (a result, each of its route copies, a dead letter): each is acknowledged for
        # its source offset, which at-least-once counts.
        self.messages_sent = 0
        self.commits = 0
        self.sink = sink_factory()

    # -- the interface the loop uses -------------------------------------------------------------------
    def emit(self, outputs: list[Output]) -> None:
        raise NotImplementedError

    def commit(self, final: bool = False) -> CommitResult:
        raise NotImplementedError

    def drop_partitions(self, tps: Collection[TP]) -> None:
        """Partitions given up: forget their offsets and any output not yet delivered (the next owner redoes it)."""
        for tp in tps:
            self.tracker.forget(tp)

    def acknowledge(self, reports: DeliveryReports) -> None:
        """Take the sink's delivery reports (the loop hands them over each turn, and before a final commit); stop
        on a producer error that nothing but a restart can fix."""
        for refusal in reports.refused:
            self._refused(refusal)
        if reports.error is not None:
            raise reports.error

    def serve_reports(self) -> None:
        """Serve the sink's delivery reports that arrived since the last call and take them (`acknowledge`)."""
        self.acknowledge(self.sink.poll(0))

    def output_backlog(self) -> int:
        """Outputs waiting in the sink's own queue for room in librdkafka's (flow pauses input meanwhile)."""
        return self.sink.backlog

    @property
    def unacknowledged(self) -> int:
        """Frames whose output was handed to the sink and is not yet acknowledged (`delivery.max_unacknowledged_outputs`
        bounds them; exactly-once: none between turns, its transaction's commit waits for every acknowledgement)."""
        return 0

    def output_problem(self) -> str | None:
        """Results or dead-letter partitions not acknowledging for a while, named (the current sink's: a stuck
        transactional one is replaced), or None."""
        return self.sink.output_stalls.problem()

    def unacknowledged_outputs(self) -> dict[tuple[str, int], float]:
        """Per output partition with outputs waiting, the seconds since its last acknowledgement."""
        return self.sink.output_stalls.unacknowledged_s()

    def commits_reported(self, outcomes: list[CommitOutcome]) -> None:
        """Outcomes of the consumer's offset commits (Polled.commits); only at-least-once commits through it."""

    def finish(self) -> None:
        """Before a final commit (partitions given up, the worker stopping): wait for what was produced to be
        acknowledged. The loop then hands the sink's reports to `acknowledge`."""

    @property
    def busy(self) -> bool:
        """Outputs not yet delivered."""
        return False

    def close(self) -> None:
        self.sink.close()

    def _refused(self, refusal: Refusal) -> None:
        """The broker refused the output of `refusal.source` for good."""

    # -- shared ----------------------------------------------------------------------------------------
    def _send(self, out: Output) -> Output:
        """Produce `out`; if it is refused, its reference-only dead letter instead. Returns what was produced."""
        try:
            self._produce(out)
            return out
        except MessageRejected as exc:
            replacement = self._replacement(out, str(exc))
            try:
                self._produce(replacement)
            except MessageRejected as again:
                raise self._dead_letter_topic_refuses(str(again)) from None
            return replacement

    def _dead_letter_topic_refuses(self, reason: str) -> DeliveryError:
        topic = self.settings.topics.dead_letter
        return DeliveryError(f"the dead-letter topic {topic} refuses even a reference-only dead letter: {reason}",
                             setting=f"max.message.bytes of topic {topic}")

    def _produce(self, out: Output) -> None:
        if out.dead_letter is not None:
            self.sink.send_dead_letter(out.dead_letter)
            self.messages_sent += 1
        else:
            self.sink.send_result(out.source, out.key or b"", out.value, out.result_headers)
            self.messages_sent += 1
            for topic in out.routes:
                self.sink.send_copy(topic, out.source, out.key or b"", out.value, out.result_headers)
                self.messages_sent += 1

    @staticmethod
    def _replacement(out: Output, reason: str) -> Output:
        """A dead letter that names the source offset instead of carrying the output (which cannot be produced:
        the original frame is still in its input topic)."""
        log.warning("the %s for %s/%d@%d cannot be produced, dead-lettering a reference instead: %s",
                    "dead letter" if out.dead_letter else "result", out.source.topic, out.source.partition,
                    out.source.offset, reason)
        dl = DeadLetter(source=out.source, reason=f"its output cannot be produced: {reason}",
                        error_type=OUTPUT_REJECTED, payload=b"", key=out.key, headers=out.headers)
        return Output.of_dead_letter(dl, out.tenant)

    def _count(self, out: Output) -> None:
        if out.dead_letter is not None:
            self.dead_lettered += 1
            error_type = self.metrics.error_type_label(out.dead_letter.error_type)
            self._dead_lettered.labels(out.source.topic, error_type).inc()
        else:
            self.results += 1
            key = (out.tenant, out.status)
            child = self._produced_by.get(key)
            if child is None:
                if len(self._produced_by) >= MAX_TENANT_CHILDREN:
                    self._produced_by.clear()
                child = self._produced_by[key] = self._produced.labels(
                    self.settings.topics.results, self.metrics.tenant_label(out.tenant), out.status.value)
            child.inc()
            for topic in out.routes:
                self._produced.labels(topic, self.metrics.tenant_label(out.tenant), out.status.value).inc()


class AtLeastOnceDelivery(Delivery):
    """Produce at once; an offset is done when its output is acknowledged; commit the watermark after each batch.

    A crash re-reads from the last commit: an output may be produced twice, never lost. One asynchronous commit at a
    time: librdkafka retries a failed OffsetCommit request as it was sent, so with a newer commit already on its way
    the older offsets could land after it and move the committed offset back (seen while a coordinator failed over:
    commits of 8 and 9 retried in turn, 8 landing after 9)."""

    def __init__(self, settings: Settings, sink_factory: SinkFactory, committer: Source,
                 tracker: OffsetTracker, assignments: Assignments, metrics: Metrics,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(settings, sink_factory, committer, tracker, assignments, metrics)
        self.clock = clock
        self._awaiting_ack: dict[SourceRef, Output] = {}
        # Acknowledgements still to come for an output with route copies (its result and each copy are acknowledged
        # for the same source offset): the offset is done at the last one. Absent: one (the output alone).
        self._acks_left: dict[SourceRef, int] = {}
        self._last_commit = float("-inf")
        self._commits_in_flight: deque[float] = deque()
        # When the asynchronous commit whose outcome is not reported yet was sent (self.clock), or None.
        self._outcome_awaited_since: float | None = None
        self._last_failure_log = float("-inf")
        self._failures_unlogged = 0
        # The offsets done beyond each held commit point, in the commit's metadata (issue 67).
        self._metadata = CommitMetadata(clock, settings.delivery.commit_metadata_max_bytes)

    def emit(self, outputs: list[Output]) -> None:
        for out in outputs:
            if self.assignments.is_current(out.source):
                before = self.messages_sent
                self._awaiting_ack[out.source] = self._send(out)
                # The result and its copies (or, a copy refused at once, also the reference dead letter after them).
                if self.messages_sent - before > 1:
                    self._acks_left[out.source] = self.messages_sent - before

    def acknowledge(self, reports: DeliveryReports) -> None:
        """An acknowledged output's offset is done; a refused one is replaced by its reference dead letter."""
        awaiting, is_current = self._awaiting_ack, self.assignments.is_current
        acks_left = self._acks_left
        for source in reports.acknowledged:
            if acks_left and source in acks_left and awaiting.get(source) is not None:
                left = acks_left[source] - 1
                if left > 0:
                    acks_left[source] = left  # the result or a copy: the others are still to come
                    continue
                del acks_left[source]
            out = awaiting.pop(source, None)
            if out is None or not is_current(source):
                continue  # an acknowledgement of a partition given up since: the next owner redoes its frame
            self._count(out)
            self.tracker.mark_done(source.topic_partition, source.offset)
        super().acknowledge(reports)

    def _refused(self, refusal: Refusal) -> None:
        source = refusal.source
        out = self._awaiting_ack.get(source)
        if out is None or not self.assignments.is_current(source):
            return
        if out.dead_letter is not None and out.dead_letter.error_type == OUTPUT_REJECTED:
            raise self._dead_letter_topic_refuses(refusal.reason)
        self._awaiting_ack[source] = self._send(self._replacement(out, refusal.reason))

    @property
    def busy(self) -> bool:
        return bool(self._awaiting_ack)

    @property
    def unacknowledged(self) -> int:
        # One per source offset however often its output is produced again (librdkafka failed it after
        # message.timeout.ms) and however many messages it takes (route copies).
        return len(self._awaiting_ack)

    def finish(self) -> None:
        remaining = self.sink.flush(FINAL_FLUSH_TIMEOUT_S)
        if remaining:
            log.warning("%d results still unacknowledged after %.0fs; their offsets stay uncommitted", remaining,
                        FINAL_FLUSH_TIMEOUT_S)

    def commit(self, final: bool = False) -> CommitResult:
        """Commit the watermark: asynchronously in the loop (a synchronous commit would stall it for a broker
        round trip per batch), synchronously before partitions are given up (after `finish` and `acknowledge`)."""
        now = self.clock()
        if not final and self._awaiting_outcome(now):
            return CommitResult.NOTHING
        # Before the interval ends when half the uncommitted cap is used, so the cap pauses reading only while
        # commits fail, never because the interval is long (outputs awaiting acknowledgement have their own bound:
        # a commit cannot pass them anyway).
        if not final and now - self._last_commit < self.settings.delivery.commit_interval_ms / 1000.0 \
                and self.tracker.held() - len(self._awaiting_ack) < self.settings.max_uncommitted_frames // 2:
            return CommitResult.NOTHING
        # A partition given up since is someone else's to commit.
        points = {tp: point for tp, point in self.tracker.commit_points().items() if tp in self.assignments}
        metadata = self._metadata_for(points, final)
        if not points:
            return CommitResult.NOTHING
        # librdkafka reports every commit, synchronous ones too, in order: they come back through commits_reported.
        self._commits_in_flight.append(time.monotonic())
        try:
            self.committer.commit(points, asynchronous=not final, metadata=metadata)
        except KafkaException as exc:  # retried next turn
            self._commits_in_flight.pop()
            log.warning("offset commit failed (will retry): %s", exc)
            return CommitResult.NOTHING
        if not final:
            self._outcome_awaited_since = now
        self.tracker.mark_committed(points)
        self._last_commit = now
        self.commits += 1
        return CommitResult.COMMITTED

    def _metadata_for(self, points: dict[TP, int], final: bool) -> dict[TP, str]:
        """Each held partition's metadata where due (adding to `points` those due a refresh); overflows counted."""
        before = self._metadata.overflows
        metadata = self._metadata.for_commit(points, self.tracker, self.assignments.__contains__, final)
        if self._metadata.overflows > before:
            self.metrics.commit_metadata_overflows.inc(self._metadata.overflows - before)
        return metadata

    def _awaiting_outcome(self, now: float) -> bool:
        """Whether the last asynchronous commit's outcome is still to come (then the next one waits for it)."""
        if self._outcome_awaited_since is None:
            return False
        if now - self._outcome_awaited_since < COMMIT_OUTCOME_WAIT_S:
            return True
        log.warning("no outcome reported for an offset commit sent %.0fs ago: committing again",
                    now - self._outcome_awaited_since)
        self._outcome_awaited_since = None
        return False

    def commits_reported(self, outcomes: list[CommitOutcome]) -> None:
        for outcome in outcomes:
            self._commit_reported(outcome)

    def _commit_reported(self, outcome: CommitOutcome) -> None:
        """Outcome of a commit, served by a consumer poll; a failed partition's commit point is offered again."""
        self._outcome_awaited_since = None
        if self._commits_in_flight:
            self.metrics.commit_latency.observe(time.monotonic() - self._commits_in_flight.popleft())
        self.tracker.commit_confirmed(outcome.committed)
        failed, reason = outcome.failed, outcome.reason
        if not failed:
            self.metrics.commits.labels("ok").inc()
            return
        self.metrics.commits.labels("error").inc()
        # During a rebalance every commit fails for a moment: one line per interval, with a count.
        now = time.monotonic()
        if now - self._last_failure_log >= COMMIT_FAILURE_LOG_INTERVAL_S:
            more = f" ({self._failures_unlogged} more since the last report)" if self._failures_unlogged else ""
            log.warning("asynchronous offset commit failed for %s (will retry): %s%s", sorted(failed), reason, more)
            self._last_failure_log = now
            self._failures_unlogged = 0
        else:
            self._failures_unlogged += 1
        for tp in failed:
            self.tracker.commit_failed(tp)

    def drop_partitions(self, tps: Collection[TP]) -> None:
        gone = set(tps)
        for source in [s for s in self._awaiting_ack if s.topic_partition in gone]:
            del self._awaiting_ack[source]
            self._acks_left.pop(source, None)
        for tp in tps:
            self._metadata.forget(tp)
        super().drop_partitions(tps)


class ExactlyOnceDelivery(Delivery):
    """Outputs and their offsets in one transaction per turn: a read_committed reader sees each output once."""

    def __init__(self, settings: Settings, sink_factory: SinkFactory, committer: Source,
                 tracker: OffsetTracker, assignments: Assignments, metrics: Metrics) -> None:
        super().__init__(settings, sink_factory, committer, tracker, assignments, metrics)
        # Outputs waiting for their partition's commit point to pass them, by partition and offset.
        self._held: dict[TP, dict[int, Output]] = {}
        # Offsets whose output a broker refused inside a transaction (which then aborted): when read again,
        # they are dead-lettered by reference at once.
        self._refused_offsets: dict[tuple[TP, int], str] = {}

    @property
    def _call_timeout_s(self) -> float:
        return self.settings.delivery.transaction_call_timeout_ms / 1000.0

    def emit(self, outputs: list[Output]) -> None:
        """Hold each output: it is done (its offset may be committed) once it joins a transaction."""
        for out in outputs:
            if not self.assignments.is_current(out.source):
                continue
            tp = out.source.topic_partition
            refused = self._refused_offsets.get((tp, out.source.offset))
            if refused is not None:
                out = self._replacement(out, refused)
            self._held.setdefault(tp, {})[out.source.offset] = out
            self.tracker.mark_done(tp, out.source.offset)

    @property
    def busy(self) -> bool:
        return any(self._held.values())

    def _refused(self, refusal: Refusal) -> None:
        # The transaction fails to commit and is aborted; the frame is read again and dead-lettered then.
        source = refusal.source
        self._refused_offsets[(source.topic_partition, source.offset)] = refusal.reason

    def commit(self, final: bool = False) -> CommitResult:
        """Produce the outputs below each partition's commit point and commit those offsets, atomically.

        An output beyond its partition's commit point (an earlier frame is still batching or running) stays
        held: committing its result while its offset is not committed would let the next owner of the
        partition, after a crash, produce that frame's result a second time."""
        points = self.tracker.commit_points()
        if not points:
            return CommitResult.NOTHING
        releasable = [out for tp, point in points.items()
                      for _offset, out in sorted(o for o in self._held.get(tp, {}).items() if o[0] < point)]
        started = time.monotonic()
        try:
            self.sink.begin()
            # The offsets first, before any output joins the transaction: the group coordinator refuses them
            # (ILLEGAL_GENERATION) when a rebalance round moved the group to a new generation since this consumer
            # last heard, which happens once per round to a worker that commits all the time. Refused here, the
            # transaction holds nothing: its abort needs no epoch bump, and the outputs stay held for the next one.
            try:
                self.sink.send_offsets(points, self.committer.group_metadata(), self._call_timeout_s)
            except KafkaException as exc:
                self._raise_if_refused(exc.args[0])
                if not exc.args[0].txn_requires_abort():
                    raise
                return self._abort_offsets_only(exc.args[0])
            sent = [self._send(out) for out in releasable]
            self.sink.commit_transaction(self._call_timeout_s)
        except TransactionStuckError as exc:
            return self._replace_stuck_sink(exc)
        except KafkaException as exc:
            err = exc.args[0]
            self._raise_if_refused(err)
            if not err.txn_requires_abort():
                raise
            self.metrics.commits.labels("aborted").inc()
            log.warning("transaction aborted (%s): rewinding to the committed offsets", err.str())
            try:
                self.sink.abort(self._call_timeout_s)
            except TransactionStuckError as stuck:
                return self._replace_stuck_sink(stuck)
            return self._rewind()
        for out, produced in zip(releasable, sent, strict=True):
            del self._held[out.source.topic_partition][out.source.offset]
            self._count(produced)
        self.tracker.mark_committed(points)
        self.tracker.commit_confirmed(points)
        # A refused offset is remembered until its reference dead letter is committed (a later transaction may
        # fail for another reason and read it again).
        self._refused_offsets = {(tp, o): r for (tp, o), r in self._refused_offsets.items()
                                 if o >= points.get(tp, -1)}
        self.metrics.commits.labels("ok").inc()
        self.metrics.commit_latency.observe(time.monotonic() - started)
        self.commits += 1
        return CommitResult.COMMITTED

    def _raise_if_refused(self, err: KafkaError) -> None:
        """An ACL or credential refusal: no abort-and-retry can fix it."""
        refused = self.sink.access_error or classify_producer_error(err, None, self.sink.identity)
        if refused is not None:
            raise refused from None

    def _abort_offsets_only(self, err: KafkaError) -> CommitResult:
        """Abort a transaction the coordinator refused the offsets of before any output joined it. Nothing was
        produced, so nothing is read again: the held outputs and their offsets go into the next transaction (with
        the consumer's group metadata as it is then)."""
        self.metrics.commits.labels("aborted").inc()
        log.info("transaction aborted before any output joined it (%s): its outputs go in the next one",
                 err.str())
        try:
            self.sink.abort(self._call_timeout_s)
        except TransactionStuckError as stuck:
            return self._replace_stuck_sink(stuck)
        return CommitResult.NOTHING

    def drop_partitions(self, tps: Collection[TP]) -> None:
        for tp in tps:
            # Outputs still held behind a gap: the next owner redoes those frames.
            self._held.pop(tp, None)
        super().drop_partitions(tps)

    def _replace_stuck_sink(self, exc: TransactionStuckError) -> CommitResult:
        """A transactional call is stuck inside librdkafka (or its outcome is unknown): start a producer with the
        same transactional id, which fences the stuck one and aborts its open transaction, then read again from
        the committed offsets. Nothing of the stuck transaction is visible to a read_committed reader."""
        self.metrics.commits.labels("timed_out").inc()
        log.error("%s: replacing the transactional producer and rewinding to the committed offsets", exc)
        # Its refusals served so far name the offsets to dead-letter by reference when read again.
        for refusal in self.sink.reports().refused:
            self._refused(refusal)
        self.sink.close()
        self.sink = self._sink_factory()
        return self._rewind()

    def _rewind(self) -> CommitResult:
        self._held.clear()
        return CommitResult.REWIND
