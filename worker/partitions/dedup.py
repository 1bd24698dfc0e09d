"""Repeated frames: (stream_id, frame_index) is a frame's identity (schemas/frame.avsc), so a second message
with the identity of a recent one is a duplicate (a producer retry without idempotence, a replayed upload).
A frame `worker dlq replay` published again is a new copy on purpose: its replay count (header
`streamfer.replay_count`, 0 for a producer's own message) is the third part of its identity, so the copy is not
a duplicate of the dead-lettered one it replaces, while a second copy with the same count is.

Pure policy, no Kafka, no torch. Per input partition, a bounded window remembers the offset at which each of
the last `window` identities was first read. A frame whose identity is remembered at a *different* offset is a
duplicate; the same offset read again (a rewind to the committed offset, a re-read after a failed transaction)
is the same message, not a duplicate, and gets the same answer as the first time. The window of a partition is
cleared when the partition is released (revoked or lost): best effort within one assignment, so a duplicate
whose first copy was read before a rebalance, or by another worker, or more than `window` frames earlier on
the partition, is scored again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from worker.frames import TP

FrameIdentity = tuple[str, int, int]  # (stream_id, frame_index, replay_count)


def duplicate_reason(identity: FrameIdentity, first_offset: int) -> str:
    """The dead letter's reason for a duplicate: what repeated, and where the copy that counts is."""
    replayed = f" (replay {identity[2]})" if identity[2] else ""
    return (f"duplicate frame: (stream_id, frame_index) = ({identity[0]!r}, {identity[1]}){replayed} was first read "
            f"at offset {first_offset} of this partition; only that copy is scored (limits.duplicate_window_frames)")


class DuplicateFrames:
    """Per-partition windows of recently read frame identities; `window` 0 turns detection off."""

    def __init__(self, window: int) -> None:
        if window < 0:
            raise ValueError(f"window must be >= 0, got {window}")
        self.window = window
        self._seen: dict[TP, OrderedDict[FrameIdentity, int]] = {}

    def first_offset(self, tp: TP, identity: FrameIdentity, offset: int) -> int | None:
        """Record the frame read at `offset`; the offset of the earlier message it duplicates, or None when it
        is not a duplicate (new identity, the same message read again, or detection off)."""
        if self.window == 0:
            return None
        seen = self._seen.get(tp)
        if seen is None:
            seen = self._seen[tp] = OrderedDict()
        first = seen.get(identity)
        if first is not None:
            return None if first == offset else first
        seen[identity] = offset
        if len(seen) > self.window:
            seen.popitem(last=False)  # forget the identity read longest ago
        return None

    def drop_partitions(self, tps: Iterable[TP]) -> None:
        """Forget the windows of partitions no longer assigned here (revoked or lost)."""
        for tp in tps:
            self._seen.pop(tp, None)

    def remembered(self, tp: TP) -> int:
        """How many identities the partition's window holds (at most `window`)."""
        return len(self._seen.get(tp, ()))
