"""Output partitions that have stopped acknowledging: what an operator sees of a partial outage (issue 67).

A results or dead-letter partition whose leader is away (replication factor 1, or `acks=all` below min ISR) takes
outputs into librdkafka's queue and acknowledges none. Its streams wait; the others flow on (worker.partitions.
offsets keeps their answered offsets behind the held commit points). This names those partitions and how long each
has not acknowledged, for `/readyz`, `streamfer_output_partition_unacknowledged_seconds` and the
`StreamferOutputPartitionStalled` alert.

Pure: fed librdkafka's per-partition queue counts (its statistics) and the partitions delivery reports acknowledged;
time from an injected clock.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

from worker.frames import TP

# /readyz names a partition once it has not acknowledged for this long while outputs wait for it.
READY_NOTE_AFTER_S = 10.0


class OutputStalls:
    """Per output partition: whether outputs wait for it, and since when it has acknowledged none."""

    def __init__(self, topics: Iterable[str], clock: Callable[[], float]) -> None:
        self._topics = frozenset(topics)
        self._clock = clock
        self._last_ack: dict[TP, float] = {}
        self._pending_since: dict[TP, float] = {}  # partitions with outputs queued or in flight, since when
        self.known: set[TP] = set()  # every partition seen, so a gauge returns to 0 rather than vanish

    def acknowledged(self, tps: Iterable[TP]) -> None:
        """Partitions that acknowledged an output since the last call."""
        now = self._clock()
        for tp in tps:
            self._last_ack[tp] = now
            self.known.add(tp)

    def queued(self, pending: dict[TP, int]) -> None:
        """Outputs each partition holds in librdkafka (queued, being sent or awaiting the broker), as its latest
        statistics tell; a partition missing has none."""
        now = self._clock()
        for tp, count in pending.items():
            if count > 0:
                self._pending_since.setdefault(tp, now)
                self.known.add(tp)
        for tp in [tp for tp in self._pending_since if pending.get(tp, 0) <= 0]:
            del self._pending_since[tp]

    def unacknowledged_s(self) -> dict[TP, float]:
        """Seconds each partition with outputs waiting has acknowledged none (since they began waiting, at the
        latest); 0 for every other partition seen."""
        # Copied in one C call: /metrics reads this from its own thread while the loop feeds it.
        return {**dict.fromkeys(list(self.known), 0.0), **self._waiting_s()}

    def _waiting_s(self) -> dict[TP, float]:
        now = self._clock()
        return {tp: now - max(since, self._last_ack.get(tp, since)) for tp, since in list(self._pending_since.items())}

    def problem(self, after_s: float = READY_NOTE_AFTER_S) -> str | None:
        """/readyz's note naming the partitions not acknowledging for `after_s` or more, or None."""
        stalled = sorted((tp, s) for tp, s in self._waiting_s().items() if s >= after_s)
        if not stalled:
            return None
        named = ", ".join(f"{t}[{p}] for {s:.0f}s" for (t, p), s in stalled)
        return (f"output partitions not acknowledging: {named} (their streams wait, answered once they are back; "
                f"the others flow on)")

    def stats(self, stats_json: str) -> None:
        """librdkafka's producer statistics (its `stats_cb`): each output partition's queued and in-flight count."""
        try:
            stats: dict[str, Any] = json.loads(stats_json)
        except ValueError:
            return
        pending: dict[TP, int] = {}
        for name, topic in (stats.get("topics") or {}).items():
            if name not in self._topics:
                continue
            for pid, part in (topic.get("partitions") or {}).items():
                partition = int(pid)
                if partition < 0:  # the unassigned partition: messages not yet given one
                    continue
                pending[(name, partition)] = (int(part.get("msgq_cnt", 0)) + int(part.get("xmit_msgq_cnt", 0))
                                              + int(part.get("msgs_inflight", 0)))
        self.queued(pending)
