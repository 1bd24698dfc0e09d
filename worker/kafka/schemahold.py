"""Frames waiting for their writer schema: the hold-and-retry policy of registry-framed frames.

A registry outage must cost neither data nor other traffic. A frame whose writer-schema id is not known yet is
held on its partition (not dead-lettered) while the id is looked up off the loop; a lookup that fails for a
transient reason (unreachable, timeout, HTTP 5xx or 429) is tried again with a growing backoff; a partition is
paused once its held bytes reach a bound; when the id becomes known the held frames are released in offset
order. Only a permanent answer (an unknown id, a schema the worker cannot read) makes them dead letters.

Only framed frames are held. A framed frame waits when its id is not known or when an earlier framed frame of its
partition still waits: a stream's frames share a key, hence a partition, and are answered in order, so framed
frames keep their order among themselves. An unframed frame needs no registry and is never held, even on a
partition that holds framed frames: it flows on at once (the consumer tracks every offset as it is read, held or
not, so the partition's commit still stops at its earliest held frame). A holding partition is paused when its held
bytes reach a bound, or when the unframed frames that passed its held ones reach a count: those are answered but
cannot be committed until the held ones are, so the count bounds what a crash would answer again, as the worker's
uncommitted cap does (which, counting them, would otherwise pause every partition). A paused partition reads
nothing, its unframed frames included. Other partitions flow untouched.

Pure policy: no Kafka, no HTTP; time from an injected clock. The Kafka edge (worker.kafka.schemalookups) runs
the lookups and feeds their answers in.
"""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from worker.frames import TP

M = TypeVar("M")

# Transient failures are retried after BACKOFF_INITIAL_S, doubling up to BACKOFF_MAX_S.
BACKOFF_INITIAL_S = 0.5
BACKOFF_MAX_S = 30.0
# A permanent answer (unknown id, unreadable schema) is remembered this long before the id is asked again: a flood
# of frames with a bad id costs one request per id per this, not one per frame.
PERMANENT_RETRY_S = 30.0
# Ids remembered as permanently failed, at most (oldest forgotten first): random ids in hostile input stay bounded.
MAX_FAILED_IDS = 10_000


class LookupState(enum.Enum):
    PENDING = "pending"  # needed, not asked yet (or due again after a transient failure)
    ASKING = "asking"  # a lookup is running
    RETRYING = "retrying"  # the last lookup failed for a transient reason; asked again at `retry_at`
    KNOWN = "known"
    FAILED = "failed"  # a permanent answer: frames needing it are dead letters with `reason`


@dataclass
class _Lookup:
    state: LookupState
    schema: Any = None
    reason: str = ""
    failures: int = 0  # transient failures in a row
    retry_at: float = 0.0  # RETRYING: when to ask again; FAILED: when the answer is forgotten


@dataclass(frozen=True)
class Released(Generic[M]):
    """A held frame let go: decode it now (`reason` None: its id is known), or dead-letter it with `reason` (its id
    failed permanently)."""

    message: M
    reason: str | None


@dataclass
class _Held(Generic[M]):
    message: M
    nbytes: int
    schema_id: int


class SchemaHold(Generic[M]):
    """Per writer-schema id a lookup state, per partition the ordered queue of held framed frames; see the module
    docstring. `held_bytes_max`: a partition holding this many bytes is paused
    (schema_registry.max_held_bytes_per_partition); `passed_frames_max`: so is one past whose held frames this many
    unframed frames flowed (delivery.max_uncommitted_frames)."""

    def __init__(self, held_bytes_max: int, passed_frames_max: int, clock: Callable[[], float],
                 backoff_initial_s: float = BACKOFF_INITIAL_S,
                 backoff_max_s: float = BACKOFF_MAX_S, permanent_retry_s: float = PERMANENT_RETRY_S,
                 max_failed_ids: int = MAX_FAILED_IDS) -> None:
        self._held_bytes_max = held_bytes_max
        self._passed_frames_max = passed_frames_max
        self._clock = clock
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._permanent_retry_s = permanent_retry_s
        self._max_failed_ids = max_failed_ids
        self._lookups: dict[int, _Lookup] = {}
        self._failed_order: OrderedDict[int, None] = OrderedDict()
        self._queues: dict[TP, deque[_Held[M]]] = {}
        self._bytes: Counter[TP] = Counter()
        self._waiting: Counter[int] = Counter()  # held frames per schema id
        # Unframed frames read on each holding partition since it began holding (answered, not committable).
        self._passed: Counter[TP] = Counter()
        self.held_frames = 0
        self.passed_frames = 0

    # -- reading ----------------------------------------------------------------------------------------------
    def must_hold(self, tp: TP, schema_id: int | None) -> bool:
        """Whether a message just read must wait: it is framed (`schema_id` not None) and its partition already
        holds a framed frame, or its id is neither known nor permanently failed. An unframed one never waits."""
        if schema_id is None:
            return False
        if tp in self._queues:
            return True
        lookup = self._current(schema_id)
        return lookup is None or lookup.state not in (LookupState.KNOWN, LookupState.FAILED)

    def hold(self, tp: TP, message: M, nbytes: int, schema_id: int) -> None:
        """Queue a framed frame behind its partition's held ones (call when must_hold says so)."""
        queue = self._queues.get(tp)
        if queue is None:
            queue = self._queues[tp] = deque()
        queue.append(_Held(message, nbytes, schema_id))
        self._bytes[tp] += nbytes
        self.held_frames += 1
        self._waiting[schema_id] += 1
        if self._current(schema_id) is None:
            self._lookups[schema_id] = _Lookup(LookupState.PENDING)

    def passed(self, tp: TP) -> None:
        """An unframed frame of `tp` flowed on (never held): while `tp` holds frames, its offset cannot be committed
        until they are answered, so it counts towards the partition's pause."""
        if tp in self._queues:
            self._passed[tp] += 1
            self.passed_frames += 1

    def schema(self, schema_id: int) -> Any:
        """The known schema of an id, else None."""
        lookup = self._lookups.get(schema_id)
        return lookup.schema if lookup is not None and lookup.state is LookupState.KNOWN else None

    def failure(self, schema_id: int) -> str | None:
        """Why an id failed permanently, else None (the answer as it stands: must_hold forgets it once due)."""
        lookup = self._lookups.get(schema_id)
        return lookup.reason if lookup is not None and lookup.state is LookupState.FAILED else None

    # -- lookups ------------------------------------------------------------------------------------------------
    def due_lookups(self) -> list[int]:
        """Ids to look up now (frames wait for them, and no lookup runs or backs off); marked as asking."""
        now = self._clock()
        due = []
        for schema_id in self._waiting:
            lookup = self._lookups[schema_id]
            if lookup.state is LookupState.PENDING or (lookup.state is LookupState.RETRYING and now >= lookup.retry_at):
                lookup.state = LookupState.ASKING
                due.append(schema_id)
        return due

    def found(self, schema_id: int, schema: Any) -> None:
        """The registry gave the id's schema: known for good (a registry id names one schema forever)."""
        self._lookups[schema_id] = _Lookup(LookupState.KNOWN, schema=schema)
        self._failed_order.pop(schema_id, None)

    def failed(self, schema_id: int, reason: str, transient: bool) -> None:
        """A lookup failed: transient, retried after the backoff; permanent, frames needing the id are dead letters
        (the answer is remembered for `permanent_retry_s`, then the id may be asked again)."""
        lookup = self._lookups.get(schema_id)
        if lookup is None or lookup.state is LookupState.KNOWN:
            return
        now = self._clock()
        lookup.reason = reason
        if transient:
            lookup.failures += 1
            lookup.state = LookupState.RETRYING
            lookup.retry_at = now + self.backoff_s(lookup.failures)
            return
        lookup.state = LookupState.FAILED
        lookup.failures = 0
        lookup.retry_at = now + self._permanent_retry_s
        self._failed_order[schema_id] = None
        self._failed_order.move_to_end(schema_id)
        while len(self._failed_order) > self._max_failed_ids:
            forgotten, _ = self._failed_order.popitem(last=False)
            if not self._waiting[forgotten]:
                self._lookups.pop(forgotten, None)

    def backoff_s(self, failures: int) -> float:
        """The wait after `failures` transient failures in a row: doubling from the initial, capped."""
        return min(self._backoff_max_s, self._backoff_initial_s * 2.0 ** min(failures - 1, 32))

    def state(self, schema_id: int) -> LookupState | None:
        lookup = self._current(schema_id)
        return lookup.state if lookup is not None else None

    # -- releasing ------------------------------------------------------------------------------------------------
    def release(self) -> list[Released[M]]:
        """What may go on now, per partition in offset order: the head of each queue while its id is known or failed
        permanently. A partition whose queue empties holds nothing any more."""
        out: list[Released[M]] = []
        for tp in list(self._queues):
            queue = self._queues[tp]
            while queue:
                head = queue[0]
                lookup = self._current(head.schema_id)
                if lookup is None or lookup.state not in (LookupState.KNOWN, LookupState.FAILED):
                    break
                queue.popleft()
                self._unhold(tp, head)
                out.append(Released(head.message, lookup.reason if lookup.state is LookupState.FAILED else None))
            if not queue:
                del self._queues[tp]
                self._forget_passed(tp)
        return out

    def drop(self, tps: Iterable[TP]) -> int:
        """Forget what revoked, lost or rewound partitions hold (their next reading reads it again); how many."""
        dropped = 0
        for tp in tps:
            queue = self._queues.pop(tp, None)
            for held in queue or ():
                self._unhold(tp, held)
                dropped += 1
            self._forget_passed(tp)
        return dropped

    @property
    def paused(self) -> frozenset[TP]:
        """Partitions holding at least `held_bytes_max` bytes, or past whose held frames `passed_frames_max` unframed
        ones flowed: read no further until they are released."""
        if not self._queues:
            return frozenset()
        return frozenset(tp for tp in self._queues
                         if self._bytes[tp] >= self._held_bytes_max or self._passed[tp] >= self._passed_frames_max)

    @property
    def pinned_frames(self) -> int:
        """Frames read on the holding partitions since they began holding, held or passed: offsets no commit passes
        until the registry answers."""
        return self.held_frames + self.passed_frames

    @property
    def held_partitions(self) -> frozenset[TP]:
        return frozenset(self._queues)

    def held_bytes(self, tp: TP) -> int:
        return self._bytes.get(tp, 0)

    @property
    def waiting_ids(self) -> dict[int, int]:
        """Held frames per schema id they wait for."""
        return {schema_id: n for schema_id, n in self._waiting.items() if n}

    def _unhold(self, tp: TP, held: _Held[M]) -> None:
        self.held_frames -= 1
        self._bytes[tp] -= held.nbytes
        if self._bytes[tp] <= 0:
            del self._bytes[tp]
        self._waiting[held.schema_id] -= 1
        if self._waiting[held.schema_id] <= 0:
            del self._waiting[held.schema_id]
            lookup = self._lookups.get(held.schema_id)
            if lookup is not None and lookup.state in (LookupState.PENDING, LookupState.RETRYING):
                del self._lookups[held.schema_id]  # nothing waits for it: ask again only when a frame needs it

    def _forget_passed(self, tp: TP) -> None:
        self.passed_frames -= self._passed.pop(tp, 0)

    def _current(self, schema_id: int) -> _Lookup | None:
        """The id's lookup, with a remembered permanent failure forgotten once it is due to be asked again."""
        lookup = self._lookups.get(schema_id)
        if lookup is not None and lookup.state is LookupState.FAILED and self._clock() >= lookup.retry_at:
            if self._waiting[schema_id]:
                # Frames still wait for the id (they arrived while its failure stood): they are answered with it.
                return lookup
            del self._lookups[schema_id]
            self._failed_order.pop(schema_id, None)
            return None
        return lookup
