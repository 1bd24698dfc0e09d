"""Finished work that survives a hand-over: the offsets done beyond a partition's commit point, carried in the
commit's metadata (issue 67; the idea of Confluent's Parallel Consumer).

A frame whose output cannot be delivered (its results partition is down) holds its input partition's commit point;
the frames answered after it cannot be committed. Without more, the next owner of the partition (after a restart or
a rebalance) would score and produce them all again. So an at-least-once commit of a held partition carries, as text
in the offset's metadata, which offsets from the committed one on are *not* done yet; everything else up to the end
of what was read is done, and the next owner skips it (`OffsetRuns.contains`) while still committing past it.

The text is bounded (the broker refuses metadata over its `offset.metadata.max.bytes`, 4096 by default): a partition
whose list does not fit is committed without it, as before this, and counted. Exactly-once never carries it: there an
answered offset beyond the commit point holds an output not yet in any transaction (worker.loop.delivery), so it is
not finished work.

Format `sf1:<base64url of unsigned LEB128 varints>`: the length of the range read from the committed offset, the
count of runs not done, then per run the gap from the previous run's end (the first from the committed offset) and
its length. Pure: no Kafka import; time from an injected clock.
"""

from __future__ import annotations

import base64
import binascii
import logging
from bisect import bisect_right
from collections.abc import Callable, Iterable

from worker.errors import StreamferError
from worker.partitions.offsets import OffsetTracker

log = logging.getLogger(__name__)

PREFIX = "sf1:"
# A held partition's metadata is refreshed (its point re-committed) at most this often while its done offsets grow.
REFRESH_INTERVAL_S = 1.0


class MetadataError(StreamferError):
    """Commit metadata that is not ours or is malformed: ignored (the frames are redone), never trusted."""


class OffsetRuns:
    """A set of offsets kept as sorted, disjoint, non-adjacent [start, end) runs: a partition's done offsets beyond
    its commit point cost two integers per run, not one per offset."""

    def __init__(self, runs: Iterable[tuple[int, int]] = ()) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        for start, end in runs:
            self.add_run(start, end)

    def add(self, offset: int) -> None:
        self.add_run(offset, offset + 1)

    def add_run(self, start: int, end: int) -> None:
        """Add [start, end), merging it with the runs it overlaps or touches."""
        if end <= start:
            return
        starts, ends = self._starts, self._ends
        # Fast path: offsets mostly arrive in order, extending the last run.
        if starts and ends[-1] <= start:
            if ends[-1] == start:
                ends[-1] = end
            else:
                starts.append(start)
                ends.append(end)
            return
        lo = bisect_right(ends, start - 1)  # first run ending at or after start (touching counts)
        hi = bisect_right(starts, end)  # runs before hi start at or before end
        if lo < hi:
            start, end = min(start, starts[lo]), max(end, ends[hi - 1])
        starts[lo:hi] = [start]
        ends[lo:hi] = [end]

    def advance(self, point: int) -> None:
        """Forget everything below `point` (the commit point moved there)."""
        starts, ends = self._starts, self._ends
        cut = bisect_right(ends, point)
        del starts[:cut], ends[:cut]
        if starts and starts[0] < point:
            starts[0] = point

    def contains(self, offset: int) -> bool:
        i = bisect_right(self._starts, offset) - 1
        return i >= 0 and offset < self._ends[i]

    @property
    def end(self) -> int:
        """One past the highest offset held (0 when empty)."""
        return self._ends[-1] if self._ends else 0

    def __len__(self) -> int:
        """Offsets held."""
        return sum(e - s for s, e in zip(self._starts, self._ends, strict=True))

    @property
    def run_count(self) -> int:
        return len(self._starts)

    def runs(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._ends, strict=True))

    def __bool__(self) -> bool:
        return bool(self._starts)


def _varint(n: int, out: bytearray) -> None:
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def encode(point: int, pending: list[tuple[int, int]], end: int, max_bytes: int) -> str | None:
    """The metadata of a commit at `point`: [point, end) was read, and the sorted [start, end) runs of `pending` are
    not done yet. None when it would be longer than `max_bytes` (commit without it: the done offsets are redone after
    a hand-over). An empty string when nothing beyond the point is done."""
    if end <= point or max_bytes <= 0:
        return ""
    raw = bytearray()
    _varint(end - point, raw)
    _varint(len(pending), raw)
    previous = point
    limit = (max_bytes - len(PREFIX)) * 3 // 4  # base64 makes 4 characters of 3 bytes
    for start, stop in pending:
        if start < previous or stop <= start or stop > end:
            raise ValueError(f"runs not done must be sorted, disjoint and within [{point}, {end}): {start}..{stop}")
        _varint(start - previous, raw)
        _varint(stop - start, raw)
        previous = stop
        if len(raw) > limit:
            return None
    text = PREFIX + base64.urlsafe_b64encode(bytes(raw)).decode("ascii").rstrip("=")
    return text if len(text) <= max_bytes else None


def decode(text: str | None, point: int) -> OffsetRuns:
    """The offsets done beyond a commit at `point`, from its metadata; empty for no metadata or another tool's.
    Raises MetadataError for text of ours that does not decode (the caller redoes the frames)."""
    done = OffsetRuns()
    if not text or not text.startswith(PREFIX):
        return done
    body = text[len(PREFIX):]
    try:
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
    except (binascii.Error, ValueError) as exc:
        raise MetadataError(f"commit metadata at {point} is not base64: {exc}") from None
    values = _read_varints(raw, point)
    if len(values) < 2 or len(values) != 2 + 2 * values[1]:
        raise MetadataError(f"commit metadata at {point} has {len(values)} numbers, not 2 + 2 x its run count")
    span = values[0]
    cursor = point
    for i in range(values[1]):
        gap, length = values[2 + 2 * i], values[3 + 2 * i]
        if length == 0 or cursor + gap + length > point + span:
            raise MetadataError(f"commit metadata at {point}: run {i} is empty or past the range read")
        done.add_run(cursor, cursor + gap)
        cursor += gap + length
    done.add_run(cursor, point + span)
    return done


def _read_varints(raw: bytes, point: int) -> list[int]:
    values: list[int] = []
    n = shift = 0
    for b in raw:
        n |= (b & 0x7F) << shift
        if b & 0x80:
            shift += 7
            if shift > 63:
                raise MetadataError(f"commit metadata at {point} holds a number over 64 bits")
        else:
            values.append(n)
            n = shift = 0
    if shift:
        raise MetadataError(f"commit metadata at {point} ends inside a number")
    return values


def done_count(text: str | None, point: int) -> int:
    """Offsets the metadata of a commit at `point` lists as done beyond it (0 for none, or metadata not ours or
    malformed): what `worker lag` shows."""
    try:
        return len(decode(text, point))
    except MetadataError:
        return 0


class MetadataRefresh:
    """Which held partitions to commit again at the same point so their metadata lists the offsets done since.

    A commit point that does not move is not committed again (worker.partitions.offsets), so without this the last
    metadata would grow stale for as long as an output partition is down. Each partition at most once per
    `interval_s`, and only when its count done beyond the point changed."""

    def __init__(self, clock: Callable[[], float], interval_s: float = REFRESH_INTERVAL_S) -> None:
        self._clock = clock
        self._interval_s = interval_s
        self._sent: dict[tuple[str, int], tuple[int, float]] = {}  # tp -> (done beyond when sent, when)

    def due(self, done_beyond: dict[tuple[str, int], int]) -> list[tuple[str, int]]:
        """Of `done_beyond` (a partition's offsets done beyond its commit point), those to commit again now."""
        now = self._clock()
        out = []
        for tp, count in done_beyond.items():
            sent = self._sent.get(tp)
            if count and (sent is None or (sent[0] != count and now - sent[1] >= self._interval_s)):
                out.append(tp)
        return out

    def sent(self, tp: tuple[str, int], done_beyond: int) -> None:
        self._sent[tp] = (done_beyond, self._clock())

    def forget(self, tp: tuple[str, int]) -> None:
        self._sent.pop(tp, None)


def read_already_done(done: dict[tuple[str, int], OffsetRuns], tp: tuple[str, int], offset: int) -> bool:
    """Whether `offset` of `tp`, just read, was finished by the partition's previous owner (listed in the metadata of
    the commit it was sought to; `done` holds those lists per partition). A list is dropped once read past."""
    runs = done.get(tp)
    if runs is None:
        return False
    if runs.contains(offset):
        return True
    if offset >= runs.end:
        del done[tp]
    return False


class CommitMetadata:
    """At-least-once: the metadata of each partition's commit, and the held partitions to commit again for it.

    `for_commit` adds to a commit's points the held partitions due a refresh (`MetadataRefresh`) and returns the
    metadata of those due: a partition's list is encoded at most once per interval (it sorts the partition's offsets
    in flight, thousands on a backlog), so a commit in between goes without and a hand-over then redoes at most that
    interval's done offsets; a final commit (partitions given up, the worker stopping) carries every held
    partition's. A partition whose list does not fit `max_bytes` is committed without it and counted in `overflows`
    (its done offsets are redone after a hand-over, as before issue 67)."""

    def __init__(self, clock: Callable[[], float], max_bytes: int, interval_s: float = REFRESH_INTERVAL_S) -> None:
        self._max_bytes = max_bytes
        self._refresh = MetadataRefresh(clock, interval_s)
        self.overflows = 0

    def for_commit(self, points: dict[tuple[str, int], int], tracker: OffsetTracker,
                   assigned: Callable[[tuple[str, int]], bool], final: bool = False) -> dict[tuple[str, int], str]:
        if self._max_bytes <= 0:
            return {}
        held = {tp: n for tp, n in tracker.done_beyond_by_partition().items() if assigned(tp)}
        due = set(held) if final else set(self._refresh.due(held))
        for tp in due:
            if tp not in points:
                point = tracker.commit_point(tp)
                if point is not None:
                    points[tp] = point
        metadata: dict[tuple[str, int], str] = {}
        for tp in points:
            count = held.get(tp, 0)
            if not count or tp not in due:
                continue
            point, pending, end = tracker.done_runs(tp)
            text = encode(point, pending, end, self._max_bytes)
            if text is None:
                self.overflows += 1
            else:
                metadata[tp] = text
            self._refresh.sent(tp, count)
        return metadata

    def forget(self, tp: tuple[str, int]) -> None:
        self._refresh.forget(tp)


def done_after(done: dict[tuple[str, int], OffsetRuns], tp: tuple[str, int], point: int, text: str | None) -> None:
    """A partition was sought to its commit at `point`: keep in `done` what that commit's metadata lists as finished
    beyond it (skipped as read, see `read_already_done`). Metadata that does not decode is redone, with a warning."""
    done.pop(tp, None)
    try:
        runs = decode(text, point)
    except MetadataError as exc:
        log.warning("%s of %s: redoing what is past the committed offset", exc, tp)
        return
    if runs:
        done[tp] = runs
        log.info("%s read from %d: its previous owner finished %d offsets up to %d beyond it, which are skipped",
                 tp, point, len(runs), runs.end - 1)
