"""The broker helpers of the test kit: a test's own topics and group, its frame producer and results reader, and
probes of committed and end offsets. Every client is one of worker.kafka.roles', imported when first used, so
importing the kit loads no Kafka client."""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.codec.schemas import FrameRecord
    from worker.frames import Encoding, Priority
    from worker.tools.publish_frames import PublishReport

# librdkafka's own log lines of the frame producer (start-up retries such as "Coordinator load in progress"):
# delivery errors reach the caller anyway, so they stay out of test and benchmark output.
_CLIENT_LOG = logging.getLogger("worker.testing.kafka")
_CLIENT_LOG.addHandler(logging.NullHandler())
_CLIENT_LOG.propagate = False


# -- topics ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TestTopics:
    """One test's input, results and dead-letter topics and consumer group, named apart from every other's."""

    __test__ = False  # not a test class, whatever its name

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
        from worker.frames import Priority

        return {Priority.REALTIME: self.realtime, Priority.STANDARD: self.standard, Priority.BULK: self.bulk}[priority]

    def priority_of(self) -> dict[str, Priority]:
        from worker.frames import Priority

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


def make_topics(bootstrap: str, unique: str, partitions: int = 3, replication: int = 1,
                inputs_of: TestTopics | None = None, results_replication: int | None = None,
                results_partitions: int | None = None) -> TestTopics:
    """Create the five topics of one test (`t<unique>.realtime`, ...) and name its group `g<unique>`.

    `inputs_of`: keep those input topics (and what was published to them), new results and dead-letter topics
    and a new group: another consumer of the same frames, from the beginning (a benchmark's next round).
    `results_replication`, `results_partitions`: the results topic's own (a cheap results topic, issue 67)."""
    from worker.kafka.topics import ensure_topics

    t = TestTopics(realtime=f"t{unique}.realtime", standard=f"t{unique}.standard", bulk=f"t{unique}.bulk",
                   results=f"t{unique}.results", dead_letter=f"t{unique}.dlq", group=f"g{unique}")
    if inputs_of is not None:
        t = dataclasses.replace(t, realtime=inputs_of.realtime, standard=inputs_of.standard, bulk=inputs_of.bulk)
    if results_replication is not None or results_partitions is not None:
        ensure_topics(bootstrap, [t.results], results_partitions or partitions,
                      replication if results_replication is None else results_replication)
    ensure_topics(bootstrap, [*([] if inputs_of else t.inputs), t.results, t.dead_letter], partitions, replication)
    return t


# -- producing frames, reading results -------------------------------------------------------------------
def synthetic_frames(count: int, shapes: Sequence[tuple[int, int]] = ((32, 32),), encoding: Encoding | None = None,
                     priority: Priority | str = "standard", run_id: str | None = None,
                     streams_per_shape: int = 2) -> list[FrameRecord]:
    """`count` deterministic frames (smooth random pixels, JPEG-compressible like video) of the given (width,
    height) shapes, cycled over shapes, streams (`<run_id>-<class>-<w>x<h>-s<n>`) and three tenants; raw RGB
    unless `encoding` says otherwise, and a fresh run id unless one is given."""
    from worker.frames import Encoding, Priority
    from worker.tools.publish_frames import synthetic_frames as make

    prio = priority if isinstance(priority, Priority) else Priority[priority.upper()]
    return list(make(count, list(shapes), encoding or Encoding.RAW_RGB8, prio, run_id or f"test{uuid.uuid4().hex[:6]}",
                     streams_per_shape=streams_per_shape))


@dataclass
class FrameProducer:
    """Publishes frames (Avro, as cameras do) to the test's input topics, through one frame producer
    (worker.kafka.roles) kept for its life: a new one takes ~0.5 s to connect and get its idempotent id."""

    bootstrap: str
    topics: TestTopics
    # How a frame becomes a message on a topic: None, a plain Avro body; `registry_frame_producer`'s, registry-framed.
    encode: Callable[[FrameRecord, str], bytes] | None = None
    _producer: Any = field(default=None, init=False, repr=False)

    def publish(self, frames: Iterable[FrameRecord], rate_fps: float | None = None, topic: str | None = None,
                keep_capture_ts: bool = False) -> PublishReport:
        """Publish frames keyed by stream, each to its priority's topic unless `topic` is given, as a camera
        would: as fast as possible (a backlog) or open loop at `rate_fps`, each frame's capture time its
        *intended* send time (a late send counts against the consumer, not hidden) unless `keep_capture_ts`.
        Returns the PublishReport once every frame is acknowledged; RuntimeError if one is refused."""
        from worker.tools.publish_frames import send_frames

        return send_frames(self._client(), frames, lambda rec: topic or self.topics.for_priority(rec.priority),
                           rate_fps, keep_capture_ts=keep_capture_ts, encode=self.encode)

    def send_raw(self, topic: str, value: bytes, key: bytes | None = None) -> None:
        """A message that need not be a frame at all (to test dead-lettering), once acknowledged."""
        producer = self._client()
        producer.produce(topic, value=value, key=key)
        if producer.flush(30):
            raise RuntimeError(f"a message to {topic} was not acknowledged within 30 s")

    def _client(self) -> Any:
        if self._producer is None:
            from worker.kafka.roles import frame_producer

            self._producer = frame_producer(self.bootstrap, logger=_CLIENT_LOG)
            # Connected before the first frame's clock starts, so its start-up is not charged to the frames.
            self._producer.list_topics(self.topics.realtime, timeout=30)
        return self._producer


@dataclass
class ResultsReader:
    """Reads the results topic (and dead letters) as a downstream consumer would: read_committed, from the start."""

    bootstrap: str
    topics: TestTopics

    def read(self, count: int, timeout_s: float = 120.0) -> list[dict[str, Any]]:
        """At least `count` decoded results (all committed so far once `count` are there); TimeoutError if not."""
        from worker.tools.read_results import read_results

        return read_results(self.bootstrap, self.topics.results, until=lambda rs: len(rs) >= count,
                            timeout_s=timeout_s)

    def read_all(self, idle_timeout_s: float = 3.0) -> list[dict[str, Any]]:
        """Every committed result, once nothing new came for `idle_timeout_s`."""
        from worker.tools.read_results import read_results

        return read_results(self.bootstrap, self.topics.results, idle_timeout_s=idle_timeout_s)

    def dead_letters(self, idle_timeout_s: float = 3.0) -> list[Any]:
        from worker.tools.read_results import read_dead_letters

        return read_dead_letters(self.bootstrap, self.topics.dead_letter, idle_timeout_s)


# -- offsets probes -------------------------------------------------------------------------
def committed_offsets(bootstrap: str, group: str, topics: list[str]) -> dict[tuple[str, int], int]:
    from confluent_kafka import TopicPartition

    from worker.kafka.roles import offsets_reader

    consumer = offsets_reader(bootstrap, group)
    try:
        md = consumer.list_topics(timeout=10)
        tps = [TopicPartition(t, p) for t in topics for p in md.topics[t].partitions]
        return {(tp.topic, tp.partition): tp.offset for tp in consumer.committed(tps, timeout=10)}
    finally:
        consumer.close()


def end_offsets(bootstrap: str, topics: list[str]) -> dict[tuple[str, int], int]:
    from confluent_kafka import TopicPartition

    from worker.kafka.roles import offsets_reader

    consumer = offsets_reader(bootstrap, "offsets-probe")
    try:
        md = consumer.list_topics(timeout=10)
        out = {}
        for t in topics:
            for p in md.topics[t].partitions:
                out[(t, p)] = consumer.get_watermark_offsets(TopicPartition(t, p), timeout=10)[1]
        return out
    finally:
        consumer.close()


def wait_committed(bootstrap: str, group: str, ends: Mapping[tuple[str, int], int], timeout_s: float,
                   alive: Callable[[], bool] = lambda: True, first: bool = False) -> bool:
    """Wait until `group` has committed every partition up to `ends` (end_offsets taken after publishing), or
    with `first` anything of them (its consumer is past start-up and group join). False after `timeout_s` or
    once `alive()` is false; one probe consumer, polled every 0.2 s."""
    from confluent_kafka import TopicPartition

    from worker.kafka.roles import offsets_reader

    probe = offsets_reader(bootstrap, group)
    tps = [TopicPartition(t, p) for (t, p), end in ends.items() if end > 0]
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            committed = {(tp.topic, tp.partition): tp.offset for tp in probe.committed(tps, timeout=10)}
            done = [committed.get((tp.topic, tp.partition), -1) >= ends[(tp.topic, tp.partition)] for tp in tps]
            if (any(offset > 0 for offset in committed.values()) if first else all(done)):
                return True
            if not alive():
                return False
            time.sleep(0.2)
        return False
    finally:
        probe.close()


def uncommitted(bootstrap: str, group: str, topics: list[str]) -> dict[tuple[str, int], tuple[int, int]]:
    """Partitions whose committed offset is not their end offset: {tp: (committed, end)}.

    An empty partition has nothing to commit, so "no committed offset" counts as at its end (0)."""
    committed = committed_offsets(bootstrap, group, topics)
    ends = end_offsets(bootstrap, topics)
    return {tp: (committed.get(tp, -1), end) for tp, end in ends.items()
            if not (committed.get(tp, -1) == end or (end == 0 and committed.get(tp, -1) < 0))}
