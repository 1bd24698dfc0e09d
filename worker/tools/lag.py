"""`worker lag`: how far each consumer group is behind on its input, read from the broker alone, so it answers
while no worker runs. Per group, topic and partition: the committed offset, the end offset, the lag, the member
that owns the partition and the age of the oldest frame not yet done (the frame at the committed offset, by its
capture time); totals per priority class; an exit code for probes and scripts above a threshold.

The end offset is the high watermark and the lag `end - committed`, as `kafka-consumer-groups.sh --describe`
shows them; where the committed offset is below the partition's first retained offset (or nothing is committed,
and a worker starts at the first offset), the lag counts from that first offset. See docs/operations.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, ConsumerGroupTopicPartitions, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from worker.codec.schemas import MessageDecodeError, read_frame_record
from worker.config import Settings
from worker.errors import OperatorError
from worker.frames import TP, Priority
from worker.kafka.roles import admin_client, frame_peeker
from worker.partitions.donemeta import done_count

# Exit code when a --fail-above threshold is exceeded (0: within; 2: an operator error, as for every command).
EXIT_ABOVE_THRESHOLD = 3
OTHER_CLASS = "other"
ADMIN_TIMEOUT_S = 30.0
DEFAULT_AGE_TIMEOUT_S = 5.0


class LagReadError(OperatorError):
    """The broker did not answer what `worker lag` needs (unreachable, refused, a group it cannot describe)."""


@dataclass(frozen=True)
class Owner:
    """A member of a consumer group: the worker's client id is its observability.worker_id."""

    member_id: str
    client_id: str
    host: str

    @property
    def label(self) -> str:
        return f"{self.client_id}@{self.host}"


@dataclass(frozen=True)
class Pending:
    """The oldest frame a partition has not done yet: its capture time, or why there is none to tell."""

    capture_ts_ms: int | None = None
    note: str = ""  # "caught up", "not a frame", "not read within 5s", "not asked (--no-age)"


@dataclass(frozen=True)
class PartitionLag:
    group: str
    topic: str
    partition: int
    priority: str  # realtime, standard, bulk (the worker's input topics), else "other"
    committed: int | None  # None: nothing committed for the group
    start: int  # the first offset still retained
    end: int  # the high watermark
    owner: Owner | None
    pending: Pending = field(default_factory=Pending)
    # Offsets beyond the committed one that the commit's metadata lists as done (worker.partitions.donemeta): a
    # partition held by a stalled output; its next owner skips them.
    done_beyond: int = 0

    @property
    def lag(self) -> int:
        """Messages from where the group would resume to the end."""
        resume = self.start if self.committed is None else max(self.committed, self.start)
        return max(0, self.end - resume)

    @property
    def resume_offset(self) -> int:
        return self.start if self.committed is None else max(self.committed, self.start)

    def age_s(self, now_ms: int) -> float | None:
        """Seconds since the oldest pending frame was captured; None when there is none or it cannot be read."""
        if self.pending.capture_ts_ms is None:
            return None
        return max(0.0, (now_ms - self.pending.capture_ts_ms) / 1000.0)


@dataclass(frozen=True)
class GroupLag:
    group: str
    state: str  # Stable, Empty, PreparingRebalance, ... ("Dead": the group does not exist)
    members: tuple[Owner, ...]
    partitions: tuple[PartitionLag, ...]


@dataclass(frozen=True)
class ClassTotal:
    lag: int = 0
    partitions: int = 0
    oldest_age_s: float | None = None


@dataclass(frozen=True)
class LagReport:
    groups: tuple[GroupLag, ...]
    now_ms: int

    def rows(self) -> list[PartitionLag]:
        return [p for g in self.groups for p in g.partitions]

    @property
    def total_lag(self) -> int:
        return sum(p.lag for p in self.rows())

    @property
    def oldest_age_s(self) -> float | None:
        ages = [a for a in (p.age_s(self.now_ms) for p in self.rows()) if a is not None]
        return max(ages, default=None)

    def totals(self) -> dict[str, ClassTotal]:
        """Lag, partitions and the oldest pending frame's age per priority class (all groups together)."""
        out: dict[str, ClassTotal] = {}
        for p in self.rows():
            t = out.get(p.priority, ClassTotal())
            age = p.age_s(self.now_ms)
            oldest = t.oldest_age_s if age is None else max(age, t.oldest_age_s or 0.0)
            out[p.priority] = ClassTotal(t.lag + p.lag, t.partitions + 1, oldest)
        return dict(sorted(out.items(), key=lambda kv: _class_order(kv[0])))

    def exceeded(self, fail_above: int | None, fail_above_age_s: float | None) -> list[str]:
        """The thresholds crossed, each as a sentence; empty when within them."""
        out = []
        if fail_above is not None and self.total_lag > fail_above:
            out.append(f"lag {self.total_lag} is above --fail-above {fail_above}")
        oldest = self.oldest_age_s
        if fail_above_age_s is not None and oldest is not None and oldest > fail_above_age_s:
            out.append(f"the oldest pending frame is {oldest:.1f}s old, above --fail-above-age {fail_above_age_s:g}")
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "at": _iso(self.now_ms),
            "groups": [{"group": g.group, "state": g.state,
                        "members": [{"member_id": m.member_id, "client_id": m.client_id, "host": m.host}
                                    for m in g.members],
                        "partitions": [_row_json(p, self.now_ms) for p in g.partitions]} for g in self.groups],
            "totals": {cls: {"lag": t.lag, "partitions": t.partitions, "oldest_pending_age_s": _round(t.oldest_age_s)}
                       for cls, t in self.totals().items()},
            "total_lag": self.total_lag, "oldest_pending_age_s": _round(self.oldest_age_s),
        }

    def render(self) -> str:
        lines = []
        for g in self.groups:
            if g.state == "Dead":
                lines.append(f"group {g.group}: does not exist (no member, nothing committed)")
            else:
                members = ", ".join(m.label for m in g.members)
                lines.append(f"group {g.group}: {g.state}, " + (f"{len(g.members)} member(s): {members}"
                                                                 if g.members else "no members"))
            if not g.partitions:
                lines.append("  no partitions (no input topic exists, and nothing is committed)")
                continue
            lines.append(f"  {'class':<9} {'topic':<24} {'part':>4} {'committed':>10} {'end':>10} {'lag':>8} "
                         f"{'done+':>6}  {'owner':<24} oldest pending")
            for p in g.partitions:
                committed = "-" if p.committed is None else str(p.committed)
                owner = p.owner.label if p.owner else "-"
                lines.append(f"  {p.priority:<9} {p.topic:<24} {p.partition:>4} {committed:>10} {p.end:>10} "
                             f"{p.lag:>8} {p.done_beyond:>6}  {owner:<24} {_pending_text(p, self.now_ms)}")
        parts = []
        for cls, t in self.totals().items():
            age = f" (oldest {t.oldest_age_s:.1f}s)" if t.oldest_age_s is not None else ""
            parts.append(f"{cls} {t.lag}{age}")
        lines.append("lag by class: " + ", ".join(parts) + f"; total {self.total_lag}")
        return "\n".join(lines)


def _class_order(name: str) -> int:
    return next((p.value for p in Priority if p.label == name), len(Priority))


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _pending_text(p: PartitionLag, now_ms: int) -> str:
    age = p.age_s(now_ms)
    if age is not None and p.pending.capture_ts_ms is not None:
        return f"{age:.1f}s (captured {_iso(p.pending.capture_ts_ms)})"
    return p.pending.note or "-"


def _row_json(p: PartitionLag, now_ms: int) -> dict[str, Any]:
    return {"topic": p.topic, "partition": p.partition, "class": p.priority, "committed": p.committed,
            "start": p.start, "end": p.end, "lag": p.lag, "done_beyond": p.done_beyond,
            "owner": {"member_id": p.owner.member_id, "client_id": p.owner.client_id, "host": p.owner.host}
            if p.owner else None,
            "oldest_pending_capture": _iso(p.pending.capture_ts_ms) if p.pending.capture_ts_ms is not None else None,
            "oldest_pending_age_s": _round(p.age_s(now_ms)), "oldest_pending_note": p.pending.note or None}


# -- building the report (pure) ------------------------------------------------------------------------------
def group_lag(group: str, state: str, members: Mapping[Owner, Iterable[TP]], committed: Mapping[TP, int | None],
              watermarks: Mapping[TP, tuple[int, int]], priorities: Mapping[str, str],
              classes: set[str] | None = None, pending: Mapping[TP, Pending] | None = None,
              done_beyond: Mapping[TP, int] | None = None) -> GroupLag:
    """One group's rows: every partition with known watermarks, in topic and partition order; `classes` keeps
    only those priority classes; `done_beyond`: what each commit's metadata lists as done beyond it."""
    owner_of = {tp: owner for owner, tps in members.items() for tp in tps}
    rows = []
    for tp in sorted(watermarks, key=lambda tp: (_class_order(priorities.get(tp[0], OTHER_CLASS)), tp)):
        priority = priorities.get(tp[0], OTHER_CLASS)
        if classes is not None and priority not in classes:
            continue
        low, high = watermarks[tp]
        rows.append(PartitionLag(group, tp[0], tp[1], priority, committed.get(tp), low, high, owner_of.get(tp),
                                 (pending or {}).get(tp, Pending()), (done_beyond or {}).get(tp, 0)))
    return GroupLag(group, state, tuple(sorted(members, key=lambda m: (m.client_id, m.member_id))), tuple(rows))


def state_name(state: Any) -> str:
    """ConsumerGroupState.PREPARING_REBALANCE -> PreparingRebalance, as Kafka's tools print it."""
    name = getattr(state, "name", str(state))
    return "".join(word.capitalize() for word in name.split("_"))


# -- reading the broker ---------------------------------------------------------------------------------------
def read_lag(settings: Settings, groups: list[str], classes: set[str] | None = None, read_age: bool = True,
             age_timeout_s: float = DEFAULT_AGE_TIMEOUT_S, now: Callable[[], float] = time.time) -> LagReport:
    """The lag of `groups` on the worker's input topics and on whatever else each group committed or owns."""
    admin = admin_client(settings.kafka)
    priorities = {topic: prio.label for topic, prio in settings.topics.input_topics().items()}
    try:
        md = admin.list_topics(timeout=ADMIN_TIMEOUT_S)
        described = admin.describe_consumer_groups(groups, request_timeout=ADMIN_TIMEOUT_S)
        found = []
        for group in groups:
            description = described[group].result()
            members = {Owner(m.member_id, m.client_id, m.host):
                       [(tp.topic, tp.partition) for tp in (m.assignment.topic_partitions if m.assignment else [])]
                       for m in description.members}
            committed, done = _committed(admin, group)
            topics = {t for t in priorities if t in md.topics} | {t for t, _ in committed} | \
                {t for tps in members.values() for t, _ in tps}
            tps = [(t, p) for t in sorted(topics) if t in md.topics for p in md.topics[t].partitions]
            found.append((group, state_name(description.state), members, committed, done, tps))
        all_tps = sorted({tp for *_, tps in found for tp in tps})
        watermarks = _watermarks(admin, all_tps)
    except KafkaException as exc:
        raise LagReadError(f"reading consumer groups {groups} from {settings.kafka.bootstrap_servers}: "
                           f"{exc.args[0].str()}", setting="kafka.bootstrap_servers") from None
    reports = []
    for group, state, members, committed, done, tps in found:
        marks = {tp: watermarks[tp] for tp in tps}
        lag = group_lag(group, state, members, committed, marks, priorities, classes, done_beyond=done)
        pending = _pending(settings, lag.partitions, age_timeout_s) if read_age else \
            {(p.topic, p.partition): Pending(note="not asked (--no-age)") for p in lag.partitions if p.lag}
        reports.append(group_lag(group, state, members, committed, marks, priorities, classes, pending, done))
    return LagReport(tuple(reports), int(now() * 1000))


def _committed(admin: AdminClient, group: str) -> tuple[dict[TP, int | None], dict[TP, int]]:
    """The group's committed offsets, and per partition the offsets its commit's metadata lists as done beyond."""
    result = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)],
                                               request_timeout=ADMIN_TIMEOUT_S)[group].result()
    tps = result.topic_partitions or []
    return ({(tp.topic, tp.partition): (tp.offset if tp.offset >= 0 else None) for tp in tps},
            {(tp.topic, tp.partition): done_count(tp.metadata, tp.offset) for tp in tps if tp.metadata})


def _watermarks(admin: AdminClient, tps: list[TP]) -> dict[TP, tuple[int, int]]:
    """(first retained offset, high watermark) of each partition, in two requests."""
    if not tps:
        return {}
    out: dict[str, dict[TP, int]] = {}
    for name, spec in (("low", OffsetSpec.earliest()), ("high", OffsetSpec.latest())):
        futures = admin.list_offsets({TopicPartition(t, p): spec for t, p in tps}, request_timeout=ADMIN_TIMEOUT_S)
        out[name] = {(tp.topic, tp.partition): fut.result().offset for tp, fut in futures.items()}
    return {tp: (out["low"][tp], out["high"][tp]) for tp in tps}


def _pending(settings: Settings, rows: Iterable[PartitionLag], timeout_s: float) -> dict[TP, Pending]:
    """The capture time of the frame each lagging partition resumes at, read (read_committed, as the worker reads)
    with one consumer that joins no group; partitions not answered within `timeout_s` say so."""
    lagging = {(p.topic, p.partition): p.resume_offset for p in rows if p.lag}
    out: dict[TP, Pending] = {}
    if not lagging:
        return out
    consumer = frame_peeker(settings.kafka)
    try:
        consumer.assign([TopicPartition(t, p, offset if offset >= 0 else OFFSET_BEGINNING)
                         for (t, p), offset in lagging.items()])
        deadline = time.monotonic() + timeout_s
        while len(out) < len(lagging) and time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is None:
                continue
            tp = (msg.topic() or "", msg.partition() or 0)
            if tp in out or tp not in lagging:
                continue
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    out[tp] = Pending(note="no frame left: only transaction markers (or aborted frames)")
                continue
            try:
                out[tp] = Pending(capture_ts_ms=read_frame_record(msg.value() or b"").capture_ts_ms)
            except MessageDecodeError:
                out[tp] = Pending(note=f"offset {msg.offset()} is not a frame")
            consumer.pause([TopicPartition(*tp)])
    finally:
        consumer.close()
    for tp in lagging:
        out.setdefault(tp, Pending(note=f"not read within {timeout_s:g}s"))
    return out
