"""The frames waiting for a batch: per class, groups of one batch shape and lane; per group, a heap for the oldest
frame and per-tenant FIFO queues taken by deficit round robin (the Tenants rule of the package docstring)."""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable

from worker.config import BatchingSettings
from worker.frames import Frame, Priority

# The arrival key (t, seq) of "no frame": later than every frame, so it never cuts anything off.
NO_CUTOFF: tuple[float, int] = (math.inf, 2**63)


class Entry:
    """One pending frame; `live` turns False when it leaves (batched, expired, discarded): lazy deletion."""

    __slots__ = ("frame", "group", "live", "seq", "t", "tenant")

    def __init__(self, frame: Frame, seq: int, group: Group):
        self.frame = frame
        self.t = frame.received_at
        self.seq = seq  # (t, seq) is the arrival order
        self.tenant = frame.tenant
        self.group = group
        self.live = True


class Group:
    """Pending frames of one (class, shape, lane): per-tenant FIFO queues plus a heap for the oldest."""

    __slots__ = (
        "area",
        "cap",
        "cap_static",
        "cls",
        "credit",
        "due_at",
        "fallback",
        "frame_bytes",
        "full_reason",
        "heap",
        "n",
        "queues",
        "reason_static",
        "ring",
        "shape",
        "trigger",
        "trigger_static",
    )

    def __init__(self, cls: ClassState, shape: tuple[int, int, int], fallback: bool, frame_bytes: int,
                 cap: int, trigger: int, full_reason: str):
        self.cls = cls
        self.shape = shape
        self.area = shape[0] * shape[1]
        self.fallback = fallback
        self.frame_bytes = frame_bytes
        self.cap = cap
        self.trigger = trigger
        self.full_reason = full_reason
        # The sizes from settings alone; the cost model may lower cap (blocking bound) and move the trigger.
        self.cap_static, self.trigger_static, self.reason_static = cap, trigger, full_reason
        self.n = 0
        self.due_at = math.inf  # when this group has a batch due (full, overdue or fallback)
        self.heap: list[tuple[float, int, Entry]] = []
        self.queues: dict[str, deque[Entry]] = {}
        self.ring: deque[str] = deque()  # tenants with queued entries, in round-robin order
        self.credit: dict[str, int] = {}  # deficit left in a tenant's current turn

    def oldest(self) -> Entry | None:
        heap = self.heap
        while heap and not heap[0][2].live:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def oldest_key(self) -> tuple[float, int]:
        e = self.oldest()
        return NO_CUTOFF if e is None else (e.t, e.seq)

    def refresh_due(self) -> None:
        e = self.oldest()
        if e is None:
            self.due_at = math.inf
        elif self.fallback or self.n >= self.trigger:
            self.due_at = e.t
        else:
            due = e.t + self.cls.wait_s
            start_by = self.cls.start_by
            if start_by is not None:
                latest = start_by(self, e)
                if latest >= e.t:  # arrived too late to meet the budget anyway: waiting to fill costs nothing more
                    due = min(due, latest)
            self.due_at = due

    def take(self, k: int, out: list[Entry], age_now: float | None, cutoff: tuple[float, int] | None,
             weights: dict[str, int]) -> int:
        """Deficit round robin over tenants (quantum: the tenant's weight, default 1): mark up to k live entries
        taken and move them to `out`; how many. With `age_now`, only frames overdue at that time
        (t + max_wait <= age_now); with `cutoff`, only frames that arrived before it. The caller keeps the
        counts (Pending.take)."""
        ring, queues, credit = self.ring, self.queues, self.credit
        wait_s = self.cls.wait_s
        taken = 0
        idle = 0  # tenants visited in a row without taking anything
        while taken < k and ring and idle < len(ring):
            tenant = ring[0]
            q = queues[tenant]
            c = credit.get(tenant, 0)
            if c <= 0:
                c = weights.get(tenant, 1)
            took = 0
            while c > 0 and taken < k and q:
                e = q[0]
                if not e.live:
                    q.popleft()
                    continue
                if (age_now is not None and e.t + wait_s > age_now) or (
                        cutoff is not None and (e.t, e.seq) >= cutoff):
                    break
                q.popleft()
                e.live = False
                out.append(e)
                c -= 1
                taken += 1
                took += 1
            while q and not q[0].live:
                q.popleft()
            if not q:  # no live frames left: the tenant leaves the ring (progress, so not idle)
                ring.popleft()
                del queues[tenant]
                credit.pop(tenant, None)
                if took:
                    idle = 0
                continue
            credit[tenant] = c
            if c <= 0 or taken < k:  # turn over, or blocked by age/cutoff: next tenant
                ring.rotate(-1)
            idle = 0 if took else idle + 1
        return taken


class ClassState:
    """One priority class: its groups (exact and fallback lanes, by shape), its counts, and what the class
    selection (credit), backpressure (mem_paused) and sizing (start_by) keep for it."""

    __slots__ = ("budget_s", "credit", "fallback", "groups", "max_age_s", "max_batch", "mem_paused", "pending",
                 "pending_bytes", "priority", "share", "start_by", "wait_s", "weight")

    def __init__(self, priority: Priority, settings: BatchingSettings):
        c = settings.for_class(priority)
        self.priority = priority
        self.wait_s = c.max_wait_ms / 1000.0
        self.max_age_s = c.max_age_ms / 1000.0
        self.budget_s = c.latency_budget_ms / 1000.0
        self.share = c.pending_share
        self.weight = c.weight
        self.max_batch = settings.max_batch_size_for(priority)
        self.groups: dict[tuple[int, int, int], Group] = {}
        self.fallback: dict[tuple[int, int, int], Group] = {}
        self.pending = 0
        self.pending_bytes = 0
        self.credit = 0  # smooth weighted round robin among classes
        self.mem_paused = False  # this class and the less urgent ones hold their share of the caps
        # With a budget and a cost model: the latest start for a group's batch to finish within the budget.
        self.start_by: Callable[[Group, Entry], float] | None = None

    def oldest_key(self) -> tuple[float, int]:
        """Arrival key of the class's oldest pending frame (NO_CUTOFF when it has none)."""
        keys = [g.oldest_key() for groups in (self.fallback, self.groups) for g in groups.values()]
        return min(keys, default=NO_CUTOFF)


class Pending:
    """Every frame waiting for a batch, in its class's groups, and the totals backpressure reads."""

    __slots__ = ("bytes", "classes", "frames", "seq", "tenant_weights")

    def __init__(self, settings: BatchingSettings):
        self.classes = tuple(ClassState(p, settings) for p in sorted(Priority))  # indexed by Priority
        self.tenant_weights = dict(settings.tenant_weights)
        self.frames = 0
        self.bytes = 0  # tensor bytes (the batch shape's h*w*c*tensor_dtype_bytes)
        self.seq = 0

    def enqueue(self, frame: Frame, group: Group) -> Entry:
        """Queue a frame in `group`, at the back of its tenant's queue, and bring the group's due time up to date."""
        seq = self.seq = self.seq + 1
        entry = Entry(frame, seq, group)
        t = entry.t
        heapq.heappush(group.heap, (t, seq, entry))
        queue = group.queues.get(entry.tenant)
        if queue is None:
            queue = group.queues[entry.tenant] = deque()
            group.ring.append(entry.tenant)
        queue.append(entry)
        group.n += 1
        cls = group.cls
        cls.pending += 1
        cls.pending_bytes += group.frame_bytes
        self.frames += 1
        self.bytes += group.frame_bytes
        if group.n >= group.trigger or group.fallback or cls.start_by is not None:
            group.refresh_due()
        elif t + cls.wait_s < group.due_at:
            group.due_at = t + cls.wait_s
        return entry

    def take(self, group: Group, k: int, out: list[Entry], age_now: float | None,
             cutoff: tuple[float, int] | None) -> int:
        """Up to k entries of `group` into `out`, tenants in deficit round robin (Group.take); how many."""
        taken = group.take(k, out, age_now, cutoff, self.tenant_weights)
        if taken:
            self.forget(group, taken)
        return taken

    def take_two_tier(self, group: Group, k: int, out: list[Entry], age_now: float,
                      cutoff: tuple[float, int] | None) -> None:
        """Up to k entries: the frames overdue at `age_now` first, then the others; tenants in turn within each."""
        taken = self.take(group, k, out, age_now, cutoff)
        if taken < k:
            self.take(group, k - taken, out, None, cutoff)

    def forget(self, group: Group, count: int) -> None:
        """Bookkeeping for `count` entries of `group` that just stopped being live."""
        group.n -= count
        group.cls.pending -= count
        group.cls.pending_bytes -= count * group.frame_bytes
        self.frames -= count
        self.bytes -= count * group.frame_bytes
        if group.n:
            group.refresh_due()
            return
        groups = group.cls.fallback if group.fallback else group.cls.groups
        if groups.get(group.shape) is group:
            del groups[group.shape]
        # Entries point at their group: empty its containers so no reference cycle is left for the GC.
        group.heap.clear()
        group.queues.clear()
        group.ring.clear()
        group.due_at = math.inf

    def discard(self, predicate: Callable[[Frame], bool]) -> list[Frame]:
        """Remove and return the pending frames matching `predicate`; walks every frame."""
        out = []
        for cls in self.classes:
            for groups in (cls.fallback, cls.groups):
                for group in list(groups.values()):
                    count = 0
                    for q in group.queues.values():
                        for e in q:
                            if e.live and predicate(e.frame):
                                e.live = False
                                out.append(e.frame)
                                count += 1
                    if count:
                        self.forget(group, count)
        return out
