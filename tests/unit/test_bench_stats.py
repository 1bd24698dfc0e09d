"""bench/stats.py: how rounds become the figures the benchmarks print (medians of per-round ratios)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "stats.py"
_spec = importlib.util.spec_from_file_location("bench_stats", _PATH)
assert _spec and _spec.loader
stats = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = stats  # dataclasses look their module up while the class is built
_spec.loader.exec_module(stats)


def test_spread_is_median_min_max_of_the_rounds() -> None:
    s = stats.Spread.of([0.87, 0.44, 0.55, 0.6, 0.5])
    assert (s.median, s.low, s.high, s.n) == (0.55, 0.44, 0.87, 5)
    assert s.text() == "0.55 (0.44-0.87)"


def test_spread_leaves_out_nan_rounds_and_says_when_there_are_none() -> None:
    assert stats.Spread.of([1.0, float("nan"), 3.0]).n == 2
    empty = stats.Spread.of([float("nan")])
    assert empty.n == 0 and empty.text() == "n/a" and empty.as_dict()["median"] is None


def test_a_single_round_is_labelled_as_such() -> None:
    assert stats.Spread.of([724.0]).text(suffix=" f/s") == "724 f/s (1 round)"


def test_rotating_order_lets_each_variant_go_first_in_turn_and_run_once_a_round() -> None:
    order = stats.rotating(["a", "b", "c"], 3)
    assert order == [(1, "a"), (1, "b"), (1, "c"), (2, "b"), (2, "c"), (2, "a"), (3, "c"), (3, "a"), (3, "b")]
    assert stats.rotating(["b", "c"], 2) == [(1, "b"), (1, "c"), (2, "c"), (2, "b")]
    with pytest.raises(ValueError):
        stats.rotating(["b"], 0)


def test_two_variants_alternate_which_goes_first_so_a_drifting_machine_favours_neither() -> None:
    order = stats.rotating(["A", "B"], 4)
    assert order == [(1, "A"), (1, "B"), (2, "B"), (2, "A"), (3, "A"), (3, "B"), (4, "B"), (4, "A")]
    firsts = [v for i, (_, v) in enumerate(order) if i % 2 == 0]
    assert firsts.count("A") == firsts.count("B")
    with pytest.raises(ValueError):
        stats.rotating(["A", "B"], 0)


def test_interleaved_order_alternates_variants_within_each_round() -> None:
    assert stats.interleaved(["A", "B"], 3) == [(1, "A"), (1, "B"), (2, "A"), (2, "B"), (3, "A"), (3, "B")]
    with pytest.raises(ValueError):
        stats.interleaved(["A"], 0)


def test_ratio_is_the_median_of_per_round_ratios_not_a_ratio_of_bests() -> None:
    worker = {1: 600.0, 2: 700.0, 3: 500.0}
    baseline = {1: 500.0, 2: 800.0, 3: 500.0}
    # Per round: 1.2, 0.875, 1.0 -> median 1.0; the best-of-rounds ratio would be 700/800 = 0.875.
    spread = stats.ratio_spread(worker, baseline)
    assert (spread.median, spread.low, spread.high) == (1.0, 0.875, 1.2)


def test_ratios_use_only_rounds_both_sides_ran_in() -> None:
    assert stats.round_ratios({1: 2.0, 2: 4.0, 3: 9.0}, {2: 2.0, 3: 3.0}) == [2.0, 3.0]
    assert math.isnan(stats.round_ratios({1: 1.0}, {1: 0.0})[0])


def test_cpu_ms_per_frame() -> None:
    assert stats.cpu_ms_per_frame(1.5, 500) == 3.0
    assert math.isnan(stats.cpu_ms_per_frame(None, 10))
    assert math.isnan(stats.cpu_ms_per_frame(1.0, 0))


def test_cpu_between_interpolates_the_samples() -> None:
    samples = [(10.0, 1.0), (11.0, 2.0), (12.0, 2.5)]
    assert stats.cpu_between(samples, 10.5, 11.5) == pytest.approx(0.75)
    assert stats.cpu_between(samples, 11.0, 12.0) == pytest.approx(0.5)


def test_cpu_between_refuses_a_window_outside_the_samples() -> None:
    samples = [(10.0, 1.0), (11.0, 2.0)]
    assert math.isnan(stats.cpu_between(samples, 9.0, 10.5))
    assert math.isnan(stats.cpu_between(samples, 10.2, 11.5))
    assert math.isnan(stats.cpu_between(samples[:1], 10.0, 10.0))


def test_rounds_run_in_the_given_order_and_a_failed_run_is_kept_as_a_finding() -> None:
    ran: list[str] = []

    def measure(variant: str) -> dict[str, float]:
        ran.append(variant)
        if variant == "b" and ran.count("b") == 2:
            raise RuntimeError("consumer b exited\nTraceback ...\nValueError: bad frame\n")
        return {"frames_per_s": 10.0 * len(ran)}

    logged: list[str] = []
    runs = stats.run_rounds(stats.interleaved(["a", "b"], 2), measure, logged.append)
    assert ran == ["a", "b", "a", "b"]
    assert runs["a"] == {1: {"frames_per_s": 10.0}, 2: {"frames_per_s": 30.0}}
    assert runs["b"][2] == {"failed": "consumer b exited\nTraceback ...\nValueError: bad frame\n"}
    assert stats.failures(runs) == ["round 2 b: ValueError: bad frame"] and logged == ["round 2 b FAILED: "
                                                                                       "ValueError: bad frame"]
    # The failed round is left out of the spread and of the per-round ratios, not counted as zero.
    assert stats.spread(runs["b"], "frames_per_s").n == 1
    assert stats.ratio_spread(stats.figure(runs["b"], "frames_per_s"), stats.figure(runs["a"], "frames_per_s")).n == 1


def test_a_crash_that_is_not_a_runtime_error_stops_the_rounds() -> None:
    def measure(variant: str) -> dict[str, float]:
        raise KeyError(variant)

    with pytest.raises(KeyError):
        stats.run_rounds(stats.interleaved(["a"], 1), measure)


def test_a_spread_survives_its_json_form() -> None:
    s = stats.Spread.of([3.0, 1.0, 2.0])
    assert stats.Spread.from_dict(s.as_dict()) == s
    assert stats.Spread.from_dict(stats.Spread.of([]).as_dict()).text() == "n/a"


def test_percentile_is_nearest_rank() -> None:
    values = sorted(float(v) for v in range(1, 101))
    assert (stats.percentile(values, 0.5), stats.percentile(values, 0.99), stats.percentile(values, 1.0)) == (
        50.0, 99.0, 100.0)
    assert stats.percentile([7.0], 0.99) == 7.0
    assert math.isnan(stats.percentile([], 0.5))
