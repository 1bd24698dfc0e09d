"""Output partitions that stop acknowledging, named for /readyz, the gauge and the alert (worker/kafka/outputstalls.py),
with a fake clock."""

from __future__ import annotations

import json
from dataclasses import dataclass

from tests.unit.test_health import SourceStub
from worker.kafka.outputstalls import OutputStalls
from worker.metrics import Health
from worker.testing import FakeClock

RESULTS = "moderation.results"
DLQ = "frames.dlq"


def stats(pending: dict[tuple[str, int], int]) -> str:
    """librdkafka's statistics JSON, as much of it as is read: per topic and partition the queue counts."""
    topics: dict[str, dict] = {}
    for (topic, partition), count in pending.items():
        parts = topics.setdefault(topic, {"partitions": {"-1": {"msgq_cnt": 7}}})["partitions"]
        parts[str(partition)] = {"msgq_cnt": count, "xmit_msgq_cnt": 0, "msgs_inflight": 0}
    return json.dumps({"topics": topics})


def test_a_partition_with_outputs_waiting_and_no_acknowledgement_counts_from_its_last_one() -> None:
    clock = FakeClock()
    stalls = OutputStalls([RESULTS, DLQ], clock)
    stalls.acknowledged([(RESULTS, 0), (RESULTS, 4)])
    stalls.stats(stats({(RESULTS, 0): 3, (RESULTS, 4): 3}))
    clock.now += 30
    stalls.acknowledged([(RESULTS, 0)])  # 0 keeps acknowledging; 4 does not
    stalls.stats(stats({(RESULTS, 0): 2, (RESULTS, 4): 40}))
    assert stalls.unacknowledged_s() == {(RESULTS, 0): 0.0, (RESULTS, 4): 30.0}


def test_a_partition_idle_for_long_counts_from_when_outputs_began_waiting_not_its_last_acknowledgement() -> None:
    clock = FakeClock()
    stalls = OutputStalls([RESULTS], clock)
    stalls.acknowledged([(RESULTS, 2)])
    clock.now += 600  # nothing to send for 10 minutes
    stalls.stats(stats({(RESULTS, 2): 1}))
    clock.now += 5
    assert stalls.unacknowledged_s()[(RESULTS, 2)] == 5.0


def test_a_partition_with_nothing_waiting_is_at_zero_and_other_topics_and_the_unassigned_one_are_ignored() -> None:
    clock = FakeClock()
    stalls = OutputStalls([RESULTS], clock)
    stalls.stats(stats({(RESULTS, 1): 5, ("someone.elses", 0): 9}))
    clock.now += 20
    stalls.stats(stats({(RESULTS, 1): 0}))
    assert stalls.unacknowledged_s() == {(RESULTS, 1): 0.0}
    stalls.stats("not json")  # ignored, as librdkafka's output is never trusted blindly
    assert stalls.problem(after_s=0.0) is None


@dataclass
class OutputsStub:
    """What Health reads of delivery's outputs (worker.metrics.WatchedOutputs), over the stalls under test."""

    stalls: OutputStalls

    def output_problem(self) -> str | None:
        return self.stalls.problem()

    def unacknowledged_outputs(self) -> dict[tuple[str, int], float]:
        return self.stalls.unacknowledged_s()


def test_readyz_names_the_stalled_partitions_and_stays_ready() -> None:
    clock = FakeClock()
    stalls = OutputStalls([RESULTS, DLQ], clock)
    stalls.stats(stats({(RESULTS, 0): 4, (RESULTS, 4): 4, (DLQ, 0): 1}))
    clock.now += 12
    stalls.acknowledged([(DLQ, 0)])
    health = Health(alive=True, warmed_up=True, clock=clock)
    health.source, health.outputs = SourceStub(frozenset({(RESULTS, 0)})), OutputsStub(stalls)
    assert health.ready
    assert "moderation.results[0] for 12s, moderation.results[4] for 12s" in health.degraded
    assert "frames.dlq" not in health.degraded
