"""Recovery time: seconds from a fault to the first answer of each input partition it affected, read from the
answers themselves (each result's Kafka timestamp, the time the broker appended it, and its source partition).

A partition counts for a fault when the fault interrupted it: it was in service (answered within IN_SERVICE_S
before the fault) and had input waiting (a message sent before the fault whose first answer came after it, or never;
for a SIGTERM, after the drained process exited).
A partition with nothing to do measures nothing (its next answer waits for new input, not for the worker), nor does
one the worker had not reached yet (a bulk backlog behind realtime: its first answer waits for the priorities, with
or without a fault). Pure: no Kafka.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from worker.frames import SourceRef

TP = tuple[str, int]
# A partition answered within this long before a fault was being served when it hit.
IN_SERVICE_S = 5.0


@dataclass(frozen=True)
class FaultMoment:
    """When a fault hit (time.time(), the clock the results' timestamps use) and the input partitions it left without
    a server: a killed or stopped worker's partitions, or None for every partition (a broker or node fault).

    `began`: when the fault was set off, where that is before `at`, the moment from which only a successor can
    answer (a SIGTERM before the drained process exits; a broker's stop before it is down; a kill while the broker
    is frozen before the dead process's requests on the wire have landed). Recovery counts from `began` to the first
    answer after `at`: an answer in between (the drain's, the dead process's last) is not the recovery's."""

    at: float
    partitions: frozenset[TP] | None = None
    began: float | None = None

    @property
    def start(self) -> float:
        return self.at if self.began is None else self.began


@dataclass(frozen=True)
class Recovery:
    """One interrupted partition of one fault: seconds to its first answer after the fault (None: none came)."""

    partition: TP
    fault_at: float
    seconds: float | None


def recoveries(moments: Iterable[FaultMoment], intended: Mapping[SourceRef, float],
               answered: Mapping[SourceRef, Sequence[float]], in_service_s: float = IN_SERVICE_S) -> list[Recovery]:
    """Per fault and partition it interrupted, the time to that partition's first answer after it. `intended`: when
    each input message was sent; `answered`: when each one's answers were produced."""
    sent_by_tp: dict[TP, list[SourceRef]] = {}
    for ref in intended:
        sent_by_tp.setdefault(ref.topic_partition, []).append(ref)
    answers_by_tp: dict[TP, list[float]] = {}
    for ref, times in answered.items():
        answers_by_tp.setdefault(ref.topic_partition, []).extend(times)
    out: list[Recovery] = []
    for moment in moments:
        start = moment.start
        for tp in sorted(moment.partitions if moment.partitions is not None else sent_by_tp):
            times = answers_by_tp.get(tp, ())
            if not any(start - in_service_s < t <= start for t in times):
                continue
            if not any(_waiting(intended[ref], answered.get(ref, ()), start, moment.at)
                       for ref in sent_by_tp.get(tp, ())):
                continue
            after = [t for t in times if t > moment.at]
            out.append(Recovery(tp, moment.at, min(after) - start if after else None))
    return out


def _waiting(sent_at: float, answer_times: Sequence[float], began: float, down: float) -> bool:
    """Sent before the fault began, and not answered before nothing could serve it (a drain's answers are)."""
    return sent_at <= began and (not answer_times or min(answer_times) > down)


@dataclass(frozen=True)
class RecoverySummary:
    """Over the affected partitions of one or more runs: how many, median and max seconds, and how many never got
    an answer after their fault (the audit counts their frames as lost)."""

    partitions: int
    median_s: float | None
    max_s: float | None
    unanswered: int

    @classmethod
    def of(cls, items: Iterable[Recovery]) -> RecoverySummary:
        items = list(items)
        seconds = [r.seconds for r in items if r.seconds is not None]
        return cls(partitions=len(items), median_s=round(statistics.median(seconds), 1) if seconds else None,
                   max_s=round(max(seconds), 1) if seconds else None,
                   unanswered=sum(1 for r in items if r.seconds is None))

    def cell(self) -> str:
        """`median / max` for the table, `–` when the fault left no partition waiting."""
        if not self.partitions:
            return "–"
        text = f"{self.median_s} / {self.max_s}" if self.median_s is not None else "none"
        return text + (f" ({self.unanswered} never)" if self.unanswered else "")
