"""`worker dlq replay`: publish dead-lettered frames again once their cause (a model, a setting, a topic limit) is
fixed.

Each selected frame goes to its source topic (or `--topic`) with its key and its own headers plus a replay marker
(`streamfer.replay_count`, `streamfer.replayed_from`). In the same transaction each replayed dead letter is recorded
in the ledger topic `<topics.dead_letter>.replayed`, so a dead letter is replayed at most once, a replay cut short
leaves each chunk either all published and recorded or not at all, and a frame already replayed `dlq.max_replays`
times is left where it is. See docs/operations.md.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from worker.codec.schemas import MessageDecodeError, read_frame_record
from worker.config import Settings
from worker.errors import StreamferError
from worker.frames import (
    DEAD_LETTER_HEADERS,
    HEADER_REPLAY_COUNT,
    HEADER_REPLAYED_FROM,
    HEADER_SOURCE_TOPIC,
    REPLAY_HEADERS,
    Headers,
    SourceRef,
)
from worker.kafka.roles import (
    LIBRDKAFKA_DEFAULT_MESSAGE_MAX_BYTES,
    RECORD_FRAMING_HEADROOM_BYTES,
    admin_client,
    dead_letter_reader,
    transactional_producer,
)
from worker.kafka.topics import ensure_topics, topic_message_limits
from worker.tools.dlq.entries import (
    REPLAY_TRANSACTION_TIMEOUT_MS,
    DeadLetterEntry,
    DeadLetterToolError,
    Selection,
    entries,
    is_replayed,
    iso_ms,
    ledger_topic,
    message_headers,
    read_ledger,
    replay_selection,
)

log = logging.getLogger(__name__)

# A dead letter of an OutputRejected output: how long reading its original frame from the input topic may take.
ORIGINAL_READ_TIMEOUT_S = 10.0
# One replay transaction: at most this many frames or bytes (well inside the default transaction.timeout.ms).
CHUNK_FRAMES = 500
CHUNK_BYTES = 32 * 1024 * 1024
TRANSACTION_CALL_TIMEOUT_S = 60.0


# `worker dlq replay`'s exit code when a replay transaction failed (what it held was not published).
EXIT_REPLAY_FAILED = 1


class ReplayFailed(StreamferError):
    """A replay transaction failed and was aborted: its `items` were not published; earlier chunks' were."""

    def __init__(self, message: str, items: list[ReplayItem]) -> None:
        super().__init__(message)
        self.items = items


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


def ledger_record(e: DeadLetterEntry, message: ReplayMessage, now_ms: int) -> tuple[bytes, bytes]:
    """Key and value of the ledger record that says `e` was replayed (compacted: one record per dead letter)."""
    value = {"dead_letter_timestamp_ms": e.timestamp_ms, "replayed_to": message.topic,
             "replay_count": (e.replay_count or 0) + 1, "replayed_at": iso_ms(now_ms)}
    return e.coordinates.encode(), json.dumps(value, sort_keys=True).encode()


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


# -- replay: reading originals and publishing -----------------------------------------------------------------
class OriginalReader:
    """Reads the frame an OutputRejected dead letter points at from its input topic, while it is retained."""

    def __init__(self, settings: Settings, timeout_s: float = ORIGINAL_READ_TIMEOUT_S) -> None:
        self._consumer = dead_letter_reader(settings.kafka)
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
                return Original(msg.key(), msg.value() or b"", message_headers(msg))
            return f"not read within {self._timeout_s:.0f}s from {source.topic}/{source.partition}@{source.offset}"
        finally:
            self._consumer.unassign()

    def close(self) -> None:
        self._consumer.close()


class _Publisher:
    """One transactional (so idempotent) producer: replayed frames and their ledger records, committed in chunks."""

    def __init__(self, settings: Settings, max_message_bytes: int) -> None:
        dlq = settings.topics.dead_letter
        self.ledger = ledger_topic(dlq)
        record_limit = max(LIBRDKAFKA_DEFAULT_MESSAGE_MAX_BYTES, max_message_bytes)
        # One id per dead-letter topic: a second replay of the same topic fences the first (its open transaction
        # is aborted), and does so before it reads the ledger (replay()), so two replays never interleave.
        self._producer = transactional_producer(
            settings.kafka, f"{settings.delivery.transactional_id_prefix}-dlq-replay.{dlq}", "streamfer-dlq-replay",
            REPLAY_TRANSACTION_TIMEOUT_MS, record_limit)
        # The largest message (key, value and headers) the producer takes: the record limit less the framing.
        self.max_message_bytes = record_limit - RECORD_FRAMING_HEADROOM_BYTES
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


def _ensure_ledger(settings: Settings) -> None:
    """Create the ledger topic (compacted: one record per replayed dead letter) like the dead-letter topic."""
    dlq = settings.topics.dead_letter
    md = admin_client(settings.kafka).list_topics(timeout=30)
    if ledger_topic(dlq) in md.topics:
        return
    replicas = len(md.topics[dlq].partitions[0].replicas) if dlq in md.topics and md.topics[dlq].partitions else 1
    try:
        ensure_topics(settings.kafka, [ledger_topic(dlq)], partitions=1, replication=replicas,
                      configs={ledger_topic(dlq): {"cleanup.policy": "compact"}})
    except KafkaException as exc:
        raise DeadLetterToolError(f"cannot create the replay ledger topic {ledger_topic(dlq)}: {exc.args[0].str()}; "
                                  "create it (cleanup.policy=compact, 1 partition) or grant CREATE on it",
                                  setting=f"topic {ledger_topic(dlq)}") from None


def _fencing_publisher(settings: Settings, limits: _TopicLimits, target_topic: str | None) -> _Publisher:
    """The replay's transactional producer, which fences a replay of the same dead-letter topic still running; its
    message limit the largest of the input topics' (and the target's)."""
    _ensure_ledger(settings)
    inputs = [t for t in (*settings.topics.input_topics(), *((target_topic,) if target_topic else ()))
              if limits.known(t)]
    return _Publisher(settings, max((limits.of(t) for t in inputs), default=0))


def replay(settings: Settings, selection: Selection, target_topic: str | None = None, dry_run: bool = False,
           limit: int | None = None, now: Callable[[], float] = time.time,
           on_item: Callable[[ReplayItem], None] | None = None) -> ReplayReport:
    """Publish the frames of the selected dead letters again (see the module docstring); `limit`: at most this
    many. `on_item` sees each item as soon as its outcome is known (sent items once their chunk committed)."""
    dlq = settings.topics.dead_letter
    report = ReplayReport(dlq, dry_run)
    selection = replay_selection(selection)
    max_replays = settings.dlq.max_replays
    limits = _TopicLimits(settings)
    # Fence any replay of this topic still running before reading the ledger: its open chunk is aborted and it
    # commits no more, so the ledger read next holds everything it replayed (read first, a chunk it committed
    # meanwhile would be missed and its dead letters replayed twice). A dry run fences nobody.
    publisher = None if dry_run else _fencing_publisher(settings, limits, target_topic)
    try:
        ledger = read_ledger(settings)
        originals = OriginalReader(settings)
    except BaseException:
        if publisher is not None:
            publisher.close()
        raise
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
            if message.size + RECORD_FRAMING_HEADROOM_BYTES > topic_limit:
                record(ReplayItem(e, "skipped", f"{message.size} bytes, over max.message.bytes of {topic} "
                                                f"({topic_limit}): raise it (worker topics --max-frame-bytes)"))
                continue
            if publisher is not None and message.size > publisher.max_message_bytes:
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
            assert publisher is not None  # made above for every run that is not a dry one
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
            found = topic_message_limits(self._settings.kafka, [topic])
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
