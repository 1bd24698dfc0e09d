"""MicroBatcher: the batching stage's one entry point. It holds the pending frames and hands each call to the
policy that decides it (the package docstring says which decides what); it decides nothing itself."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from worker.batching.backpressure import Backpressure
from worker.batching.batch import Batch, batch_shape
from worker.batching.costmodel import CostModel
from worker.batching.expiry import Expiry
from worker.batching.formation import Formation
from worker.batching.groups import Pending
from worker.batching.lanes import FallbackLane
from worker.batching.selection import ClassSelection
from worker.batching.sizing import Sizing
from worker.config import BatchingSettings
from worker.devices.memory import BatchSizeLimit
from worker.frames import Frame, Priority


class MicroBatcher:
    """Shape-, class- and tenant-aware micro-batcher; see the package docstring for the policy."""

    def __init__(self, settings: BatchingSettings, clock: Callable[[], float],
                 preferred_batch_sizes: Sequence[int] = (), cost: CostModel | None = None,
                 memory: BatchSizeLimit | None = None, input_hw: tuple[int, int] | None = None) -> None:
        self._clock = clock
        self._input_hw = input_hw  # the model's fixed input (height, width): the batch shape of every frame
        self._dtype_bytes = settings.tensor_dtype_bytes
        self._pending = Pending(settings)
        self._classes = self._pending.classes
        self._sizing = Sizing(settings, clock, self._classes, preferred_batch_sizes, cost, memory)
        self._fallback_lane = FallbackLane(settings)
        self._formation = Formation(settings, self._pending, self._sizing)
        self._selection = ClassSelection(self._pending, self._sizing, self._formation)
        self._expiry = Expiry(self._pending)
        self._backpressure = Backpressure(settings, self._pending, clock)

    # ----------------------------------------------------------------------------------------------- intake

    def add(self, frame: Frame) -> None:
        """Enqueue a frame at frame.received_at; raises BatcherFullError past the hard cap."""
        shape = batch_shape((frame.height, frame.width, frame.channels), self._input_hw)
        frame_bytes = shape[0] * shape[1] * shape[2] * self._dtype_bytes
        self._backpressure.admit(frame_bytes)
        cls = self._classes[frame.priority]
        t = frame.received_at
        if frame.priority == Priority.REALTIME:
            self._sizing.saw_realtime(t)
        fallback = self._fallback_lane.takes(shape, frame_bytes, t)
        groups = cls.fallback if fallback else cls.groups
        group = groups.get(shape)
        if group is None:
            group = groups[shape] = self._sizing.new_group(cls, shape, fallback, frame_bytes)
        entry = self._pending.enqueue(frame, group)
        self._backpressure.latch(cls)
        self._expiry.track(entry)

    # ---------------------------------------------------------------------------------------------- release

    def pop_batch(self, max_priority: Priority = Priority.BULK, idle: bool = False) -> Batch | None:
        """The next batch due now of a class at most as low as `max_priority`, by urgency, class weights and the
        ordering rule; None when nothing is due. `idle`: the runtime runs nothing and no more input is waiting, so
        every group with a frame counts as due (a partial one leaves with reason "idle")."""
        now = self._clock()
        self._expiry.collect(now)
        if not self._pending.frames:
            return None
        self._sizing.sync()
        return self._selection.next_batch(now, max_priority, idle)

    def pop_expired(self) -> list[Frame]:
        """Frames whose deadline (capture + class max_age_ms) has passed; they leave the batcher."""
        return self._expiry.pop(self._clock())

    def next_due(self) -> float | None:
        """Earliest clock time at which pop_batch()/pop_expired() could return something new (<= now: now).
        None when the batcher holds nothing."""
        if self._expiry.set_aside:
            return self._clock()
        self._sizing.sync()
        best = self._expiry.next_at()
        for cls in self._classes:
            if cls.pending:
                for groups in (cls.fallback, cls.groups):
                    for group in groups.values():
                        if group.due_at < best:
                            best = group.due_at
        return None if best == math.inf else best

    def flush(self) -> list[Batch]:
        """Everything pending as batches, ignoring waits (shutdown). Frames already expired are set aside for
        pop_expired(), never batched."""
        now = self._clock()
        self._expiry.collect(now)
        batches = []
        for cls in self._classes:
            while cls.pending:
                _, group = min((g.oldest_key(), g) for groups in (cls.fallback, cls.groups) for g in groups.values())
                batch = self._formation.release(group, now, math.inf, None, "flush")
                assert batch is not None
                batches.append(batch)
        return batches

    def discard(self, predicate: Callable[[Frame], bool]) -> list[Frame]:
        """Remove and return held frames matching `predicate` (e.g. of revoked partitions), including expired
        ones not yet returned by pop_expired()."""
        return self._pending.discard(predicate) + self._expiry.discard(predicate)

    # ---------------------------------------------------------------------------------------- backpressure

    @property
    def pending_frames(self) -> int:
        return self._pending.frames

    @property
    def pending_bytes(self) -> int:
        """Tensor bytes (h*w*c*tensor_dtype_bytes) of the frames waiting for a batch."""
        return self._pending.bytes

    def classes_to_pause(self) -> set[Priority]:
        """Classes whose partitions the source should pause now (rules in the package docstring)."""
        return self._backpressure.classes_to_pause()

    def poll_room(self, paused: set[Priority]) -> int:
        """How many frames the source may read now without a class that is still reading overshooting its share
        (or all classes the caps) by more than one poll: at least 1."""
        return self._backpressure.poll_room(paused)
