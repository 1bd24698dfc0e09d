"""bench/batching_gain.py's latency rounds: how rounds become medians and per-round ratios (their run order:
stats.rotating, tested in test_bench_stats.py)."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

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


def test_thread_roles_drop_the_numbering_of_the_workers_and_librdkafkas_threads() -> None:
    role = batching_gain.common.thread_role
    assert [role(n) for n in ("infer-cpu-0-0", "decode_1", "preprocess-0", "rdk:broker1", "rdk:broker-1",
                              "rdk:main", "python", "metrics-http")] == [
        "infer-cpu", "decode", "preprocess", "rdk:broker", "rdk:broker", "rdk:main", "python", "metrics-http"]


def test_a_named_thread_s_cpu_is_read_from_proc_under_its_role() -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("thread CPU is read from /proc")
    from worker.threadnames import name_os_thread

    stop = threading.Event()

    def spin() -> None:
        name_os_thread()
        while not stop.is_set():
            sum(range(1000))

    t = threading.Thread(target=spin, name="gainspin-3")
    t.start()
    try:
        deadline = time.monotonic() + 30
        seen = batching_gain.common.thread_cpu_seconds(os.getpid())
        while seen.get("gainspin", 0.0) < 0.05 and time.monotonic() < deadline:
            time.sleep(0.01)
            seen = batching_gain.common.thread_cpu_seconds(os.getpid())
    finally:
        stop.set()
        t.join()
    assert seen.get("gainspin", 0.0) >= 0.05


def test_thread_cpu_per_frame_is_each_roles_difference_largest_first_and_rounds_spread_by_role() -> None:
    per = batching_gain.common.thread_cpu_ms_per_frame({"python": 1.0, "infer-cpu": 2.0},
                                                {"python": 1.5, "infer-cpu": 4.0, "decode": 0.25}, 1000)
    assert per == {"infer-cpu": 2.0, "python": 0.5, "decode": 0.25}
    assert list(per) == ["infer-cpu", "python", "decode"]
    runs = [{**_run(1, 1), "consumer_thread_cpu_ms_per_frame": {"infer-cpu": x, "python": 0.4}} for x in (0.8, 0.9)]
    runs.append({**_run(1, 1), "consumer_thread_cpu_ms_per_frame": {"python": 0.5}})  # no inference thread here
    sp = batching_gain.latency_spread(runs)["thread_cpu_ms_per_frame"]
    assert list(sp) == ["infer-cpu", "python"]
    assert (sp["infer-cpu"]["median"], sp["infer-cpu"]["min"]) == (0.8, 0.0)
    assert sp["python"]["text"] == "0.400 (0.400-0.500)"
