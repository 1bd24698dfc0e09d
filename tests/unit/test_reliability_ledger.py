"""The fault suite's ledger when its feeder wrote a message twice (an idempotent producer's retry across a leader
change): the worker scores the first copy and dead-letters the repeat, and the ledger expects exactly that."""

from __future__ import annotations

from tests.reliability.harness import DEAD_LETTER, RESULT, Sent, ledger_of_repeats
from worker.frames import SourceRef


def ref(offset: int) -> SourceRef:
    return SourceRef("t.bulk", 1, offset)


FRAME = Sent("frame", RESULT, ("s1", 4), "d53")


def test_a_copy_before_the_reported_offset_expects_the_result_and_the_reported_one_the_dead_letter() -> None:
    sent = {ref(52): Sent("frame", RESULT, ("s0", 4), "d52"), ref(53): FRAME}
    found = [(ref(50), "d53"), (ref(52), "d52"), (ref(53), "d53")]
    got = ledger_of_repeats(sent, found)
    assert got[ref(50)] == (FRAME, ref(53))
    again, original = got[ref(53)]
    assert original == ref(53) and again.expect == DEAD_LETTER and again.frame_id == ("s1", 4)
    assert ref(52) not in got


def test_a_copy_after_the_reported_offset_expects_the_dead_letter() -> None:
    got = ledger_of_repeats({ref(53): FRAME}, [(ref(53), "d53"), (ref(60), "d53")])
    assert got[ref(53)] == (FRAME, ref(53))
    assert got[ref(60)][0].expect == DEAD_LETTER


def test_messages_no_report_named_and_no_copy_of_one_are_left_alone() -> None:
    assert ledger_of_repeats({ref(53): FRAME}, [(ref(53), "d53"), (ref(54), "other")]) == {}
    assert ledger_of_repeats({ref(53): FRAME}, []) == {}
