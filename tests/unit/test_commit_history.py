"""The verifier's reading of a group's commit history from __consumer_offsets (tests/integration/helpers.py): the
records are Kafka's internal format, so decode them against hand-built bytes of each record version."""

from __future__ import annotations

import struct

from tests.integration.helpers import _decode_offset_commit, offsets_moved_backwards, offsets_topic_partition


def string(value: str) -> bytes:
    return struct.pack(">h", len(value)) + value.encode()


def key(record_type: int, group: str, topic: str, partition: int) -> bytes:
    return struct.pack(">h", record_type) + string(group) + string(topic) + struct.pack(">i", partition)


def test_an_offset_commit_is_decoded_whatever_its_value_version() -> None:
    k = key(1, "g1", "frames.bulk", 2)
    v1 = struct.pack(">hq", 1, 219) + string("") + struct.pack(">qq", 1, -1)  # with an expire timestamp
    v3 = struct.pack(">hqi", 3, 148, 0) + string("") + struct.pack(">q", 1)  # with a leader epoch
    v4 = struct.pack(">hqi", 4, 7, 0) + b"\x01" + struct.pack(">q", 1) + b"\x00"  # flexible: compact string, tags
    assert _decode_offset_commit(k, v1) == ("g1", "frames.bulk", 2, 219)
    assert _decode_offset_commit(k, v3) == ("g1", "frames.bulk", 2, 148)
    assert _decode_offset_commit(k, v4) == ("g1", "frames.bulk", 2, 7)


def test_group_metadata_records_and_tombstones_are_not_commits() -> None:
    assert _decode_offset_commit(struct.pack(">h", 2) + string("g1"), b"\x00\x03" + bytes(20)) is None
    assert _decode_offset_commit(key(1, "g1", "t", 0), None) is None


def test_a_committed_offset_moving_back_is_reported() -> None:
    history = {("t", 0): [10, 219, 148, 300], ("t", 1): [5, 5, 9]}
    assert offsets_moved_backwards(history) == ["('t', 0): 219 then 148"]


def test_a_groups_offsets_partition_is_kafkas_abs_hash_modulo() -> None:
    # Java: "abc".hashCode() == 96354; "polygenelubricants".hashCode() == Integer.MIN_VALUE (abs is then 0).
    assert offsets_topic_partition("abc", 50) == 96354 % 50
    assert offsets_topic_partition("polygenelubricants", 50) == 0
