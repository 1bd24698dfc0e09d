"""A partition's state has one lifetime: everything the loop keeps per partition is dropped by one call, under one
verb (`drop_partitions`), when the partition is revoked or lost and when what was read of it is rewound. Pure.

What the loop keeps per partition since it was last read from a commit point (the offset tracker and the outputs
held for delivery, verdict reuse's references and held frames) goes on every drop. What belongs to owning the
partition (its window of frame identities for duplicate detection, its consumer-lag series) outlives a rewind,
which reads the partition again without giving it up: a frame repeated across the commit point is still a repeat.
The frame source drops its own per-partition state (worker.kafka.consumer.FrameSource.drop_partitions) once the
loop's rebalance handler returned, and starts a new reading of a rewound partition in `seek_to_committed`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from typing import Protocol

from worker.frames import TP


class PartitionState(Protocol):
    """An object that keeps state per partition."""

    def drop_partitions(self, tps: Collection[TP]) -> None:
        """Forget everything kept of these partitions."""


class PartitionStates:
    """Every holder of per-partition state in the loop, listed once where the loop is built."""

    def __init__(self, read: Sequence[PartitionState], owned: Sequence[PartitionState]) -> None:
        self.read = tuple(read)  # what was read since the commit point: dropped by every drop
        self.owned = tuple(owned)  # what belongs to owning the partition: kept over a rewind

    def drop_partitions(self, tps: Collection[TP], rewind: bool = False) -> None:
        """The one call: the partitions revoked or lost (`rewind` False), or read again from their committed
        offsets (`rewind`)."""
        for holder in self.read if rewind else self.read + self.owned:
            holder.drop_partitions(tps)

    def __iter__(self) -> Iterator[PartitionState]:
        return iter(self.read + self.owned)
