"""The fault table's recovery time: from a fault to the first answer of each partition it interrupted."""

from __future__ import annotations

from tests.reliability.recovery import IN_SERVICE_S, FaultMoment, Recovery, RecoverySummary, recoveries
from worker.frames import SourceRef

A0, A1, B0 = ("a", 0), ("a", 1), ("b", 0)


def ref(tp: tuple[str, int], offset: int) -> SourceRef:
    return SourceRef(tp[0], tp[1], offset)


def test_a_partition_in_service_with_input_waiting_recovers_at_its_first_answer_after_the_fault() -> None:
    intended = {ref(A0, 0): 1.0, ref(A0, 1): 2.0, ref(A0, 2): 3.0}
    answered = {ref(A0, 0): [9.5], ref(A0, 1): [18.0], ref(A0, 2): [18.5]}
    assert recoveries([FaultMoment(10.0)], intended, answered) == [Recovery(A0, 10.0, 8.0)]


def test_a_partition_not_served_before_the_fault_is_not_counted() -> None:
    # A bulk backlog behind realtime: its first answer waits for the priorities, with or without a fault.
    intended = {ref(B0, 0): 1.0, ref(B0, 1): 2.0}
    answered = {ref(B0, 0): [10.0 - IN_SERVICE_S - 0.1], ref(B0, 1): [40.0]}
    assert recoveries([FaultMoment(10.0)], intended, answered) == []
    assert recoveries([FaultMoment(10.0)], {ref(B0, 0): 1.0}, {ref(B0, 0): [40.0]}) == []


def test_a_partition_answered_up_to_the_fault_has_nothing_to_recover() -> None:
    intended = {ref(A0, 0): 1.0, ref(A0, 1): 12.0}  # the second one is sent after the fault
    answered = {ref(A0, 0): [9.5], ref(A0, 1): [30.0]}
    assert recoveries([FaultMoment(10.0)], intended, answered) == []


def test_an_answer_again_after_the_fault_does_not_make_a_frame_wait() -> None:
    intended = {ref(A0, 0): 1.0}
    answered = {ref(A0, 0): [9.5, 14.0]}  # at-least-once: answered again by the next process
    assert recoveries([FaultMoment(10.0)], intended, answered) == []


def test_the_first_answer_after_the_fault_may_be_a_repeat_of_an_earlier_frame() -> None:
    # The restarted worker answers again from the committed offset before it reaches the waiting frame.
    intended = {ref(A0, 0): 1.0, ref(A0, 1): 2.0}
    answered = {ref(A0, 0): [9.5, 13.0], ref(A0, 1): [13.2]}
    assert recoveries([FaultMoment(10.0)], intended, answered) == [Recovery(A0, 10.0, 3.0)]


def test_only_the_faults_partitions_count() -> None:
    intended = {ref(A0, 0): 1.0, ref(A0, 1): 2.0, ref(A1, 0): 1.0, ref(A1, 1): 2.0}
    answered = {ref(A0, 0): [9.0], ref(A0, 1): [11.0], ref(A1, 0): [9.0], ref(A1, 1): [25.0]}
    assert recoveries([FaultMoment(10.0, frozenset({A1}))], intended, answered) == [Recovery(A1, 10.0, 15.0)]
    assert recoveries([FaultMoment(10.0, frozenset())], intended, answered) == []


def test_a_partition_never_answered_after_the_fault_is_reported_as_such() -> None:
    intended = {ref(B0, 0): 1.0, ref(B0, 1): 2.0}
    assert recoveries([FaultMoment(10.0)], intended, {ref(B0, 0): [9.0]}) == [Recovery(B0, 10.0, None)]


def test_a_drain_before_the_exit_is_service_and_recovery_counts_from_the_signal() -> None:
    # SIGTERM at 10; the process drains (answers at 10.4) and exits at 11; its successor answers at 16.
    intended = {ref(A0, i): 1.0 + i for i in range(3)}
    answered = {ref(A0, 0): [9.0], ref(A0, 1): [10.4], ref(A0, 2): [16.0]}
    got = recoveries([FaultMoment(11.0, began=10.0)], intended, answered)
    assert got == [Recovery(A0, 11.0, 6.0)]


def test_a_partition_the_drain_answered_in_full_has_nothing_to_recover() -> None:
    intended = {ref(A0, 0): 1.0, ref(A0, 1): 2.0}
    answered = {ref(A0, 0): [9.0], ref(A0, 1): [10.4]}  # SIGTERM at 10, exit at 11: nothing left for a successor
    assert recoveries([FaultMoment(11.0, began=10.0)], intended, answered) == []


def test_each_fault_of_a_run_is_measured_from_its_own_moment() -> None:
    intended = {ref(A0, i): float(i) for i in range(60)}
    answered = {ref(A0, i): [i + 0.5 if i < 10 else (25.0 + i if i < 20 else 40.0 + i)] for i in range(60)}
    got = recoveries([FaultMoment(10.0), FaultMoment(45.0)], intended, answered)
    assert got == [Recovery(A0, 10.0, 25.0), Recovery(A0, 45.0, 15.0)]


def test_the_summary_gives_median_and_max_and_counts_partitions_never_answered() -> None:
    summary = RecoverySummary.of([Recovery(A0, 0.0, 2.0), Recovery(A1, 0.0, 4.0), Recovery(B0, 0.0, 9.0),
                                  Recovery(B0, 5.0, None)])
    assert summary == RecoverySummary(partitions=4, median_s=4.0, max_s=9.0, unanswered=1)
    assert summary.cell() == "4.0 / 9.0 (1 never)"
    assert RecoverySummary.of([]).cell() == "–"
