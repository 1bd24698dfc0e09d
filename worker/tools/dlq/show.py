"""`worker dlq show`: the dead-letter topic at a glance, counts by error type, source topic, stream, tenant, time
window and replay count, and the newest dead letters with their reasons.
"""

from __future__ import annotations

import base64
import heapq
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from worker.config import Settings
from worker.tools.dlq.entries import (
    UNIT_MS,
    DeadLetterEntry,
    RetentionCheck,
    Selection,
    entries,
    is_replayed,
    iso_ms,
    read_ledger,
)


# -- show -----------------------------------------------------------------------------------------------------
@dataclass
class DeadLetterSummary:
    """Counts of the selected dead letters and the newest of them. Pure: entries are added by the reader."""

    topic: str
    window_ms: int
    max_replays: int
    newest_wanted: int
    total: int = 0
    first_ms: int | None = None
    last_ms: int | None = None
    by_error_type: Counter[str] = field(default_factory=Counter)
    by_source_topic: Counter[str] = field(default_factory=Counter)
    by_stream: Counter[str] = field(default_factory=Counter)
    by_tenant: Counter[str] = field(default_factory=Counter)
    by_window: Counter[int] = field(default_factory=Counter)
    by_replay_count: Counter[str] = field(default_factory=Counter)
    at_replay_limit: int = 0
    replayed: int = 0
    reference_only: int = 0
    reference_gone: int = 0
    _newest: list[tuple[int, int, int, DeadLetterEntry, bool, bool | None]] = field(default_factory=list)

    def add(self, e: DeadLetterEntry, replayed: bool, retained: bool | None) -> None:
        """Count one dead letter; `replayed`: the ledger has it; `retained`: a reference-only dead letter's frame
        is still in its input topic (None for dead letters that carry their frame)."""
        self.total += 1
        self.first_ms = e.timestamp_ms if self.first_ms is None else min(self.first_ms, e.timestamp_ms)
        self.last_ms = e.timestamp_ms if self.last_ms is None else max(self.last_ms, e.timestamp_ms)
        self.by_error_type[e.error_type] += 1
        self.by_source_topic[e.source.topic if e.source else "unknown"] += 1
        self.by_stream[e.stream] += 1
        self.by_tenant[e.tenant or "unknown"] += 1
        self.by_window[e.timestamp_ms - e.timestamp_ms % self.window_ms] += 1
        self.by_replay_count["?" if e.replay_count is None else str(e.replay_count)] += 1
        if e.replay_count is not None and e.replay_count >= self.max_replays:
            self.at_replay_limit += 1
        self.replayed += replayed
        if e.reference_only:
            self.reference_only += 1
            self.reference_gone += retained is False
        item = (e.timestamp_ms, e.partition, e.offset, e, replayed, retained)
        if len(self._newest) < self.newest_wanted:
            heapq.heappush(self._newest, item)  # (timestamp, partition, offset) is unique: entries are never compared
        elif self.newest_wanted and item[:3] > self._newest[0][:3]:
            heapq.heapreplace(self._newest, item)

    def newest(self) -> list[tuple[DeadLetterEntry, bool, bool | None]]:
        """The newest dead letters, newest first, with whether each was replayed and (reference-only) retained."""
        return [(e, rep, ret) for _ts, _p, _o, e, rep, ret in sorted(self._newest, key=lambda i: i[:3],
                                                                        reverse=True)]

    def to_json(self, top: int, with_payload: bool = False) -> dict[str, Any]:
        return {
            "dead_letter_topic": self.topic, "total": self.total,
            "first": iso_ms(self.first_ms) if self.first_ms is not None else None,
            "last": iso_ms(self.last_ms) if self.last_ms is not None else None,
            "by_error_type": dict(self.by_error_type.most_common()),
            "by_source_topic": dict(self.by_source_topic.most_common()),
            "by_stream": _top(self.by_stream, top), "by_tenant": _top(self.by_tenant, top),
            "window_seconds": self.window_ms / 1000,
            "by_window": {iso_ms(start): n for start, n in sorted(self.by_window.items())},
            "by_replay_count": dict(sorted(self.by_replay_count.items())),
            "max_replays": self.max_replays, "at_replay_limit": self.at_replay_limit, "replayed": self.replayed,
            "reference_only": self.reference_only, "reference_only_not_retained": self.reference_gone,
            "newest": [entry_json(e, rep, ret, with_payload) for e, rep, ret in self.newest()],
        }


def _top(counts: Counter[str], top: int) -> dict[str, int]:
    """The `top` largest counts, the rest summed under "(others)"."""
    out = dict(counts.most_common(top))
    rest = sum(counts.values()) - sum(out.values())
    if rest:
        out["(others)"] = rest
    return out


def entry_json(e: DeadLetterEntry, replayed: bool, retained: bool | None, with_payload: bool = False
               ) -> dict[str, Any]:
    """One dead letter for --json: its place, headers and frame identity; its bytes only with `with_payload`."""
    out: dict[str, Any] = {
        "dead_letter": {"topic": e.topic, "partition": e.partition, "offset": e.offset,
                        "timestamp": iso_ms(e.timestamp_ms)},
        "error_type": e.error_type, "reason": e.reason,
        "source": {"topic": e.source.topic, "partition": e.source.partition, "offset": e.source.offset}
        if e.source else None,
        "worker_id": e.worker_id, "replay_count": e.replay_count, "replayed": replayed,
        "stream_id": e.stream, "frame_index": e.frame_index, "tenant": e.tenant,
        "capture": iso_ms(e.capture_ts_ms) if e.capture_ts_ms is not None else None,
        "payload_bytes": len(e.value), "reference_only": e.reference_only, "retained": retained,
        "headers": {name: (v or b"").decode("utf-8", errors="replace") for name, v in e.own_headers()},
    }
    if with_payload:
        out["key_base64"] = base64.b64encode(e.key).decode() if e.key is not None else None
        out["payload_base64"] = base64.b64encode(e.value).decode()
    return out


def render_summary(s: DeadLetterSummary, top: int, with_payload: bool = False) -> str:
    """`worker dlq show` as text: one screen of counts, then the newest dead letters with their reasons."""
    if not s.total:
        return f"no dead letters selected in {s.topic}"
    lines = [f"{s.total} dead letters in {s.topic}, {iso_ms(s.first_ms or 0)} .. {iso_ms(s.last_ms or 0)}",
             f"  replayed already: {s.replayed}   at the replay limit ({s.max_replays}, not replayed again): "
             f"{s.at_replay_limit}   reference-only (OutputRejected): {s.reference_only}"
             + (f", {s.reference_gone} no longer in their input topic" if s.reference_gone else "")]

    def counts(title: str, items: dict[str, int]) -> None:
        lines.append(f"{title:<20} " + "  ".join(f"{k} {v}" for k, v in items.items()))

    counts("by error type:", dict(s.by_error_type.most_common()))
    counts("by source topic:", dict(s.by_source_topic.most_common()))
    counts(f"by stream (top {top}):", _top(s.by_stream, top))
    counts(f"by tenant (top {top}):", _top(s.by_tenant, top))
    counts("by replay count:", dict(sorted(s.by_replay_count.items())))
    lines.append(f"by {_duration_text(s.window_ms)} window (UTC start):")
    lines += [f"  {iso_ms(start)}  {n}" for start, n in sorted(s.by_window.items())[-top:]]
    if len(s.by_window) > top:
        lines.append(f"  ... {len(s.by_window) - top} earlier windows (--json has all)")
    newest = s.newest()
    lines.append(f"newest {len(newest)} (dead-lettered at, its partition@offset, error type, read from, "
                 "stream#frame, tenant):")
    for e, replayed, retained in newest:
        src = f"{e.source.topic}/{e.source.partition}@{e.source.offset}" if e.source else "source unknown"
        frame = f"{e.stream}#{e.frame_index}" if e.frame_index is not None else e.stream
        flags = [f"replays {e.replay_count if e.replay_count is not None else '?'}"]
        if replayed:
            flags.append("replayed")
        if e.reference_only:
            flags.append("reference-only, " + ("retained" if retained else "NOT retained"))
        else:
            flags.append(f"{len(e.value)} B")
        lines.append(f"  {iso_ms(e.timestamp_ms)}  {e.partition}@{e.offset}  {e.error_type}  {src}  {frame}  "
                     f"{e.tenant or 'unknown'}  {', '.join(flags)}")
        lines.append(f"      reason: {e.reason}")
        if with_payload:
            lines.append(f"      payload (base64): {base64.b64encode(e.value).decode()}")
    return "\n".join(lines)


def _duration_text(ms: int) -> str:
    for unit in ("d", "h", "m", "s"):
        if ms % UNIT_MS[unit] == 0:
            return f"{ms // UNIT_MS[unit]}{unit}"
    return f"{ms}ms"


# -- counting the selected dead letters -----------------------------------------------------------------------
def show(settings: Settings, selection: Selection, newest: int = 10, window_ms: int = 3_600_000
         ) -> DeadLetterSummary:
    """Count the selected dead letters (by error type, source topic, stream, tenant, time window, replay count)
    and keep the newest `newest`."""
    summary = DeadLetterSummary(settings.topics.dead_letter, window_ms, settings.dlq.max_replays, newest)
    ledger = read_ledger(settings)
    retention = RetentionCheck(settings)
    try:
        for e in entries(settings, selection.since_ms):
            if not selection.matches(e):
                continue
            retained = retention.retained(e.source) if e.reference_only and e.source is not None else None
            if e.reference_only and e.source is None:
                retained = False
            summary.add(e, is_replayed(ledger, e), retained)
    finally:
        retention.close()
    return summary
