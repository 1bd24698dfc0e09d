"""The fault suite's ledger when its feeder wrote a message twice (an idempotent producer's retry across a leader
change): the worker scores the first copy and dead-letters the repeat, and the ledger expects exactly that. And
the audit of a run, over the kit's FrameLedger."""

from __future__ import annotations

from tests.reliability.harness import Sent, audit, digest, ledger_of_repeats
from worker.frames import SourceRef
from worker.testing import DEAD_LETTER, RESULT
from worker.tools.read_results import DeadLetterRecord


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


def result(offset: int, frame_id: tuple[str, int]) -> dict:
    return {"source_topic": "t.bulk", "source_partition": 1, "source_offset": offset, "stream_id": frame_id[0],
            "frame_index": frame_id[1]}


def dead_letter(offset: int | None, value: bytes) -> DeadLetterRecord:
    headers = {"streamfer.error": "bad", "streamfer.error_type": "MessageDecodeError"}
    if offset is not None:
        headers |= {"streamfer.source_topic": "t.bulk", "streamfer.source_partition": "1",
                    "streamfer.source_offset": str(offset)}
    return DeadLetterRecord(None, value, headers)


def test_the_audit_counts_every_way_a_run_can_break_its_promise() -> None:
    sent = {ref(0): Sent("frame", RESULT, ("s", 0)), ref(1): Sent("frame", RESULT, ("s", 1)),
            ref(2): Sent("frame", RESULT, ("s", 2)), ref(3): Sent("garbage", DEAD_LETTER, None, digest(b"x"))}
    a = audit(sent, [result(0, ("s", 0)), result(0, ("s", 0)), result(1, ("s", 9)), result(3, ("?", 0)),
                     result(7, ("s", 7))],
              [dead_letter(3, b"y"), dead_letter(None, b"z")])
    assert (a.produced, a.results, a.dead_letters) == (4, 5, 2)
    assert a.lost == 1 and a.lost_sample == [f"{ref(2)} frame ('s', 2)"]
    assert a.duplicated == 2  # offset 0 twice; garbage both scored and dead-lettered
    assert a.misrouted == 1 and a.misrouted_sample[0].startswith(f"{ref(3)} garbage: expected dead_letter")
    assert a.phantom == 2  # offset 7 was never sent; one dead letter names no message
    assert a.mismatched == 1 and a.bad_headers == 1 and a.dead_letters_without_original == 1
