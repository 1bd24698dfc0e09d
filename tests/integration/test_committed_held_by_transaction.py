"""A committed offset held by a dead member's open transaction is "not known yet", never "nothing committed".

The group commits offset N of a partition; a transactional producer sends offset M > N for the group in a
transaction and is SIGKILLed with it open. Until the broker aborts it (`transaction.timeout.ms`), the group's
committed offset of that partition cannot be read (KIP-447: a read_committed consumer asks for stable offsets).
Whoever reads the partition then must wait and read from N, never from its beginning (issue 13: partitions re-read
from 0, a second result for each frame already committed):
- a FrameSource asked to seek to the committed offset (the pipeline's rewind after an aborted transaction, or a
  rebalance inside one poll);
- a FrameSource newly assigned the partition while the assignment changes again: librdkafka 2.16 then starts the
  partition at "no committed offset", i.e. at auto.offset.reset (its beginning).
"""

from __future__ import annotations

import select
import subprocess
import sys
from collections.abc import Callable

import pytest
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

from worker.codec.schemas import encode_frame
from worker.config import load_settings
from worker.frames import Encoding, Priority
from worker.kafka.consumer import FrameSource
from worker.tools.publish_frames import synthetic_frames

from .helpers import TestTopics as Topics
from .helpers import group_commit_history, make_topics, offsets_moved_backwards, wait_for

pytestmark = pytest.mark.integration

FRAMES = 40
COMMITTED = 10  # N: what the group commits normally
PENDING = 30  # M: what the dead transaction sends for the group
# Longer than the old FrameSource's 10 s look-up, so a rewind cannot simply outwait the transaction.
TRANSACTION_TIMEOUT_MS = 20_000

# A transaction that adds offset M for the group, with a live member's group metadata (so the broker accepts it);
# it says so and waits to be killed.
DEAD_TRANSACTION = """
import sys, time
from confluent_kafka import Producer, TopicPartition
bootstrap, txn_id, topic, offset, metadata = sys.argv[1:6]
p = Producer({"bootstrap.servers": bootstrap, "transactional.id": txn_id, "transaction.timeout.ms": TIMEOUT_MS})
p.init_transactions(30)
p.begin_transaction()
p.send_offsets_to_transaction([TopicPartition(topic, 0, int(offset))], bytes.fromhex(metadata), 30)
print("pending", flush=True)
time.sleep(3600)
""".replace("TIMEOUT_MS", str(TRANSACTION_TIMEOUT_MS))

# An exactly-once member of the group: owns the partition, commits N, adds M in a transaction, and waits to be
# killed (polling, so it stays in the group until then).
DEAD_MEMBER = """
import sys
from confluent_kafka import Consumer, Producer, TopicPartition
bootstrap, txn_id, topic, offset, group, committed = sys.argv[1:7]
c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False,
              "session.timeout.ms": 6000, "partition.assignment.strategy": "cooperative-sticky"})
c.subscribe([topic])
while not c.assignment():
    c.poll(0.1)
c.commit(offsets=[TopicPartition(topic, 0, int(committed))], asynchronous=False)
p = Producer({"bootstrap.servers": bootstrap, "transactional.id": txn_id, "transaction.timeout.ms": TIMEOUT_MS})
p.init_transactions(30)
p.begin_transaction()
p.send_offsets_to_transaction([TopicPartition(topic, 0, int(offset))], c.consumer_group_metadata(), 30)
print("pending", flush=True)
while True:
    c.poll(0.1)
""".replace("TIMEOUT_MS", str(TRANSACTION_TIMEOUT_MS))


def publish_frames(bootstrap: str, topic: str, count: int) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for record in synthetic_frames(count, [(8, 8)], Encoding.RAW_RGB8, Priority.REALTIME, "held"):
        producer.produce(topic, value=encode_frame(record), partition=0)
    assert producer.flush(30) == 0


def committed_is_readable(bootstrap: str, group: str, tp: tuple[str, int]) -> bool:
    """Whether a read_committed client (asking for stable offsets, as the worker does) can read it now."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "isolation.level": "read_committed",
                         "log_level": 0})
    try:
        (answer,) = consumer.committed([TopicPartition(*tp)], timeout=2)
        return answer.error is None
    except KafkaException:  # timed out: librdkafka keeps asking while the offset is unstable
        return False
    finally:
        consumer.close()


def kill_after_pending(script: str, *args: str) -> None:
    """Run a helper until it has sent its offsets in a transaction, then SIGKILL it with the transaction open."""
    proc = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline() if ready else b""
    proc.kill()
    proc.wait(10)
    assert line.strip() == b"pending", f"the transactional helper did not send its offsets (said {line!r})"


def make_source(bootstrap: str, topics: Topics, worker_id: str) -> FrameSource:
    overrides = topics.overrides()
    overrides["kafka"].update(bootstrap_servers=bootstrap, session_timeout_ms=6000)
    overrides["observability"] = {"worker_id": worker_id, "metrics_enabled": False}
    source = FrameSource(load_settings(env={}, overrides=overrides))
    source.subscribe(lambda tps: None, lambda tps, commits: None, lambda tps: None)
    return source


def read_after_hold(bootstrap: str, topics: Topics, source: FrameSource, delivered: list[int],
                    poll: Callable[[], None]) -> None:
    """Poll until the partition is read again and read to its end; check what was read and what was committed."""
    tp = (topics.realtime, 0)
    wait_for(lambda: (poll(), bool(delivered))[1], TRANSACTION_TIMEOUT_MS / 1000 + 50,
             "reading the partition once the broker aborted the dead transaction")
    # Nothing may be read before the committed offset is known, i.e. before the dead transaction ended.
    readable_at_first_read = committed_is_readable(bootstrap, topics.group, tp)
    # Read up to the end, so a re-read from below N would show.
    wait_for(lambda: (poll(), delivered[-1] >= FRAMES - 1)[1], 30, "the rest of the frames")
    assert min(delivered) >= COMMITTED, f"re-read from offset {min(delivered)}, below the committed {COMMITTED}"
    assert delivered[0] == COMMITTED, f"read from {delivered[0]}, not from the committed {COMMITTED}"
    assert readable_at_first_read, "read while the dead transaction still held the committed offset"
    history = group_commit_history(bootstrap, topics.group)
    assert history.get(tp, [])[-1:] == [COMMITTED], f"the aborted offset {PENDING} became committed: {history}"
    assert offsets_moved_backwards(history) == []


def test_a_rewind_while_a_dead_transaction_holds_the_committed_offset_waits_and_reads_from_it(
        kafka_bootstrap: str, unique: str) -> None:
    topics = make_topics(kafka_bootstrap, unique, partitions=1)
    tp = (topics.realtime, 0)
    publish_frames(kafka_bootstrap, topics.realtime, FRAMES)
    source = make_source(kafka_bootstrap, topics, f"rewind-{unique}")
    delivered: list[int] = []

    def poll() -> None:
        delivered.extend(f.source.offset for f in source.poll(100, 0.1).frames if f.source.topic_partition == tp)

    try:
        # The group reads the partition and commits N normally.
        wait_for(lambda: (poll(), len(delivered) >= COMMITTED)[1], 60, "the first frames")
        source.commit({tp: COMMITTED})
        assert committed_is_readable(kafka_bootstrap, topics.group, tp)
        # A transaction of this member adds M for the group; its producer dies with it open.
        kill_after_pending(DEAD_TRANSACTION, kafka_bootstrap, f"rewind-{unique}", tp[0], str(PENDING),
                           source.group_metadata().hex())  # type: ignore[attr-defined]
        assert not committed_is_readable(kafka_bootstrap, topics.group, tp), "the dead transaction holds nothing"
        # Rewind to the committed offset while the dead transaction still holds it.
        delivered.clear()
        source.seek_to_committed([tp])
        read_after_hold(kafka_bootstrap, topics, source, delivered, poll)
    finally:
        source.close()


def test_a_partition_assigned_while_a_dead_transaction_holds_its_offset_is_read_from_it(
        kafka_bootstrap: str, unique: str) -> None:
    """librdkafka waits for the stable offset itself, unless the assignment changes meanwhile (here a member
    joining for another topic takes a partition away): then it starts the partition at auto.offset.reset."""
    topics = make_topics(kafka_bootstrap, unique, partitions=1)
    tp = (topics.realtime, 0)
    publish_frames(kafka_bootstrap, topics.realtime, FRAMES)
    kill_after_pending(DEAD_MEMBER, kafka_bootstrap, f"assign-{unique}", tp[0], str(PENDING), topics.group,
                       str(COMMITTED))
    assert not committed_is_readable(kafka_bootstrap, topics.group, tp), "the dead transaction holds nothing"
    source = make_source(kafka_bootstrap, topics, f"assign-{unique}")
    other = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": topics.group, "enable.auto.commit": False,
                      "partition.assignment.strategy": "cooperative-sticky", "session.timeout.ms": 6000,
                      "log_level": 0})
    delivered: list[int] = []
    joined = False

    def poll() -> None:
        nonlocal joined
        delivered.extend(f.source.offset for f in source.poll(100, 0.1).frames if f.source.topic_partition == tp)
        if not joined and tp in source.assignment:  # assigned (after the dead member's session): change it
            other.subscribe([topics.bulk])
            joined = True
        if joined:
            other.poll(0)

    try:
        read_after_hold(kafka_bootstrap, topics, source, delivered, poll)
        assert joined
    finally:
        source.close()
        other.close()
