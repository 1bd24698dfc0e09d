"""The control topic's model rollouts (issue 69), the Kafka side: the worker's follower applies both the group's
policy (issue 66, worker.control.apply) and its desired model set (worker.rollout.manager), and writes one report
under `<group_id>/worker/<worker_id>` holding both (compaction keeps one record per key); the shadow results go to
`topics.shadow_results` from a producer of their own."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

from worker.codec.schemas import ResultContext, result_writer
from worker.config import Settings
from worker.control.apply import PolicyApplier
from worker.control.records import WORKER_STATUS, ControlRecord, worker_key
from worker.errors import OperatorError
from worker.frames import BatchOutcome, Frame, ModelId
from worker.kafka.client import client_properties, new_client
from worker.kafka.control import ControlFollower, ControlReader, ControlWriter
from worker.kafka.roles import TOOL_LOG_LEVEL
from worker.rollout.manager import Rollout, compare_shadow

log = logging.getLogger(__name__)


class RolloutReader(ControlReader):
    """A ControlReader whose reads also say when the group's desired model set changed."""

    def read_to_end(self, timeout_s: float = 30.0) -> bool:
        seen = self.state.models_changes
        return super().read_to_end(timeout_s) or self.state.models_changes != seen

    def poll(self, timeout_s: float) -> bool:
        """As ControlReader.poll; True also when the desired model set changed."""
        seen = self.state.models_changes
        return super().poll(timeout_s) or self.state.models_changes != seen


class RolloutFollower(ControlFollower):
    """The worker's follower of the control topic with rollouts: a change of the policy goes to the applier, a
    change of the model set to the rollout; the worker's one report is written by a thread of its own, so neither
    the loop (a promote is taken there) nor a model's load waits for the broker."""

    def __init__(self, settings: Settings, applier: PolicyApplier, rollout: Rollout) -> None:
        super().__init__(settings, applier, RolloutReader(settings))
        self.rollout = rollout
        # Reports on topics.worker_status when set, so workers need no WRITE on the control topic.
        self.report_writer = ControlWriter(status_settings(settings)) if settings.topics.worker_status else self.writer
        self._policy_seen: object = _NOTHING
        self._models_seen = -1
        self._policy_report: ControlRecord | None = None
        self._dirty = threading.Event()
        self._reporter = threading.Thread(target=self._report_loop, name="control-reporter", daemon=True)
        self._reporter.start()
        rollout.report = lambda _report: self._dirty.set()

    def _apply(self) -> None:
        state = self.reader.state
        if state.policy is not self._policy_seen:
            self._policy_seen = state.policy
            self._policy_report = self.applier.apply(state.policy)
        if state.models_changes != self._models_seen:
            self._models_seen = state.models_changes
            self.rollout.apply(state.models)
        self._dirty.set()

    def _report_loop(self) -> None:
        while not self._stop.is_set():
            if not self._dirty.wait(0.5):
                continue
            self._dirty.clear()
            self._write_report()

    def _write_report(self) -> None:
        policy = self._policy_report
        if policy is None or policy.status is None or not self.reader.assigned:
            return
        record = ControlRecord(WORKER_STATUS, policy.group_id, policy.revision, int(time.time() * 1000),
                               policy.written_by, status=policy.status, rollout=self.rollout.current_report())
        try:
            self.report_writer.write(worker_key(self.settings.kafka.group_id, self.applier.worker_id), record)
        except OperatorError as exc:  # informational: what the worker does does not depend on it
            log.warning("could not report this worker's state on the control topic: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        self._reporter.join(10.0)
        if self.report_writer is not self.writer:
            self.report_writer.close()
        super().stop()


_NOTHING = object()


def status_settings(settings: Settings) -> Settings:
    """The settings whose control topic is topics.worker_status (where reports go when it is set)."""
    return dataclasses.replace(settings, topics=dataclasses.replace(settings.topics,
                                                                    control=settings.topics.worker_status))


class ShadowPublisher:
    """A candidate's shadow results on topics.shadow_results (results schema, keyed by stream), best effort: a
    shadow result is a measurement, never an answer, so it is not part of the loop's delivery or transactions."""

    def __init__(self, settings: Settings, metrics: Any = None) -> None:
        self.topic = settings.topics.shadow_results
        self.worker_id = settings.observability.worker_id
        self.metrics = metrics
        self._conf: dict[str, Any] = {**client_properties(settings.kafka), "acks": "all", "linger.ms": 20,
                                      "log_level": TOOL_LOG_LEVEL}
        self._producer: Any = None  # made at the first shadow batch: no connection while nothing rolls out
        self._writers: dict[ModelId, Any] = {}
        self._failed = 0

    def __call__(self, frames: Sequence[Frame], primary: BatchOutcome, shadow: BatchOutcome, model: ModelId) -> None:
        verdicts = compare_shadow(frames, primary, shadow, self.metrics)
        writer = self._writers.get(model)
        if writer is None:
            writer = self._writers[model] = result_writer(ResultContext(model[0], model[1], self.worker_id))
        if self._producer is None:
            self._producer = new_client(Producer, self._conf, "shadow results producer")
        now = time.time()
        values = writer.write_frames([(f, v, max(0.0, shadow.started_at - f.received_at) * 1000.0)
                                      for f, v in verdicts], "OK", shadow.batch_size,
                                     shadow.preprocess_ms + shadow.inference_ms, now * 1000.0)
        for (frame, _), value in zip(verdicts, values, strict=True):
            try:
                self._producer.produce(self.topic, key=frame.stream_id.encode(), value=value,
                                       on_delivery=self._delivered)
            except (KafkaException, BufferError) as exc:
                self._count_failure(str(exc))
        self._producer.poll(0)

    def _delivered(self, err: KafkaError | None, _msg: Any) -> None:
        if err is not None:
            self._count_failure(err.str())

    def _count_failure(self, why: str) -> None:
        self._failed += 1
        if self._failed == 1 or self._failed % 1000 == 0:
            log.warning("shadow results to %s not written (%d so far): %s", self.topic, self._failed, why)

    def close(self) -> None:
        if self._producer is not None:
            self._producer.flush(10.0)


def skipped_counter(metrics: Any) -> Callable[[int], None]:
    return lambda n: metrics.shadow_frames.labels("skipped").inc(n)


def start_control_with_rollout(settings: Settings, judge: Any, metrics: Any, health: Any,
                               rollout: Rollout) -> RolloutFollower:
    """start_control (worker.kafka.control) with the model rollout: the group's policy and model set are read to
    the topic's end and applied before this returns (a model still to load loads in the background)."""
    applier = PolicyApplier(judge, settings.policy, settings.kafka.group_id, settings.observability.worker_id,
                            metrics, lambda: int(time.time() * 1000))
    health.policy_problem = lambda: "; ".join(p for p in (applier.problem, rollout.problem) if p) or None
    follower = RolloutFollower(settings, applier, rollout)
    try:
        follower.start()
    except BaseException:
        follower.stop()
        raise
    return follower


def read_desired(settings: Settings, timeout_s: float = 30.0) -> ControlRecord | None:
    """The group's desired model set as the control topic holds it now (None: no record, or no topic)."""
    reader = ControlReader(settings)
    try:
        reader.read_to_end(timeout_s)
    finally:
        reader.close()
    return reader.state.models

