"""The micro-batcher: pure policy that turns polled frames into GPU batches. No Kafka, no torch; time comes
from an injected clock (the same clock, in seconds, as `Frame.received_at`). Not thread-safe: one loop owns it.

Guarantees and decisions, in the order the batcher applies them:

Groups and lanes. A frame joins the group of its class and batch shape (`batch_shape`): the model's fixed input
  (height, width) when the contract has one, since frames of any resolution become that same input (720p and
  1080p frames for a 224x224 model share batches, and no batch is padded), else the frame's own height and width;
  with the frame's channels. A group is released
  - full: when it holds its *trigger* size: the largest preferred size (settings.preferred_batch_sizes plus the
    runner's CUDA-graph buckets) that fits its cap, else the cap itself; the cap is min(the class's
    max_batch_size, max_batch_bytes // frame tensor bytes), and on a GPU at most the largest batch device
    memory takes for the input the device runs (worker.memorypolicy: what the devices take together, the
    executor splitting a batch larger than one device takes). Reason "full" when the trigger is the class's
    max_batch_size, "bytes" when the memory cap is what bounds it, else "preferred" (Triton: a batch of the
    largest preferred size goes at once);
  - deadline: when its oldest frame has waited its class's max_wait_ms. The batch takes every overdue frame
    (up to the cap) and is then topped up to the largest preferred size that holds them all and that the
    group (plus padding partners, below) can fill; when no preferred size fits in between, it takes all it
    can, and the runner pads it to its next bucket. One padded batch beats a 16+8+4+2+1 split, and no frame is
    ever left past its wait: while a group still has an overdue frame it stays due, so the caller draining
    pop_batch() gets every overdue frame in that same call sequence;
  - idle: pop_batch(idle=True), which the loop calls when no batch is running and its last poll took all the
    consumer had fetched: every group with a frame counts as due (a partial one leaves with reason "idle").
    Waiting for a fuller batch only saves time while the runtime is busy; on a backlog polls come back full and
    while a batch runs the next one fills, so batches still grow with the load.
  Padding ("padded" lane): a deadline batch short of its trigger may take frames of other shapes of the same
  class and channel count, closest pixel area first, padded to the largest height and width, while
  padded pixels / batch padded pixels <= padding_waste_max and the padded tensor stays <= max_batch_bytes (and,
  on a GPU, the batch within the memory policy's largest for the padded shape).
  Channels are never mixed. Partner frames leave before their own wait is up, which only shortens it.
Fallback lane. A frame whose tensor alone exceeds max_batch_bytes runs alone (never dropped). A shape seen
  fewer than rare_shape_min_count times (this frame included) within rare_shape_window_ms goes to the fallback
  lane: due at once, in batches of up to fallback_max_batch_size frames of its class and shape, so an odd
  shape neither waits nor holds a common shape's batch back.
Classes. Each pop_batch() serves one class among those with a due batch, by smooth weighted round robin on
  the class weights (realtime first when all are due, since it weighs most), with two rules on top:
  - ordering: a less urgent class may go ahead of a more urgent due class only with frames that arrived
    before that class's oldest pending frame, so a realtime frame is never released after a bulk frame that
    arrived later while both are due;
  - slack: and only when no more urgent due class with a deadline (latency_budget_ms or max_age_ms) is
    at risk: backlogged (more than a batch pending, its oldest past its wait), or its oldest due frame would
    miss its budget or expire if the less urgent batch (predicted time, cost model) ran before its own.
  So under overload the model serves realtime first, then standard; bulk (no deadline) waits, and standard
  sheds (expires) before realtime. With slack to spare, weights share the device and nothing starves. Within a
  class, the due group with the oldest frame goes first. pop_batch(max_priority) considers only classes at
  least that urgent (the loop's reserved realtime slot).
Cost model (optional, worker.costmodel, learned from measured batches). Per group:
  - trigger: with adaptive_batch_size, the measured size with the most frames per device second (reason
    "cost"), within the group's cap (so within its class's max_batch_size), instead of the static trigger above;
  - cap: for standard and bulk, the largest size predicted to run within max_blocking_ms (reason "blocking"),
    so a realtime batch waits behind at most one such batch. The bound holds while realtime is present (a
    realtime frame pending, or one arrived within realtime_quiet_ms; 0: always): with no realtime traffic it
    would only cost throughput, so lower classes then fill to full size;
  - budget: a batch of a class with latency_budget_ms takes at most the frames its oldest frame can wait for
    and still finish within the budget (unless that frame is already past it: then throughput), and a partial
    group is due by the latest start that still meets the budget, if that comes before its max_wait_ms.
  Without a cost model or a measurement for the shape, the static sizes and waits apply.
Tenants. Inside a group, frames are taken overdue-first and, within each of these two tiers, by deficit
  round robin over tenants (quantum = settings.tenant_weights[tenant], default 1; state kept across
  batches). Bound: a tenant of weight w with n frames in a tier, among tenants of total weight W with frames
  in that tier, has all n taken within (ceil(n / w) + 1) * W frames taken from that tier. E.g. with 2 tenants
  of weight 1, one flooding 1000 frames and one sending 10, the 10 all leave in the first 32-frame batch.
  Overdue-first means a flood never holds another tenant's frame past its own wait when the caller drains.
Expiry. A frame whose capture_ts_ms/1000 + class max_age_ms/1000 < clock() (max_age_ms 0: never) is never
  put in a batch: pop_batch() sets it aside and pop_expired() returns it.
Backpressure (classes_to_pause). A class pauses when its own pending frames or bytes reach its pending_share
  of max_pending_frames / max_pending_bytes (defaults: realtime 1, standard 0.5, bulk 0.25) and resumes below
  75% of that; every class pauses when all classes together reach the caps, until they are below 75% of them
  or realtime holds nothing (the others are bounded by their shares, so their frames alone never keep realtime
  paused). Less urgent classes therefore wait in Kafka (bulk has no deadline), never in realtime's room.
  poll_room() says how many frames the source may read so a still-reading class overshoots by one poll at most.
  When realtime is backlogged (at least its max_batch_size frames pending and its oldest past its max_wait_ms)
  bulk pauses, and standard too once more than 2 * that are pending; they resume only once
  realtime is drained (no frame pending). A standard backlog pauses nothing: bulk gets no model time while
  standard is at risk (the slack rule) and holds at most its share. The hysteresis matters:
  librdkafka drops a paused partition's prefetched messages (which also takes them out of the shared fetch
  queue ahead of realtime), so pausing on every late frame made all classes slower. A steady stream within
  capacity pauses nothing. Call it after dispatching what the runtime has room for, so that frames still due
  are the backlog.
  A frame's bytes are its batch tensor's share: at the model's fixed input size when it has one (a 1080p
  frame bound for 224x224 holds a 224x224 row), else at the frame's own size. poll_room() also bounds the
  frames read by the bytes left, at the largest frame seen so far; a frame's size is only known once read,
  so max_pending_bytes pauses reading but may be passed by one poll of frames larger than any before.
  add() raises BatcherFullError past twice max_pending_frames (except into an empty batcher): the source
  did not pause.
next_due() is the earliest of the groups' release times and the next expiry (a time <= now means now),
  so the caller can sleep until then.
Cost. add() and a release are O(log n) in the group's pending frames; pop_batch() and next_due() also scan
  the groups (one per class and shape in use), never the frames; discard() alone walks every frame.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from worker.config import BatchingSettings, ConfigError
from worker.costmodel import CostModel
from worker.errors import StreamferError
from worker.frames import Frame, Priority
from worker.memorypolicy import BatchSizeLimit

LANE_EXACT = "exact"
LANE_PADDED = "padded"
LANE_FALLBACK = "fallback"

# Backpressure resumes below this share of max_pending_frames / max_pending_bytes.
RESUME_WATERMARK = 0.75
# add() refuses frames beyond this multiple of max_pending_frames: the caller ignored classes_to_pause().
HARD_CAP_FACTOR = 2
# The expiry heap is rebuilt from the frames still pending once it holds this many more than twice as many.
EXPIRY_HEAP_SLACK = 64

_NO_CUTOFF: tuple[float, int] = (math.inf, 2**63)


class BatcherFullError(StreamferError):
    """add() was called past the hard cap: the source kept consuming while classes_to_pause() said stop."""


@dataclass(frozen=True)
class Batch:
    """Frames of one class to run together, padded to `shape` = (height, width, channels)."""

    frames: tuple[Frame, ...]
    shape: tuple[int, int, int]
    priority: Priority
    lane: str
    padding_waste: float
    released_at: float
    reason: str
    # The cost model's predicted run time (preprocess + inference) for this size and shape; None if unknown.
    predicted_s: float | None = None

    @property
    def size(self) -> int:
        return len(self.frames)


class _Entry:
    """One pending frame; `live` turns False when it leaves (batched, expired, discarded): lazy deletion."""

    __slots__ = ("frame", "group", "live", "seq", "t", "tenant")

    def __init__(self, frame: Frame, seq: int, group: _Group):
        self.frame = frame
        self.t = frame.received_at
        self.seq = seq  # (t, seq) is the arrival order
        self.tenant = frame.tenant
        self.group = group
        self.live = True


class _Group:
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

    def __init__(self, cls: _ClassState, shape: tuple[int, int, int], fallback: bool, frame_bytes: int,
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
        self.heap: list[tuple[float, int, _Entry]] = []
        self.queues: dict[str, deque[_Entry]] = {}
        self.ring: deque[str] = deque()  # tenants with queued entries, in round-robin order
        self.credit: dict[str, int] = {}  # deficit left in a tenant's current turn

    def oldest(self) -> _Entry | None:
        heap = self.heap
        while heap and not heap[0][2].live:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def oldest_key(self) -> tuple[float, int]:
        e = self.oldest()
        return _NO_CUTOFF if e is None else (e.t, e.seq)

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


class _ClassState:
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
        self.groups: dict[tuple[int, int, int], _Group] = {}
        self.fallback: dict[tuple[int, int, int], _Group] = {}
        self.pending = 0
        self.pending_bytes = 0
        self.credit = 0  # smooth weighted round robin among classes
        self.mem_paused = False  # this class and the less urgent ones hold their share of the caps
        # With a budget and a cost model: the latest start for a group's batch to finish within the budget.
        self.start_by: Callable[[_Group, _Entry], float] | None = None


class MicroBatcher:
    """Shape-, class- and tenant-aware micro-batcher; see the module docstring for the policy."""

    def __init__(self, settings: BatchingSettings, clock: Callable[[], float],
                 preferred_batch_sizes: Sequence[int] = (), cost: CostModel | None = None,
                 memory: BatchSizeLimit | None = None, input_hw: tuple[int, int] | None = None) -> None:
        bad = [s for s in preferred_batch_sizes if s < 1]
        if bad:
            raise ConfigError([f"preferred_batch_sizes: sizes must be >= 1 (got {bad})"])
        self._s = settings
        self._clock = clock
        # Runner buckets above every class's max_batch_size are simply never reached (a group's own cap filters).
        self._preferred = tuple(sorted({s for s in (*settings.preferred_batch_sizes, *preferred_batch_sizes)
                                        if 1 <= s <= settings.largest_batch_size}))
        self._dtype_bytes = settings.tensor_dtype_bytes
        self._input_hw = input_hw  # the model's fixed input (height, width): the batch shape of every frame
        self._largest_frame_bytes = 0
        self._waste_max = settings.padding_waste_max
        self._rare_window_s = settings.rare_shape_window_ms / 1000.0
        self._rare_min = settings.rare_shape_min_count
        self._tenant_weights = dict(settings.tenant_weights)
        self._classes = tuple(_ClassState(p, settings) for p in sorted(Priority))
        self._cost = cost
        self._memory = memory  # device memory peaks measured at warm-up: a cap per shape
        self._cost_version = -1
        self._adaptive = settings.adaptive_batch_size
        self._blocking_s = settings.blocking_limit_ms / 1000.0
        self._quiet_s = settings.realtime_quiet_ms / 1000.0
        self._realtime_seen_at = -math.inf  # received_at of the latest realtime frame
        self._bounded = self._quiet_s == 0  # lower classes' batches bounded by the blocking limit now
        # Groups are emptied and made again all the time: a new one takes the sizes last worked out for its class
        # and shape, while the cost model has learned nothing since and the blocking bound is unchanged.
        self._sized: dict[tuple[Priority, tuple[int, int, int], int, int, str], tuple[int, int, str]] = {}
        self._sized_at = (-1, self._bounded)
        if cost is not None:
            for cls in self._classes:
                if cls.budget_s > 0:
                    cls.start_by = self._start_by
        self._shape_seen: dict[tuple[int, int, int], deque[float]] = {}
        self._shape_sweep_at = 1024
        self._expiry: list[tuple[float, int, _Entry]] = []
        self._expired: list[Frame] = []
        self._seq = 0
        self._pending_frames = 0
        self._pending_bytes = 0
        self._paused_all = False  # every class together at the caps
        # Classes paused for a backlog of a more urgent class; they stay paused until it is drained (hysteresis:
        # librdkafka drops a paused partition's fetched messages, so flapping pauses costs refetches).
        self._priority_pause: set[Priority] = set()
        self._backlog_pauses: dict[Priority, set[Priority]] = {}

    # ----------------------------------------------------------------------------------------------- intake

    def add(self, frame: Frame) -> None:
        """Enqueue a frame at frame.received_at; raises BatcherFullError past the hard cap."""
        s = self._s
        shape = batch_shape((frame.height, frame.width, frame.channels), self._input_hw)
        frame_bytes = shape[0] * shape[1] * shape[2] * self._dtype_bytes
        if self._pending_frames and self._pending_frames >= HARD_CAP_FACTOR * s.max_pending_frames:
            raise BatcherFullError(
                f"batcher holds {self._pending_frames} frames, past {HARD_CAP_FACTOR}x batching.max_pending_frames: "
                f"the source must pause the classes returned by classes_to_pause() and drain pop_batch() before "
                f"adding more")
        self._largest_frame_bytes = max(self._largest_frame_bytes, frame_bytes)
        cls = self._classes[frame.priority]
        t = frame.received_at
        if frame.priority == Priority.REALTIME and t > self._realtime_seen_at:
            self._realtime_seen_at = t
        fallback = frame_bytes > s.max_batch_bytes or self._is_rare(shape, t)
        groups = cls.fallback if fallback else cls.groups
        group = groups.get(shape)
        if group is None:
            group = groups[shape] = self._new_group(cls, shape, fallback, frame_bytes)
        seq = self._seq = self._seq + 1
        entry = _Entry(frame, seq, group)
        heapq.heappush(group.heap, (t, seq, entry))
        queue = group.queues.get(entry.tenant)
        if queue is None:
            queue = group.queues[entry.tenant] = deque()
            group.ring.append(entry.tenant)
        queue.append(entry)
        group.n += 1
        cls.pending += 1
        cls.pending_bytes += frame_bytes
        self._pending_frames += 1
        self._pending_bytes += frame_bytes
        self._latch_memory_pauses(frame.priority)
        if group.n >= group.trigger or fallback or cls.start_by is not None:
            group.refresh_due()
        elif t + cls.wait_s < group.due_at:
            group.due_at = t + cls.wait_s
        if cls.max_age_s > 0:
            heapq.heappush(self._expiry, (frame.capture_ts_ms / 1000.0 + cls.max_age_s, seq, entry))

    def _is_rare(self, shape: tuple[int, int, int], t: float) -> bool:
        # Only the last rare_shape_min_count arrival times matter: rare iff the oldest of them is out of window.
        seen = self._shape_seen.get(shape)
        if seen is None:
            if len(self._shape_seen) >= self._shape_sweep_at:
                self._sweep_shapes(t)
            seen = self._shape_seen[shape] = deque(maxlen=self._rare_min)
        seen.append(t)
        return len(seen) < self._rare_min or t - seen[0] > self._rare_window_s

    def _sweep_shapes(self, t: float) -> None:
        horizon = t - self._rare_window_s
        self._shape_seen = {k: v for k, v in self._shape_seen.items() if v[-1] >= horizon}
        self._shape_sweep_at = max(1024, 2 * len(self._shape_seen))

    def _new_group(self, cls: _ClassState, shape: tuple[int, int, int], fallback: bool,
                   frame_bytes: int) -> _Group:
        s = self._s
        cap = max(1, min(cls.max_batch, s.max_batch_bytes // frame_bytes))
        cap = self._memory_cap(shape, cap)
        if fallback:
            limit = 1 if frame_bytes > s.max_batch_bytes else min(s.fallback_max_batch_size, cap)
            return _Group(cls, shape, True, frame_bytes, limit, limit, "fallback")
        trigger = max((p for p in self._preferred if p <= cap), default=cap)
        if trigger == cls.max_batch:
            reason = "full"
        elif cap < cls.max_batch:
            reason = "bytes"
        else:
            reason = "preferred"
        group = _Group(cls, shape, False, frame_bytes, cap, trigger, reason)
        if self._cost is not None:
            self._size_from_cost(group)
        return group

    # ------------------------------------------------------------------------------------------- cost model

    def _sync_cost(self) -> None:
        """Re-size every group when the cost model learned something since the last look, or realtime came or
        went (the blocking bound follows it)."""
        cost = self._cost
        if cost is None:
            return
        bounded = self._realtime_present()
        if cost.version == self._cost_version and bounded == self._bounded:
            return
        self._cost_version = cost.version
        self._bounded = bounded
        for cls in self._classes:
            for group in cls.groups.values():
                self._size_from_cost(group)
                group.refresh_due()

    def _realtime_present(self) -> bool:
        """Whether a realtime frame is pending or arrived within realtime_quiet_ms (always, with 0)."""
        return (self._quiet_s == 0 or self._classes[Priority.REALTIME].pending > 0
                or self._clock() - self._realtime_seen_at <= self._quiet_s)

    def _size_from_cost(self, group: _Group) -> None:
        """The group's cap, trigger and full reason from the cost model, worked out once per class and shape until
        the model learns something or the blocking bound comes or goes."""
        cost = self._cost
        assert cost is not None
        if self._sized_at != (cost.version, self._bounded):
            self._sized.clear()
            self._sized_at = (cost.version, self._bounded)
        key = (group.cls.priority, group.shape, group.cap_static, group.trigger_static, group.reason_static)
        sized = self._sized.get(key)
        if sized is None:
            sized = self._sized[key] = self._sizes_from_cost(cost, group)
        group.cap, group.trigger, group.full_reason = sized

    def _sizes_from_cost(self, cost: CostModel, group: _Group) -> tuple[int, int, str]:
        """cap: while realtime is present, bounded so a standard or bulk batch runs at most the blocking limit;
        trigger: the measured size with the most frames per device second (adaptive), within that cap."""
        cap, trigger, reason = group.cap_static, group.trigger_static, group.reason_static
        if group.cls.priority != Priority.REALTIME and self._blocking_s > 0 and self._bounded:
            k = cost.largest_within(group.shape, self._blocking_s, cap)
            if k is not None and k < cap:
                cap, reason = max(1, k), "blocking"
        if self._adaptive:
            best = cost.best_size(group.shape, cap)
            if best is not None:
                trigger, reason = best, "cost"
        return cap, min(trigger, cap), reason

    def _predict(self, group: _Group, n: int) -> float:
        """Predicted seconds for n frames of the group's shape; 0 when unknown (no model, nothing measured)."""
        if self._cost is None:
            return 0.0
        t = self._cost.predict(group.shape, n)
        return 0.0 if t is None else t

    def _start_by(self, group: _Group, e: _Entry) -> float:
        """Latest release of the group's next batch for its oldest frame to finish within the class budget."""
        return (e.frame.capture_ts_ms / 1000.0 + group.cls.budget_s
                - self._predict(group, min(group.n, group.trigger)))

    def _budget_limit(self, group: _Group, now: float) -> int:
        """Most frames the group's next batch may take so that its oldest frame finishes within the budget. A
        frame already past it gets throughput instead (smaller batches would only make more frames late)."""
        cls = group.cls
        if self._cost is None or cls.budget_s <= 0 or group.fallback:
            return group.cap
        e = group.oldest()
        if e is None:
            return group.cap
        remaining = e.frame.capture_ts_ms / 1000.0 + cls.budget_s - now
        k = self._cost.largest_within(group.shape, remaining, group.cap)
        return group.cap if k is None or k < 1 else k

    def _at_risk(self, cls: _ClassState, groups: list[_Group], now: float, extra_s: float) -> bool:
        """Whether a class with a deadline (budget or max age) must not give way: it is backlogged (more than a
        batch pending, its oldest past its wait), or its oldest due frame would miss its budget or expire if a
        batch of `extra_s` ran before the class's own next batch."""
        e = min((g.oldest() for g in groups), key=lambda x: (x.t, x.seq) if x is not None else _NO_CUTOFF)
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
        own = self._predict(e.group, min(e.group.n, e.group.trigger))
        return now + extra_s + own > deadline

    # ---------------------------------------------------------------------------------------------- release

    def pop_batch(self, max_priority: Priority = Priority.BULK, idle: bool = False) -> Batch | None:
        """The next batch due now of a class at most as low as `max_priority`, by urgency, class weights and the
        ordering rule; None when nothing is due. `idle`: the runtime runs nothing and no more input is waiting, so
        every group with a frame counts as due (a partial one leaves with reason "idle")."""
        now = self._clock()
        self._collect_expired(now)
        if not self._pending_frames:
            return None
        self._sync_cost()
        due: list[tuple[_ClassState, list[_Group]]] = []
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
        eligible: list[tuple[_ClassState, list[_Group], tuple[float, int] | None]] = []
        cutoff: tuple[float, int] | None = None
        for i, (cls, groups) in enumerate(due):
            # Within a class, the group with the oldest frame first.
            keyed = sorted((g.oldest_key(), g) for g in groups) if len(groups) > 1 else [(groups[0].oldest_key(),
                                                                                         groups[0])]
            ok = [g for key, g in keyed if cutoff is None or key < cutoff]
            if ok:
                eligible.append((cls, ok, cutoff))
            if i + 1 < len(due):
                oldest = self._oldest_key(cls)
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
                batch = self._release(group, now, now, cls_cutoff, "idle" if idle else None,
                                      limit=self._budget_limit(group, now))
                if batch is not None:
                    cls.credit -= total
                    return batch
        raise AssertionError("unreachable: the most urgent due class always yields a batch")

    def _blocks_urgent(self, cls: _ClassState, group: _Group, due: list[tuple[_ClassState, list[_Group]]],
                       now: float) -> bool:
        """Whether running this class's next batch first would put a more urgent due class at risk (slack rule)."""
        extra = self._predict(group, min(group.n, group.trigger))
        for other, groups in due:
            if other.priority >= cls.priority:
                return False
            if self._at_risk(other, groups, now, extra):
                return True
        return False

    @staticmethod
    def _oldest_key(cls: _ClassState) -> tuple[float, int]:
        keys = [g.oldest_key() for groups in (cls.fallback, cls.groups) for g in groups.values()]
        return min(keys, default=_NO_CUTOFF)

    def _release(self, group: _Group, now: float, age_now: float, cutoff: tuple[float, int] | None,
                 early: str | None, limit: int | None = None) -> Batch | None:
        """Take one batch of at most `limit` frames from `group` (and padding partners); None if the cutoff left
        nothing to take. `early` ("flush", "idle"): why a group is released before it is due, its batch's reason
        (a full group keeps its own, except on a flush)."""
        cls = group.cls
        out: list[_Entry] = []
        limit = group.cap if limit is None else limit
        if group.fallback or group.n >= group.trigger:
            size = min(group.n, group.cap if group.fallback else group.trigger, limit)
            self._take_two_tier(group, size, out, age_now, cutoff)
            if not out:
                return None
            reason = "flush" if early == "flush" else group.full_reason
            lane = LANE_FALLBACK if group.fallback else LANE_EXACT
            return self._batch(out, group.shape, cls.priority, lane, 0.0, now, reason)

        n_lead = min(group.n, group.cap, limit)
        target = min(group.trigger, limit)
        overdue = self._take(group, n_lead, out, age_now, cls.wait_s, cutoff)
        # Padding partners change the batch's shape, so they are only used with no ordering cutoff (whose
        # partial takes could break the waste bound).
        plan: list[tuple[_Group, int]] = []
        if cutoff is None and self._waste_max > 0 and n_lead < target:
            plan = self._plan_partners(group, n_lead, target)
        available = n_lead + sum(k for _, k in plan)
        size = self._size_for(overdue, available)
        if size <= n_lead:
            plan = []
        else:
            plan = self._trim(plan, size - n_lead)
            if self._waste(group, n_lead, plan) > self._waste_max:
                plan = []
                size = self._size_for(overdue, n_lead)
        lead_size = min(size, n_lead)
        if lead_size > overdue:
            self._take(group, lead_size - overdue, out, None, cls.wait_s, cutoff)
        for partner, k in plan:
            self._take_two_tier(partner, k, out, age_now, None)
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

    def _memory_cap(self, shape: tuple[int, int, int], cap: int) -> int:
        """At most `cap` frames, and on a GPU at most the largest batch device memory takes for a batch of `shape`
        (the input the device runs: a batch shape is the model's fixed input when it has one)."""
        if self._memory is None:
            return cap
        return min(cap, self._memory.max_batch(shape, cap) or cap)

    def _size_for(self, must: int, available: int) -> int:
        """Largest preferred size in [must, available]; else all available (the runner pads to its bucket)."""
        for p in reversed(self._preferred):
            if p <= available:
                return p if p >= must else available
        return available

    def _plan_partners(self, lead: _Group, n_lead: int, target: int) -> list[tuple[_Group, int]]:
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
            room = min(self._memory_cap((h2, w2, channels), target),
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

    @staticmethod
    def _trim(plan: list[tuple[_Group, int]], keep: int) -> list[tuple[_Group, int]]:
        out = []
        for g, k in plan:
            if keep <= 0:
                break
            out.append((g, min(k, keep)))
            keep -= k
        return out

    def _waste(self, lead: _Group, n_lead: int, plan: list[tuple[_Group, int]]) -> float:
        if not plan:
            return 0.0
        height = max(lead.shape[0], *(g.shape[0] for g, _ in plan))
        width = max(lead.shape[1], *(g.shape[1] for g, _ in plan))
        n = n_lead + sum(k for _, k in plan)
        padded = height * width
        if n * padded * lead.shape[2] * self._dtype_bytes > self._s.max_batch_bytes:
            return math.inf
        return _waste(n, n_lead * lead.area + sum(k * g.area for g, k in plan), padded)

    def _take_two_tier(self, group: _Group, k: int, out: list[_Entry], age_now: float,
                       cutoff: tuple[float, int] | None) -> None:
        taken = self._take(group, k, out, age_now, group.cls.wait_s, cutoff)
        if taken < k:
            self._take(group, k - taken, out, None, group.cls.wait_s, cutoff)

    def _take(self, group: _Group, k: int, out: list[_Entry], age_now: float | None, wait_s: float,
              cutoff: tuple[float, int] | None) -> int:
        """Deficit round robin over tenants: move up to k live entries to `out`. With `age_now`, only frames
        overdue at that time (t + wait_s <= age_now); with `cutoff`, only frames that arrived before it."""
        ring, queues, credit = group.ring, group.queues, group.credit
        weights = self._tenant_weights
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
        if taken:
            self._forget(group, taken)
        return taken

    def _forget(self, group: _Group, count: int) -> None:
        """Bookkeeping for `count` entries of `group` that just stopped being live."""
        group.n -= count
        group.cls.pending -= count
        group.cls.pending_bytes -= count * group.frame_bytes
        self._pending_frames -= count
        self._pending_bytes -= count * group.frame_bytes
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

    def _batch(self, entries: list[_Entry], shape: tuple[int, int, int], priority: Priority, lane: str,
               waste: float, now: float, reason: str) -> Batch:
        predicted = self._cost.predict(shape, len(entries)) if self._cost is not None else None
        return Batch(tuple(e.frame for e in entries), shape, priority, lane, waste, now, reason, predicted)

    # ------------------------------------------------------------------------------------- expiry, flush, etc.

    def pop_expired(self) -> list[Frame]:
        """Frames whose deadline (capture + class max_age_ms) has passed; they leave the batcher."""
        self._collect_expired(self._clock())
        out, self._expired = self._expired, []
        return out

    def _collect_expired(self, now: float) -> None:
        heap = self._expiry
        while heap and heap[0][0] < now:
            _, _, entry = heapq.heappop(heap)
            if entry.live:
                entry.live = False
                self._forget(entry.group, 1)
                self._expired.append(entry.frame)
        # A frame that left in a batch stays in the heap until its deadline (max_age_ms after capture: 30 s for
        # standard), and with it its bytes: rebuilt from the pending ones when those are the smaller part.
        if len(heap) > 2 * self._pending_frames + EXPIRY_HEAP_SLACK:
            self._expiry = [item for item in heap if item[2].live]
            heapq.heapify(self._expiry)

    def next_due(self) -> float | None:
        """Earliest clock time at which pop_batch()/pop_expired() could return something new (<= now: now).
        None when the batcher holds nothing."""
        if self._expired:
            return self._clock()
        self._sync_cost()
        best = math.inf
        heap = self._expiry
        while heap and not heap[0][2].live:
            heapq.heappop(heap)
        if heap:
            best = math.nextafter(heap[0][0], math.inf)  # expiry is strict: due just after
        for cls in self._classes:
            if cls.pending:
                for groups in (cls.fallback, cls.groups):
                    for group in groups.values():
                        if group.due_at < best:
                            best = group.due_at
        return None if best == math.inf else best

    def flush(self) -> list[Batch]:
        """Everything pending as batches, ignoring waits (shutdown). Frames already expired are set aside for
        pop_expired(), never batched."""
        now = self._clock()
        self._collect_expired(now)
        batches = []
        for cls in self._classes:
            while cls.pending:
                _, group = min((g.oldest_key(), g) for groups in (cls.fallback, cls.groups) for g in groups.values())
                batch = self._release(group, now, math.inf, None, "flush")
                assert batch is not None
                batches.append(batch)
        return batches

    def discard(self, predicate: Callable[[Frame], bool]) -> list[Frame]:
        """Remove and return held frames matching `predicate` (e.g. of revoked partitions), including expired
        ones not yet returned by pop_expired()."""
        out = []
        for cls in self._classes:
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
                        self._forget(group, count)
        kept: list[Frame] = []
        for frame in self._expired:
            (out if predicate(frame) else kept).append(frame)
        self._expired = kept
        return out

    # ---------------------------------------------------------------------------------------- backpressure

    @property
    def pending_frames(self) -> int:
        return self._pending_frames

    @property
    def pending_bytes(self) -> int:
        """Tensor bytes (h*w*c*tensor_dtype_bytes) of the frames waiting for a batch."""
        return self._pending_bytes

    def classes_to_pause(self) -> set[Priority]:
        """Classes whose partitions the source should pause now (rules in the module docstring)."""
        self._release_memory_pauses()
        if self._paused_all:
            return set(Priority)
        paused = {cls.priority for cls in self._classes if cls.mem_paused}
        s = self._s
        now = self._clock()
        # Only realtime's backlog pauses the others. A standard backlog leaves bulk reading: bulk gets no model time
        # while standard is at risk anyway (the slack rule) and its share bounds what it holds, while pausing it on
        # every standard backlog dropped and refetched its prefetched messages over and over on a saturated
        # backlog (0.6x the throughput, no gain under overload: tests/integration/test_overload.py).
        for cls in self._classes[:1]:
            if not cls.pending:
                self._backlog_pauses.pop(cls.priority, None)  # drained: what it paused may resume
                continue
            if cls.pending < s.max_batch_size_for(cls.priority) or not self._overdue(cls, now):
                continue
            # Backlogged: this class's batches are not keeping up. The least urgent class pauses, and every
            # less urgent one once more than two batches wait.
            lower = [c.priority for c in self._classes if c.priority > cls.priority]
            hit = set(lower) if cls.pending > 2 * s.max_batch_size_for(cls.priority) else {lower[-1]}
            self._backlog_pauses.setdefault(cls.priority, set()).update(hit)
        # A class paused for several backlogs stays paused until every one of them is drained.
        self._priority_pause = set().union(*self._backlog_pauses.values())
        return paused | self._priority_pause

    def _overdue(self, cls: _ClassState, now: float) -> bool:
        return any((e := g.oldest()) is not None and e.t + cls.wait_s <= now
                   for groups in (cls.groups, cls.fallback) for g in groups.values())

    def _latch_memory_pauses(self, priority: Priority) -> None:
        """After an add of `priority`: its class pauses at its own share of the caps, every class at the caps."""
        s = self._s
        cls = self._classes[priority]
        if not cls.mem_paused and (cls.pending >= cls.share * s.max_pending_frames
                                   or cls.pending_bytes >= cls.share * s.max_pending_bytes):
            cls.mem_paused = True
        if self._pending_frames >= s.max_pending_frames or self._pending_bytes >= s.max_pending_bytes:
            self._paused_all = True

    def _release_memory_pauses(self) -> None:
        s = self._s
        for cls in self._classes:
            if cls.mem_paused and (cls.pending < RESUME_WATERMARK * cls.share * s.max_pending_frames
                                   and cls.pending_bytes < RESUME_WATERMARK * cls.share * s.max_pending_bytes):
                cls.mem_paused = False
        # Less urgent classes are bounded by their own shares, so their frames alone never keep realtime paused.
        if self._paused_all and (not self._classes[Priority.REALTIME].pending or (
                self._pending_frames < RESUME_WATERMARK * s.max_pending_frames
                and self._pending_bytes < RESUME_WATERMARK * s.max_pending_bytes)):
            self._paused_all = False

    def poll_room(self, paused: set[Priority]) -> int:
        """How many frames the source may read now without a class that is still reading overshooting its share
        (or all classes the caps) by more than one poll: at least 1."""
        s = self._s
        room = s.max_pending_frames - self._pending_frames
        if self._largest_frame_bytes:
            room = min(room, (s.max_pending_bytes - self._pending_bytes) // self._largest_frame_bytes)
        for cls in self._classes:
            if cls.priority not in paused:
                room = min(room, math.ceil(cls.share * s.max_pending_frames) - cls.pending)
        return max(1, room)


def batch_shape(frame_shape: tuple[int, int, int], input_hw: tuple[int, int] | None) -> tuple[int, int, int]:
    """The (height, width, channels) a frame is batched by: the model's fixed input when it has one (every frame
    becomes that input, whatever its resolution), else the frame's own shape; the channels are the frame's."""
    return (input_hw[0], input_hw[1], frame_shape[2]) if input_hw else frame_shape


def _waste(n: int, real_pixels: int, padded_pixels: int) -> float:
    """Share of the batch's padded pixels that are padding."""
    total = n * padded_pixels
    return (total - real_pixels) / total
