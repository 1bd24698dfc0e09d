"""The control topic's I/O (topics.control; the pure records and state are worker/control/): Kafka Connect's
config-topic pattern. A follower reads the topic with a consumer of its own that assigns the one partition (it joins
no group, commits nothing): at start-up to its end before the worker serves, then on a thread of its own, so the
loop never waits for it. A writer produces one record at a time (acks=all) and waits for its acknowledgement.

A control topic that does not exist yet is not an error: the settings file's policy decides, and the follower
looks for the topic again every few seconds (`worker topics` creates it)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Producer, TopicPartition

from worker.config import Settings
from worker.control.apply import PolicyApplier
from worker.control.records import ControlRecord, encode, worker_key
from worker.control.state import ControlState
from worker.errors import OperatorError
from worker.kafka.client import client_properties, new_client
from worker.kafka.roles import TOOL_LOG_LEVEL

log = logging.getLogger(__name__)

CONTROL_READER_GROUP = "streamfer-control-reader"  # never joined: the reader assigns its partition
FOLLOW_POLL_S = 0.5
MISSING_TOPIC_RETRY_S = 5.0


class ControlUnavailable(OperatorError):
    """The control topic could not be read to its end in time."""


def control_reader(settings: Settings) -> Consumer:
    conf: dict[str, Any] = {**client_properties(settings.kafka), "group.id": CONTROL_READER_GROUP,
                            "enable.auto.commit": False, "enable.partition.eof": True,
                            "isolation.level": "read_committed", "log_level": TOOL_LOG_LEVEL}
    return new_client(Consumer, conf, "control reader")


def control_writer(settings: Settings) -> Producer:
    # Not idempotent: a record is acknowledged before the next is produced, so none can overtake another, and a
    # retried record is the same revision again. An idempotent producer waited ~500 ms for its producer id before
    # its first record: every `worker rollout` and `worker policy` command, and every promote, paid it.
    conf: dict[str, Any] = {**client_properties(settings.kafka), "enable.idempotence": False, "acks": "all",
                            "max.in.flight.requests.per.connection": 1, "log_level": TOOL_LOG_LEVEL}
    return new_client(Producer, conf, "control writer")


class ControlReader:
    """The group's view of the control topic: `read_to_end` at start-up, then `poll` for what came since."""

    def __init__(self, settings: Settings, state: ControlState | None = None) -> None:
        self.topic = settings.topics.control
        self.state = state or ControlState(settings.kafka.group_id)
        self._consumer = control_reader(settings)
        self.assigned = False

    def _assign(self, timeout_s: float) -> bool:
        """Assign the topic's partitions from the beginning; False when it does not exist."""
        try:
            md = self._consumer.list_topics(self.topic, timeout=timeout_s)
        except KafkaException as exc:
            raise ControlUnavailable(f"the control topic {self.topic} cannot be looked up: {exc.args[0].str()}",
                                     setting="kafka.bootstrap_servers") from None
        meta = md.topics.get(self.topic)
        if meta is None or meta.error is not None or not meta.partitions:
            return False
        self._consumer.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in meta.partitions])
        self.assigned = True
        return True

    def read_to_end(self, timeout_s: float = 30.0) -> bool:
        """Read every record up to the topic's end as it is now; False (nothing read) when the topic is missing.
        Raises ControlUnavailable when the end is not reached within `timeout_s`. Returns whether the group's
        desired policy changed."""
        deadline = time.monotonic() + timeout_s
        if not self.assigned and not self._assign(timeout_s):
            return False
        ends = {}
        for tp in self._consumer.assignment():
            _low, high = self._consumer.get_watermark_offsets(tp, timeout=timeout_s)
            ends[tp.partition] = high
        changed = False
        positions = {p: 0 for p in ends}
        while any(positions[p] < end for p, end in ends.items()):
            if time.monotonic() > deadline:
                raise ControlUnavailable(f"the control topic {self.topic} was not read to its end in {timeout_s:.0f}s"
                                         f" (at {positions}, end {ends})", setting="topics.control")
            msg = self._consumer.poll(0.2)
            if msg is None:
                continue
            err, partition, offset = msg.error(), msg.partition() or 0, msg.offset() or 0
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    positions[partition] = max(positions[partition], offset)
                    continue
                raise ControlUnavailable(f"reading the control topic {self.topic}: {err.str()}",
                                         setting="topics.control")
            positions[partition] = offset + 1
            changed = self.state.take(msg.key(), msg.value()) or changed
        return changed

    def poll(self, timeout_s: float) -> bool:
        """What arrived since (or the whole topic, once it exists); True when the desired policy changed."""
        if not self.assigned:
            if not self._assign(timeout_s):
                return False
            return self.read_to_end()
        # Back as soon as a record arrives (then what else is there): consume(500, timeout) alone waits its whole
        # timeout unless 500 records come, which every change would wait out.
        first = self._consumer.poll(timeout_s)
        if first is None:
            return False
        changed = False
        for msg in [first, *self._consumer.consume(500, 0)]:
            if msg.error() is None:
                changed = self.state.take(msg.key(), msg.value()) or changed
        return changed

    def close(self) -> None:
        self._consumer.close()


class ControlWriter:
    def __init__(self, settings: Settings) -> None:
        self.topic = settings.topics.control
        self._producer = control_writer(settings)

    def write(self, key: str, record: ControlRecord | None, timeout_s: float = 30.0) -> None:
        """Produce one record (None: a tombstone, which deletes the key) and wait for the broker's acknowledgement;
        raises OperatorError if it is refused."""
        failed: list[str] = []

        def delivered(err: KafkaError | None, _msg: Any) -> None:
            if err is not None:
                failed.append(err.str())

        try:
            self._producer.produce(self.topic, key=key.encode(), value=None if record is None else encode(record),
                                   on_delivery=delivered)
        except KafkaException as exc:
            raise OperatorError(f"writing to the control topic {self.topic}: {exc.args[0].str()}",
                                setting="topics.control") from None
        if self._producer.flush(timeout_s):
            raise OperatorError(f"the control topic {self.topic} did not acknowledge the record in {timeout_s:.0f}s",
                                setting="topics.control")
        if failed:
            raise OperatorError(f"the control topic {self.topic} refused the record: {failed[0]}",
                                setting="topics.control")

    def close(self) -> None:
        self._producer.flush(5.0)


class ControlFollower:
    """A worker's follower: applies the group's policy at start-up (before the loop serves) and on each change,
    and reports what it applies under its own key. Runs on its own daemon thread; `stop` ends it."""

    def __init__(self, settings: Settings, applier: PolicyApplier, reader: ControlReader | None = None,
                 writer: ControlWriter | None = None) -> None:
        self.settings = settings
        self.applier = applier
        self.reader = reader or ControlReader(settings)
        self.writer = writer or ControlWriter(settings)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float = 30.0) -> ControlFollower:
        """Read the topic to its end and apply what it says, then follow it on a thread."""
        self.reader.read_to_end(timeout_s)
        if self.reader.assigned:
            self._apply()  # the group's policy, or the settings file's without one; reported either way
        else:
            log.info("control topic %s not found: the settings file's policy applies (`worker topics` creates it)",
                     self.reader.topic)
        self._thread = threading.Thread(target=self._follow, name="control-follower", daemon=True)
        self._thread.start()
        return self

    def _apply(self) -> None:
        report = self.applier.apply(self.reader.state.policy)
        try:
            self.writer.write(worker_key(self.settings.kafka.group_id, self.applier.worker_id), report)
        except OperatorError as exc:  # the report is informational: the policy is applied (or refused) anyway
            log.warning("could not report the policy applied on the control topic: %s", exc)

    def _follow(self) -> None:
        while not self._stop.is_set():
            try:
                changed = self.reader.poll(FOLLOW_POLL_S if self.reader.assigned else MISSING_TOPIC_RETRY_S)
            except (KafkaException, ControlUnavailable) as exc:
                log.warning("control topic: %s (retrying)", exc)
                self._stop.wait(MISSING_TOPIC_RETRY_S)
                continue
            if changed:
                self._apply()
            elif not self.reader.assigned:
                self._stop.wait(MISSING_TOPIC_RETRY_S)

    def stop(self) -> None:
        """Stop following; a worker that stops gracefully deletes its report (a crashed one's stays, the last
        thing it said)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10.0)
        if self.reader.assigned:
            try:
                self.writer.write(worker_key(self.settings.kafka.group_id, self.applier.worker_id), None, 5.0)
            except OperatorError as exc:
                log.warning("could not remove this worker's report from the control topic: %s", exc)
        self.reader.close()
        self.writer.close()


def start_control(settings: Settings, judge: Any, metrics: Any, health: Any,
                  clock_ms: Callable[[], int] | None = None) -> ControlFollower:
    """The worker's follower of the control topic, started: the policy it says is applied before this returns."""
    applier = PolicyApplier(judge, settings.policy, settings.kafka.group_id, settings.observability.worker_id,
                            metrics, clock_ms or (lambda: int(time.time() * 1000)))
    health.policy_problem = lambda: applier.problem
    return ControlFollower(settings, applier).start()
