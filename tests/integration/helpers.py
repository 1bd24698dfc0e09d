"""Helpers for integration tests: unique topics per test, worker processes, and the verifier's ledger.

They live in worker/testing/ (the test kit users get too); the names stay importable from here."""

from __future__ import annotations

import struct
import time
import uuid

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

from worker.testing import (
    TestTopics,
    committed_offsets,
    end_offsets,
    http_get,
    ledger,
    make_topics,
    start_worker,
    uncommitted,
    wait_for,
)

__all__ = [
    "OFFSETS_TOPIC",
    "TestTopics",
    "committed_offsets",
    "end_offsets",
    "group_commit_history",
    "http_get",
    "ledger",
    "make_topics",
    "offsets_moved_backwards",
    "offsets_topic_partition",
    "start_worker",
    "uncommitted",
    "wait_for",
]


OFFSETS_TOPIC = "__consumer_offsets"


def offsets_topic_partition(group: str, partitions: int) -> int:
    """The __consumer_offsets partition holding a group's commits: Kafka's abs(group.hashCode()) % partitions."""
    h = 0
    for unit in struct.unpack(f">{len(group.encode('utf-16-be')) // 2}H", group.encode("utf-16-be")):
        h = (31 * h + unit) & 0xFFFFFFFF
    h = h - (1 << 32) if h >= 1 << 31 else h
    return (0 if h == -(1 << 31) else abs(h)) % partitions


def group_commit_history(bootstrap: str, group: str, timeout_s: float = 60.0) -> dict[tuple[str, int], list[int]]:
    """Every offset the group committed, per partition, in commit order, read from __consumer_offsets.

    read_committed, so offsets sent in transactions that were aborted are left out, as the broker leaves them
    out of the group's committed offsets. Complete, unlike sampling committed(): a commit that moved an offset
    back and a later one that moved it forward again both show. Only the offset is decoded (the first field of
    every OffsetCommitValue version); keys of other record types (group metadata) are skipped. Compaction could
    drop old commits of a key, but the log cleaner never touches the active segment, which holds a short run."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"history-{uuid.uuid4().hex[:8]}",
                         "enable.auto.commit": False, "isolation.level": "read_committed",
                         "enable.partition.eof": True, "log_level": 0})
    history: dict[tuple[str, int], list[int]] = {}
    try:
        md = consumer.list_topics(OFFSETS_TOPIC, timeout=10)
        partition = offsets_topic_partition(group, len(md.topics[OFFSETS_TOPIC].partitions))
        consumer.assign([TopicPartition(OFFSETS_TOPIC, partition, OFFSET_BEGINNING)])
        deadline = time.monotonic() + timeout_s
        while True:
            if time.monotonic() > deadline:
                raise AssertionError(f"could not read {OFFSETS_TOPIC} [{partition}] to its end in {timeout_s}s")
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            if msg.error() is not None:
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    return history
                continue
            commit = _decode_offset_commit(msg.key(), msg.value())
            if commit is not None and commit[0] == group:
                history.setdefault((commit[1], commit[2]), []).append(commit[3])
    finally:
        consumer.close()


def _decode_offset_commit(key: bytes | None, value: bytes | None) -> tuple[str, str, int, int] | None:
    """(group, topic, partition, offset) of an offset-commit record; None for other records and tombstones."""
    if not key or len(key) < 2 or value is None or len(value) < 10:
        return None
    (record_type,) = struct.unpack_from(">h", key, 0)
    if record_type not in (0, 1):  # 0 and 1: OffsetCommitKey; 2 and above: group metadata and the like
        return None
    pos = 2
    names = []
    for _ in range(2):  # group, topic: int16 length + UTF-8
        (length,) = struct.unpack_from(">h", key, pos)
        names.append(key[pos + 2:pos + 2 + length].decode())
        pos += 2 + length
    (partition,) = struct.unpack_from(">i", key, pos)
    (offset,) = struct.unpack_from(">q", value, 2)  # after the int16 value version
    return names[0], names[1], partition, offset


def offsets_moved_backwards(history: dict[tuple[str, int], list[int]]) -> list[str]:
    """Each commit that moved a partition's committed offset below the one before it."""
    return [f"{tp}: {before} then {after}" for tp, offsets in sorted(history.items())
            for before, after in zip(offsets, offsets[1:]) if after < before]
