"""The rolling-restart benchmark's figures (tests/reliability/rollout.py), from the answers' append times and the
workers' logs: latency percentiles per window of send time, each partition's longest wait for an answer while it had
input, how long a partition had no owner, and the transaction aborts around each rebalance. Pure: no Kafka.

Times are time.time() seconds: the answers' Kafka append timestamps (see harness.stamp_on_append), the frames'
intended send times, and the workers' log lines (`%(asctime)s`, local time to the millisecond, on the same host).
"""

from __future__ import annotations

import ast
import datetime
import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

TP = tuple[str, int]
# `2026-12-05 16:10:16,123 INFO [w0] worker: partitions assigned: [('t.realtime', 0)]` (worker/app.py's text format).
LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ \[[^\]]*\] \S+: (.*)$")
# What a worker logs for each event counted here (worker/loop/pipeline.py, worker/loop/delivery.py).
PARTITION_EVENT = re.compile(r"^partitions (assigned|revoked|lost): (\[.*\])$")
MESSAGES = (("started", "worker started:"), ("aborted", "transaction aborted"),
            ("rewound", "rewinding to the committed offsets"))
REBALANCE = ("assigned", "revoked", "lost")


def percentile(values: Iterable[float], q: float) -> float:
    """Nearest-rank percentile (NaN when there are no values)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))]


@dataclass(frozen=True)
class Window:
    """Frames sent (intended send time) in [start, end)."""

    name: str
    start: float
    end: float


def window_latencies(samples: Iterable[tuple[float, float]], windows: Sequence[Window],
                     qs: Sequence[float] = (0.5, 0.99)) -> dict[str, dict[str, float]]:
    """`samples`: (sent, latency s) per frame. Per window: its frames and their latency percentiles in ms."""
    samples = list(samples)
    out: dict[str, dict[str, float]] = {}
    for w in windows:
        lat = [lat for sent, lat in samples if w.start <= sent < w.end]
        figures: dict[str, float] = {"frames": len(lat)}
        for q in qs:
            figures[f"p{round(q * 100)}_ms"] = percentile(lat, q) * 1000.0
        out[w.name] = figures
    return out


def longest_answer_gap(frames: Iterable[tuple[float, float | None]], end: float) -> float:
    """One partition's longest time without an answer while it had input: `frames` are (sent, first answer or None:
    never, counted as answered at `end`). Between two answers the partition waits from the later of the first
    answer and the earliest send of a frame still unanswered then, to the second answer."""
    pairs = sorted((end if a is None else a, s) for s, a in frames)
    if not pairs:
        return 0.0
    # earliest[i]: the earliest send among frames answered at pairs[i] or later (still waiting before it).
    earliest = [0.0] * len(pairs)
    low = math.inf
    for i in range(len(pairs) - 1, -1, -1):
        low = min(low, pairs[i][1])
        earliest[i] = low
    longest, previous = 0.0, -math.inf
    for i, (answered, _sent) in enumerate(pairs):
        longest = max(longest, answered - max(previous, earliest[i]))
        previous = answered
    return longest


def gap_figures(gaps: Mapping[str, float]) -> dict[str, float]:
    """Partitions' longest gaps: the longest of any, the median partition's, and their ratio."""
    values = list(gaps.values())
    if not values:
        return {"max_s": float("nan"), "median_s": float("nan"), "ratio": float("nan")}
    worst, median = max(values), statistics.median(values)
    return {"max_s": worst, "median_s": median, "ratio": worst / median if median > 0 else float("inf")}


# -- the workers' logs ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LogEvent:
    t: float
    process: str  # one worker process (a role's log holds its successive processes)
    kind: str  # assigned, revoked, lost, started, aborted, rewound
    tps: frozenset[TP] = frozenset()


def log_time(stamp: str) -> float:
    """`2026-12-05 16:10:16,123` (local time, as the worker's log writes it) -> time.time() seconds."""
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def parse_log(text: str, process: str) -> list[LogEvent]:
    """The events of one process's log text (librdkafka's own `%...` lines and anything unparsed skipped)."""
    out = []
    for line in text.splitlines():
        m = LOG_LINE.match(line)
        if m is None:
            continue
        t, message = log_time(m.group(1)), m.group(2)
        p = PARTITION_EVENT.match(message)
        if p is not None:
            try:
                tps = frozenset((str(topic), int(part)) for topic, part in ast.literal_eval(p.group(2)))
            except (ValueError, SyntaxError, TypeError):
                continue
            out.append(LogEvent(t, process, p.group(1), tps))
            continue
        for kind, needle in MESSAGES:
            if needle in message:
                out.append(LogEvent(t, process, kind))
    return out


def unowned_spans(events: Iterable[LogEvent], since: float, until: float) -> dict[TP, float]:
    """Per partition, its longest time with no owner that began (a revoke or loss left it to nobody) in
    [since, until): to the next assignment, or to `until` if none came. Partitions never left ownerless: absent."""
    owners: dict[TP, set[str]] = {}
    unowned_at: dict[TP, float] = {}
    longest: dict[TP, float] = {}
    for e in sorted((e for e in events if e.kind in REBALANCE), key=lambda e: e.t):
        for tp in e.tps:
            held = owners.setdefault(tp, set())
            if e.kind == "assigned":
                held.add(e.process)
                began = unowned_at.pop(tp, None)
                if began is not None:
                    longest[tp] = max(longest.get(tp, 0.0), e.t - began)
            else:
                held.discard(e.process)
                if not held and since <= e.t < until:
                    unowned_at[tp] = e.t
    for tp, began in unowned_at.items():
        longest[tp] = max(longest.get(tp, 0.0), until - began)
    return longest


@dataclass(frozen=True)
class Aborts:
    """Transaction aborts counted per rebalance callback of each process (the aborts after one callback and before
    the next): the most after any one, how many callbacks were followed by more than one, and the rewinds (an
    abort that read again from the committed offsets)."""

    total: int
    most_per_rebalance: int
    repeated: int
    rewinds: int
    rebalances: int

    def as_dict(self) -> dict[str, int]:
        return {"total": self.total, "most_per_rebalance": self.most_per_rebalance, "repeated": self.repeated,
                "rewinds": self.rewinds, "rebalances": self.rebalances}


def aborts_per_rebalance(events: Iterable[LogEvent]) -> Aborts:
    counts: list[int] = []  # aborts after each rebalance callback, per process
    total = rewinds = rebalances = 0
    by_process: dict[str, list[LogEvent]] = {}
    for e in events:
        by_process.setdefault(e.process, []).append(e)
    for mine in by_process.values():
        since_rebalance = 0
        for e in sorted(mine, key=lambda e: e.t):
            if e.kind in REBALANCE:
                counts.append(since_rebalance)
                since_rebalance = 0
                rebalances += 1
            elif e.kind == "aborted":
                since_rebalance += 1
                total += 1
            elif e.kind == "rewound":
                rewinds += 1
        counts.append(since_rebalance)
    return Aborts(total, max(counts, default=0), sum(1 for n in counts if n > 1), rewinds, rebalances)


def first_assignment(events: Iterable[LogEvent], process: str) -> float | None:
    """When the process was first assigned a partition (an empty cooperative increment does not count)."""
    times = [e.t for e in events if e.process == process and e.kind == "assigned" and e.tps]
    return min(times, default=None)
