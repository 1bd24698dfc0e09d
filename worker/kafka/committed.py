"""Where a partition is read from: the policy that keeps a partition paused until its committed offset is known.

Pure (no Kafka client, time from an injected clock): `worker.kafka.consumer.FrameSource` asks the broker and seeks;
this module decides which partitions wait, which are asked this poll, how long a poll may spend asking, when a
partition the broker could not answer is asked again, and what is worth a log line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from worker.frames import TP

log = logging.getLogger(__name__)


# Looking up committed offsets: how long one call may block the loop, how much of one poll the look-ups of
# partitions waiting for theirs may take, and how often a partition whose committed offset could not be read is
# asked again (doubling up to the cap: a dead member's open transaction can hold it for transaction.timeout.ms).
COMMITTED_LOOKUP_TIMEOUT_S = 1.0
COMMITTED_LOOKUP_BUDGET_S = 1.0
COMMITTED_RETRY_FIRST_S = 0.25
COMMITTED_RETRY_MAX_S = 2.0


@dataclass
class _Waiting:
    """A partition to seek to its committed offset once the broker can tell it; paused until then."""

    since: float
    next_try: float
    delay: float = COMMITTED_RETRY_FIRST_S
    reported: bool = False  # that its committed offset cannot be read now (a warning, counted)
    reported_unstarted: bool = False  # that librdkafka has not started fetching it yet, so it cannot be sought


class CommittedPositions:
    """The partitions waiting for their committed offset, and when each is asked for it next.

    A partition is never read from where librdkafka happened to start it, nor from its beginning while its
    committed offset is unknown (a dead member's open transaction holds pending offsets until the broker aborts
    it): it waits, paused, from `wait()` until `sought()`."""

    def __init__(self, clock: Callable[[], float], budget_s: float = COMMITTED_LOOKUP_BUDGET_S,
                 retry_first_s: float = COMMITTED_RETRY_FIRST_S, retry_max_s: float = COMMITTED_RETRY_MAX_S) -> None:
        self._clock = clock
        self._budget_s = budget_s
        self._retry_first_s = retry_first_s
        self._retry_max_s = retry_max_s
        self._waiting: dict[TP, _Waiting] = {}
        self._unknown_unreported = 0

    def __contains__(self, tp: object) -> bool:
        return tp in self._waiting

    def __bool__(self) -> bool:
        return bool(self._waiting)

    @property
    def waiting(self) -> frozenset[TP]:
        return frozenset(self._waiting)

    def wait(self, tps: Iterable[TP]) -> None:
        """Mark partitions to be sought to their committed offsets; one already waiting is asked again now."""
        now = self._clock()
        for tp in tps:
            waiting = self._waiting.get(tp)
            if waiting is None:
                self._waiting[tp] = _Waiting(since=now, next_try=now, delay=self._retry_first_s)
            else:
                waiting.next_try = now

    def drop_partitions(self, tps: Iterable[TP]) -> None:
        """Partitions revoked or lost: no longer ours to seek."""
        for tp in tps:
            self._waiting.pop(tp, None)

    def due(self, order: Callable[[TP], Any]) -> Iterator[TP]:
        """The partitions to ask now, in `order`; stops once the look-ups have taken the budget, so the loop keeps
        polling (and the member stays in the group) however long a transaction holds an offset.

        One partition per look-up: librdkafka holds back a whole answer while any of its partitions is unstable."""
        started = self._clock()
        for tp in sorted((tp for tp, w in self._waiting.items() if w.next_try <= started), key=order):
            if self._clock() - started >= self._budget_s:
                return
            if tp in self._waiting:
                yield tp

    def sought(self, tp: TP) -> None:
        """The partition was sought to its committed offset: it may be read (resumed) again."""
        waited = self._waiting.pop(tp)
        if waited.reported or waited.reported_unstarted:
            log.info("committed offset of %s known after %.1fs: reading it from there", tp,
                     self._clock() - waited.since)

    def unknown(self, tp: TP, reason: str) -> None:
        """The broker could not tell the committed offset (an open transaction, a time-out): ask again later."""
        waiting = self._retry_later(tp)
        if not waiting.reported:
            waiting.reported = True
            self._unknown_unreported += 1
            log.warning("the committed offset of %s cannot be read now (%s; a dead member's transaction may still "
                        "hold it): keeping it paused and asking again, never reading it from its beginning",
                        tp, reason)

    def unstarted(self, tp: TP, reason: str) -> None:
        """The seek was refused: librdkafka seeks a partition only once it has started fetching it."""
        waiting = self._retry_later(tp)
        if not waiting.reported_unstarted:
            waiting.reported_unstarted = True
            log.info("%s cannot be sought yet (%s): librdkafka has not started fetching it, as it waits for the "
                     "committed offsets of its assignment; keeping it paused and seeking it once it has", tp, reason)

    def take_new_unknowns(self) -> int:
        """How many partitions began waiting for an unknown committed offset since the last call (each counted once)."""
        count, self._unknown_unreported = self._unknown_unreported, 0
        return count

    def _retry_later(self, tp: TP) -> _Waiting:
        waiting = self._waiting[tp]
        waiting.next_try = self._clock() + waiting.delay
        waiting.delay = min(waiting.delay * 2, self._retry_max_s)
        return waiting
