"""Fair reading within a class: which partitions to hold (pause) so that every partition of a class with a backlog
in Kafka is read at the same pace. Pure policy: no Kafka, no torch; time from an injected clock. Not thread-safe:
one loop owns it.

Why. librdkafka serves the partitions it has fetched from one first-in-first-out queue, one partition's fetched
messages after another's, in an order that favours some; while backpressure lets the loop read only part of
what is queued (a class at its pending share resumes for a few hundred frames, a class reading its floor share
reads a batch), the partitions at the front of that queue are read at every resume and the others never (issue
51: bulk-5 got no answer for 28 s while bulk-1 and bulk-3 on the same worker advanced; after a move the
lowest-numbered partitions went first for 13 s). Pausing a partition drops its prefetched messages from that
queue, so its siblings' messages come next; and the batcher takes a class's frames oldest read first, so a
class whose partitions are read at the same pace answers them at the same pace.

Rule (virtual time, as in fair queueing). Each partition counts the frames read from it. A partition is
backlogged while it has a backlog in Kafka and can be read (it is not waiting for its committed offset, and not
stuck: below). When it becomes backlogged its count is raised to the least count among its class's other
backlogged partitions, so a partition that was idle gets no credit for the time it had nothing to read. A
backlogged partition whose count is a chunk ahead of the least of its class is held until it is less than half a
chunk ahead (or no sibling is behind it any more). A chunk is two of the class's batches, or the partition's
share of FAIR_PERIOD_S of the class's read rate when that is more: the front of the queue gets at most a chunk
more than the back, and a partition is held at most a few times a second (each hold drops its prefetched
messages, which are fetched again on resume). While a class that reads has two backlogged partitions or more,
polls take at most a chunk, so one poll does not put a partition far ahead (the first poll after a resume would
otherwise take the whole room from the partition at the front).
Stuck: a backlogged partition that read nothing for STUCK_S of time in which it could be read (its class not
paused, itself not held) is left out of the least until it reads again, so a partition that cannot be read (its
leader away) never holds its siblings for long.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from worker.config import BatchingSettings
from worker.frames import TP, Priority

FAIR_PERIOD_S = 0.25
STUCK_S = 2.0
RATE_WINDOW_S = 1.0
CHUNK_BATCHES = 2


@dataclass(frozen=True)
class FairDecision:
    """Partitions to hold for their siblings now, and the most frames the next poll may take (None: no limit)."""

    held: frozenset[TP] = frozenset()
    poll_limit: int | None = None


class _Partition:
    __slots__ = ("backlogged", "read", "read_since_turn", "waiting_s")

    def __init__(self) -> None:
        self.read = 0  # frames read, in the class's virtual time
        self.backlogged = False
        self.read_since_turn = False
        self.waiting_s = 0.0  # time it could be read without reading anything


class PartitionFairness:
    """Decides the partitions held for fairness within their class (see the module docstring)."""

    def __init__(self, settings: BatchingSettings, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._batch = {p: settings.max_batch_size_for(p) for p in Priority}
        self._parts: dict[TP, _Partition] = {}
        self._held: set[TP] = set()
        self._last_turn: float | None = None
        self._window_start = clock()
        self._window_reads: dict[Priority, int] = dict.fromkeys(Priority, 0)
        self._rate: dict[Priority, float] = dict.fromkeys(Priority, 0.0)

    def record_read(self, read: Mapping[TP, int], class_of: Callable[[TP], Priority]) -> None:
        """Frames (and dead letters) one poll read, per partition."""
        for tp, n in read.items():
            if n:
                part = self._parts.get(tp)
                if part is None:
                    part = self._parts[tp] = _Partition()
                part.read += n
                part.read_since_turn = True
                self._window_reads[class_of(tp)] += n

    def drop_partitions(self, tps: Iterable[TP]) -> None:
        """Partitions given up: their reading counts forgotten (a partition assigned again starts level)."""
        for tp in tps:
            self._parts.pop(tp, None)
            self._held.discard(tp)

    def decide(self, backlog: Mapping[TP, int], class_of: Callable[[TP], Priority],
               paused_classes: Iterable[Priority], unreadable: Iterable[TP] = ()) -> FairDecision:
        """The partitions to hold now, given each assigned partition's backlog in Kafka (frames), the classes
        paused as a whole (backpressure, priority) and the partitions the source cannot read now."""
        now = self._clock()
        self._roll_rate(now)
        dt = 0.0 if self._last_turn is None else now - self._last_turn
        self._last_turn = now
        paused = set(paused_classes)
        blocked = set(unreadable)
        for tp in [tp for tp in self._parts if tp not in backlog]:  # revoked
            del self._parts[tp]
        self._held.intersection_update(backlog)
        by_class: dict[Priority, list[TP]] = {}
        for tp in backlog:
            by_class.setdefault(class_of(tp), []).append(tp)
        limits: list[int] = []
        for cls, tps in by_class.items():
            parts = {tp: self._parts.setdefault(tp, _Partition()) for tp in tps}
            for tp, part in parts.items():
                could_read = cls not in paused and tp not in self._held and tp not in blocked
                if part.read_since_turn or not backlog[tp]:
                    part.waiting_s = 0.0
                elif could_read:
                    part.waiting_s += dt
                part.read_since_turn = False
            counted = {tp: part for tp, part in parts.items()
                       if backlog[tp] > 0 and tp not in blocked and part.waiting_s < STUCK_S}
            for tp, part in counted.items():
                if not part.backlogged:  # joins: no credit for the time it had nothing to read
                    others = [q.read for t, q in counted.items() if t != tp and q.backlogged]
                    if others:
                        part.read = max(part.read, min(others))
            for tp, part in parts.items():
                part.backlogged = tp in counted
            if len(counted) < 2:
                self._held.difference_update(tps)
                continue
            least = min(part.read for part in counted.values())
            chunk = max(CHUNK_BATCHES * self._batch[cls], int(self._rate[cls] * FAIR_PERIOD_S / len(counted)))
            for tp, part in parts.items():
                ahead = part.read - least
                if tp not in counted:
                    self._held.discard(tp)
                elif tp in self._held and ahead < chunk / 2:
                    self._held.discard(tp)
                elif tp not in self._held and ahead >= chunk:
                    self._held.add(tp)
            if cls not in paused:
                limits.append(chunk)
        return FairDecision(held=frozenset(self._held), poll_limit=min(limits) if limits else None)

    def _roll_rate(self, now: float) -> None:
        elapsed = now - self._window_start
        if elapsed >= RATE_WINDOW_S:
            self._rate = {p: n / elapsed for p, n in self._window_reads.items()}
            self._window_reads = dict.fromkeys(Priority, 0)
            self._window_start = now
