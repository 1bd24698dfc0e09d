"""Helpers for integration tests: unique topics per test, worker processes, and the verifier's ledger."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
import uuid
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

from worker.frames import Priority
from worker.topics import ensure_topics


@dataclass(frozen=True)
class TestTopics:
    realtime: str
    standard: str
    bulk: str
    results: str
    dead_letter: str
    group: str

    @property
    def inputs(self) -> list[str]:
        return [self.realtime, self.standard, self.bulk]

    def for_priority(self, priority: Priority) -> str:
        return {Priority.REALTIME: self.realtime, Priority.STANDARD: self.standard, Priority.BULK: self.bulk}[priority]

    def priority_of(self) -> dict[str, Priority]:
        return {self.realtime: Priority.REALTIME, self.standard: Priority.STANDARD, self.bulk: Priority.BULK}

    def env(self) -> dict[str, str]:
        return {
            "WORKER_TOPICS_REALTIME": self.realtime, "WORKER_TOPICS_STANDARD": self.standard,
            "WORKER_TOPICS_BULK": self.bulk, "WORKER_TOPICS_RESULTS": self.results,
            "WORKER_TOPICS_DEAD_LETTER": self.dead_letter, "WORKER_KAFKA_GROUP_ID": self.group,
        }

    def overrides(self) -> dict[str, dict[str, Any]]:
        return {"topics": {"realtime": self.realtime, "standard": self.standard, "bulk": self.bulk,
                           "results": self.results, "dead_letter": self.dead_letter},
                "kafka": {"group_id": self.group}}


def make_topics(bootstrap: str, unique: str, partitions: int = 3, replication: int = 1) -> TestTopics:
    t = TestTopics(realtime=f"t{unique}.realtime", standard=f"t{unique}.standard", bulk=f"t{unique}.bulk",
                   results=f"t{unique}.results", dead_letter=f"t{unique}.dlq", group=f"g{unique}")
    ensure_topics(bootstrap, [t.realtime, t.standard, t.bulk, t.results, t.dead_letter], partitions, replication)
    return t


def start_worker(bootstrap: str, topics: TestTopics, extra_env: dict[str, str] | None = None,
                 exit_when_idle: float | None = None, worker_id: str | None = "w0",
                 log_path: str | None = None) -> subprocess.Popen:
    """A `worker run` process with the test's topics; small batching waits keep tests quick.

    `worker_id` None leaves the worker its default id (`<hostname>-<pid>`: a new transactional id per process)."""
    env = dict(os.environ)
    env.update(topics.env())
    env.pop("WORKER_OBSERVABILITY_WORKER_ID", None)
    if worker_id is not None:
        env["WORKER_OBSERVABILITY_WORKER_ID"] = worker_id
    env.update({"WORKER_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
                "WORKER_OBSERVABILITY_METRICS_PORT": "0", "WORKER_RUNTIME_TORCH_THREADS": "1",
                "WORKER_RUNTIME_WARMUP_BATCHES": "1", "WORKER_KAFKA_SESSION_TIMEOUT_MS": "6000",
                "WORKER_KAFKA_MAX_POLL_INTERVAL_MS": "60000",
                # Tests publish backlogs before the worker starts; expiry has tests of its own.
                "WORKER_BATCHING_REALTIME_MAX_AGE_MS": "0", "WORKER_BATCHING_STANDARD_MAX_AGE_MS": "0"})
    env.update(extra_env or {})
    argv = [sys.executable, "-m", "worker", "run"]
    if exit_when_idle is not None:
        argv += ["--exit-when-idle", str(exit_when_idle)]
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT if log_path else subprocess.DEVNULL)


def committed_offsets(bootstrap: str, group: str, topics: list[str]) -> dict[tuple[str, int], int]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        md = consumer.list_topics(timeout=10)
        tps = [TopicPartition(t, p) for t in topics for p in md.topics[t].partitions]
        return {(tp.topic, tp.partition): tp.offset for tp in consumer.committed(tps, timeout=10)}
    finally:
        consumer.close()


def end_offsets(bootstrap: str, topics: list[str]) -> dict[tuple[str, int], int]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "offsets-probe"})
    try:
        md = consumer.list_topics(timeout=10)
        out = {}
        for t in topics:
            for p in md.topics[t].partitions:
                out[(t, p)] = consumer.get_watermark_offsets(TopicPartition(t, p), timeout=10)[1]
        return out
    finally:
        consumer.close()


def uncommitted(bootstrap: str, group: str, topics: list[str]) -> dict[tuple[str, int], tuple[int, int]]:
    """Partitions whose committed offset is not their end offset: {tp: (committed, end)}.

    An empty partition has nothing to commit, so "no committed offset" counts as at its end (0)."""
    committed = committed_offsets(bootstrap, group, topics)
    ends = end_offsets(bootstrap, topics)
    return {tp: (committed.get(tp, -1), end) for tp, end in ends.items()
            if not (committed.get(tp, -1) == end or (end == 0 and committed.get(tp, -1) < 0))}


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


def http_get(port: int, path: str) -> tuple[int, str]:
    """Status and body of a GET on the worker's metrics port; (0, "") while nothing listens."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.2) -> None:
    """Poll a condition until it holds; fail with `what` after the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def ledger(results: list[dict[str, Any]]) -> Counter:
    """How many results each frame id got."""
    return Counter((r["stream_id"], r["frame_index"]) for r in results)
