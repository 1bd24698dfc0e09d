"""Which assigned partitions the consumer holds paused: the union of four reasons, each decided elsewhere. Pure
policy (no Kafka import): FrameSource applies the plan with pause and resume calls.

- its priority class is paused (worker.reading.priority, through worker.loop.flow);
- it waits for its siblings (worker.reading.fairness);
- it waits for its committed offset (worker.kafka.committed);
- it holds frames for their writer schema past its bound (worker.kafka.schemahold).
"""

from __future__ import annotations

from collections.abc import Collection, Container, Iterable, Mapping

from worker.frames import TP, Priority


class PauseUnion:
    """The partitions paused now, and what to pause and resume to match the four reasons."""

    def __init__(self, priorities: Mapping[str, Priority]) -> None:
        self._priorities = priorities
        self._classes: frozenset[Priority] = frozenset()
        self._siblings: frozenset[TP] = frozenset()  # paused for their siblings (worker.reading.fairness)
        # The partitions the writer-schema hold paused, as last applied: a change re-applies the union.
        self._for_schemas: frozenset[TP] = frozenset()
        self._paused: set[TP] = set()

    def request(self, classes: Collection[Priority], siblings: frozenset[TP]) -> bool:
        """The loop's pauses (classes, and partitions held for their siblings); whether they changed."""
        if frozenset(classes) == self._classes and siblings == self._siblings:
            return False
        self._classes = frozenset(classes)
        self._siblings = siblings
        return True

    def schemas_changed(self, for_schemas: frozenset[TP]) -> bool:
        """Whether the writer-schema hold pauses other partitions than when the union was last planned."""
        return for_schemas != self._for_schemas

    def plan(self, assigned: Iterable[TP], awaiting_committed: Container[TP],
             for_schemas: frozenset[TP]) -> tuple[list[TP], list[TP]]:
        """What to pause (in partition order) and what to resume (highest class first, so its fetches start first)
        for the union over the `assigned` partitions; taken as done."""
        self._for_schemas = for_schemas
        classes, siblings, priorities = self._classes, self._siblings, self._priorities
        want = {tp for tp in assigned
                if priorities[tp[0]] in classes or tp in awaiting_committed or tp in siblings or tp in for_schemas}
        to_pause = sorted(want - self._paused)
        to_resume = sorted(self._paused - want, key=self.priority_order)
        self._paused = want
        return to_pause, to_resume

    def priority_order(self, tp: TP) -> tuple[int, str, int]:
        """Highest class first, then by topic and partition."""
        return (self._priorities[tp[0]].value, tp[0], tp[1])

    def drop_partitions(self, tps: Iterable[TP]) -> None:
        """Partitions given up: a partition assigned again starts resumed (librdkafka's own state for it)."""
        for tp in tps:
            self._paused.discard(tp)

    def __len__(self) -> int:
        return len(self._paused)
