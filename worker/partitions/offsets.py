"""Per-partition tracking of which offsets are done, giving the highest offset that is safe to commit.

Batches of different shapes and priorities finish out of order, so a partition's commit point is the
lowest offset that is read but not yet done: committing past it would lose that frame on a crash.

What is read since the last confirmed commit splits in three, each with its own bound (issue 67): offsets not yet
done (a frame batching, running, or its output awaiting acknowledgement: it holds memory), done offsets below the
commit point whose commit is not confirmed yet (what failing commits would make a lost session redo), and done
offsets *beyond* the commit point, held back by an earlier one still in flight (an output partition down, say). The
last cost no memory here: a partition keeps only its offsets not yet done; the done ones are the rest of the range
read (`done_runs` lists them as runs for the commit's metadata, worker.partitions.donemeta).
Pure policy: no Kafka import.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from worker.errors import StreamferError
from worker.frames import TP


class OffsetTrackingError(StreamferError):
    """An offset was marked done that was never tracked, or read again without a rewind: a pipeline bug,
    never data. Raised rather than tolerated: a frame read twice gets two results."""


@dataclass
class _PartitionState:
    # Offsets read and not yet done: a min-heap (with lazy deletion) plus a set for membership.
    outstanding: list[int] = field(default_factory=list)
    outstanding_set: set[int] = field(default_factory=set)
    highest_seen: int = -1
    committed: int = -1  # next offset to consume, as last committed (-1: nothing committed by us)
    # Where a re-reading of this partition would start: the first offset read since it was assigned or sought,
    # then each commit the broker confirmed.
    reread_from: int = -1

    @property
    def uncommitted(self) -> int:
        return self.highest_seen + 1 - self.reread_from if self.reread_from >= 0 else 0

    @property
    def span(self) -> int:
        """Offsets from the commit point to the highest read: those not yet done and the done ones held behind them."""
        return self.highest_seen + 1 - self.outstanding[0] if self.outstanding else 0


class OffsetTracker:
    """Tracks read and done offsets per partition; `commit_points` gives the offsets to commit."""

    def __init__(self) -> None:
        self._parts: dict[TP, _PartitionState] = {}
        # Totals over all partitions, kept as they change: the loop reads both several times a turn.
        self._in_flight = 0
        self._uncommitted = 0
        self._span = 0  # sum of the partitions' spans: done_beyond() = this - in_flight()

    def track(self, tp: TP, offset: int) -> None:
        """Record that `offset` was read and is now in flight.

        Kafka delivers a partition's offsets in increasing order until a seek, and every seek (a rewind, a
        new assignment) starts from a forgotten partition: an offset at or below the highest one read is a
        re-delivery the pipeline failed to drop."""
        self._read(tp, offset, in_flight=True)

    def track_done(self, tp: TP, offset: int) -> None:
        """Record that `offset` was read and needs no work: a previous owner finished it beyond its commit point and
        said so in the commit's metadata (worker.partitions.donemeta). Counted as read, never in flight."""
        self._read(tp, offset, in_flight=False)

    def _read(self, tp: TP, offset: int, in_flight: bool) -> None:
        st = self._parts.get(tp)
        if st is None:
            st = self._parts[tp] = _PartitionState()
        if offset <= st.highest_seen:
            raise OffsetTrackingError(f"offset {offset} of {tp} read again (highest read {st.highest_seen}) "
                                      f"without a rewind")
        before, span_before = st.uncommitted, st.span
        if in_flight:
            st.outstanding_set.add(offset)
            heapq.heappush(st.outstanding, offset)
            self._in_flight += 1
        st.highest_seen = offset  # above every offset read (checked)
        if st.reread_from < 0:
            st.reread_from = offset
        self._uncommitted += st.uncommitted - before
        self._span += st.span - span_before

    def mark_done(self, tp: TP, offset: int) -> None:
        """Record that `offset` needs no more work (result acknowledged, dead-lettered or expired)."""
        st = self._parts.get(tp)
        if st is None or offset not in st.outstanding_set:
            raise OffsetTrackingError(f"offset {offset} of {tp} marked done but not in flight")
        st.outstanding_set.remove(offset)
        self._in_flight -= 1
        # Lazy deletion: pop finished offsets off the top of the heap only.
        if st.outstanding[0] == offset:
            span_before = st.span
            while st.outstanding and st.outstanding[0] not in st.outstanding_set:
                heapq.heappop(st.outstanding)
            self._span += st.span - span_before

    def in_flight(self, tp: TP | None = None) -> int:
        if tp is not None:
            st = self._parts.get(tp)
            return len(st.outstanding_set) if st else 0
        return self._in_flight

    def commit_points(self) -> dict[TP, int]:
        """Offsets to commit (Kafka's "next offset to read") for partitions whose watermark moved."""
        points: dict[TP, int] = {}
        for tp, st in self._parts.items():
            point = self._watermark(st)
            if point is not None and point > st.committed:
                points[tp] = point
        return points

    def mark_committed(self, points: dict[TP, int]) -> None:
        for tp, point in points.items():
            st = self._parts.get(tp)
            if st is not None and point > st.committed:
                st.committed = point

    def commit_confirmed(self, points: dict[TP, int]) -> None:
        """The broker has these commits: a lost session re-reads from there."""
        for tp, point in points.items():
            st = self._parts.get(tp)
            if st is not None and point > st.reread_from:
                before = st.uncommitted
                st.reread_from = point
                self._uncommitted += st.uncommitted - before

    def uncommitted(self) -> int:
        """Offsets read since the last commit the broker confirmed, over all partitions: what a lost session or a
        crash would answer again (done or not) without the commit's metadata."""
        return self._uncommitted

    def done_beyond(self, tp: TP | None = None) -> int:
        """Offsets done (or never delivered: transaction markers, compacted records) beyond the commit point, held
        there by an earlier offset still in flight; over all partitions, or of `tp`."""
        if tp is not None:
            st = self._parts.get(tp)
            return st.span - len(st.outstanding_set) if st else 0
        return self._span - self._in_flight

    def held(self) -> int:
        """What the memory bound counts: offsets not done yet, and done ones below the commit point not confirmed
        committed (failing commits; a lost session would redo them). Equals uncommitted() - done_beyond()."""
        return self._uncommitted - (self._span - self._in_flight)

    def done_beyond_by_partition(self) -> dict[TP, int]:
        """Partitions with offsets done beyond their commit point, and how many: read per commit, not per frame."""
        out = {}
        for tp, st in self._parts.items():
            n = st.span - len(st.outstanding_set)
            if n:
                out[tp] = n
        return out

    def commit_point(self, tp: TP) -> int | None:
        st = self._parts.get(tp)
        return self._watermark(st) if st is not None else None

    def done_runs(self, tp: TP) -> tuple[int, list[tuple[int, int]], int]:
        """(commit point, the [start, end) runs of offsets not yet done from it, end of what was read) of a partition
        with offsets in flight; everything in [commit point, end) outside the runs is done. Sorts the offsets in
        flight: called per commit, never per frame."""
        st = self._parts[tp]
        pending = sorted(st.outstanding_set)
        runs: list[tuple[int, int]] = []
        for o in pending:
            if runs and runs[-1][1] == o:
                runs[-1] = (runs[-1][0], o + 1)
            else:
                runs.append((o, o + 1))
        return (pending[0] if pending else st.highest_seen + 1), runs, st.highest_seen + 1

    def commit_failed(self, tp: TP) -> None:
        """An asynchronous commit of `tp` failed: offer its commit point again next time."""
        st = self._parts.get(tp)
        if st is not None:
            st.committed = -1

    def forget(self, tp: TP) -> int:
        """Stop tracking a revoked or lost partition; returns how many offsets were still in flight."""
        st = self._parts.pop(tp, None)
        if st is None:
            return 0
        self._in_flight -= len(st.outstanding_set)
        self._uncommitted -= st.uncommitted
        self._span -= st.span
        return len(st.outstanding_set)

    @staticmethod
    def _watermark(st: _PartitionState) -> int | None:
        if st.highest_seen < 0:
            return None
        return st.outstanding[0] if st.outstanding else st.highest_seen + 1
