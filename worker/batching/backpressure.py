"""When input must wait in Kafka: the classes whose partitions the source pauses (each class's share of the
pending caps, the caps together, a realtime backlog), how many frames it may read, and the hard cap add() holds
(the Backpressure rule of the package docstring)."""

from __future__ import annotations

import math
from collections.abc import Callable

from worker.batching.batch import BatcherFullError
from worker.batching.groups import ClassState, Pending
from worker.config import BatchingSettings
from worker.frames import Priority

# Backpressure resumes below this share of max_pending_frames / max_pending_bytes.
RESUME_WATERMARK = 0.75
# add() refuses frames beyond this multiple of max_pending_frames: the caller ignored classes_to_pause().
HARD_CAP_FACTOR = 2


class Backpressure:
    """Pause and resume decisions, with their hysteresis, over the pending frames."""

    def __init__(self, settings: BatchingSettings, pending: Pending, clock: Callable[[], float]):
        self._s = settings
        self._pending = pending
        self._classes = pending.classes
        self._clock = clock
        self._largest_frame_bytes = 0
        self._paused_all = False  # every class together at the caps
        # Classes paused for a backlog of a more urgent class; they stay paused until it is drained (hysteresis:
        # librdkafka drops a paused partition's fetched messages, so flapping pauses costs refetches).
        self._backlog_pauses: dict[Priority, set[Priority]] = {}

    def admit(self, frame_bytes: int) -> None:
        """Before a frame is added: raises BatcherFullError past the hard cap (except into an empty batcher)."""
        pending = self._pending.frames
        if pending and pending >= HARD_CAP_FACTOR * self._s.max_pending_frames:
            raise BatcherFullError(
                f"batcher holds {pending} frames, past {HARD_CAP_FACTOR}x batching.max_pending_frames: "
                f"the source must pause the classes returned by classes_to_pause() and drain pop_batch() before "
                f"adding more")
        self._largest_frame_bytes = max(self._largest_frame_bytes, frame_bytes)

    def latch(self, cls: ClassState) -> None:
        """After an add to `cls`: the class pauses at its own share of the caps, every class at the caps."""
        s = self._s
        if not cls.mem_paused and (cls.pending >= cls.share * s.max_pending_frames
                                   or cls.pending_bytes >= cls.share * s.max_pending_bytes):
            cls.mem_paused = True
        if self._pending.frames >= s.max_pending_frames or self._pending.bytes >= s.max_pending_bytes:
            self._paused_all = True

    def classes_to_pause(self) -> set[Priority]:
        """Classes whose partitions the source should pause now (rules in the package docstring)."""
        self._release_memory_pauses()
        if self._paused_all:
            return set(Priority)
        paused = {cls.priority for cls in self._classes if cls.mem_paused}
        s = self._s
        now = self._clock()
        # Only realtime's backlog pauses the others. A standard backlog leaves bulk reading: bulk gets no model time
        # while standard is at risk anyway (the slack rule) and its share bounds what it holds, while pausing it on
        # every standard backlog dropped and refetched its prefetched messages over and over on a saturated
        # backlog (0.6x the throughput, no gain under overload: tests/integration/test_overload.py).
        for cls in self._classes[:1]:
            if not cls.pending:
                self._backlog_pauses.pop(cls.priority, None)  # drained: what it paused may resume
                continue
            if cls.pending < s.max_batch_size_for(cls.priority) or not self._overdue(cls, now):
                continue
            # Backlogged: this class's batches are not keeping up. The least urgent class pauses, and every
            # less urgent one once more than two batches wait.
            lower = [c.priority for c in self._classes if c.priority > cls.priority]
            hit = set(lower) if cls.pending > 2 * s.max_batch_size_for(cls.priority) else {lower[-1]}
            self._backlog_pauses.setdefault(cls.priority, set()).update(hit)
        # A class paused for several backlogs stays paused until every one of them is drained.
        return paused | set().union(*self._backlog_pauses.values())

    def poll_room(self, paused: set[Priority]) -> int:
        """How many frames the source may read now without a class that is still reading overshooting its share
        (or all classes the caps) by more than one poll: at least 1."""
        s = self._s
        room = s.max_pending_frames - self._pending.frames
        if self._largest_frame_bytes:
            room = min(room, (s.max_pending_bytes - self._pending.bytes) // self._largest_frame_bytes)
        for cls in self._classes:
            if cls.priority not in paused:
                room = min(room, math.ceil(cls.share * s.max_pending_frames) - cls.pending)
        return max(1, room)

    @staticmethod
    def _overdue(cls: ClassState, now: float) -> bool:
        return any((e := g.oldest()) is not None and e.t + cls.wait_s <= now
                   for groups in (cls.groups, cls.fallback) for g in groups.values())

    def _release_memory_pauses(self) -> None:
        s = self._s
        for cls in self._classes:
            if cls.mem_paused and (cls.pending < RESUME_WATERMARK * cls.share * s.max_pending_frames
                                   and cls.pending_bytes < RESUME_WATERMARK * cls.share * s.max_pending_bytes):
                cls.mem_paused = False
        # Less urgent classes are bounded by their own shares, so their frames alone never keep realtime paused.
        if self._paused_all and (not self._classes[Priority.REALTIME].pending or (
                self._pending.frames < RESUME_WATERMARK * s.max_pending_frames
                and self._pending.bytes < RESUME_WATERMARK * s.max_pending_bytes)):
            self._paused_all = False
