"""bench/latency_sweep.py's level sizing and latency breakdown, and the broker warm-up's JIT probe (bench/common.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))  # appended: never shadows a real module

import common
import latency_sweep
import stats


def test_a_level_lasts_until_its_standard_frames_give_a_p99_within_the_time_limits() -> None:
    full_low, full_high = latency_sweep.LEVEL_SECONDS["full"]
    wanted = latency_sweep.STANDARD_SAMPLES["full"]
    # 100 standard frames/s: the sample count decides.
    assert latency_sweep.level_seconds(250.0, 0.4, quick=False) == pytest.approx(wanted / 100.0)
    # A high rate reaches the samples at once: the shortest level still runs.
    assert latency_sweep.level_seconds(50_000.0, 0.4, quick=False) == full_low
    # A low rate would need minutes: the longest level instead.
    assert latency_sweep.level_seconds(10.0, 0.4, quick=False) == full_high
    quick_low, quick_high = latency_sweep.LEVEL_SECONDS["quick"]
    assert quick_low <= latency_sweep.level_seconds(80.0, 0.4, quick=True) <= quick_high
    assert latency_sweep.level_seconds(0.0, 0.4, quick=True) == quick_high


def _result(end_to_end: float, queued: float, inference: float) -> dict[str, float]:
    return {"end_to_end_ms": end_to_end, "queued_ms": queued, "inference_ms": inference}


def test_standard_parts_split_each_frame_into_in_queued_and_run() -> None:
    # 100 frames: in = 1..100 ms, queued = 2x, run = 5 ms each.
    ok = [_result(end_to_end=i + 2 * i + 5, queued=2 * i, inference=5) for i in range(1, 101)]
    parts = latency_sweep.standard_parts(ok)
    assert parts["in_p50_ms"] == pytest.approx(stats.percentile(sorted(range(1, 101)), 0.5))
    assert parts["in_p99_ms"] == pytest.approx(stats.percentile(sorted(range(1, 101)), 0.99))
    assert parts["queued_p99_ms"] == pytest.approx(2 * parts["in_p99_ms"])
    assert parts["run_p50_ms"] == parts["run_p99_ms"] == 5


def test_standard_parts_of_no_frames_are_not_numbers() -> None:
    parts = latency_sweep.standard_parts([])
    assert set(parts) == {f"{k}_{q}_ms" for k in ("in", "queued", "run") for q in ("p50", "p99")}
    assert all(v != v for v in parts.values())


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_compiler_probe_counts_the_cpu_of_threads_named_like_the_jvms_c2_compiler() -> None:
    import ctypes
    import threading
    import time

    libc = ctypes.CDLL(None, use_errno=True)
    burned, release = threading.Event(), threading.Event()

    def compiler_like(name: bytes) -> None:
        libc.prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # PR_SET_NAME: what /proc/<pid>/task/<tid>/comm shows
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.3:
            pass
        burned.set()
        release.wait(10)

    before = common.compiler_cpu_seconds(os.getpid())
    thread = threading.Thread(target=compiler_like, args=(b"C2 CompilerThre",))
    thread.start()
    try:
        assert burned.wait(10)
        assert common.compiler_cpu_seconds(os.getpid()) - before >= 0.2
    finally:
        release.set()
        thread.join()
    assert common.compiler_cpu_seconds(2**22 + 12345) == 0.0  # no such process


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_compiler_probe_leaves_out_other_threads() -> None:
    busy = sum(range(3_000_000))  # this process's own threads are not compiler threads
    assert busy > 0
    assert common.compiler_cpu_seconds(os.getpid()) == 0.0
