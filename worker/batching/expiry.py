"""Frames past their deadline (capture_ts_ms/1000 + their class's max_age_ms/1000; max_age_ms 0: never) are never
put in a batch: they are set aside for pop_expired() (the Expiry rule of the package docstring)."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

from worker.batching.groups import Entry, Pending
from worker.frames import Frame

# The expiry heap is rebuilt from the frames still pending once it holds this many more than twice as many.
EXPIRY_HEAP_SLACK = 64


class Expiry:
    """A heap of pending frames by deadline, and the frames found past it."""

    def __init__(self, pending: Pending):
        self._pending = pending
        self._heap: list[tuple[float, int, Entry]] = []
        self._expired: list[Frame] = []

    @property
    def set_aside(self) -> bool:
        """Whether expired frames wait for pop()."""
        return bool(self._expired)

    def track(self, entry: Entry) -> None:
        """Watch a newly pending frame's deadline, if its class has one."""
        max_age_s = entry.group.cls.max_age_s
        if max_age_s > 0:
            heapq.heappush(self._heap, (entry.frame.capture_ts_ms / 1000.0 + max_age_s, entry.seq, entry))

    def collect(self, now: float) -> None:
        """Take the pending frames past their deadline at `now` out of their groups and set them aside."""
        heap = self._heap
        while heap and heap[0][0] < now:
            _, _, entry = heapq.heappop(heap)
            if entry.live:
                entry.live = False
                self._pending.forget(entry.group, 1)
                self._expired.append(entry.frame)
        # A frame that left in a batch stays in the heap until its deadline (max_age_ms after capture: 30 s for
        # standard), and with it its bytes: rebuilt from the pending ones when those are the smaller part.
        if len(heap) > 2 * self._pending.frames + EXPIRY_HEAP_SLACK:
            self._heap = [item for item in heap if item[2].live]
            heapq.heapify(self._heap)

    def pop(self, now: float) -> list[Frame]:
        """The frames expired by `now`; they leave the batcher."""
        self.collect(now)
        out, self._expired = self._expired, []
        return out

    def next_at(self) -> float:
        """When the next pending frame expires (math.inf: none will)."""
        heap = self._heap
        while heap and not heap[0][2].live:
            heapq.heappop(heap)
        return math.nextafter(heap[0][0], math.inf) if heap else math.inf  # expiry is strict: due just after

    def discard(self, predicate: Callable[[Frame], bool]) -> list[Frame]:
        """Remove and return the frames set aside that match `predicate`."""
        out: list[Frame] = []
        kept: list[Frame] = []
        for frame in self._expired:
            (out if predicate(frame) else kept).append(frame)
        self._expired = kept
        return out
