"""Writer-schema lookups off the loop thread, and the frames held for them (the policy: worker.kafka.schemahold).

The loop never waits for the Schema Registry: a registry-framed frame whose writer-schema id is not known yet is
held on its partition, with the framed frames read after it there (unframed frames flow on), while one lookup
thread asks the registry (with its own timeout, no client retries: the policy's backoff decides when to ask again).
Each poll the consumer hands the thread's answers to the policy and takes back what it may release, in order. An
outage is one log line when it starts and one when it ends.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import time
from collections.abc import Callable, Mapping
from typing import Any

from worker.codec.schemas import FRAMING_BYTES, MessageDecodeError, decode_frame, is_registry_framed
from worker.config import LimitsSettings
from worker.errors import StreamferError
from worker.frames import MESSAGE_DECODE_ERROR, TP, DeadLetter, Frame, Priority, SourceRef
from worker.kafka.schemahold import Released, SchemaHold
from worker.metrics import SCHEMA_LOOKUP_OUTCOMES, Metrics
from worker.threadnames import name_os_thread

log = logging.getLogger(__name__)

LookupAnswer = tuple[int, Any, "LookupFailure | None"]


class LookupFailure:
    """Why a lookup failed, and whether asking again may help (worker.kafka.registry.LookupFailed's content)."""

    def __init__(self, reason: str, transient: bool) -> None:
        self.reason = reason
        self.transient = transient


class RegistryLookups:
    """Runs `fetch(schema_id)` on a thread of its own; the loop collects the answers without waiting. `fetch`
    returns the schema or raises an exception with `reason` and `transient` (worker.kafka.registry.LookupFailed);
    any other exception is a transient failure."""

    def __init__(self, fetch: Callable[[int], Any]) -> None:
        self._fetch = fetch
        self._answers: queue.SimpleQueue[LookupAnswer] = queue.SimpleQueue()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="schema-lookup",
                                                           initializer=name_os_thread)

    def ask(self, schema_id: int) -> None:
        self._pool.submit(self._lookup, schema_id)

    def answers(self) -> list[LookupAnswer]:
        out = []
        while not self._answers.empty():  # the loop is the only reader
            out.append(self._answers.get_nowait())
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _lookup(self, schema_id: int) -> None:
        try:
            schema = self._fetch(schema_id)
        except Exception as exc:  # noqa: BLE001 (LookupFailed, or anything else the client raised: transient)
            reason = getattr(exc, "reason", None) or f"{type(exc).__name__}: {exc}"
            self._answers.put((schema_id, None, LookupFailure(reason, bool(getattr(exc, "transient", True)))))
            return
        self._answers.put((schema_id, schema, None))


class RegistryOutage:
    """Whether the registry answers, as the lookups see it: one log line when it stops answering and one when it
    is back, the seconds it has not answered (while it does not), and /readyz's line about it."""

    def __init__(self, url: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._url = url
        self.clock = clock
        self.last_answer = clock()
        # When the first request the registry left unanswered in the current outage was sent; None: no outage.
        self.since: float | None = None
        self.reason = ""

    def answered(self) -> None:
        if self.since is not None:
            log.info("schema registry %s answers again after %.1fs: held frames are released", self._url,
                     self.clock() - self.since)
            self.since = None
        self.last_answer = self.clock()

    def failed(self, reason: str, asked_at: float) -> None:
        """A lookup sent at `asked_at` failed for a transient reason."""
        self.reason = reason
        if self.since is None:
            self.since = max(asked_at, self.last_answer)
            log.warning("schema registry %s does not answer (%s): frames that need a writer schema it has not given "
                        "yet are held on their partitions and it is asked again with backoff; nothing is "
                        "dead-lettered for it", self._url, reason)

    def nothing_waits(self) -> None:
        """No frame waits for the registry any more (their partitions were revoked): no outage to report."""
        self.since = None

    def unanswered_s(self) -> float:
        """Seconds since the registry last answered, counted from the first request it left unanswered (a worker
        that had nothing to ask for days is not days into an outage); 0 when its last lookup was answered."""
        return 0.0 if self.since is None else max(0.0, self.clock() - self.since)


class HeldFrames:
    """The consumer's side of the registry: writer schemas for decode_frame (`writer_schema`), the framed messages
    held until their schema is known (`admit`, `release`) and the partitions to pause for them (`paused`).

    Messages are kept as read (with their SourceRef): the consumer decodes them when they are released. The consumer
    tracks a held message's offset when it reads it, so no commit passes it while later unframed frames of its
    partition are answered."""

    def __init__(self, lookups: RegistryLookups, hold: SchemaHold[Any], outage: RegistryOutage,
                 metrics: Metrics) -> None:
        self._lookups = lookups
        self._hold = hold
        self.outage = outage
        self._metrics = metrics
        self._lookup_outcomes = {outcome: metrics.schema_lookups.labels(outcome) for outcome in SCHEMA_LOOKUP_OUTCOMES}
        self._clock = outage.clock
        self._asked_at: dict[int, float] = {}  # when each running lookup was sent

    def writer_schema(self, schema_id: int) -> Any:
        """The writer schema of a message that was not held: known, or failed permanently (MessageDecodeError)."""
        schema = self._hold.schema(schema_id)
        if schema is not None:
            return schema
        reason = self._hold.failure(schema_id)
        if reason is None:
            raise StreamferError(f"registry schema id {schema_id} read before it was looked up: a message that "
                                 "needs it must be held (HeldFrames.admit)")
        raise MessageDecodeError(reason)

    def admit(self, tp: TP, message: Any, value: bytes | None) -> bool:
        """Hold `message` (True) when it is registry-framed and its writer schema is not known yet or its partition
        already holds a framed one; an unframed message is never held."""
        if value is None or len(value) < FRAMING_BYTES or not is_registry_framed(value):
            self._hold.passed(tp)  # unframed: it needs no registry, never waits (SchemaHold.must_hold)
            return False
        schema_id = int.from_bytes(value[1:FRAMING_BYTES], "big")
        if not self._hold.must_hold(tp, schema_id):
            return False
        self._hold.hold(tp, message, len(value), schema_id)
        return True

    def release(self) -> list[Released[Any]]:
        """Take the lookups' answers, start those due, and return what may go on now, in order per partition."""
        answers = self._lookups.answers()
        if not answers and not self._hold.held_frames and self.outage.since is None:
            return []  # every poll without a registry matter: nothing to do
        for schema_id, schema, failure in answers:
            asked_at = self._asked_at.pop(schema_id, self._clock())
            if failure is None:
                self.outage.answered()
                self._lookup_outcomes["found"].inc()
                self._hold.found(schema_id, schema)
                log.info("registry schema id %d resolved (writer schema of framed frames)", schema_id)
            elif failure.transient:
                self.outage.failed(failure.reason, asked_at)
                self._lookup_outcomes["transient"].inc()
                self._hold.failed(schema_id, failure.reason, transient=True)
            else:
                self.outage.answered()  # a permanent answer is an answer
                self._lookup_outcomes["permanent"].inc()
                self._hold.failed(schema_id, failure.reason, transient=False)
                log.warning("%s: its frames are dead-lettered", failure.reason)
        self.ask_due()
        released = self._hold.release() if self._hold.held_frames else []
        self._metrics.frames_held_for_schema.set(self._hold.held_frames)
        if not self._hold.held_frames:
            self.outage.nothing_waits()
        self._metrics.schema_registry_unanswered.set(self.outage.unanswered_s())
        return released

    def decode_released(self, now: float, priorities: Mapping[str, Priority], limits: LimitsSettings,
                        is_current: Callable[[SourceRef], bool]) -> tuple[list[Frame], list[DeadLetter],
                                                                          set[SourceRef]]:
        """What the registry's answers released, in order per partition: decoded frames, dead letters (a permanent
        answer, or a body that does not decode with its writer schema) and their sources (tracked when they were
        held). Deadlines apply as to any frame read now: one held past its max age is answered EXPIRED."""
        frames: list[Frame] = []
        dead_letters: list[DeadLetter] = []
        sources: set[SourceRef] = set()
        for released in self.release():
            source, msg = released.message
            if not is_current(source):
                continue  # its partition was revoked since (dropped then): never answered for an old epoch
            sources.add(source)
            headers = msg.headers()
            try:
                if released.reason is not None:
                    raise MessageDecodeError(released.reason)
                frames.append(decode_frame(msg.value(), source, priorities[source.topic], now, limits, headers,
                                           self))
            except MessageDecodeError as exc:
                dead_letters.append(DeadLetter(source=source, reason=str(exc), error_type=MESSAGE_DECODE_ERROR,
                                               payload=msg.value() or b"", key=msg.key(),
                                               headers=tuple(headers) if headers else ()))
        return frames, dead_letters, sources

    def ask_due(self) -> None:
        """Start the lookups due: ids new frames wait for, and those whose backoff ended."""
        for schema_id in self._hold.due_lookups():
            self._asked_at[schema_id] = self._clock()
            self._lookups.ask(schema_id)

    def drop(self, tps: list[TP]) -> int:
        """Forget the held messages of partitions revoked, lost or rewound: their next reading reads them again."""
        dropped = self._hold.drop(tps)
        self._metrics.frames_held_for_schema.set(self._hold.held_frames)
        return dropped

    @property
    def paused(self) -> frozenset[TP]:
        return self._hold.paused

    @property
    def held_frames(self) -> int:
        return self._hold.held_frames

    @property
    def pinned_frames(self) -> int:
        """Frames held, and unframed ones answered past them: offsets no commit passes until the registry answers."""
        return self._hold.pinned_frames

    def problem(self) -> str | None:
        """/readyz's line while frames wait for an unanswering registry, else None."""
        if self.outage.since is None:
            return None
        return (f"schema registry not answering for {self.outage.unanswered_s():.0f}s ({self.outage.reason}): "
                f"{self._hold.held_frames} frames held for their writer schema")

    def close(self) -> None:
        self._lookups.close()
