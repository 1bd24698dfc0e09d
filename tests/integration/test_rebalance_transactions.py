"""Exactly-once through cooperative rebalances, on the real broker: workers (the real pipeline, Kafka clients and
delivery, over an in-process executor) keep committing transactions while a member joins and another leaves.
Nothing is lost or answered twice, and a rebalance costs a surviving worker at most one aborted transaction,
never two in a row, and none makes it read again (issue #51)."""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from dataclasses import dataclass, field

import pytest

from worker.config import load_settings
from worker.frames import Encoding, Priority
from worker.loop.delivery import CommitResult
from worker.loop.pipeline import Pipeline, build_pipeline
from worker.metrics import Health, Metrics
from worker.testing import FrameProducer, ResultsReader, TestTopics, make_topics, synthetic_frames, wait_for
from worker.testing.fakes import FakeExecutor

PARTITIONS = 6
RATE_FPS = 150.0
WAIT_S = 60.0


@dataclass
class InProcessWorker:
    """One worker's pipeline on a thread of its own, stopped gracefully (drain, final commit, leave)."""

    name: str
    pipeline: Pipeline
    metrics: Metrics
    stop: threading.Event = field(default_factory=threading.Event)
    error: list[BaseException] = field(default_factory=list)
    thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        # Each turn's commit outcome: whether it aborted a transaction, and whether it rewound the worker.
        self.turns: list[tuple[bool, CommitResult]] = []
        delivery = self.pipeline.delivery
        commit = delivery.commit

        def recorded(final: bool = False) -> CommitResult:
            aborts = self.count("aborted")
            result = commit(final)
            self.turns.append((self.count("aborted") > aborts, result))
            return result

        delivery.commit = recorded  # type: ignore[method-assign]

    def start(self) -> InProcessWorker:
        def run() -> None:
            try:
                self.pipeline.run(self.stop.is_set)
            except BaseException as exc:  # noqa: BLE001 (reported by the test)
                self.error.append(exc)

        self.thread = threading.Thread(target=run, name=f"worker-{self.name}", daemon=True)
        self.thread.start()
        return self

    def halt(self) -> None:
        self.stop.set()
        assert self.thread is not None
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), f"{self.name} did not stop"

    @property
    def owned(self) -> int:
        return len(self.pipeline.assignments.partitions)

    def count(self, outcome: str) -> float:
        """Transactions by outcome (streamfer_commits_total)."""
        return self.metrics.registry.get_sample_value("streamfer_commits_total", {"outcome": outcome}) or 0.0


def start(bootstrap: str, t: TestTopics, name: str) -> InProcessWorker:
    settings = load_settings(
        env={"WORKER_BATCHING_REALTIME_MAX_AGE_MS": "0", "WORKER_BATCHING_STANDARD_MAX_AGE_MS": "0"},
        overrides={**t.overrides(), "kafka": {"bootstrap_servers": bootstrap, "group_id": t.group,
                                              "session_timeout_ms": 6000},
                   "delivery": {"mode": "exactly_once"},
                   "observability": {"worker_id": f"{t.group}-{name}", "metrics_enabled": False}})
    metrics = Metrics(settings=settings)
    pipeline = build_pipeline(settings, FakeExecutor(), metrics, Health())
    return InProcessWorker(name, pipeline, metrics).start()


@pytest.fixture
def topics(kafka_bootstrap: str) -> TestTopics:
    return make_topics(kafka_bootstrap, uuid.uuid4().hex[:8], partitions=PARTITIONS)


class Load:
    """Frames published open loop on a thread until stopped; `sent` is what the broker acknowledged."""

    def __init__(self, bootstrap: str, t: TestTopics) -> None:
        self._producer = FrameProducer(bootstrap, t)
        self._stop = threading.Event()
        self.sent = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        run = uuid.uuid4().hex[:6]
        chunk = 0
        while not self._stop.is_set():
            priority = list(Priority)[chunk % len(Priority)]  # every worker owns partitions of some class
            frames = synthetic_frames(30, [(8, 8)], Encoding.RAW_RGB8, priority, f"{run}-{chunk}",
                                      streams_per_shape=PARTITIONS * 2)
            self._producer.publish(frames, RATE_FPS)
            self.sent += len(frames)
            chunk += 1

    def finish(self) -> int:
        self._stop.set()
        self._thread.join(WAIT_S)
        return self.sent


def test_a_join_and_a_leave_under_load_lose_nothing_answer_once_and_abort_at_most_once_per_rebalance(
        kafka_bootstrap: str, topics: TestTopics, workers: list[InProcessWorker]) -> None:
    total = PARTITIONS * 3
    a, b = start(kafka_bootstrap, topics, "a"), start(kafka_bootstrap, topics, "b")
    workers += [a, b]
    wait_for(lambda: a.owned + b.owned == total and a.owned > 0 and b.owned > 0, WAIT_S,
             "two workers share the partitions")
    load = Load(kafka_bootstrap, topics)
    wait_for(lambda: a.count("ok") >= 5 and b.count("ok") >= 5, WAIT_S, "both commit transactions under load")

    c = start(kafka_bootstrap, topics, "c")  # a join: partitions move from a and b to c, in two rounds
    workers.append(c)
    wait_for(lambda: a.owned == b.owned == c.owned == total // 3, WAIT_S, "balanced after the join")
    wait_for(lambda: c.count("ok") >= 5, WAIT_S, "the newcomer commits transactions")
    a.halt()  # a graceful leave: a's partitions move to b and c
    wait_for(lambda: b.owned + c.owned == total, WAIT_S, "the leaver's partitions owned again")
    wait_for(lambda: b.count("ok") >= 5 and c.count("ok") >= 5, WAIT_S, "transactions after the leave")
    sent = load.finish()

    results = ResultsReader(kafka_bootstrap, topics).read(sent, timeout_s=WAIT_S)
    answered = Counter((r["stream_id"], r["frame_index"]) for r in results)
    assert len(answered) == sent  # nothing lost
    assert [k for k, n in answered.items() if n > 1] == []  # nothing answered twice
    for w in workers:
        assert not w.error, f"{w.name}: {w.error}"
    aborts = {w.name: w.count("aborted") + w.count("timed_out") for w in workers}
    print(f"aborted transactions per worker: {aborts}")
    for w in workers:
        # A refused transaction holds no output: nothing is read again.
        assert [r for _aborted, r in w.turns if r is CommitResult.REWIND] == [], w.name
        aborted = [a for a, _r in w.turns]
        assert not any(x and y for x, y in zip(aborted, aborted[1:], strict=False)), f"{w.name}: two aborts in a row"
    # The join's two rounds and the leave's one: at most one abort per round on each worker.
    assert all(n <= 3 for n in aborts.values()), aborts
