"""The committed-position policy alone (worker.kafka.committed): which partitions wait, which are asked on a poll,
when one is asked again, and what is reported; over a fake clock, no Kafka client."""

from __future__ import annotations

import ast
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

import worker.kafka.committed as positions_module
from worker.kafka.committed import (
    COMMITTED_LOOKUP_BUDGET_S,
    COMMITTED_RETRY_FIRST_S,
    COMMITTED_RETRY_MAX_S,
    TP,
    CommittedPositions,
)
from worker.testing import FakeClock

A, B, C = ("frames.bulk", 0), ("frames.realtime", 1), ("frames.realtime", 0)


def by_name(tp: TP) -> TP:
    return tp


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def positions(clock: FakeClock) -> CommittedPositions:
    return CommittedPositions(clock)


def test_a_partition_waits_from_wait_until_sought(positions: CommittedPositions) -> None:
    assert not positions and A not in positions
    positions.wait([A])
    assert positions and A in positions and positions.waiting == {A}
    positions.sought(A)
    assert not positions and positions.waiting == frozenset()


def test_new_partitions_are_due_at_once_in_the_order_given(positions: CommittedPositions) -> None:
    positions.wait([A, B, C])
    assert list(positions.due(by_name)) == [A, C, B]
    assert list(positions.due(lambda tp: -tp[1])) == [B, A, C]


def test_an_unknown_committed_offset_is_asked_again_after_a_delay_that_doubles_up_to_a_cap(
        positions: CommittedPositions, clock: FakeClock) -> None:
    positions.wait([A])
    waits: list[float] = []
    for _ in range(6):
        (tp,) = positions.due(by_name)
        positions.unknown(tp, "UNSTABLE_OFFSET_COMMIT")
        asked_at = clock.now
        while not list(positions.due(by_name)):
            clock.advance(0.125)  # exact in binary, as are the delays
        waits.append(clock.now - asked_at)
    assert waits == [COMMITTED_RETRY_FIRST_S, 0.5, 1.0, COMMITTED_RETRY_MAX_S, COMMITTED_RETRY_MAX_S,
                     COMMITTED_RETRY_MAX_S]


def test_a_partition_not_due_is_not_asked(positions: CommittedPositions, clock: FakeClock) -> None:
    positions.wait([A, B])
    positions.unknown(A, "held")
    assert list(positions.due(by_name)) == [B]
    clock.advance(COMMITTED_RETRY_FIRST_S)
    assert list(positions.due(by_name)) == [A, B]


def test_waiting_again_asks_again_now(positions: CommittedPositions) -> None:
    """A rewind (seek_to_committed) of a partition already waiting does not wait out its retry delay."""
    positions.wait([A])
    positions.unknown(A, "held")
    assert list(positions.due(by_name)) == []
    positions.wait([A])
    assert list(positions.due(by_name)) == [A]


def test_one_poll_stops_asking_once_the_look_ups_took_the_budget(positions: CommittedPositions,
                                                                 clock: FakeClock) -> None:
    positions.wait([A, B, C])
    asked = []
    for tp in positions.due(by_name):
        asked.append(tp)
        clock.advance(COMMITTED_LOOKUP_BUDGET_S)  # a look-up that timed out
        positions.unknown(tp, "timed out")
    assert asked == [A]


def test_the_budget_is_the_polls_not_each_look_ups(clock: FakeClock) -> None:
    positions = CommittedPositions(clock, budget_s=1.0)
    positions.wait([A, B, C])
    asked = []
    for tp in positions.due(by_name):
        asked.append(tp)
        clock.advance(0.4)
        positions.unknown(tp, "slow")
    assert asked == [A, C, B]  # 0, 0.4 and 0.8 s into the poll: all within the budget
    clock.advance(10.0)
    asked = []
    for tp in positions.due(by_name):
        asked.append(tp)
        clock.advance(0.6)
        positions.unknown(tp, "slow")
    assert asked == [A, C]


def test_a_partition_forgotten_while_a_poll_asks_is_not_yielded(positions: CommittedPositions) -> None:
    positions.wait([A, B])
    due = positions.due(by_name)
    assert next(due) == A
    positions.drop_partitions([B])
    assert list(due) == []


def test_an_unknown_offset_is_counted_once_per_wait(positions: CommittedPositions, clock: FakeClock) -> None:
    positions.wait([A, B])
    positions.unknown(A, "held")
    positions.unknown(B, "held")
    assert positions.take_new_unknowns() == 2
    clock.advance(10.0)
    positions.unknown(A, "held")
    assert positions.take_new_unknowns() == 0
    positions.sought(A)
    positions.wait([A])
    positions.unknown(A, "held")
    assert positions.take_new_unknowns() == 1


def test_an_unstarted_partition_is_retried_but_not_counted_as_unknown(positions: CommittedPositions,
                                                                      clock: FakeClock) -> None:
    positions.wait([A])
    positions.unstarted(A, "Local: Erroneous state")
    assert positions.take_new_unknowns() == 0 and A in positions
    assert list(positions.due(by_name)) == []
    clock.advance(COMMITTED_RETRY_FIRST_S)
    assert list(positions.due(by_name)) == [A]


def test_each_kind_of_wait_is_logged_once_and_the_end_of_a_reported_wait_once(
        positions: CommittedPositions, clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="worker.kafka.committed")

    def lines(test: Callable[[str], bool]) -> int:
        return sum(test(r.getMessage()) for r in caplog.records)

    positions.wait([A, B])
    for _ in range(3):
        positions.unknown(A, "held")
        positions.unstarted(A, "not started")
    assert lines(lambda m: "cannot be read now" in m) == 1 and lines(lambda m: "cannot be sought yet" in m) == 1
    clock.advance(7.0)
    positions.sought(A)
    positions.sought(B)  # never reported: its end is not worth a line either
    assert [m for m in (r.getMessage() for r in caplog.records) if "known after" in m] == [
        f"committed offset of {A} known after 7.0s: reading it from there"]


def test_forgotten_partitions_no_longer_wait(positions: CommittedPositions) -> None:
    positions.wait([A, B])
    positions.drop_partitions([A, C])
    assert positions.waiting == {B}


def test_the_policy_imports_no_kafka_client_and_no_torch() -> None:
    tree = ast.parse(Path(positions_module.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported.isdisjoint({"confluent_kafka", "torch"}) and "logging" in imported
