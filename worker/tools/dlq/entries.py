"""The dead letters as the tools read them: one dead letter parsed (`DeadLetterEntry`), which ones a command
selects, reading a topic as it stood when the command started (read_committed, no group joined), the replay
ledger's records and whether an input message is still retained. Shared by `worker dlq show` and `replay`.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from worker.codec.schemas import MessageDecodeError, read_frame_record
from worker.config import Settings
from worker.errors import OperatorError
from worker.frames import (
    DEAD_LETTER_HEADERS,
    DUPLICATE_FRAME,
    HEADER_ERROR,
    HEADER_ERROR_TYPE,
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
from worker.kafka.roles import dead_letter_reader, uncommitted_end_reader

log = logging.getLogger(__name__)

LEDGER_SUFFIX = ".replayed"
# How long a read may go without a message or an end-of-partition event before it is given up as stuck.
READ_IDLE_TIMEOUT_S = 30.0
# How long the broker lets a replay transaction stay open (librdkafka's default): a chunk's reads of original
# frames (up to replay.ORIGINAL_READ_TIMEOUT_S each) happen inside it.
REPLAY_TRANSACTION_TIMEOUT_MS = 60_000
# How long reading the ledger waits for a transaction on it to complete: a replay's times out, and the broker
# aborts it within its 10 s sweep (transaction.abort.timed.out.transaction.cleanup.interval.ms); a margin on top.
LEDGER_SETTLE_TIMEOUT_S = REPLAY_TRANSACTION_TIMEOUT_MS / 1000 + 30
DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)$")
UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


class DeadLetterToolError(OperatorError):
    """The dead-letter tools cannot do what was asked (a topic missing, a read stuck, a replay refused)."""


# -- time -----------------------------------------------------------------------------------------------------
def parse_duration_ms(text: str) -> int:
    """'90s', '15m', '2h', '1d', '250ms' -> milliseconds; ValueError otherwise."""
    m = DURATION.match(text.strip())
    if not m:
        raise ValueError(f"{text!r} is not a duration: use a number and one of ms, s, m, h, d (e.g. 15m, 2h)")
    ms = int(float(m.group(1)) * UNIT_MS[m.group(2)])
    if ms <= 0:
        raise ValueError(f"{text!r}: a duration must be positive")
    return ms


def parse_time_ms(text: str, now_ms: int) -> int:
    """A point in time: a duration ago ('2h': two hours before now) or an ISO 8601 time (UTC unless it says)."""
    text = text.strip()
    if DURATION.match(text):
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


def ledger_topic(dead_letter_topic: str) -> str:
    return dead_letter_topic + LEDGER_SUFFIX


def is_replayed(ledger: dict[str, int], e: DeadLetterEntry) -> bool:
    """The ledger names this dead letter: same coordinates and timestamp (so a recreated topic's offsets that
    happen to match an old record do not count)."""
    return ledger.get(e.coordinates) == e.timestamp_ms


# -- reading topics -------------------------------------------------------------------------------------------
def read_to_end(settings: Settings, topic: str, since_ms: int | None = None,
                idle_timeout_s: float = READ_IDLE_TIMEOUT_S, missing_ok: bool = False,
                settle_timeout_s: float | None = None) -> Iterator[Any]:
    """Every committed message of `topic` from the first at or after `since_ms` (all without it) up to the end
    each partition had when the read started; with `settle_timeout_s`, up to where its records ended then, once
    the transactions open there have completed (see `settled_ends`). Raises DeadLetterToolError when the topic
    does not exist (unless `missing_ok`), a partition stops answering or a transaction does not complete."""
    consumer = dead_letter_reader(settings.kafka)
    try:
        md = consumer.list_topics(topic, timeout=30)
        meta = md.topics.get(topic)
        if meta is None or meta.error is not None or not meta.partitions:
            if missing_ok:
                return
            raise DeadLetterToolError(f"topic {topic} does not exist on {settings.kafka.bootstrap_servers}",
                                      setting="topics.dead_letter")
        if settle_timeout_s is None:
            ends = committed_ends(consumer, topic, meta.partitions)
        else:
            ends = settled_ends(settings, consumer, topic, meta.partitions, settle_timeout_s)
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


def committed_ends(consumer: Consumer, topic: str, partitions: Iterable[int]) -> dict[int, int]:
    """Each partition's end as a read_committed consumer sees it: the last stable offset (librdkafka's
    get_watermark_offsets honours isolation.level), below the first record of any transaction not yet completed."""
    return {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in partitions}


def settled_ends(settings: Settings, consumer: Consumer, topic: str, partitions: Iterable[int],
                 timeout_s: float) -> dict[int, int]:
    """The read_committed ends once they reach each partition's high watermark as it is now, so every record
    written so far is decided. Kafka acknowledges a commit once the coordinator has logged it, before the commit
    markers reach the partitions: a read_committed reader that starts right after (the next `dlq replay` reading
    the ledger) would otherwise stop below the just-committed records, as it would below an open transaction's."""
    partitions = sorted(partitions)
    probe = uncommitted_end_reader(settings.kafka)
    try:
        written = {p: probe.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in partitions}
    finally:
        probe.close()
    deadline = time.monotonic() + timeout_s
    pause_s, waiting = 0.005, False
    while True:
        ends = committed_ends(consumer, topic, partitions)
        open_at = {p: ends[p] for p in partitions if ends[p] < written[p]}
        if not open_at:
            return ends
        if time.monotonic() >= deadline:
            where = ", ".join(f"partition {p} from offset {o}" for p, o in open_at.items())
            raise DeadLetterToolError(
                f"reading {topic}: a transaction on it ({where}) is still open after {timeout_s:g}s, longer than a "
                f"replay's may stay open ({REPLAY_TRANSACTION_TIMEOUT_MS // 1000} s): a producer other than "
                "`worker dlq replay` writes to it with a longer transaction.timeout.ms. Stop that producer or wait "
                "until the broker aborts its transaction, then run again")
        if not waiting:
            waiting = True
            log.info("waiting for a transaction on %s to complete (%s)", topic,
                     ", ".join(f"partition {p}: committed to {ends[p]}, written to {written[p]}" for p in open_at))
        time.sleep(pause_s)
        pause_s = min(pause_s * 2, 0.5)


def message_headers(msg: Any) -> Headers:
    """A consumed message's headers as a tuple of (name, value) pairs."""
    return tuple(msg.headers() or ())


def entries(settings: Settings, since_ms: int | None = None) -> Iterator[DeadLetterEntry]:
    """The dead letters of topics.dead_letter from `since_ms` on, parsed."""
    topic = settings.topics.dead_letter
    for msg in read_to_end(settings, topic, since_ms):
        _ts_type, ts = msg.timestamp()
        yield parse_entry(topic, msg.partition(), msg.offset(), ts, msg.key(), msg.value(), message_headers(msg))


def read_ledger(settings: Settings, settle_timeout_s: float = LEDGER_SETTLE_TIMEOUT_S) -> dict[str, int]:
    """The ledger: dead-letter coordinates -> that dead letter's timestamp, for every dead letter replayed,
    including a replay whose commit is still completing or whose transaction is open (waited for, up to
    `settle_timeout_s`): stopping short of its records would replay its dead letters again."""
    ledger: dict[str, int] = {}
    for msg in read_to_end(settings, ledger_topic(settings.topics.dead_letter), missing_ok=True,
                           settle_timeout_s=settle_timeout_s):
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
                self._consumer = dead_letter_reader(self._settings.kafka)
            try:
                low, high = self._consumer.get_watermark_offsets(TopicPartition(*tp), timeout=30)
            except KafkaException:  # the topic or partition is gone
                low, high = 0, -1
            self._low[tp] = low if high >= 0 else 1 << 62
        return source.offset >= self._low[tp]

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
