"""The frame ledger: what became of every input message, by its source coordinates (topic, partition, offset),
which every output carries (a result in its `source_*` fields, a dead letter in its `streamfer.source_*` headers).

One ledger for every check of the worker's promise (each message read answered once, nothing lost): the
integration tests, the fault suite's audit (tests/reliability) and the GPU benchmark's run (bench/gpu_e2e.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from worker.frames import HEADER_SOURCE_OFFSET, HEADER_SOURCE_PARTITION, HEADER_SOURCE_TOPIC, TP, SourceRef

RESULT = "result"
DEAD_LETTER = "dead_letter"
EITHER = "either"  # a message that may be answered either way (expected answers are RESULT, DEAD_LETTER or this)


def result_source(result: Mapping[str, Any]) -> SourceRef:
    """The coordinates of the input message a (decoded) result answers."""
    return SourceRef(result["source_topic"], result["source_partition"], result["source_offset"])


def dead_letter_source(headers: Mapping[str, str]) -> SourceRef | None:
    """The coordinates of the input message a dead letter stands for; None when its headers do not say."""
    try:
        return SourceRef(headers[HEADER_SOURCE_TOPIC], int(headers[HEADER_SOURCE_PARTITION]),
                         int(headers[HEADER_SOURCE_OFFSET]))
    except (KeyError, ValueError):
        return None


def ledger(results: Iterable[Mapping[str, Any]]) -> Counter[tuple[str, int]]:
    """How many results each frame id (stream_id, frame_index) got: for tests that know their frames by id."""
    return Counter((r["stream_id"], r["frame_index"]) for r in results)


@dataclass
class FrameLedger:
    """Every message sent (with the answer it expects) against every answer seen, by source coordinates.

    Lost: sent, never answered. Duplicated: answered more than once. Phantom: answered, never sent. Misrouted:
    answered otherwise than expected (a good frame dead-lettered, garbage scored)."""

    expected: dict[SourceRef, str] = field(default_factory=dict)
    answers: dict[SourceRef, list[str]] = field(default_factory=dict)
    unplaced: int = 0  # answers that name no coordinates (a dead letter without its source headers)

    def sent(self, ref: SourceRef, expect: str = RESULT) -> None:
        self.expected[ref] = expect

    def answered(self, ref: SourceRef | None, kind: str = RESULT) -> None:
        if ref is None:
            self.unplaced += 1
        else:
            self.answers.setdefault(ref, []).append(kind)

    def add_results(self, results: Iterable[Mapping[str, Any]]) -> None:
        for r in results:
            self.answered(result_source(r), RESULT)

    def add_dead_letters(self, headers: Iterable[Mapping[str, str]]) -> None:
        for h in headers:
            self.answered(dead_letter_source(h), DEAD_LETTER)

    def lost(self, committed: Mapping[TP, int] | None = None) -> list[SourceRef]:
        """Sent and never answered; with the group's `committed` offsets, only those below their partition's
        (a message above it was not read yet: it is not lost)."""
        return [ref for ref in sorted(self.expected, key=_order) if ref not in self.answers
                and (committed is None or ref.offset < committed.get(ref.topic_partition, 0))]

    def duplicated(self) -> dict[SourceRef, list[str]]:
        """The messages answered more than once, with their answers."""
        return {ref: got for ref, got in sorted(self.answers.items(), key=lambda kv: _order(kv[0])) if len(got) > 1}

    @property
    def duplicates(self) -> int:
        """Answers beyond the first, summed over messages."""
        return sum(len(got) - 1 for got in self.answers.values())

    @property
    def phantoms(self) -> int:
        """Answers for messages nobody sent, and answers that name no message."""
        return self.unplaced + sum(len(got) for ref, got in self.answers.items() if ref not in self.expected)

    def misrouted(self) -> list[SourceRef]:
        """Messages answered at least once otherwise than expected."""
        return [ref for ref, expect in sorted(self.expected.items(), key=lambda kv: _order(kv[0]))
                if expect != EITHER and any(g != expect for g in self.answers.get(ref, []))]

    def answered_at_or_above(self, committed: Mapping[TP, int]) -> int:
        """Messages answered at or above their partition's committed offset (their answer is out, their offset
        not committed: at-least-once answers them again after a restart)."""
        return sum(1 for ref in self.answers if ref.offset >= committed.get(ref.topic_partition, 0))


def _order(ref: SourceRef) -> tuple[str, int, int]:
    return (ref.topic, ref.partition, ref.offset)
