"""Flow control at the consumer: which partitions the loop reads now and how many frames a poll may take. Four
rules meet here: the batcher's backpressure, the uncommitted cap, reading by priority
(`worker.reading.priority`, the pure policy), for which this module sums each class's backlog in Kafka from the
source, and fair reading within a class (`worker.reading.fairness`), which holds the partitions read ahead of their
siblings."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Mapping

from worker.batching import MicroBatcher
from worker.config import Settings
from worker.frames import TP, Priority
from worker.loop.ports import Source
from worker.metrics import Children, Metrics
from worker.partitions.offsets import OffsetTracker
from worker.reading.fairness import FairDecision, PartitionFairness
from worker.reading.priority import PriorityReading, PriorityReadingDecision

# How often the partitions' backlogs in Kafka are read for reading by priority and fair reading (positions and
# cached watermarks: no broker request, ~15 us for nine partitions).
BACKLOG_REFRESH_S = 0.01


class FlowControl:
    """Pauses and resumes the source's classes once per turn, and sizes the next poll."""

    def __init__(self, settings: Settings, source: Source, batcher: MicroBatcher, tracker: OffsetTracker,
                 metrics: Metrics, clock: Callable[[], float]) -> None:
        self._settings = settings
        self._source = source
        self._batcher = batcher
        self._tracker = tracker
        self._metrics = metrics
        self._clock = clock
        self.by_priority = PriorityReading(settings.batching, clock) if settings.batching.read_by_priority else None
        self._decision = PriorityReadingDecision()
        self.fairness = PartitionFairness(settings.batching, clock)
        self._fair = FairDecision()
        self.class_of_topic = settings.topics.input_topics()
        self._lag: dict[TP, int] = {}
        self._backlog: dict[Priority, int] = {}
        self._backlog_at = float("-inf")
        self.paused: set[Priority] = set()
        # Frames held for their writer schema and the unframed ones answered past them (worker.kafka.schemahold):
        # offsets no commit passes until the registry answers, bounded by their partitions' pauses; they do not count
        # against the uncommitted cap, which would stop every partition.
        self.pinned_frames = 0
        # Outputs waiting for room in the producer's local queue (worker.kafka.producer): input pauses meanwhile.
        self.output_backlog = 0
        # Frames whose output was handed to the sink and awaits its acknowledgement (worker.loop.delivery): bounded by
        # `delivery.max_unacknowledged_outputs`, not by the memory bound (issue 67: they hold no pixels).
        self.unacknowledged = 0
        self._priority_paused = Children(metrics.priority_paused)
        self._priority_pauses = Children(metrics.priority_pauses)
        self._unservable = Children(metrics.backlog_unservable)
        for p in Priority:  # every class's series from the start (0: not paused), as dashboards and alerts expect
            self._priority_paused.labels(p.label).set(0)
            self._priority_pauses.labels(p.label)
            self._unservable.labels(p.label).set(0)

    def room(self) -> int:
        """Frames the loop may read now: the batcher's room (no class still reading past its share), and what is
        left under the uncommitted cap."""
        room = min(self._batcher.poll_room(self.paused), self._held_room(), self._done_room(),
                   self._unacknowledged_room())
        decision = self._decision
        # While a class reads its floor share, polls stay small so it does not pass its share by much (not while
        # backpressure keeps it paused anyway: small polls would only slow the others down).
        if decision.poll_limit is not None and not decision.floor_reading <= self.paused:
            room = min(room, decision.poll_limit)
        # While a partition is held for its siblings, one poll must not put another far ahead of them.
        if self._fair.poll_limit is not None:
            room = min(room, self._fair.poll_limit)
        return max(0, room)

    def apply(self) -> None:
        """Pause what the batcher has no room for and what waits for a more urgent backlog; pause everything while
        the uncommitted cap is reached (frames not yet answered, or commits failing: what more the worker read, a
        lost session would answer again), the bound of answered offsets held behind a commit point, or the bound of
        outputs awaiting acknowledgement, or while outputs wait for room in the producer's queue."""
        self._refresh_lag()
        if self.by_priority is not None:
            self._read_by_priority(self.by_priority)
        self._metrics.unacknowledged_outputs.set(self.unacknowledged)
        if self._held_room() <= 0 or self._done_room() <= 0 or self._unacknowledged_room() <= 0 \
                or self.output_backlog:
            self.paused = set(Priority)
        else:
            self.paused = self._batcher.classes_to_pause() | self._decision.paused
        self._fair = self.fairness.decide(self._lag, self._class_of, self.paused,
                                          self._source.awaiting_committed_offset)
        self._source.pause_classes(self.paused, self._fair.held)
        self._metrics.paused_partitions.set(self._source.paused_partitions)

    def _held_room(self) -> int:
        """Room under `delivery.max_uncommitted_frames`: frames not yet answered and answered ones below an
        unconfirmed commit point (worker.partitions.offsets), less those whose output awaits its acknowledgement
        (`_unacknowledged_room`); frames pinned by a schema hold are bounded per partition instead."""
        return self._settings.max_uncommitted_frames - max(
            0, self._tracker.held() - self.pinned_frames - self.unacknowledged)

    def _unacknowledged_room(self) -> int:
        """Room under `delivery.max_unacknowledged_outputs`: frames whose output awaits its acknowledgement."""
        return self._settings.max_unacknowledged_outputs - self.unacknowledged

    def _done_room(self) -> int:
        """Room under `delivery.max_done_offsets_held`: answered offsets held behind an earlier one (issue 67)."""
        return self._settings.max_done_offsets_held - self._tracker.done_beyond()

    def record_read(self, read: Counter[Priority], late: Counter[Priority], oldest_s: Mapping[Priority, float],
                    drained: bool, by_partition: Mapping[TP, int]) -> None:
        """What a poll read per class (frames and dead letters), which of its frames were past their deadline, each
        class's oldest capture time read, whether it emptied the consumer's queue, and what it read per partition."""
        self.fairness.record_read(by_partition, self._class_of)
        if self.by_priority is not None:
            self.by_priority.record_read(read, late, oldest_s, drained if len(self.paused) < len(Priority) else None)

    def drop_partitions(self, tps: Collection[TP]) -> None:
        """Partitions given up: their backlog and fair-reading counts forgotten now, not at the next refresh."""
        for tp in tps:
            self._lag.pop(tp, None)
        self.fairness.drop_partitions(tps)

    def record_expired(self, expired: Counter[Priority]) -> None:
        """Frames that expired waiting for a batch, per class."""
        if self.by_priority is not None:
            self.by_priority.record_expired(expired)

    def _class_of(self, tp: TP) -> Priority:
        return self.class_of_topic[tp[0]]

    def _refresh_lag(self) -> None:
        """Each partition's backlog in Kafka and each class's sum, every BACKLOG_REFRESH_S."""
        now = self._clock()
        if now - self._backlog_at >= BACKLOG_REFRESH_S:
            self._backlog_at = now
            self._lag = self._source.lag()
            backlog: Counter[Priority] = Counter()
            for (topic, _partition), lag in self._lag.items():
                backlog[self.class_of_topic[topic]] += lag
            self._backlog = dict(backlog)

    def _read_by_priority(self, policy: PriorityReading) -> None:
        """Ask the reading-by-priority policy which classes to pause for a more urgent class's backlog in Kafka."""
        before = self._decision
        decision = self._decision = policy.decide(self._backlog)
        if decision == before:
            return
        for p in Priority:
            if (p in decision.paused) != (p in before.paused):
                self._priority_paused.labels(p.label).set(1 if p in decision.paused else 0)
                if p in decision.paused:
                    self._priority_pauses.labels(p.label).inc()
            if (p in decision.unservable) != (p in before.unservable):
                self._unservable.labels(p.label).set(1 if p in decision.unservable else 0)
