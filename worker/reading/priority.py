"""Reading by priority: which classes' partitions to pause so that a more urgent class's backlog in Kafka is read
first. Pure policy: no Kafka, no torch; time from an injected clock. Not thread-safe: one loop owns it.

Why. librdkafka fetches every assigned partition into one first-in-first-out queue. When reading and decoding
messages (not the model) is the bottleneck, the batcher can only schedule what was read, and a realtime frame
waits behind every bulk message fetched before it (issue 37: 61% of realtime expired while bulk had 30% of
the frames scored). Pausing a partition stops its fetches and drops its prefetched messages from that queue,
so what the worker reads is the most urgent class's backlog.

Inputs, each loop turn: every class's backlog in Kafka (high watermark minus position over its partitions, from
the watermarks the consumer caches from fetch responses: no broker request), and for each poll the messages read
per class, how many of them were already past their deadline, the capture time of the oldest, and whether the
poll took all the consumer had; and the frames expired while waiting for a batch.

Rules, in the order they are applied:
- Service rate: messages read per second, over RATE_WINDOW_S windows in which some class had a backlog at every
  decision (so the window saw what the worker takes in, not what arrived); the mean of the latest two.
- Backlogged: a class whose backlog has stayed at or above max(batching.max_batch_size, rate x BACKLOG_S) frames
  for PERSIST_S while every poll came back full (the worker is behind); it stops being one below half of that.
  A steady stream within capacity is read by the next poll (polls come back short), so it pauses nothing. A poll
  of a consumer whose every partition is paused (backpressure) says nothing either way.
- Servable: a backlogged class with a deadline (max_age_ms) cannot be served when reading its whole backlog at
  the service rate would take longer than max_age_ms and every frame of it read for max_age_ms was already past
  its deadline: even its newest frame would expire before it is reached. It holds no class back (its frames are
  answered EXPIRED as they are read, at the cost of reading them). Both conditions are needed: a class just
  above capacity still scores its newer frames while the oldest expire, and a backlog left by a stall is read
  faster than it expires.
- Priority: every class less urgent than the most urgent servable backlogged class is paused.
- Floor: a class paused for priority still reads batching.lower_class_read_floor of the messages read in time
  (not past their deadline) over FLOOR_WINDOW_S, except while a more urgent class is near its deadline (a frame
  of it expired, or was read older than NEAR_DEADLINE of its max_age_ms, within EXPIRING_S): its floor would be
  paid for with more urgent frames. It is resumed once it is a chunk (a batch, or FLOOR_PERIOD_S of its share at
  the service rate) short of its share and paused again once it has it; while it reads, polls take at most its
  shortfall (at least a batch), so it passes its share by a batch at most.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from worker.config import BatchingSettings
from worker.frames import Priority

RATE_WINDOW_S = 0.5
BACKLOG_S = 0.05
PERSIST_S = 0.05
EXPIRING_S = 1.0
NEAR_DEADLINE = 0.5
FLOOR_WINDOW_S = 5.0
FLOOR_PERIOD_S = 0.5
BUCKET_S = 0.1

_CLASSES = tuple(sorted(Priority))


@dataclass(frozen=True)
class PriorityReadingDecision:
    """What the source should do now. `paused`: classes paused for a more urgent class's backlog (those reading
    their floor share are not in it); `floor_reading`: classes paused for priority that read their floor share
    now;
    `unservable`: backlogged classes whose backlog cannot be served within their deadline; `poll_limit`: the most
    messages the next poll may take (None: no limit), so a class reading its floor does not pass it."""

    paused: frozenset[Priority] = frozenset()
    floor_reading: frozenset[Priority] = frozenset()
    unservable: frozenset[Priority] = frozenset()
    poll_limit: int | None = None


class _RecentCounts:
    """Counts over the last `span_s`, one row of `width` per BUCKET_S bucket (old buckets drop off as time passes)."""

    def __init__(self, span_s: float, width: int) -> None:
        self._span_s = span_s
        self._width = width
        self._buckets: deque[tuple[float, list[int]]] = deque()
        self._totals = [0] * width

    def add(self, now: float, values: list[int]) -> None:
        self._expire(now)
        if not self._buckets or now - self._buckets[-1][0] >= BUCKET_S:
            self._buckets.append((now, [0] * self._width))
        bucket = self._buckets[-1][1]
        for i, n in enumerate(values):
            bucket[i] += n
            self._totals[i] += n

    def totals(self, now: float) -> list[int]:
        self._expire(now)
        return self._totals

    def _expire(self, now: float) -> None:
        while self._buckets and now - self._buckets[0][0] > self._span_s:
            _, counts = self._buckets.popleft()
            for i, n in enumerate(counts):
                self._totals[i] -= n


class PriorityReading:
    """Decides the classes paused for priority (see the module docstring for the rules)."""

    def __init__(self, settings: BatchingSettings, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._min_frames = settings.max_batch_size
        self._floor = settings.lower_class_read_floor
        self._deadline_s = {p: settings.for_class(p).max_age_ms / 1000.0 for p in _CLASSES}
        self._rates: deque[float] = deque(maxlen=2)
        self._window_start: float | None = None
        self._window_reads = 0
        self._window_busy = True  # some class had a backlog at every decision of the window
        self._reading_since: float | None = None  # since when every poll came back full (the worker is behind)
        self._above_since: dict[Priority, float] = {}
        self._backlogged: set[Priority] = set()
        # Per class: since when every frame of it read was already past its deadline, and how many those were.
        self._late_since: dict[Priority, float] = {}
        self._late_count: dict[Priority, int] = dict.fromkeys(_CLASSES, 0)
        # Messages read per class, then all messages read in time (not yet past their deadline), over FLOOR_WINDOW_S.
        self._floor_reads = _RecentCounts(FLOOR_WINDOW_S, len(_CLASSES) + 1)
        # When each class last expired a frame or had one read older than NEAR_DEADLINE of its deadline.
        self._near_deadline_at: dict[Priority, float] = {}
        self._floor_on: set[Priority] = set()

    @property
    def rate(self) -> float | None:
        """The measured service rate (messages read per second while reading all the time), None before any."""
        return sum(self._rates) / len(self._rates) if self._rates else None

    @property
    def backlogged(self) -> frozenset[Priority]:
        return frozenset(self._backlogged)

    def record_read(self, read: Mapping[Priority, int], late: Mapping[Priority, int],
                    oldest_capture_s: Mapping[Priority, float], drained: bool | None) -> None:
        """One poll: messages read per class, how many of them were already past their deadline, the capture time
        of the oldest frame read per class, and whether the poll took all the consumer had (came back short; None
        when that says nothing, as every partition was paused)."""
        now = self._clock()
        self._roll_rate(now)
        total = sum(read.values())
        self._window_reads += total
        if drained:
            self._reading_since = None
        elif drained is not None and self._reading_since is None:
            self._reading_since = now
        if total:
            reads = [read.get(p, 0) for p in _CLASSES]
            lates = [late.get(p, 0) for p in _CLASSES]
            self._floor_reads.add(now, [*reads, total - sum(lates)])
            for p in _CLASSES:
                if reads[p] > lates[p]:
                    self._late_since.pop(p, None)
                    self._late_count[p] = 0
                elif lates[p]:
                    self._late_since.setdefault(p, now)
                    self._late_count[p] += lates[p]
        for p, captured in oldest_capture_s.items():
            deadline = self._deadline_s[p]
            if deadline > 0 and now - captured > NEAR_DEADLINE * deadline:
                self._near_deadline_at[p] = now

    def record_expired(self, expired: Mapping[Priority, int]) -> None:
        """Frames answered EXPIRED (when read, or while waiting for a batch)."""
        now = self._clock()
        for p, n in expired.items():
            if n:
                self._near_deadline_at[p] = now

    def decide(self, backlog: Mapping[Priority, int]) -> PriorityReadingDecision:
        """The classes to pause for priority now, given each class's backlog in Kafka (frames)."""
        now = self._clock()
        self._roll_rate(now)
        if sum(backlog.values()) < self._min_frames:
            self._window_busy = False
        rate = self.rate
        threshold = max(float(self._min_frames), (rate or 0.0) * BACKLOG_S)
        for p in _CLASSES:
            self._track_backlog(p, backlog.get(p, 0), threshold, now)
        unservable = frozenset(p for p in self._backlogged if self._beyond_deadline(p, backlog.get(p, 0), rate, now))
        servable = self._backlogged - unservable
        if not servable:
            self._floor_on.clear()
            return PriorityReadingDecision(unservable=unservable)
        most_urgent = min(servable)
        lower = [p for p in _CLASSES if p > most_urgent]
        reads = self._floor_reads.totals(now)
        in_time = reads[len(_CLASSES)]
        chunk = max(float(self._min_frames), self._floor * (rate or 0.0) * FLOOR_PERIOD_S)
        shortfalls: list[float] = []
        for p in lower:
            shortfall = self._floor * in_time - reads[p]
            if self._floor <= 0 or any(q < p and q not in unservable and self._near_deadline(q, now)
                                       for q in _CLASSES):
                self._floor_on.discard(p)
            elif p in self._floor_on and shortfall <= 0:
                self._floor_on.discard(p)
            elif p not in self._floor_on and shortfall >= chunk:
                self._floor_on.add(p)
            if p in self._floor_on:
                shortfalls.append(shortfall)
        self._floor_on.intersection_update(lower)
        limit = max(self._min_frames, int(min(shortfalls))) if shortfalls else None
        return PriorityReadingDecision(paused=frozenset(lower) - self._floor_on,
                                       floor_reading=frozenset(self._floor_on), unservable=unservable,
                                       poll_limit=limit)

    def _roll_rate(self, now: float) -> None:
        if self._window_start is None:
            self._window_start = now
            return
        elapsed = now - self._window_start
        if elapsed < RATE_WINDOW_S:
            return
        if self._window_busy and self._window_reads:
            self._rates.append(self._window_reads / elapsed)
        self._window_start, self._window_reads, self._window_busy = now, 0, True

    def _track_backlog(self, p: Priority, frames: int, threshold: float, now: float) -> None:
        if p in self._backlogged:
            if frames < threshold / 2:
                self._backlogged.discard(p)
                self._above_since.pop(p, None)
            return
        if frames < threshold:
            self._above_since.pop(p, None)
            return
        since = self._above_since.setdefault(p, now)
        behind = self._reading_since is not None and now - self._reading_since >= PERSIST_S
        if behind and now - since >= PERSIST_S:
            self._backlogged.add(p)

    def _beyond_deadline(self, p: Priority, frames: int, rate: float | None, now: float) -> bool:
        """Whether even the newest frame of this backlog would expire before it is read (rules: Servable)."""
        deadline = self._deadline_s[p]
        if deadline <= 0 or rate is None or frames <= rate * deadline:
            return False
        return self._late_count[p] >= self._min_frames and now - self._late_since.get(p, now) >= deadline

    def _near_deadline(self, p: Priority, now: float) -> bool:
        at = self._near_deadline_at.get(p)
        return at is not None and now - at <= EXPIRING_S
