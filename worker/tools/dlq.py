"""`worker dlq show` and `worker dlq replay`: what the dead-letter topic holds, and publishing dead-lettered frames
again once their cause (a model, a setting, a topic limit) is fixed.

Both read the dead-letter topic as it stood when they started (read_committed, no group joined), from the first
dead letter at or after `--since`. Replay publishes each selected frame to its source topic (or `--topic`) with its
key and its own headers plus a replay marker (`streamfer.replay_count`, `streamfer.replayed_from`). In the same
transaction it records each replayed dead letter in the ledger topic `<topics.dead_letter>.replayed`, so a dead
letter is replayed at most once, a replay cut short leaves each chunk either all published and recorded or not at
all, and a frame already replayed `dlq.max_replays` times is left where it is. See docs/operations.md.
"""

from __future__ import annotations

import base64
import heapq
import json
import logging
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from worker.config import Settings
from worker.errors import OperatorError, StreamferError
from worker.frames import (
    DEAD_LETTER_HEADERS,
    DUPLICATE_FRAME,
    HEADER_ERROR,
    HEADER_ERROR_TYPE,
    HEADER_REPLAY_COUNT,
    HEADER_REPLAYED_FROM,
    HEADER_SOURCE_OFFSET,
    HEADER_SOURCE_PARTITION,
    HEADER_SOURCE_TOPIC,
    HEADER_WORKER_ID,
    OUTPUT_REJECTED,
    REPLAY_HEADERS,
    Headers,
    SourceRef,
    replay_count_of,
)
from worker.kafka.client import client_properties, security_properties
from worker.kafka.topics import ensure_topics, topic_message_limits
from worker.schemas import MessageDecodeError, read_frame_record

log = logging.getLogger(__name__)

LEDGER_SUFFIX = ".replayed"
# librdkafka wants a group id; partitions are assigned, so the group is never joined and nothing is committed.
READER_GROUP = "streamfer-dlq-reader"
# How long a read may go without a message or an end-of-partition event before it is given up as stuck.
READ_IDLE_TIMEOUT_S = 30.0
# A dead letter of an OutputRejected output: how long reading its original frame from the input topic may take.
ORIGINAL_READ_TIMEOUT_S = 10.0
# One replay transaction: at most this many frames or bytes (well inside the default transaction.timeout.ms).
CHUNK_FRAMES = 500
CHUNK_BYTES = 32 * 1024 * 1024
TRANSACTION_CALL_TIMEOUT_S = 60.0
# What a record adds to its key, value and headers in a record batch, so a frame that passes here fits the topic.
RECORD_HEADROOM_BYTES = 512
LIBRDKAFKA_DEFAULT_MESSAGE_MAX_BYTES = 1_000_000
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)$")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


# `worker dlq replay`'s exit code when a replay transaction failed (what it held was not published).
EXIT_REPLAY_FAILED = 1


class DeadLetterToolError(OperatorError):
    """The dead-letter tools cannot do what was asked (a topic missing, a read stuck, a replay refused)."""


class ReplayFailed(StreamferError):
    """A replay transaction failed and was aborted: its `items` were not published; earlier chunks' were."""

    def __init__(self, message: str, items: list[ReplayItem]) -> None:
        super().__init__(message)
        self.items = items


# -- time -----------------------------------------------------------------------------------------------------
def parse_duration_ms(text: str) -> int:
    """'90s', '15m', '2h', '1d', '250ms' -> milliseconds; ValueError otherwise."""
    m = _DURATION.match(text.strip())
    if not m:
        raise ValueError(f"{text!r} is not a duration: use a number and one of ms, s, m, h, d (e.g. 15m, 2h)")
    ms = int(float(m.group(1)) * _UNIT_MS[m.group(2)])
    if ms <= 0:
        raise ValueError(f"{text!r}: a duration must be positive")
    return ms


def parse_time_ms(text: str, now_ms: int) -> int:
    """A point in time: a duration ago ('2h': two hours before now) or an ISO 8601 time (UTC unless it says)."""
    text = text.strip()
    if _DURATION.match(text):
        return now_ms - parse_duration_ms(text)
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"{text!r} is neither a duration ago (2h, 30m) nor an ISO 8601 time "
                         "(2026-12-04T10:00:00Z)") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return int(when.timestamp() * 1000)


def iso_ms(ms: int) -> str:
    """Epoch milliseconds as an ISO 8601 UTC time to the millisecond (2026-12-04T10:00:00.000Z)."""
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# -- one dead letter --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeadLetterEntry:
    """One dead letter as read back: where it sits in the dead-letter topic, what its headers say, and the frame's
    identity when its payload is a frame record (an OutputRejected dead letter has no payload)."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    error_type: str
    reason: str
    source: SourceRef | None  # where the worker read the message; None when the headers do not say
    worker_id: str
    replay_count: int | None  # None: its streamfer.replay_count header is not a count
    stream_id: str | None
    frame_index: int | None
    tenant: str | None
    capture_ts_ms: int | None = None
    key: bytes | None = field(repr=False, default=None)
    value: bytes = field(repr=False, default=b"")
    headers: Headers = field(repr=False, default=())

    @property
    def coordinates(self) -> str:
        """The dead letter's own address, `<topic>/<partition>@<offset>`: the replay marker and the ledger key."""
        return f"{self.topic}/{self.partition}@{self.offset}"

    @property
    def reference_only(self) -> bool:
        """An OutputRejected dead letter keeps only the coordinates of its frame, which stays in its input topic."""
        return self.error_type == OUTPUT_REJECTED and not self.value

    @property
    def stream(self) -> str:
        """The frame's stream id; else the message key (dead letters are keyed by stream); else "unknown"."""
        if self.stream_id is not None:
            return self.stream_id
        if self.key:
            return self.key.decode("utf-8", errors="replace")
        return "unknown"

    def own_headers(self) -> Headers:
        """The input message's own headers: the dead letter's, less its context and any earlier replay marker."""
        return tuple(h for h in self.headers if h[0] not in DEAD_LETTER_HEADERS and h[0] not in REPLAY_HEADERS)


def parse_entry(topic: str, partition: int, offset: int, timestamp_ms: int, key: bytes | None, value: bytes | None,
                headers: Sequence[tuple[str, bytes | None]] | None) -> DeadLetterEntry:
    """A dead-letter message as a DeadLetterEntry; missing or malformed headers become None or "unknown"."""
    hdrs: Headers = tuple(headers or ())
    last = {name: (v or b"").decode("utf-8", errors="replace") for name, v in hdrs}
    source = None
    try:
        source = SourceRef(last[HEADER_SOURCE_TOPIC], int(last[HEADER_SOURCE_PARTITION]),
                           int(last[HEADER_SOURCE_OFFSET]))
    except (KeyError, ValueError):
        pass
    try:
        count: int | None = replay_count_of(hdrs)
    except ValueError:
        count = None
    stream_id = frame_index = tenant = capture_ts_ms = None
    if value:
        try:
            rec = read_frame_record(value)
            stream_id, frame_index, tenant, capture_ts_ms = rec.stream_id, rec.frame_index, rec.tenant, \
                rec.capture_ts_ms
        except MessageDecodeError:
            pass  # not a frame record (that may be why it is here)
    return DeadLetterEntry(topic=topic, partition=partition, offset=offset, timestamp_ms=timestamp_ms,
                           error_type=last.get(HEADER_ERROR_TYPE, "unknown"), reason=last.get(HEADER_ERROR, ""),
                           source=source, worker_id=last.get(HEADER_WORKER_ID, ""), replay_count=count,
                           stream_id=stream_id, frame_index=frame_index, tenant=tenant, capture_ts_ms=capture_ts_ms,
                           key=key, value=value or b"", headers=hdrs)


@dataclass(frozen=True)
class Selection:
    """Which dead letters a command looks at. None: no filter on that field."""

    error_types: frozenset[str] | None = None
    exclude_error_types: frozenset[str] = frozenset()
    since_ms: int | None = None
    until_ms: int | None = None
    streams: frozenset[str] | None = None
    tenants: frozenset[str] | None = None
    source_topics: frozenset[str] | None = None

    def matches(self, e: DeadLetterEntry) -> bool:
        if self.error_types is not None and e.error_type not in self.error_types:
            return False
        if e.error_type in self.exclude_error_types:
            return False
        if self.since_ms is not None and e.timestamp_ms < self.since_ms:
            return False
        if self.until_ms is not None and e.timestamp_ms >= self.until_ms:
            return False
        if self.streams is not None and e.stream not in self.streams:
            return False
        if self.tenants is not None and (e.tenant or "unknown") not in self.tenants:
            return False
        return self.source_topics is None or (e.source is not None and e.source.topic in self.source_topics)


def replay_selection(selection: Selection) -> Selection:
    """What replay takes by default: every error type but DuplicateFrame (a duplicate's first copy was scored:
    replaying it scores the frame twice), unless --error-type names the types."""
    if selection.error_types is not None:
        return selection
    return Selection(None, selection.exclude_error_types | {DUPLICATE_FRAME}, selection.since_ms,
                     selection.until_ms, selection.streams, selection.tenants, selection.source_topics)


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
        if ms % _UNIT_MS[unit] == 0:
            return f"{ms // _UNIT_MS[unit]}{unit}"
    return f"{ms}ms"


# -- replay: the decisions ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Original:
    """The input message an OutputRejected dead letter points at, read back from its input topic."""

    key: bytes | None
    value: bytes
    headers: Headers


@dataclass(frozen=True)
class ReplayMessage:
    topic: str
    key: bytes | None
    value: bytes = field(repr=False)
    headers: Headers

    @property
    def size(self) -> int:
        """Bytes of key, value and headers, as the broker counts them against max.message.bytes (less framing)."""
        return (len(self.key or b"") + len(self.value)
                + sum(len(name) + len(v or b"") for name, v in self.headers))


def skip_reason(e: DeadLetterEntry, max_replays: int, target_topic: str | None, already_replayed: bool) -> str | None:
    """Why a selected dead letter is not replayed, or None when it is."""
    if already_replayed:
        return "already replayed (in the ledger)"
    if e.replay_count is None:
        return f"its {HEADER_REPLAY_COUNT} header is not a count"
    if e.replay_count >= max_replays:
        return f"at the replay limit: replayed {e.replay_count} times (dlq.max_replays = {max_replays})"
    if target_topic is None and e.source is None:
        return f"no {HEADER_SOURCE_TOPIC} header: give --topic"
    if e.reference_only and e.source is None:
        return "reference-only without source coordinates: nothing to read the frame from"
    return None


def replay_message(e: DeadLetterEntry, topic: str, original: Original | None = None) -> ReplayMessage:
    """The frame to publish again: its key, value and own headers (from the input topic for a reference-only dead
    letter), plus the replay marker with the count raised by one."""
    assert e.replay_count is not None, "skip_reason refuses dead letters without a replay count"
    if original is not None:
        key, value = original.key, original.value
        own = tuple(h for h in original.headers if h[0] not in REPLAY_HEADERS and h[0] not in DEAD_LETTER_HEADERS)
    else:
        key, value, own = e.key, e.value, e.own_headers()
    marker = ((HEADER_REPLAY_COUNT, str(e.replay_count + 1).encode()), (HEADER_REPLAYED_FROM, e.coordinates.encode()))
    return ReplayMessage(topic, key, value, own + marker)


def expires(settings: Settings, topic: str, message: ReplayMessage, now_s: float) -> bool:
    """A replayed frame keeps its capture time: older than its class's max_age_ms, it is answered EXPIRED."""
    priority = settings.topics.input_topics().get(topic)
    if priority is None:
        return False
    max_age_ms = settings.batching.for_class(priority).max_age_ms
    try:
        capture_ts_ms = read_frame_record(message.value).capture_ts_ms
    except MessageDecodeError:
        return False
    return max_age_ms > 0 and now_s * 1000 - capture_ts_ms > max_age_ms


def ledger_topic(dead_letter_topic: str) -> str:
    return dead_letter_topic + LEDGER_SUFFIX


def ledger_record(e: DeadLetterEntry, message: ReplayMessage, now_ms: int) -> tuple[bytes, bytes]:
    """Key and value of the ledger record that says `e` was replayed (compacted: one record per dead letter)."""
    value = {"dead_letter_timestamp_ms": e.timestamp_ms, "replayed_to": message.topic,
             "replay_count": (e.replay_count or 0) + 1, "replayed_at": iso_ms(now_ms)}
    return e.coordinates.encode(), json.dumps(value, sort_keys=True).encode()


def is_replayed(ledger: dict[str, int], e: DeadLetterEntry) -> bool:
    """The ledger names this dead letter: same coordinates and timestamp (so a recreated topic's offsets that
    happen to match an old record do not count)."""
    return ledger.get(e.coordinates) == e.timestamp_ms


@dataclass(frozen=True)
class ReplayItem:
    """What became of one selected dead letter: sent (or would be, in a dry run), skipped and why, or failed."""

    entry: DeadLetterEntry
    outcome: str  # "sent", "would send", "skipped", "failed"
    reason: str = ""
    topic: str | None = None
    replay_count: int | None = None  # the replayed frame's count
    size: int = 0
    expires: bool = False  # older than its class's max_age_ms: the worker answers it EXPIRED, unscored

    def to_json(self) -> dict[str, Any]:
        e = self.entry
        return {"dead_letter": e.coordinates, "timestamp": iso_ms(e.timestamp_ms), "error_type": e.error_type,
                "stream_id": e.stream, "frame_index": e.frame_index, "tenant": e.tenant,
                "source": f"{e.source.topic}/{e.source.partition}@{e.source.offset}" if e.source else None,
                "reference_only": e.reference_only, "outcome": self.outcome, "reason": self.reason or None,
                "topic": self.topic, "replay_count": self.replay_count, "bytes": self.size,
                "expires": self.expires}

    def render(self) -> str:
        e = self.entry
        frame = f"{e.stream}#{e.frame_index}" if e.frame_index is not None else e.stream
        if self.outcome in ("sent", "would send"):
            return (f"{self.outcome:<10} {e.coordinates}  {e.error_type}  {frame}  -> {self.topic}  "
                    f"replay {self.replay_count}  {self.size} B" + ("  (will be EXPIRED)" if self.expires else ""))
        return f"{self.outcome:<10} {e.coordinates}  {e.error_type}  {frame}: {self.reason}"


@dataclass
class ReplayReport:
    dead_letter_topic: str
    dry_run: bool
    items: list[ReplayItem] = field(default_factory=list)
    stopped: str = ""  # why the replay stopped before the end of the selection, if it did

    def count(self, outcome: str) -> int:
        return sum(1 for i in self.items if i.outcome == outcome)

    def skipped_by_reason(self) -> dict[str, int]:
        return dict(Counter(i.reason for i in self.items if i.outcome == "skipped").most_common())

    def to_json(self, with_items: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "dead_letter_topic": self.dead_letter_topic, "ledger_topic": ledger_topic(self.dead_letter_topic),
            "dry_run": self.dry_run, "selected": len(self.items),
            "sent": self.count("would send" if self.dry_run else "sent"), "skipped": self.count("skipped"),
            "failed": self.count("failed"), "skipped_by_reason": self.skipped_by_reason(),
            "expiring": sum(1 for i in self.items if i.expires and i.outcome in ("sent", "would send")),
            "stopped": self.stopped or None}
        if with_items:
            out["items"] = [i.to_json() for i in self.items]
        return out

    def render_totals(self) -> str:
        verb = "would send" if self.dry_run else "sent"
        line = (f"{len(self.items)} dead letters selected in {self.dead_letter_topic}: {verb} "
                f"{self.count('would send' if self.dry_run else 'sent')}, skipped {self.count('skipped')}, "
                f"failed {self.count('failed')}")
        lines = [line] + [f"  skipped, {reason}: {n}" for reason, n in self.skipped_by_reason().items()]
        expiring = sum(1 for i in self.items if i.expires and i.outcome in ("sent", "would send"))
        if expiring:
            lines.append(f"  {expiring} of them are older than their class's batching.<class>.max_age_ms: the worker "
                         "answers them EXPIRED, unscored (replay them with --topic <the bulk topic> to score them)")
        if self.stopped:
            lines.append(f"stopped: {self.stopped}")
        return "\n".join(lines)


# -- reading topics -------------------------------------------------------------------------------------------
def _reader(settings: Settings) -> Consumer:
    return Consumer({**client_properties(settings.kafka), "group.id": READER_GROUP, "enable.auto.commit": False,
                     "isolation.level": "read_committed", "enable.partition.eof": True, "log_level": 3,
                     # Dead letters carry frames: keep what is fetched ahead small.
                     "queued.max.messages.kbytes": 16384})


def read_to_end(settings: Settings, topic: str, since_ms: int | None = None,
                idle_timeout_s: float = READ_IDLE_TIMEOUT_S, missing_ok: bool = False) -> Iterator[Any]:
    """Every committed message of `topic` from the first at or after `since_ms` (all without it) up to the end
    each partition had when the read started. Raises DeadLetterToolError when the topic does not exist (unless
    `missing_ok`) or a partition stops answering."""
    consumer = _reader(settings)
    try:
        md = consumer.list_topics(topic, timeout=30)
        meta = md.topics.get(topic)
        if meta is None or meta.error is not None or not meta.partitions:
            if missing_ok:
                return
            raise DeadLetterToolError(f"topic {topic} does not exist on {settings.kafka.bootstrap_servers}",
                                      setting="topics.dead_letter")
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in meta.partitions}
        if since_ms is None:
            starts = {p: OFFSET_BEGINNING for p in ends}
        else:
            found = consumer.offsets_for_times([TopicPartition(topic, p, since_ms) for p in ends], timeout=30)
            starts = {tp.partition: (tp.offset if tp.offset >= 0 else ends[tp.partition]) for tp in found}
        pending = {p for p, end in ends.items() if end > 0 and (starts[p] == OFFSET_BEGINNING or starts[p] < end)}
        if not pending:
            return
        consumer.assign([TopicPartition(topic, p, starts[p]) for p in sorted(pending)])
        last_progress = time.monotonic()
        while pending:
            msg = consumer.poll(0.5)
            if msg is None:
                if time.monotonic() - last_progress > idle_timeout_s:
                    raise DeadLetterToolError(f"reading {topic}: partitions {sorted(pending)} gave nothing for "
                                              f"{idle_timeout_s:.0f}s before reaching their end")
                continue
            last_progress = time.monotonic()
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    pending.discard(msg.partition())
                    continue
                if err.fatal() or not err.retriable():
                    raise DeadLetterToolError(f"reading {topic}: {err.str()}")
                continue
            partition, offset = msg.partition(), msg.offset() or 0
            if partition not in pending:
                continue
            if offset >= ends[partition] - 1:
                pending.discard(partition)
            if offset < ends[partition]:
                yield msg
    finally:
        consumer.close()


def _headers(msg: Any) -> Headers:
    """A consumed message's headers as a tuple of (name, value) pairs."""
    return tuple(msg.headers() or ())


def entries(settings: Settings, since_ms: int | None = None) -> Iterator[DeadLetterEntry]:
    """The dead letters of topics.dead_letter from `since_ms` on, parsed."""
    topic = settings.topics.dead_letter
    for msg in read_to_end(settings, topic, since_ms):
        _ts_type, ts = msg.timestamp()
        yield parse_entry(topic, msg.partition(), msg.offset(), ts, msg.key(), msg.value(), _headers(msg))


def read_ledger(settings: Settings) -> dict[str, int]:
    """The ledger: dead-letter coordinates -> that dead letter's timestamp, for every dead letter replayed."""
    ledger: dict[str, int] = {}
    for msg in read_to_end(settings, ledger_topic(settings.topics.dead_letter), missing_ok=True):
        if msg.key() is None or not msg.value():
            continue
        try:
            ledger[msg.key().decode()] = int(json.loads(msg.value())["dead_letter_timestamp_ms"])
        except (ValueError, KeyError, TypeError):
            log.warning("ignoring a ledger record that is not one of ours at %s/%d@%d", msg.topic(), msg.partition(),
                        msg.offset())
    return ledger


class RetentionCheck:
    """Whether an input message is still retained: its offset at or above its partition's first offset (asked
    once per partition)."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._consumer: Consumer | None = None
        self._low: dict[tuple[str, int], int] = {}

    def retained(self, source: SourceRef) -> bool:
        tp = source.topic_partition
        if tp not in self._low:
            if self._consumer is None:
                self._consumer = _reader(self._settings)
            try:
                low, high = self._consumer.get_watermark_offsets(TopicPartition(*tp), timeout=30)
            except KafkaException:  # the topic or partition is gone
                low, high = 0, -1
            self._low[tp] = low if high >= 0 else 1 << 62
        return source.offset >= self._low[tp]

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()


class OriginalReader:
    """Reads the frame an OutputRejected dead letter points at from its input topic, while it is retained."""

    def __init__(self, settings: Settings, timeout_s: float = ORIGINAL_READ_TIMEOUT_S) -> None:
        self._consumer = _reader(settings)
        self._timeout_s = timeout_s

    def read(self, source: SourceRef) -> Original | str:
        """The original message, or why it cannot be read (no longer retained, not found)."""
        tp = TopicPartition(source.topic, source.partition)
        try:
            low, high = self._consumer.get_watermark_offsets(tp, timeout=30)
        except KafkaException as exc:
            return f"its input topic cannot be read: {exc.args[0].str()}"
        if source.offset < low:
            return (f"no longer retained: {source.topic}/{source.partition} starts at offset {low} now "
                    f"(retention), the frame was at {source.offset}")
        if source.offset >= high:
            return f"not found: {source.topic}/{source.partition} ends at offset {high}"
        self._consumer.assign([TopicPartition(source.topic, source.partition, source.offset)])
        deadline = time.monotonic() + self._timeout_s
        try:
            while time.monotonic() < deadline:
                msg = self._consumer.poll(0.5)
                if msg is None:
                    continue
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        return f"not found: nothing committed at {source.topic}/{source.partition}@{source.offset}"
                    continue
                if msg.offset() != source.offset:
                    return (f"not found: {source.topic}/{source.partition} has no committed message at offset "
                            f"{source.offset} (compacted, or an aborted transaction's)")
                return Original(msg.key(), msg.value() or b"", _headers(msg))
            return f"not read within {self._timeout_s:.0f}s from {source.topic}/{source.partition}@{source.offset}"
        finally:
            self._consumer.unassign()

    def close(self) -> None:
        self._consumer.close()


# -- show and replay --------------------------------------------------------------------------------------------
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


class _Publisher:
    """One transactional (so idempotent) producer: replayed frames and their ledger records, committed in chunks."""

    def __init__(self, settings: Settings, max_message_bytes: int) -> None:
        dlq = settings.topics.dead_letter
        self.ledger = ledger_topic(dlq)
        conf: dict[str, Any] = {
            **client_properties(settings.kafka), "enable.idempotence": True, "acks": "all",
            # One id per dead-letter topic: a second replay of the same topic fences the first (its open
            # transaction is aborted), so two replays never interleave.
            "transactional.id": f"{settings.delivery.transactional_id_prefix}-dlq-replay.{dlq}",
            "message.max.bytes": max(LIBRDKAFKA_DEFAULT_MESSAGE_MAX_BYTES, max_message_bytes),
            "linger.ms": 5, "log_level": 3}
        conf.update(settings.kafka.producer_overrides)
        self.max_message_bytes = int(conf["message.max.bytes"])
        self._producer = Producer(conf)
        self._producer.init_transactions(TRANSACTION_CALL_TIMEOUT_S)
        self._open = False
        self.pending: list[ReplayItem] = []
        self._bytes = 0

    def add(self, item: ReplayItem, message: ReplayMessage, ledger_key: bytes, ledger_value: bytes) -> None:
        if not self._open:
            self._producer.begin_transaction()
            self._open = True
        replayed: list[tuple[str, str | bytes | None]] = list(message.headers)
        for topic, key, value, headers in ((message.topic, message.key, message.value, replayed),
                                           (self.ledger, ledger_key, ledger_value, None)):
            while True:
                try:
                    self._producer.produce(topic, value=value, key=key, headers=headers)
                    break
                except BufferError:
                    self._producer.poll(0.05)
        self._producer.poll(0)
        self.pending.append(item)
        self._bytes += message.size

    @property
    def chunk_full(self) -> bool:
        return len(self.pending) >= CHUNK_FRAMES or self._bytes >= CHUNK_BYTES

    def commit(self) -> list[ReplayItem]:
        """Commit the open transaction; its items are sent. ReplayFailed (after an abort) when it cannot be."""
        if not self._open:
            return []
        items = self.pending
        self.pending, self._bytes, self._open = [], 0, False
        try:
            self._producer.commit_transaction(TRANSACTION_CALL_TIMEOUT_S)
        except KafkaException as exc:
            reason = exc.args[0].str()
            try:
                self._producer.abort_transaction(TRANSACTION_CALL_TIMEOUT_S)
            except KafkaException as abort_exc:
                reason += f"; the abort failed too ({abort_exc.args[0].str()})"
            raise ReplayFailed(reason, items) from None
        return items

    def close(self) -> None:
        if self._open:
            try:
                self._producer.abort_transaction(TRANSACTION_CALL_TIMEOUT_S)
            except KafkaException as exc:
                log.warning("aborting the open replay transaction failed: %s", exc.args[0].str())
        self._producer.flush(10)


def _admin_properties(settings: Settings) -> dict[str, str]:
    """The security properties, and librdkafka's informational logs off (they would land in the command's output)."""
    return {**security_properties(settings.kafka), "log_level": "3"}


def _ensure_ledger(settings: Settings) -> None:
    """Create the ledger topic (compacted: one record per replayed dead letter) like the dead-letter topic."""
    dlq = settings.topics.dead_letter
    conf: dict[str, Any] = {**client_properties(settings.kafka)}
    md = AdminClient(conf).list_topics(timeout=30)
    if ledger_topic(dlq) in md.topics:
        return
    replicas = len(md.topics[dlq].partitions[0].replicas) if dlq in md.topics and md.topics[dlq].partitions else 1
    try:
        ensure_topics(settings.kafka.bootstrap_servers, [ledger_topic(dlq)], partitions=1, replication=replicas,
                      configs={ledger_topic(dlq): {"cleanup.policy": "compact"}},
                      properties=_admin_properties(settings))
    except KafkaException as exc:
        raise DeadLetterToolError(f"cannot create the replay ledger topic {ledger_topic(dlq)}: {exc.args[0].str()}; "
                                  "create it (cleanup.policy=compact, 1 partition) or grant CREATE on it",
                                  setting=f"topic {ledger_topic(dlq)}") from None


def replay(settings: Settings, selection: Selection, target_topic: str | None = None, dry_run: bool = False,
           limit: int | None = None, now: Callable[[], float] = time.time,
           on_item: Callable[[ReplayItem], None] | None = None) -> ReplayReport:
    """Publish the frames of the selected dead letters again (see the module docstring); `limit`: at most this
    many. `on_item` sees each item as soon as its outcome is known (sent items once their chunk committed)."""
    dlq = settings.topics.dead_letter
    report = ReplayReport(dlq, dry_run)
    selection = replay_selection(selection)
    max_replays = settings.dlq.max_replays
    ledger = read_ledger(settings)
    limits = _TopicLimits(settings)
    originals = OriginalReader(settings)
    publisher: _Publisher | None = None
    sent = 0

    def record(item: ReplayItem) -> None:
        report.items.append(item)
        if on_item is not None:
            on_item(item)

    try:
        for e in entries(settings, selection.since_ms):
            if not selection.matches(e):
                continue
            reason = skip_reason(e, max_replays, target_topic, is_replayed(ledger, e))
            if reason is not None:
                record(ReplayItem(e, "skipped", reason))
                continue
            if limit is not None and sent >= limit:
                report.stopped = f"--limit {limit} reached; the rest of the selection was not looked at"
                break
            assert e.replay_count is not None
            topic = target_topic or e.source.topic  # type: ignore[union-attr]  # skip_reason checked it
            original = None
            if e.reference_only:
                read = originals.read(e.source)  # type: ignore[arg-type]  # skip_reason checked it
                if isinstance(read, str):
                    record(ReplayItem(e, "skipped", f"reference-only, {read}"))
                    continue
                original = read
            message = replay_message(e, topic, original)
            topic_limit = limits.of(topic)
            if message.size + RECORD_HEADROOM_BYTES > topic_limit:
                record(ReplayItem(e, "skipped", f"{message.size} bytes, over max.message.bytes of {topic} "
                                                f"({topic_limit}): raise it (worker topics --max-frame-bytes)"))
                continue
            if publisher is not None and message.size + RECORD_HEADROOM_BYTES > publisher.max_message_bytes:
                record(ReplayItem(e, "skipped", f"{message.size} bytes, over this replay's producer limit "
                                                f"({publisher.max_message_bytes}, the largest of the input topics'): "
                                                f"replay {topic} with --topic {topic}"))
                continue
            item = ReplayItem(e, "would send" if dry_run else "sent", topic=topic, replay_count=e.replay_count + 1,
                              size=message.size, expires=expires(settings, topic, message, now()))
            sent += 1
            if dry_run:
                record(item)
                continue
            if publisher is None:
                _ensure_ledger(settings)
                inputs = [t for t in (*settings.topics.input_topics(), topic) if limits.known(t)]
                publisher = _Publisher(settings, max(limits.of(t) for t in inputs))
            publisher.add(item, message, *ledger_record(e, message, int(now() * 1000)))
            if publisher.chunk_full:
                for done in publisher.commit():
                    record(done)
        if publisher is not None:
            for done in publisher.commit():
                record(done)
    except ReplayFailed as exc:
        report.stopped = f"a replay transaction failed and was aborted: {exc}"
        for item in exc.items:
            record(ReplayItem(item.entry, "failed", str(exc), item.topic, item.replay_count, item.size))
    finally:
        originals.close()
        if publisher is not None:
            publisher.close()
    return report


class _TopicLimits:
    """max.message.bytes of the topics frames are replayed to, asked once per topic."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._known: dict[str, int] = {}

    def of(self, topic: str) -> int:
        if topic not in self._known:
            found = topic_message_limits(self._settings.kafka.bootstrap_servers, [topic],
                                         properties=_admin_properties(self._settings))
            if topic not in found:
                raise DeadLetterToolError(f"cannot describe topic {topic} (missing, or no DESCRIBE_CONFIGS on it): "
                                          "frames are only replayed to topics that exist")
            self._known[topic] = found[topic]
        return self._known[topic]

    def known(self, topic: str) -> bool:
        """The topic's limit can be read (it exists)."""
        try:
            self.of(topic)
            return True
        except DeadLetterToolError:
            return False
