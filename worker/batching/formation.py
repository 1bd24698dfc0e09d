"""What one released group's batch takes: a full or fallback group its trigger's worth; a deadline batch every
overdue frame, topped up to a preferred size, with padding partners of other shapes while the waste bound holds
(the Groups and lanes rule of the package docstring)."""

from __future__ import annotations

import math

from worker.batching.batch import Batch
from worker.batching.groups import Entry, Group, Pending
from worker.batching.lanes import LANE_EXACT, LANE_FALLBACK, LANE_PADDED
from worker.batching.sizing import Sizing
from worker.config import BatchingSettings
from worker.frames import Priority


class Formation:
    """Forms one batch from a group the class selection chose (or a flush)."""

    def __init__(self, settings: BatchingSettings, pending: Pending, sizing: Sizing):
        self._s = settings
        self._pending = pending
        self._sizing = sizing
        self._dtype_bytes = settings.tensor_dtype_bytes
        self._waste_max = settings.padding_waste_max

    def release(self, group: Group, now: float, age_now: float, cutoff: tuple[float, int] | None,
                early: str | None, limit: int | None = None) -> Batch | None:
        """Take one batch of at most `limit` frames from `group` (and padding partners); None if the cutoff left
        nothing to take. `early` ("flush", "idle"): why a group is released before it is due, its batch's reason
        (a full group keeps its own, except on a flush)."""
        cls = group.cls
        pending, sizing = self._pending, self._sizing
        out: list[Entry] = []
        limit = group.cap if limit is None else limit
        if group.fallback or group.n >= group.trigger:
            size = min(group.n, group.cap if group.fallback else group.trigger, limit)
            pending.take_two_tier(group, size, out, age_now, cutoff)
            if not out:
                return None
            reason = "flush" if early == "flush" else group.full_reason
            lane = LANE_FALLBACK if group.fallback else LANE_EXACT
            return self._batch(out, group.shape, cls.priority, lane, 0.0, now, reason)

        n_lead = min(group.n, group.cap, limit)
        target = min(group.trigger, limit)
        overdue = pending.take(group, n_lead, out, age_now, cutoff)
        # Padding partners change the batch's shape, so they are only used with no ordering cutoff (whose
        # partial takes could break the waste bound).
        plan: list[tuple[Group, int]] = []
        if cutoff is None and self._waste_max > 0 and n_lead < target:
            plan = self._plan_partners(group, n_lead, target)
        available = n_lead + sum(k for _, k in plan)
        size = sizing.size_for(overdue, available)
        if size <= n_lead:
            plan = []
        else:
            plan = _trim(plan, size - n_lead)
            if self._waste(group, n_lead, plan) > self._waste_max:
                plan = []
                size = sizing.size_for(overdue, n_lead)
        lead_size = min(size, n_lead)
        if lead_size > overdue:
            pending.take(group, lead_size - overdue, out, None, cutoff)
        for partner, k in plan:
            pending.take_two_tier(partner, k, out, age_now, None)
        if not out:
            return None
        if plan:
            height = max(group.shape[0], *(p.shape[0] for p, _ in plan))
            width = max(group.shape[1], *(p.shape[1] for p, _ in plan))
            shape = (height, width, group.shape[2])
            real = sum(e.group.area for e in out)
            waste = (len(out) * height * width - real) / (len(out) * height * width)
            return self._batch(out, shape, cls.priority, LANE_PADDED, waste, now, early or "deadline")
        return self._batch(out, group.shape, cls.priority, LANE_EXACT, 0.0, now, early or "deadline")

    def _plan_partners(self, lead: Group, n_lead: int, target: int) -> list[tuple[Group, int]]:
        """Greedy, closest area first: how many frames of each other same-channel shape join the lead."""
        channels = lead.shape[2]
        candidates = [g for g in lead.cls.groups.values()
                      if g is not lead and g.n and g.shape[2] == channels]
        if not candidates:
            return []
        candidates.sort(key=lambda g: abs(g.area - lead.area))
        per_pixel_bytes = channels * self._dtype_bytes
        height, width = lead.shape[0], lead.shape[1]
        n, real = n_lead, n_lead * lead.area
        keep = 1.0 - self._waste_max
        plan = []
        for g in candidates:
            if n >= target:
                break
            h2, w2 = max(height, g.shape[0]), max(width, g.shape[1])
            padded = h2 * w2
            room = min(self._sizing.memory_cap((h2, w2, channels), target),
                       self._s.max_batch_bytes // (padded * per_pixel_bytes)) - n
            if room <= 0 or _waste(n, real, padded) > self._waste_max:
                continue
            k = min(room, g.n)
            if _waste(n + k, real + k * g.area, padded) > self._waste_max:
                # real + k*a >= keep*(n+k)*padded  <=>  k <= (real - keep*n*padded) / (keep*padded - a)
                k = min(k, int((real - keep * n * padded) / (keep * padded - g.area)))
                while k > 0 and _waste(n + k, real + k * g.area, padded) > self._waste_max:
                    k -= 1
            if k <= 0:
                continue
            plan.append((g, k))
            height, width, n, real = h2, w2, n + k, real + k * g.area
        return plan

    def _waste(self, lead: Group, n_lead: int, plan: list[tuple[Group, int]]) -> float:
        """The padding waste of the lead's frames with the planned partners (inf past max_batch_bytes)."""
        if not plan:
            return 0.0
        height = max(lead.shape[0], *(g.shape[0] for g, _ in plan))
        width = max(lead.shape[1], *(g.shape[1] for g, _ in plan))
        n = n_lead + sum(k for _, k in plan)
        padded = height * width
        if n * padded * lead.shape[2] * self._dtype_bytes > self._s.max_batch_bytes:
            return math.inf
        return _waste(n, n_lead * lead.area + sum(k * g.area for g, k in plan), padded)

    def _batch(self, entries: list[Entry], shape: tuple[int, int, int], priority: Priority, lane: str,
               waste: float, now: float, reason: str) -> Batch:
        predicted = self._sizing.predicted(shape, len(entries))
        return Batch(tuple(e.frame for e in entries), shape, priority, lane, waste, now, reason, predicted)


def _trim(plan: list[tuple[Group, int]], keep: int) -> list[tuple[Group, int]]:
    """The plan cut to `keep` partner frames, closest shapes first."""
    out = []
    for g, k in plan:
        if keep <= 0:
            break
        out.append((g, min(k, keep)))
        keep -= k
    return out


def _waste(n: int, real_pixels: int, padded_pixels: int) -> float:
    """Share of the batch's padded pixels that are padding."""
    total = n * padded_pixels
    return (total - real_pixels) / total
