"""Partition hand-over: how long a partition that moves between workers has no owner, per heartbeat interval.

Members are the worker's own consumer (`worker.kafka.consumer.FrameSource`: its librdkafka configuration, the
cooperative-sticky assignor, static membership under distinct worker ids, its graceful leave), each polling on a
thread of its own as the worker's loop does; no frames, so only the group protocol is timed. Per round, on a fresh
group over three 6-partition input topics (18 partitions):

  three members A, B, C settle 6/6/6;  C stops gracefully (leave: its partitions move to A and B);
  a new member D joins (join: partitions move from A and B to D, in the two rounds of a cooperative rebalance).

Per moved partition the unowned time runs from its revoke on the old owner to its assignment on the new one.
Variants (heartbeat.interval.ms, via kafka.heartbeat_interval_ms) run in interleaved rounds, which goes first
rotating. Figures: per variant and phase the median (min-max) of all moved partitions' unowned times, and the
median (min-max) over rounds of each round's longest; stop -> everything owned again; join -> balanced.

    KAFKA_BOOTSTRAP_SERVERS=host:port python bench/handover.py [--heartbeats 3000,1000,500] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import stats
from stats import Spread

from worker.config import Settings, load_settings
from worker.frames import TP
from worker.kafka.consumer import FrameSource

PARTITIONS = 6  # per input topic, as in issue #51's rollout
SETTLE_TIMEOUT_S = 90.0
DEFAULT_HEARTBEATS = (3000, 1000, 500)


@dataclass(frozen=True)
class Event:
    """One rebalance callback as a member served it (time.monotonic())."""

    t: float
    member: str
    kind: str  # "assign", "revoke" or "lost"
    tp: TP


def unowned_times(events: Iterable[Event], since: float = float("-inf")) -> dict[TP, list[float]]:
    """Per partition, each time from its revoke (or loss) to its next assignment, for revokes at or after `since`.
    A partition revoked and never assigned again is left out (the round then fails to settle)."""
    out: dict[TP, list[float]] = {}
    unowned_since: dict[TP, float] = {}
    for e in sorted(events, key=lambda e: e.t):
        if e.kind in ("revoke", "lost"):
            if e.t >= since:
                unowned_since[e.tp] = e.t
        elif e.tp in unowned_since:
            out.setdefault(e.tp, []).append(e.t - unowned_since.pop(e.tp))
    return out


class Member:
    """One worker's consumer, polled on its own thread until stopped, then closed (its graceful leave)."""

    def __init__(self, name: str, settings: Settings, record: Callable[[Event], None]) -> None:
        self.name = name
        self.owned: set[TP] = set()
        self._record = record
        self._stop = threading.Event()
        self._source = FrameSource(settings)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"member-{name}", daemon=True)
        self._thread.start()

    def _event(self, kind: str, tps: list[TP]) -> None:
        now = time.monotonic()
        for tp in tps:
            self._record(Event(now, self.name, kind, tp))
            if kind == "assign":
                self.owned.add(tp)
            else:
                self.owned.discard(tp)

    def _run(self) -> None:
        try:
            self._source.subscribe(lambda tps: self._event("assign", tps),
                                   lambda tps, _commits: self._event("revoke", tps),
                                   lambda tps: self._event("lost", tps))
            while not self._stop.is_set():
                self._source.poll(100, 0.05)
            self._source.close()
        except BaseException as exc:  # noqa: BLE001 (reported by the round)
            self.error = exc

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)


def member_settings(bootstrap: str, t: common.Topics, group: str, name: str, heartbeat_ms: int) -> Settings:
    return load_settings(env={}, overrides={
        **t.overrides(),
        "kafka": {"bootstrap_servers": bootstrap, "group_id": group, "heartbeat_interval_ms": heartbeat_ms},
        "observability": {"worker_id": name, "metrics_enabled": False}})


def _wait(condition: Callable[[], bool], members: Sequence[Member], what: str) -> float:
    """Wait for `condition`; the time.monotonic() it became true."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while not condition():
        for m in members:
            if m.error is not None:
                raise RuntimeError(f"member {m.name} failed: {m.error!r}") from m.error
        if time.monotonic() > deadline:
            owned = {m.name: len(m.owned) for m in members}
            raise TimeoutError(f"{what}: not within {SETTLE_TIMEOUT_S:.0f}s (owned: {owned})")
        time.sleep(0.005)
    return time.monotonic()


def one_round(bootstrap: str, t: common.Topics, heartbeat_ms: int, tag: str) -> dict[str, Any]:
    """Three members settle, one leaves, one joins; the unowned times of the partitions each phase moved."""
    group = common.new_id(f"handover-{tag}")
    total = PARTITIONS * len(t.inputs)
    events: list[Event] = []
    lock = threading.Lock()

    def record(e: Event) -> None:
        with lock:
            events.append(e)

    def member(name: str) -> Member:
        return Member(name, member_settings(bootstrap, t, group, f"{group}-{name}", heartbeat_ms), record)

    a, b, c = member("a"), member("b"), member("c")
    members = [a, b, c]
    try:
        _wait(lambda: all(len(m.owned) == total // 3 for m in members), members, "three members settle")
        left_at = time.monotonic()
        c.stop()
        settled_leave = _wait(lambda: len(a.owned) + len(b.owned) == total and not c.owned, members,
                              "the leaver's partitions owned again")
        c.join(SETTLE_TIMEOUT_S)
        joined_at = time.monotonic()
        d = member("d")
        members = [a, b, d]
        first_assign = _wait(lambda: bool(d.owned), members, "the newcomer gets partitions")
        balanced = _wait(lambda: all(len(m.owned) == total // 3 for m in members), members, "balanced after the join")
    finally:
        for m in members:
            m.stop()
        for m in members:
            m.join(30.0)
    with lock:
        leave = unowned_times([e for e in events if left_at <= e.t < joined_at], left_at)
        join = unowned_times([e for e in events if e.t >= joined_at], joined_at)
    flat_leave = [g for gs in leave.values() for g in gs]
    flat_join = [g for gs in join.values() for g in gs]
    return {"heartbeat_ms": heartbeat_ms, "leave_unowned_s": flat_leave, "join_unowned_s": flat_join,
            "leave_to_all_owned_s": settled_leave - left_at, "join_to_first_assignment_s": first_assign - joined_at,
            "join_to_balanced_s": balanced - joined_at}


def summarize(rounds: Sequence[dict[str, Any]], heartbeats: Sequence[int]) -> dict[str, Any]:
    """Per variant: pooled unowned times per phase and the spread over rounds of each round's figures."""
    out: dict[str, Any] = {}
    for hb in heartbeats:
        mine = [r for r in rounds if r["heartbeat_ms"] == hb]
        fig: dict[str, Any] = {}
        for phase in ("leave", "join"):
            pooled = [g for r in mine for g in r[f"{phase}_unowned_s"]]
            fig[f"{phase}_unowned_s"] = Spread.of(pooled).as_dict()
            fig[f"{phase}_moved_partitions"] = len(pooled)
            fig[f"{phase}_longest_s"] = Spread.of([max(r[f"{phase}_unowned_s"], default=float("nan"))
                                                   for r in mine]).as_dict()
        for key in ("leave_to_all_owned_s", "join_to_first_assignment_s", "join_to_balanced_s"):
            fig[key] = Spread.of([r[key] for r in mine]).as_dict()
        out[str(hb)] = fig
    return out


def print_table(summary: dict[str, Any], rounds_run: int) -> str:
    def s(d: dict[str, Any]) -> str:
        return Spread.from_dict(d).text(2, " s")

    rows = []
    for hb, f in summary.items():
        rows.append([hb, f["leave_moved_partitions"], s(f["leave_unowned_s"]), s(f["leave_longest_s"]),
                     s(f["leave_to_all_owned_s"]), f["join_moved_partitions"], s(f["join_unowned_s"]),
                     s(f["join_longest_s"]), s(f["join_to_balanced_s"])])
    return common.table(
        f"Partition hand-over, {PARTITIONS} partitions x 3 topics, 3 members ({stats.rounds(rounds_run)} per variant)",
        ["heartbeat ms", "left: moved", "unowned", "longest/round", "stop->all owned",
         "joined: moved", "unowned", "longest/round", "join->balanced"], rows,
        note="unowned: revoke -> next assignment per moved partition, median (min-max) over all of them; "
             "longest/round: median (min-max) over rounds of each round's longest")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heartbeats", default=",".join(map(str, DEFAULT_HEARTBEATS)),
                   help="heartbeat.interval.ms variants, comma-separated (default %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per variant (default %(default)s)")
    args = p.parse_args(argv)
    heartbeats = [int(x) for x in args.heartbeats.split(",")]
    with common.broker() as b:
        t = common.make_topics(b.bootstrap, common.new_id("handover6"), partitions=PARTITIONS)
        rounds: list[dict[str, Any]] = []
        for r, hb in stats.rotating([str(h) for h in heartbeats], args.rounds):
            result = one_round(b.bootstrap, t, int(hb), f"{hb}-{r}")
            result["round"] = r
            print(f"[bench] round {r} heartbeat {hb} ms: leave longest "
                  f"{max(result['leave_unowned_s'], default=float('nan')):.2f} s, join longest "
                  f"{max(result['join_unowned_s'], default=float('nan')):.2f} s", flush=True)
            rounds.append(result)
    summary = summarize(rounds, heartbeats)
    text = print_table(summary, args.rounds)
    common.write_json("handover", {"partitions_per_topic": PARTITIONS, "topics": 3, "members": 3,
                                   "heartbeats_ms": heartbeats, "summary": summary, "rounds": rounds,
                                   "table": text})
    return 0


if __name__ == "__main__":
    sys.exit(main())
