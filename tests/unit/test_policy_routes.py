"""Verdicts per tenant in the loop, and their routes (issue 66): every frame one result on the results topic, a
copy on topics.review / topics.flagged by its verdict; at-least-once waits for every copy's acknowledgement before
the offset passes it, exactly-once puts result, copy and offsets in one transaction. Over the in-memory fakes."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future
from typing import Any

import pytest
from confluent_kafka import KafkaError

from worker.codec.schemas import decode_result
from worker.config import (
    BatchingSettings,
    DeliverySettings,
    ObservabilitySettings,
    PolicySettings,
    Settings,
    TopicSettings,
)
from worker.frames import BatchOutcome, Frame, Priority, Verdict
from worker.loop.pipeline import build_pipeline
from worker.metrics import Health, Metrics
from worker.testing import FakeClock, FakeExecutor, InMemoryKafka, Produced, abortable, frame_value

REVIEW, FLAGGED = "moderation.review", "moderation.flagged"
TOPICS = TopicSettings(review=REVIEW, flagged=FLAGGED)
BULK = (TOPICS.bulk, 0)
POLICY = PolicySettings(flag={"nudity": 0.8}, review={"nudity": 0.5},
                        tenants={"kids": {"flag": {"nudity": 0.3}, "review": {"nudity": 0.1}}})


class ScoringExecutor(FakeExecutor):
    """Scores a frame's nudity as its frame_index / 10 (0.0, 0.1, ... 0.9): every band of both tenants is hit."""

    def submit(self, frames: Any, shape: tuple[int, int, int], priority: Priority = Priority.BULK
               ) -> Future[BatchOutcome]:
        frames = list(frames)
        self.batches.append(frames)
        future: Future[BatchOutcome] = Future()
        future.set_result(BatchOutcome(verdicts=[(f, _verdict(f)) for f in frames], failures=[],
                                       batch_size=len(frames), preprocess_ms=1.0, inference_ms=1.0, started_at=0.0,
                                       bucket=len(frames), used_graph=False))
        return future


def _verdict(frame: Frame) -> Verdict:
    score = frame.frame_index / 10
    return Verdict({"nudity": score, "violence": 0.0}, ("nudity",) if score >= 0.5 else ())


class Loop:
    def __init__(self, mode: str, policy: PolicySettings = POLICY) -> None:
        self.settings = Settings(topics=TOPICS, policy=policy,
                                 batching=BatchingSettings(rare_shape_min_count=1, max_batch_size=4),
                                 delivery=DeliverySettings(mode=mode, transaction_call_timeout_ms=1_000),
                                 observability=ObservabilitySettings(worker_id="w0", metrics_enabled=False))
        self.kafka, self.clock, self.metrics = InMemoryKafka(), FakeClock(), Metrics()
        self.executor = ScoringExecutor()
        self.pipeline: Any = None

    def send(self, tenant: str, count: int = 10, start: int = 0) -> None:
        self.kafka.send(BULK, *(frame_value(f"{tenant}-cam", start + i, tenant=tenant) for i in range(count)))

    def start(self) -> None:
        self.pipeline = build_pipeline(self.settings, self.executor, self.metrics, Health(), self.clock,
                                       clients=self.kafka.clients)
        self.pipeline.source.subscribe(self.pipeline._on_assign, self.pipeline._on_revoke, self.pipeline._on_lost)

    def run_until(self, done: Any, turns: int = 200) -> None:
        for _ in range(turns):
            self.clock.advance(0.2)
            self.pipeline.step()
            if done():
                return
        raise AssertionError("the loop did not get there")

    def on(self, topic: str) -> list[dict[str, Any]]:
        return self.kafka.results(topic)

    def verdicts(self, topic: str = TOPICS.results) -> dict[tuple[str, int], str]:
        return {(r["tenant"], r["frame_index"]): r["verdict"] for r in self.on(topic)}


def expected(tenant: str, index: int) -> str:
    score = index / 10
    flag, review = (0.3, 0.1) if tenant == "kids" else (0.8, 0.5)
    return "flag" if score >= flag else "review" if score >= review else "allow"


@pytest.mark.parametrize("mode", ["at_least_once", "exactly_once"])
def test_the_same_frames_get_each_tenants_verdict_and_copies_go_to_their_routes(mode: str) -> None:
    loop = Loop(mode)
    loop.send("kids")
    loop.send("dating")
    loop.start()
    loop.run_until(lambda: loop.kafka.committed.get(BULK) == 20)
    results = loop.verdicts()
    assert results == {(t, i): expected(t, i) for t in ("kids", "dating") for i in range(10)}
    assert results[("kids", 4)] == "flag" and results[("dating", 4)] == "allow"  # the same score, two verdicts
    review = Counter((r["tenant"], r["frame_index"]) for r in loop.on(REVIEW))
    flagged = Counter((r["tenant"], r["frame_index"]) for r in loop.on(FLAGGED))
    assert review == Counter(k for k, v in results.items() if v == "review")
    assert flagged == Counter(k for k, v in results.items() if v == "flag")
    # A copy is the result itself: same record, flagged iff the verdict is flag, the labels that decided it.
    for r in loop.on(FLAGGED):
        assert r["flagged"] and r["flagged_labels"] == ["nudity"] == r["verdict_labels"]
    assert {r["policy_version"] for r in loop.on(TOPICS.results)} == {loop.pipeline.answers.judge.version}
    assert sum(1 for r in loop.on(TOPICS.results) if r["flagged"]) == len(flagged)


def test_at_least_once_commits_past_a_frame_only_when_its_copy_is_acknowledged() -> None:
    loop = Loop("at_least_once")
    loop.send("dating")
    loop.start()
    failing = {"on": True}

    def refuse(produced: Produced) -> KafkaError | None:
        # The flagged route's broker is away: its copies time out (retried), the results go through.
        return KafkaError(KafkaError._MSG_TIMED_OUT) if failing["on"] and produced.topic == FLAGGED else None

    loop.kafka.producers[-1].refuse = refuse
    loop.run_until(lambda: len(loop.on(TOPICS.results)) == 10)
    for _ in range(10):
        loop.clock.advance(0.2)
        loop.pipeline.step()
    # Frames 8 and 9 flag: their copies are not acknowledged, so the commit stays below offset 8.
    assert loop.on(FLAGGED) == []
    assert loop.kafka.committed.get(BULK) == 8
    failing["on"] = False
    loop.run_until(lambda: loop.kafka.committed.get(BULK) == 10)
    assert sorted(r["frame_index"] for r in loop.on(FLAGGED)) == [8, 9]


def test_exactly_once_an_aborted_transaction_leaves_no_copy_and_the_retry_writes_each_once() -> None:
    loop = Loop("exactly_once")
    loop.send("kids")
    loop.start()
    loop.kafka.producers[-1].commit_errors.append(abortable())
    loop.run_until(lambda: loop.kafka.committed.get(BULK) == 10)
    results = Counter(r["frame_index"] for r in loop.on(TOPICS.results))
    assert results == Counter(range(10))
    assert Counter(r["frame_index"] for r in loop.on(FLAGGED)) == Counter(i for i in range(10)
                                                                          if expected("kids", i) == "flag")
    assert Counter(r["frame_index"] for r in loop.on(REVIEW)) == Counter([1, 2])


def test_a_policy_offered_while_running_applies_from_the_next_batch_and_results_name_it() -> None:
    loop = Loop("at_least_once")
    loop.send("dating", count=4)
    loop.start()
    loop.run_until(lambda: loop.kafka.committed.get(BULK) == 4)
    judge = loop.pipeline.answers.judge
    first = judge.version
    assert judge.offer(PolicySettings(flag={"nudity": 0.1}), "r2") is None
    loop.send("dating", count=4, start=4)
    loop.run_until(lambda: loop.kafka.committed.get(BULK) == 8)
    by_index = {r["frame_index"]: r for r in loop.on(TOPICS.results)}
    assert [by_index[i]["policy_version"] for i in range(8)] == [first] * 4 + ["r2"] * 4
    assert [by_index[i]["verdict"] for i in range(4, 8)] == ["flag"] * 4  # 0.4..0.7 >= 0.1 under r2
    assert by_index[0]["verdict"] == "allow"


def test_a_policy_naming_a_label_the_model_lacks_is_refused_and_the_last_good_one_stays() -> None:
    loop = Loop("at_least_once")
    loop.start()
    judge = loop.pipeline.answers.judge
    before = judge.version
    refusal = judge.offer(PolicySettings(flag={"colour": 0.5}), "r7")
    assert refusal is not None and refusal.version == "r7" and "no label 'colour'" in refusal.reason
    assert judge.policy().version == before and judge.refused == refusal


def test_expired_frames_go_to_review_when_the_policy_says_so() -> None:
    loop = Loop("at_least_once", PolicySettings(expired="review"))
    loop.settings = Settings(topics=TOPICS, policy=PolicySettings(expired="review"),
                             delivery=DeliverySettings(max_inflight_batches=1),
                             batching=BatchingSettings(rare_shape_min_count=1, max_batch_size=4),
                             observability=ObservabilitySettings(worker_id="w0", metrics_enabled=False))
    loop.executor = FakeExecutor(hold=True)  # the model holds its batches: realtime's max_age_ms (2 s) passes
    realtime = (TOPICS.realtime, 0)
    loop.kafka.send(realtime, *(frame_value("cam", i, tenant="t") for i in range(16)))
    loop.start()
    for _ in range(10):
        loop.clock.advance(0.2)
        loop.pipeline.step()
    loop.executor.release()
    loop.run_until(lambda: loop.kafka.committed.get(realtime) == 16)
    expired = {r["frame_index"] for r in loop.on(TOPICS.results) if r["status"] == "EXPIRED"}
    assert expired and len(loop.on(TOPICS.results)) == 16
    assert sorted(r["frame_index"] for r in loop.on(REVIEW)) == sorted(expired)  # the scored ones are allowed
    assert {r["verdict"] for r in loop.on(REVIEW)} == {"review"}
    assert {r["verdict"] for r in loop.on(TOPICS.results) if r["status"] == "OK"} == {"allow"}


def test_with_no_routes_only_the_results_topic_is_written() -> None:
    loop = Loop("at_least_once")
    loop.settings = Settings(policy=POLICY, observability=ObservabilitySettings(worker_id="w0", metrics_enabled=False))
    loop.send("kids")
    loop.start()
    loop.run_until(lambda: loop.kafka.committed.get(BULK) == 10)
    topics = {m.topic for p in loop.kafka.producers for m in p.visible}
    assert topics == {TOPICS.results}
    assert Counter(loop.verdicts().values()) == Counter(expected("kids", i) for i in range(10))


def test_verdicts_are_counted_per_tenant_and_verdict() -> None:
    loop = Loop("at_least_once")
    loop.send("kids")
    loop.start()
    loop.run_until(lambda: loop.kafka.committed.get(BULK) == 10)
    counts = {s.labels["verdict"]: s.value for m in loop.metrics.verdicts.collect() for s in m.samples
              if s.name == "streamfer_verdicts_total" and s.labels["tenant"] == "kids"}
    assert counts == {"allow": 1.0, "review": 2.0, "flag": 7.0}


def test_a_result_decodes_with_its_verdict() -> None:
    loop = Loop("at_least_once")
    loop.send("kids", count=1, start=2)
    loop.start()
    loop.run_until(lambda: loop.kafka.committed.get(BULK) == 1)
    [value] = [m.value for p in loop.kafka.producers for m in p.visible if m.topic == REVIEW]
    assert decode_result(value)["verdict_labels"] == ["nudity"]


def test_at_least_once_a_copy_the_route_refuses_is_dead_lettered_by_reference_before_the_offset_passes() -> None:
    loop = Loop("at_least_once")
    loop.send("dating")
    loop.start()

    def refuse(produced: Produced) -> KafkaError | None:
        return KafkaError(KafkaError.MSG_SIZE_TOO_LARGE) if produced.topic == FLAGGED else None

    loop.kafka.producers[-1].refuse = refuse
    loop.run_until(lambda: loop.kafka.committed.get(BULK) == 10)
    assert len(loop.on(TOPICS.results)) == 10  # the record of truth is whole
    assert loop.on(FLAGGED) == []
    refused = loop.kafka.dead_letters(TOPICS.dead_letter)
    assert sorted(int(d.headers["streamfer.source_offset"]) for d in refused) == [8, 9]
    assert {d.headers["streamfer.error_type"] for d in refused} == {"OutputRejected"}


@pytest.mark.parametrize("mode", ["at_least_once", "exactly_once"])
def test_reused_verdicts_are_judged_and_routed_like_scored_ones(mode: str) -> None:
    from tests.unit.test_pipeline_reuse import picture, reuse_batching

    loop = Loop(mode)
    loop.settings = Settings(topics=TOPICS, policy=PolicySettings(review={"nudity": 0.1}),
                             batching=reuse_batching(),
                             delivery=DeliverySettings(mode=mode, transaction_call_timeout_ms=1_000),
                             observability=ObservabilitySettings(worker_id="w0", metrics_enabled=False))
    loop.executor = FakeExecutor()  # scores nudity 0.1: review under this policy
    realtime = (TOPICS.realtime, 0)
    loop.kafka.send(realtime, *(picture("cam", i, 80) for i in range(6)))
    loop.start()
    loop.run_until(lambda: loop.kafka.committed.get(realtime) == 6)
    results = {r["frame_index"]: r for r in loop.on(TOPICS.results)}
    assert [results[i]["reused_from_frame"] for i in range(6)] == [None, 0, 0, 0, 0, 0]
    assert {r["verdict"] for r in results.values()} == {"review"}
    assert sorted(r["frame_index"] for r in loop.on(REVIEW)) == list(range(6))
