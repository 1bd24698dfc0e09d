"""The rolling-restart benchmark's figures (tests/reliability/rolloutfigures.py): pure, from answer times and log
lines."""

from __future__ import annotations

import math

import pytest

from tests.reliability.rolloutfigures import (
    LogEvent,
    Window,
    aborts_per_rebalance,
    first_assignment,
    gap_figures,
    log_time,
    longest_answer_gap,
    parse_log,
    percentile,
    unowned_spans,
    window_latencies,
)

A, B = ("t.realtime", 0), ("t.bulk", 3)


def test_percentile_is_nearest_rank_and_nan_when_empty() -> None:
    assert percentile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.0
    assert percentile(range(1, 101), 0.99) == 99
    assert math.isnan(percentile([], 0.5))


def test_latency_windows_take_the_frames_sent_inside_them() -> None:
    samples = [(0.5, 0.1), (1.5, 0.2), (1.6, 0.4), (2.5, 1.0)]
    got = window_latencies(samples, [Window("before", 0, 1), Window("during", 1, 2), Window("after", 2, 3)])
    assert got["before"] == {"frames": 1, "p50_ms": pytest.approx(100.0), "p99_ms": pytest.approx(100.0)}
    assert got["during"]["frames"] == 2 and got["during"]["p99_ms"] == pytest.approx(400.0)
    assert got["after"]["p50_ms"] == pytest.approx(1000.0)


def test_an_answer_gap_counts_only_while_a_frame_waits() -> None:
    # Answered at 1 and 2; the next frame is sent at 10 and answered at 10.5: the idle stretch is no gap.
    assert longest_answer_gap([(0.0, 1.0), (1.5, 2.0), (10.0, 10.5)], end=11) == pytest.approx(1.0)


def test_an_answer_gap_runs_from_the_previous_answer_while_input_waits() -> None:
    # A frame sent at 1.5 waits through a stall: no answer from 2 (the previous) to 6.
    assert longest_answer_gap([(0.0, 1.0), (0.5, 2.0), (1.5, 6.0)], end=7) == pytest.approx(4.0)


def test_a_frame_never_answered_waits_to_the_end() -> None:
    assert longest_answer_gap([(0.0, 1.0), (2.0, None)], end=9) == pytest.approx(7.0)


def test_gap_figures_compare_the_longest_with_the_median_partition() -> None:
    got = gap_figures({"0": 1.0, "1": 2.0, "2": 4.0})
    assert got == {"max_s": 4.0, "median_s": 2.0, "ratio": 2.0}


def test_the_log_gives_assignments_aborts_and_rewinds() -> None:
    text = "\n".join([
        "2026-12-05 16:10:16,100 INFO [w0] worker: worker started: topics=['t.realtime'] mode=exactly_once",
        "%4|1796487214.882|FAIL|rdkafka#producer-1| a librdkafka line",
        "2026-12-05 16:10:16,200 INFO [w0] worker.loop.pipeline: partitions assigned: "
        "[('t.realtime', 0), ('t.bulk', 3)]",
        "2026-12-05 16:10:17,000 INFO [w0] worker.loop.delivery: transaction aborted before any output joined it "
        "(x): ...",
        "2026-12-05 16:10:18,000 WARNING [w0] worker.loop.delivery: transaction aborted (y): rewinding to the "
        "committed offsets",
        "2026-12-05 16:10:19,000 WARNING [w0] worker.loop.pipeline: partitions lost: []",
    ])
    events = parse_log(text, "w0#1")
    assert [e.kind for e in events] == ["started", "assigned", "aborted", "aborted", "rewound", "lost"]
    assert events[1].tps == {A, B}
    assert events[1].t - events[0].t == pytest.approx(0.1, abs=1e-3)
    assert events[0].t == pytest.approx(log_time("2026-12-05 16:10:16,100"))


def _e(t: float, process: str, kind: str, *tps: tuple[str, int]) -> LogEvent:
    return LogEvent(t, process, kind, frozenset(tps))


def test_a_partition_is_unowned_from_the_revoke_that_leaves_it_to_nobody_to_its_next_assignment() -> None:
    events = [_e(0, "w0#1", "assigned", A, B), _e(10, "w0#1", "revoked", A, B), _e(10.8, "w1#1", "assigned", A),
              _e(11.2, "w2#1", "assigned", B)]
    assert unowned_spans(events, since=5, until=20) == {A: pytest.approx(0.8), B: pytest.approx(1.2)}


def test_an_unowned_stretch_outside_the_window_or_still_open_at_its_end() -> None:
    events = [_e(0, "w0#1", "assigned", A, B), _e(1, "w0#1", "revoked", A), _e(2, "w1#1", "assigned", A),
              _e(18, "w0#1", "revoked", B)]
    # A's stretch began before `since`; B's is still open at `until`.
    assert unowned_spans(events, since=5, until=20) == {B: pytest.approx(2.0)}


def test_aborts_are_counted_per_rebalance_callback_of_each_process() -> None:
    events = [_e(0, "w0#1", "assigned", A), _e(1, "w0#1", "aborted"), _e(2, "w0#1", "revoked", A),
              _e(3, "w0#1", "aborted"), _e(4, "w0#1", "aborted"), _e(4, "w0#1", "rewound"),
              _e(1.5, "w1#1", "aborted"), _e(5, "w1#1", "assigned", B)]
    got = aborts_per_rebalance(events)
    assert (got.total, got.most_per_rebalance, got.repeated, got.rewinds, got.rebalances) == (4, 2, 1, 1, 3)


def test_ready_is_the_first_assignment_that_hands_over_a_partition() -> None:
    events = [_e(1, "w0#2", "assigned"), _e(2, "w0#2", "assigned", A), _e(0.5, "w0#1", "assigned", B)]
    assert first_assignment(events, "w0#2") == 2
    assert first_assignment(events, "w9#1") is None
