"""`worker lag`'s arithmetic and report without a broker (worker/tools/lag.py); against the broker, and against
Kafka's own kafka-consumer-groups.sh, in tests/integration/test_dlq_and_lag.py."""

from __future__ import annotations

import json

from worker.partitions.donemeta import done_count, encode
from worker.tools.lag import (
    LagReport,
    Owner,
    PartitionLag,
    Pending,
    group_lag,
    state_name,
)

NOW_MS = 1_800_000_000_000
RT, STD, BULK = "frames.realtime", "frames.standard", "frames.bulk"
PRIORITIES = {RT: "realtime", STD: "standard", BULK: "bulk"}
W0 = Owner("m-0", "w0", "/10.0.0.1")
W1 = Owner("m-1", "w1", "/10.0.0.2")


def row(committed: int | None, start: int, end: int) -> PartitionLag:
    return PartitionLag("g", STD, 0, "standard", committed, start, end, None)


def test_lag_is_end_minus_committed_and_counts_from_the_first_retained_offset_when_that_is_later() -> None:
    assert row(70, 0, 100).lag == 30
    assert row(100, 0, 100).lag == 0
    assert row(None, 40, 100).lag == 60  # nothing committed: a worker starts at the first offset
    assert row(10, 40, 100).lag == 60  # retention deleted 10..39: they cannot be read any more
    assert row(120, 0, 100).lag == 0  # never negative


def test_each_partition_names_its_owner_and_rows_go_by_class_then_topic_and_partition() -> None:
    g = group_lag("g", "Stable", {W0: [(RT, 0), (STD, 1)], W1: [(BULK, 0)]}, {(STD, 1): 5, (BULK, 0): 2},
                  {(BULK, 0): (0, 4), (STD, 1): (0, 9), (RT, 0): (0, 0), ("other.topic", 0): (0, 3)}, PRIORITIES)
    assert [(p.topic, p.partition, p.priority) for p in g.partitions] == [
        (RT, 0, "realtime"), (STD, 1, "standard"), (BULK, 0, "bulk"), ("other.topic", 0, "other")]
    assert [p.owner for p in g.partitions] == [W0, W0, W1, None]
    assert [p.lag for p in g.partitions] == [0, 4, 2, 3]
    assert g.members == (W0, W1)


def test_a_class_filter_keeps_only_its_partitions() -> None:
    g = group_lag("g", "Empty", {}, {}, {(RT, 0): (0, 5), (STD, 0): (0, 7)}, PRIORITIES, classes={"realtime"})
    assert [(p.topic, p.lag) for p in g.partitions] == [(RT, 5)]


def report(pending_rt: Pending, pending_std: Pending) -> LagReport:
    g = group_lag("g", "Empty", {}, {(RT, 0): 10, (STD, 0): 50}, {(RT, 0): (0, 12), (STD, 0): (0, 80)}, PRIORITIES,
                  pending={(RT, 0): pending_rt, (STD, 0): pending_std})
    return LagReport((g,), NOW_MS)


def test_totals_per_class_carry_the_lag_and_the_oldest_pending_frames_age() -> None:
    r = report(Pending(NOW_MS - 2_500), Pending(note="offset 50 is not a frame"))
    totals = r.totals()
    assert list(totals) == ["realtime", "standard"]
    assert (totals["realtime"].lag, totals["realtime"].oldest_age_s) == (2, 2.5)
    assert (totals["standard"].lag, totals["standard"].oldest_age_s) == (30, None)
    assert r.total_lag == 32 and r.oldest_age_s == 2.5


def test_thresholds_are_crossed_only_above_them() -> None:
    r = report(Pending(NOW_MS - 2_500), Pending())
    assert r.exceeded(None, None) == []
    assert r.exceeded(32, 2.5) == []
    assert len(r.exceeded(31, None)) == 1 and "lag 32" in r.exceeded(31, None)[0]
    assert len(r.exceeded(None, 2.0)) == 1 and "2.5s" in r.exceeded(None, 2.0)[0]
    assert report(Pending(), Pending()).exceeded(None, 0.0) == []  # no age known: nothing to compare


def test_the_report_as_json_and_as_a_table() -> None:
    r = report(Pending(NOW_MS - 2_500), Pending(note="not read within 5s"))
    out = json.loads(json.dumps(r.to_json()))
    [g] = out["groups"]
    assert g["group"] == "g" and [p["lag"] for p in g["partitions"]] == [2, 30]
    assert g["partitions"][0]["oldest_pending_age_s"] == 2.5 and g["partitions"][1]["oldest_pending_note"]
    assert out["totals"]["standard"]["lag"] == 30 and out["total_lag"] == 32
    text = r.render()
    assert "group g: Empty, no members" in text and "not read within 5s" in text and "total 32" in text


def test_a_group_that_does_not_exist_says_so() -> None:
    g = group_lag("nope", "Dead", {}, {}, {(RT, 0): (0, 5)}, PRIORITIES)
    assert "does not exist" in LagReport((g,), NOW_MS).render()


def test_group_states_print_as_kafka_names_them() -> None:
    class State:
        name = "PREPARING_REBALANCE"

    assert state_name(State()) == "PreparingRebalance" and state_name("STABLE") == "Stable"


def test_a_commit_whose_metadata_lists_done_offsets_shows_them() -> None:
    text = encode(10, [(10, 11), (15, 16)], 20, 4000)  # read 10..19, not done: 10 and 15
    g = group_lag("g", "Empty", {}, {(STD, 0): 10}, {(STD, 0): (0, 30)}, PRIORITIES,
                  done_beyond={(STD, 0): done_count(text, 10)})
    [p] = g.partitions
    assert p.done_beyond == 8
    r = LagReport((g,), NOW_MS)
    assert r.to_json()["groups"][0]["partitions"][0]["done_beyond"] == 8
    assert "done+" in r.render()
