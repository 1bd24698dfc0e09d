"""bench/handover.py: how the rebalance callbacks of a round become each moved partition's unowned time."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))  # appended: never shadows a real module

import handover
from handover import Event

A, B = ("t.bulk", 0), ("t.bulk", 1)


def test_a_partition_is_unowned_from_its_revoke_to_its_next_assignment_on_any_member() -> None:
    events = [Event(10.0, "c", "revoke", A), Event(10.0, "c", "revoke", B), Event(10.4, "a", "assign", B),
              Event(10.9, "b", "assign", A)]
    assert handover.unowned_times(events) == {A: [pytest.approx(0.9)], B: [pytest.approx(0.4)]}


def test_a_lost_partition_counts_as_revoked_and_events_are_taken_in_time_order() -> None:
    events = [Event(3.0, "d", "assign", A), Event(1.0, "a", "lost", A)]
    assert handover.unowned_times(events) == {A: [2.0]}


def test_assignments_before_the_phase_and_revokes_never_followed_by_an_assignment_are_left_out() -> None:
    events = [Event(0.5, "a", "assign", A), Event(1.0, "a", "revoke", A), Event(2.0, "b", "assign", A),
              Event(5.0, "b", "revoke", B)]
    assert handover.unowned_times(events, since=0.9) == {A: [1.0]}
    assert handover.unowned_times(events, since=1.5) == {}
