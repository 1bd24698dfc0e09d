"""Which partitions this worker owns, and under which epoch: the one place that decides whether work is stale.

Every assignment of a partition starts a new epoch; each frame carries the epoch it was read under
(`SourceRef.epoch`). Work of an epoch that is no longer current (the partition was revoked, lost or
re-assigned since) is stale: its results are dropped and its acknowledgements ignored, so
a late output can never duplicate what the partition's next reading produces. Pure: no Kafka import.
"""

from __future__ import annotations

from collections.abc import Iterable

from worker.frames import TP, SourceRef


class Assignments:
    """The partitions assigned to this worker, each with its current epoch."""

    def __init__(self) -> None:
        self._current: dict[TP, int] = {}
        self._last_epoch: dict[TP, int] = {}  # kept after release, so a re-assignment gets a newer epoch

    def assign(self, tps: Iterable[TP]) -> None:
        for tp in tps:
            self._current[tp] = self._next_epoch(tp)

    def release(self, tps: Iterable[TP]) -> None:
        for tp in tps:
            self._current.pop(tp, None)

    def epoch(self, tp: TP) -> int | None:
        """The current epoch of an assigned partition; None when it is not assigned here."""
        return self._current.get(tp)

    def is_current(self, ref: SourceRef) -> bool:
        return self._current.get(ref.topic_partition) == ref.epoch

    def __contains__(self, tp: object) -> bool:
        return tp in self._current

    @property
    def partitions(self) -> frozenset[TP]:
        return frozenset(self._current)

    def _next_epoch(self, tp: TP) -> int:
        epoch = self._last_epoch.get(tp, 0) + 1
        self._last_epoch[tp] = epoch
        return epoch
