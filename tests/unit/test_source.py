"""FrameSource's handling of a rebalance served inside consume(): librdkafka runs the rebalance callbacks
within the call, so one call can return messages fetched before a partition was revoked together with
messages of its next assignment (confluent-kafka-python issue #1013). The fake consumer below scripts
exactly that interleaving; everything else about the source is tested against the real broker."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
from confluent_kafka import OFFSET_BEGINNING, OFFSET_INVALID, TopicPartition

import worker.source as source_module
from worker.config import Settings
from worker.frames import Encoding, Priority
from worker.schemas import FrameRecord, encode_frame
from worker.source import FrameSource

REALTIME = Settings().topics.realtime
BULK = Settings().topics.bulk


def frame_bytes(offset: int) -> bytes:
    return encode_frame(FrameRecord(stream_id="s", frame_index=offset, capture_ts_ms=int(time.time() * 1000),
                                    tenant="t", priority=Priority.REALTIME, width=2, height=2, channels=3,
                                    encoding=Encoding.RAW_RGB8, data=bytes(12)))


@dataclass
class FakeMessage:
    _topic: str
    _partition: int
    _offset: int

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def value(self) -> bytes:
        return frame_bytes(self._offset)

    def key(self) -> bytes:
        return b"s"

    def error(self) -> None:
        return None


# One consume() call's script: messages returned, and rebalance callbacks run in between, in order.
Event = tuple[str, Any]


@dataclass
class FakeConsumer:
    """Plays scripted consume() calls; records seeks. `committed` is the group's committed offsets."""

    script: list[list[Event]] = field(default_factory=list)
    committed_offsets: dict[tuple[str, int], int] = field(default_factory=dict)
    seeks: list[tuple[str, int, int]] = field(default_factory=list)
    callbacks: dict[str, Callable[..., None]] = field(default_factory=dict)

    def subscribe(self, topics: list[str], on_assign: Callable[..., None], on_revoke: Callable[..., None],
                  on_lost: Callable[..., None]) -> None:
        self.callbacks = {"assign": on_assign, "revoke": on_revoke, "lost": on_lost}

    def consume(self, num_messages: int, timeout: float) -> list[FakeMessage]:
        if not self.script:
            return []
        out: list[FakeMessage] = []
        for kind, arg in self.script.pop(0):
            if kind == "msg":
                out.append(FakeMessage(*arg))
            else:
                self.callbacks[kind](self, [TopicPartition(t, p) for t, p in arg])
        return out

    def committed(self, partitions: list[TopicPartition], timeout: float) -> list[TopicPartition]:
        return [TopicPartition(p.topic, p.partition, self.committed_offsets.get((p.topic, p.partition), OFFSET_INVALID))
                for p in partitions]

    def seek(self, tp: TopicPartition) -> None:
        self.seeks.append((tp.topic, tp.partition, tp.offset))

    def pause(self, partitions: list[TopicPartition]) -> None:
        pass

    def resume(self, partitions: list[TopicPartition]) -> None:
        pass


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeConsumer:
    consumer = FakeConsumer()
    monkeypatch.setattr(source_module, "Consumer", lambda conf, logger=None: consumer)
    return consumer


def make_source() -> tuple[FrameSource, list[tuple[str, list[tuple[str, int]]]]]:
    source = FrameSource(Settings())
    events: list[tuple[str, list[tuple[str, int]]]] = []
    source.subscribe(lambda tps: events.append(("assign", tps)), lambda tps: events.append(("revoke", tps)),
                     lambda tps: events.append(("lost", tps)))
    return source, events


def offsets(polled: Any) -> list[tuple[str, int, int]]:
    return [(f.source.topic, f.source.partition, f.source.offset) for f in polled.frames]


def test_messages_without_a_rebalance_all_come_through_in_order(fake: FakeConsumer) -> None:
    source, _ = make_source()
    fake.script = [[("assign", [(REALTIME, 0)]), ("msg", (REALTIME, 0, 5)), ("msg", (REALTIME, 0, 6))]]
    assert offsets(source.poll(10, 0.0)) == [(REALTIME, 0, 5), (REALTIME, 0, 6)]
    assert fake.seeks == []


def test_a_partition_revoked_and_assigned_back_within_one_call_is_reread_from_its_commit(fake: FakeConsumer) -> None:
    source, events = make_source()
    fake.script = [[("assign", [(REALTIME, 0), (BULK, 1)])]]
    source.poll(10, 0.0)
    # Offsets 5, 6 fetched before the revocation; the new assignment restarts at the committed 3.
    fake.committed_offsets = {(REALTIME, 0): 3}
    fake.script = [[("msg", (REALTIME, 0, 5)), ("msg", (BULK, 1, 40)), ("msg", (REALTIME, 0, 6)),
                    ("revoke", [(REALTIME, 0)]), ("assign", [(REALTIME, 0)]),
                    ("msg", (REALTIME, 0, 3)), ("msg", (REALTIME, 0, 4)), ("msg", (REALTIME, 0, 5))]]
    polled = source.poll(10, 0.0)
    assert offsets(polled) == [(BULK, 1, 40)]  # the untouched partition keeps its messages
    assert fake.seeks == [(REALTIME, 0, 3)]
    assert (REALTIME, 0) in source.assignment
    assert [e for e, _ in events] == ["assign", "revoke", "assign"]


def test_a_partition_revoked_for_good_loses_its_messages_and_is_not_sought(fake: FakeConsumer) -> None:
    source, _ = make_source()
    fake.script = [[("assign", [(REALTIME, 0)])],
                   [("msg", (REALTIME, 0, 5)), ("lost", [(REALTIME, 0)])]]
    source.poll(10, 0.0)
    assert offsets(source.poll(10, 0.0)) == []
    assert fake.seeks == []
    assert source.assignment == frozenset()


def test_with_nothing_committed_the_partition_is_reread_from_its_beginning(fake: FakeConsumer) -> None:
    source, _ = make_source()
    fake.script = [[("assign", [(REALTIME, 0)])],
                   [("msg", (REALTIME, 0, 0)), ("revoke", [(REALTIME, 0)]), ("assign", [(REALTIME, 0)]),
                    ("msg", (REALTIME, 0, 0))]]
    source.poll(10, 0.0)
    assert offsets(source.poll(10, 0.0)) == []
    assert fake.seeks == [(REALTIME, 0, OFFSET_BEGINNING)]


def test_a_rebalance_in_the_blocking_call_also_drops_the_earlier_calls_messages(fake: FakeConsumer) -> None:
    """poll() may call consume() up to three times; a revocation in a later call taints the whole poll."""
    source, _ = make_source()
    fake.script = [[("assign", [(REALTIME, 0)])]]
    source.poll(10, 0.0)
    fake.committed_offsets = {(REALTIME, 0): 1}
    fake.script = [[],  # nothing queued: poll blocks for one message
                   [("msg", (REALTIME, 0, 1))],
                   [("revoke", [(REALTIME, 0)]), ("assign", [(REALTIME, 0)]), ("msg", (REALTIME, 0, 1))]]
    assert offsets(source.poll(10, 1.0)) == []
    assert fake.seeks == [(REALTIME, 0, 1)]


def test_offsets_delivered_again_within_an_assignment_are_dropped(fake: FakeConsumer) -> None:
    """A rewind the worker did not ask for (librdkafka after pause/resume) re-delivers offsets already read."""
    source, _ = make_source()
    fake.script = [[("assign", [(BULK, 2)]), ("msg", (BULK, 2, 56)), ("msg", (BULK, 2, 57))],
                   [("msg", (BULK, 2, 0)), ("msg", (BULK, 2, 57)), ("msg", (BULK, 2, 58))]]
    assert offsets(source.poll(10, 0.0)) == [(BULK, 2, 56), (BULK, 2, 57)]
    polled = source.poll(10, 0.0)
    assert offsets(polled) == [(BULK, 2, 58)] and polled.redelivered == 2


def test_a_seek_or_a_new_assignment_accepts_lower_offsets_again(fake: FakeConsumer) -> None:
    source, _ = make_source()
    fake.committed_offsets = {(BULK, 2): 10}
    fake.script = [[("assign", [(BULK, 2)]), ("msg", (BULK, 2, 20))],
                   [("msg", (BULK, 2, 10))],  # after the rewind below
                   [("revoke", [(BULK, 2)])],
                   [("assign", [(BULK, 2)]), ("msg", (BULK, 2, 11))]]
    source.poll(10, 0.0)
    source.seek_to_committed([(BULK, 2)])  # the pipeline's rewind after an aborted transaction
    assert offsets(source.poll(10, 0.0)) == [(BULK, 2, 10)]
    source.poll(10, 0.0)
    assert offsets(source.poll(10, 0.0)) == [(BULK, 2, 11)]
