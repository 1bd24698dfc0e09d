"""How big a group's batch is and when it is due: the preferred sizes, the byte and device-memory caps, and, with a
cost model, the adaptive trigger, the blocking bound and the latency budget (the Groups and lanes and Cost model
rules of the package docstring)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from worker.batching.costmodel import CostModel
from worker.batching.groups import ClassState, Entry, Group
from worker.config import BatchingSettings, ConfigError
from worker.devices.memory import BatchSizeLimit
from worker.frames import Priority


class Sizing:
    """Each group's cap, trigger and full reason, kept in step with what the cost model learns."""

    def __init__(self, settings: BatchingSettings, clock: Callable[[], float], classes: Sequence[ClassState],
                 preferred_batch_sizes: Sequence[int], cost: CostModel | None, memory: BatchSizeLimit | None):
        bad = [s for s in preferred_batch_sizes if s < 1]
        if bad:
            raise ConfigError([f"preferred_batch_sizes: sizes must be >= 1 (got {bad})"])
        self._s = settings
        self._clock = clock
        self._classes = classes
        # Runner buckets above every class's max_batch_size are simply never reached (a group's own cap filters).
        self.preferred = tuple(sorted({s for s in (*settings.preferred_batch_sizes, *preferred_batch_sizes)
                                       if 1 <= s <= settings.largest_batch_size}))
        self._cost = cost
        self._memory = memory  # device memory peaks measured at warm-up: a cap per shape
        self._cost_version = -1
        self._adaptive = settings.adaptive_batch_size
        self._blocking_s = settings.blocking_limit_ms / 1000.0
        self._quiet_s = settings.realtime_quiet_ms / 1000.0
        self._realtime_seen_at = -math.inf  # received_at of the latest realtime frame
        self._bounded = self._quiet_s == 0  # lower classes' batches bounded by the blocking limit now
        # Groups are emptied and made again all the time: a new one takes the sizes last worked out for its class
        # and shape, while the cost model has learned nothing since and the blocking bound is unchanged.
        self._sized: dict[tuple[Priority, tuple[int, int, int], int, int, str], tuple[int, int, str]] = {}
        self._sized_at = (-1, self._bounded)
        if cost is not None:
            for cls in classes:
                if cls.budget_s > 0:
                    cls.start_by = self.start_by

    def saw_realtime(self, t: float) -> None:
        """A realtime frame arrived at `t`: the blocking bound holds for realtime_quiet_ms from then."""
        if t > self._realtime_seen_at:
            self._realtime_seen_at = t

    def new_group(self, cls: ClassState, shape: tuple[int, int, int], fallback: bool, frame_bytes: int) -> Group:
        s = self._s
        cap = max(1, min(cls.max_batch, s.max_batch_bytes // frame_bytes))
        cap = self.memory_cap(shape, cap)
        if fallback:
            limit = 1 if frame_bytes > s.max_batch_bytes else min(s.fallback_max_batch_size, cap)
            return Group(cls, shape, True, frame_bytes, limit, limit, "fallback")
        trigger = max((p for p in self.preferred if p <= cap), default=cap)
        if trigger == cls.max_batch:
            reason = "full"
        elif cap < cls.max_batch:
            reason = "bytes"
        else:
            reason = "preferred"
        group = Group(cls, shape, False, frame_bytes, cap, trigger, reason)
        if self._cost is not None:
            self._size_from_cost(group)
        return group

    def memory_cap(self, shape: tuple[int, int, int], cap: int) -> int:
        """At most `cap` frames, and on a GPU at most the largest batch device memory takes for a batch of `shape`
        (the input the device runs: a batch shape is the model's fixed input when it has one)."""
        if self._memory is None:
            return cap
        return min(cap, self._memory.max_batch(shape, cap) or cap)

    def size_for(self, must: int, available: int) -> int:
        """Largest preferred size in [must, available]; else all available (the runner pads to its bucket)."""
        for p in reversed(self.preferred):
            if p <= available:
                return p if p >= must else available
        return available

    # ------------------------------------------------------------------------------------------- cost model

    def sync(self) -> None:
        """Re-size every group when the cost model learned something since the last look, or realtime came or
        went (the blocking bound follows it)."""
        cost = self._cost
        if cost is None:
            return
        bounded = self._realtime_present()
        if cost.version == self._cost_version and bounded == self._bounded:
            return
        self._cost_version = cost.version
        self._bounded = bounded
        for cls in self._classes:
            for group in cls.groups.values():
                self._size_from_cost(group)
                group.refresh_due()

    def _realtime_present(self) -> bool:
        """Whether a realtime frame is pending or arrived within realtime_quiet_ms (always, with 0)."""
        return (self._quiet_s == 0 or self._classes[Priority.REALTIME].pending > 0
                or self._clock() - self._realtime_seen_at <= self._quiet_s)

    def _size_from_cost(self, group: Group) -> None:
        """The group's cap, trigger and full reason from the cost model, worked out once per class and shape until
        the model learns something or the blocking bound comes or goes."""
        cost = self._cost
        assert cost is not None
        if self._sized_at != (cost.version, self._bounded):
            self._sized.clear()
            self._sized_at = (cost.version, self._bounded)
        key = (group.cls.priority, group.shape, group.cap_static, group.trigger_static, group.reason_static)
        sized = self._sized.get(key)
        if sized is None:
            sized = self._sized[key] = self._sizes_from_cost(cost, group)
        group.cap, group.trigger, group.full_reason = sized

    def _sizes_from_cost(self, cost: CostModel, group: Group) -> tuple[int, int, str]:
        """cap: while realtime is present, bounded so a standard or bulk batch runs at most the blocking limit;
        trigger: the measured size with the most frames per device second (adaptive), within that cap."""
        cap, trigger, reason = group.cap_static, group.trigger_static, group.reason_static
        if group.cls.priority != Priority.REALTIME and self._blocking_s > 0 and self._bounded:
            k = cost.largest_within(group.shape, self._blocking_s, cap)
            if k is not None and k < cap:
                cap, reason = max(1, k), "blocking"
        if self._adaptive:
            best = cost.best_size(group.shape, cap)
            if best is not None:
                trigger, reason = best, "cost"
        return cap, min(trigger, cap), reason

    def predict(self, group: Group, n: int) -> float:
        """Predicted seconds for n frames of the group's shape; 0 when unknown (no model, nothing measured)."""
        if self._cost is None:
            return 0.0
        t = self._cost.predict(group.shape, n)
        return 0.0 if t is None else t

    def predicted(self, shape: tuple[int, int, int], n: int) -> float | None:
        """Predicted seconds for a batch of n frames of `shape` (a padded batch's too); None when unknown."""
        return self._cost.predict(shape, n) if self._cost is not None else None

    def start_by(self, group: Group, e: Entry) -> float:
        """Latest release of the group's next batch for its oldest frame to finish within the class budget."""
        return (e.frame.capture_ts_ms / 1000.0 + group.cls.budget_s
                - self.predict(group, min(group.n, group.trigger)))

    def budget_limit(self, group: Group, now: float) -> int:
        """Most frames the group's next batch may take so that its oldest frame finishes within the budget. A
        frame already past it gets throughput instead (smaller batches would only make more frames late)."""
        cls = group.cls
        if self._cost is None or cls.budget_s <= 0 or group.fallback:
            return group.cap
        e = group.oldest()
        if e is None:
            return group.cap
        remaining = e.frame.capture_ts_ms / 1000.0 + cls.budget_s - now
        k = self._cost.largest_within(group.shape, remaining, group.cap)
        return group.cap if k is None or k < 1 else k
