"""Which class's due batch goes next: smooth weighted round robin on the class weights, under the ordering and
slack rules; within a class, the due group with the oldest frame (the Classes rule of the package docstring)."""

from __future__ import annotations

import math

from worker.batching.batch import Batch
from worker.batching.formation import Formation
from worker.batching.groups import NO_CUTOFF, ClassState, Group, Pending
from worker.batching.sizing import Sizing
from worker.frames import Priority


class ClassSelection:
    """Picks the class and group of the next batch and has Formation form it."""

    def __init__(self, pending: Pending, sizing: Sizing, formation: Formation):
        self._classes = pending.classes
        self._sizing = sizing
        self._formation = formation

    def next_batch(self, now: float, max_priority: Priority, idle: bool) -> Batch | None:
        """The next batch due now of a class at most as low as `max_priority`; None when nothing is due. `idle`:
        every group with a frame counts as due (a partial one leaves with reason "idle")."""
        due: list[tuple[ClassState, list[Group]]] = []
        for cls in self._classes:
            if cls.pending and cls.priority <= max_priority:
                groups = [g for g in cls.fallback.values()]
                groups += [g for g in cls.groups.values() if idle or g.due_at <= now]
                if groups:
                    due.append((cls, groups))
        if not due:
            return None
        # Ordering rule: a class may only send frames that arrived before the oldest pending frame of every
        # more urgent class with a due batch; a class with no such group is not eligible this time.
        eligible: list[tuple[ClassState, list[Group], tuple[float, int] | None]] = []
        cutoff: tuple[float, int] | None = None
        for i, (cls, groups) in enumerate(due):
            # Within a class, the group with the oldest frame first.
            keyed = sorted((g.oldest_key(), g) for g in groups) if len(groups) > 1 else [(groups[0].oldest_key(),
                                                                                         groups[0])]
            ok = [g for key, g in keyed if cutoff is None or key < cutoff]
            if ok:
                eligible.append((cls, ok, cutoff))
            if i + 1 < len(due):
                oldest = cls.oldest_key()
                cutoff = oldest if cutoff is None else min(cutoff, oldest)
        total = 0
        if len(eligible) > 1:
            for cls, _, _ in eligible:
                cls.credit += cls.weight
                total += cls.weight
            eligible.sort(key=lambda d: (-d[0].credit, d[0].priority))
        for cls, groups, cls_cutoff in eligible:
            if cls is not due[0][0] and self._blocks_urgent(cls, groups[0], due, now):
                continue
            for group in groups:
                batch = self._formation.release(group, now, now, cls_cutoff, "idle" if idle else None,
                                                limit=self._sizing.budget_limit(group, now))
                if batch is not None:
                    cls.credit -= total
                    return batch
        raise AssertionError("unreachable: the most urgent due class always yields a batch")

    def _blocks_urgent(self, cls: ClassState, group: Group, due: list[tuple[ClassState, list[Group]]],
                       now: float) -> bool:
        """Whether running this class's next batch first would put a more urgent due class at risk (slack rule)."""
        extra = self._sizing.predict(group, min(group.n, group.trigger))
        for other, groups in due:
            if other.priority >= cls.priority:
                return False
            if self._at_risk(other, groups, now, extra):
                return True
        return False

    def _at_risk(self, cls: ClassState, groups: list[Group], now: float, extra_s: float) -> bool:
        """Whether a class with a deadline (budget or max age) must not give way: it is backlogged (more than a
        batch pending, its oldest past its wait), or its oldest due frame would miss its budget or expire if a
        batch of `extra_s` ran before the class's own next batch."""
        e = min((g.oldest() for g in groups), key=lambda x: (x.t, x.seq) if x is not None else NO_CUTOFF)
        if e is None:
            return False
        captured = e.frame.capture_ts_ms / 1000.0
        deadline = math.inf
        if cls.budget_s > 0:
            deadline = captured + cls.budget_s
        if cls.max_age_s > 0:
            deadline = min(deadline, captured + cls.max_age_s)
        if deadline == math.inf:
            return False
        if cls.pending > e.group.trigger and e.t + cls.wait_s <= now:
            return True  # backlogged: it is not keeping up, so any time given away now is shed from it later
        own = self._sizing.predict(e.group, min(e.group.n, e.group.trigger))
        return now + extra_s + own > deadline
