"""bench/batching_gain.py's latency rounds: how rounds become medians and per-round ratios (their run order:
stats.rotating, tested in test_bench_stats.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))  # appended: never shadows a real module

import batching_gain


def _run(p50: float, p99: float, kept_up: bool = True, rt: float = 1.0, std: float = 2.0, bulk: float = 3.0,
         batch: float = 4.0, cpu: float = 1.0) -> dict[str, Any]:
    return {"latency": {"p50_ms": p50, "p99_ms": p99}, "kept_up": kept_up, "consumer_cpu_ms_per_frame": cpu,
            "batch_sizes": {"mean_frame_weighted": batch},
            "latency_by_class": {"realtime": {"p99_ms": rt}, "standard": {"p99_ms": std}, "bulk": {"p99_ms": bulk}}}


def test_rounds_become_medians_with_min_and_max_and_kept_up_counts() -> None:
    sp = batching_gain.latency_spread([_run(10, 300, bulk=900, cpu=1.5), _run(30, 100, kept_up=False, bulk=100),
                                       _run(20, 200, bulk=500, cpu=float("nan"))])
    assert (sp["p50_ms"]["median"], sp["p50_ms"]["min"], sp["p50_ms"]["max"]) == (20, 10, 30)
    assert sp["p99_ms"]["text"] == "200 (100-300)"
    assert sp["bulk_p99_ms"]["median"] == 500
    assert (sp["rounds"], sp["kept_up_rounds"]) == (3, 2)
    # A round without a CPU figure is left out of its spread, not counted as zero.
    assert (sp["cpu_ms_per_frame"]["median"], sp["cpu_ms_per_frame"]["rounds"]) == (1.25, 2)


def test_the_worker_over_fixed_ratio_is_the_median_of_per_round_ratios_not_a_ratio_of_medians() -> None:
    # Per round: 100/200 = 0.5, 400/100 = 4, 300/300 = 1 -> median 1.0; the medians' ratio would be 300/200 = 1.5.
    ratio = batching_gain.worker_over_fixed_p99({"c": [_run(1, 100), _run(1, 400), _run(1, 300)],
                                                 "b": [_run(1, 200), _run(1, 100), _run(1, 300)]})
    assert (ratio["median"], ratio["min"], ratio["max"], ratio["rounds"]) == (1.0, 0.5, 4.0, 3)
