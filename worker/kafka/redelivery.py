"""The guard against librdkafka delivering a partition's offsets twice within one reading. Pure policy (no Kafka
import): FrameSource asks it about every message it consumes.

librdkafka can rewind a partition it was not asked to (seen once in 18 exactly-once SIGKILL runs, right after an
assignment, with pauses and resumes) and deliver offsets it already delivered; they are in the pipeline already,
and a second copy would get a second result. A reading starts at an assignment or a seek: the partition is
dropped here then.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from worker.frames import TP

log = logging.getLogger(__name__)


class RedeliveryGuard:
    """Per partition, the offset after the last one delivered in this reading; anything below it is a repeat."""

    def __init__(self) -> None:
        self._next_offset: dict[TP, int] = {}
        self._warned: set[TP] = set()  # partitions whose repeats were logged in this poll

    def poll_started(self) -> None:
        """A new poll: a partition delivered again is logged once per poll."""
        self._warned.clear()

    def fresh(self, tp: TP, offset: int) -> bool:
        """Whether `offset` is new in this reading (and taken as delivered); False for a repeat, to drop."""
        expected = self._next_offset.get(tp)
        if expected is not None and offset < expected:
            if tp not in self._warned:
                self._warned.add(tp)
                log.warning("the consumer delivered %s again from offset %d (already read up to %d): dropping "
                            "the offsets already read", tp, offset, expected - 1)
            return False
        self._next_offset[tp] = offset + 1
        return True

    def delivered_past(self, tp: TP, offset: int) -> bool:
        """Whether this reading delivered an offset at or past `offset`."""
        return self._next_offset.get(tp, offset) > offset

    def drop_partitions(self, tps: Iterable[TP]) -> None:
        """A reading ends (assignment, seek, revoke, loss): the next one starts wherever the consumer is sought."""
        for tp in tps:
            self._next_offset.pop(tp, None)
