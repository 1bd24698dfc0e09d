"""bench/host_cost.py, the host's CPU per frame: its device stand-in answers every frame through the real loop
without decoding a pixel, and its figures add up, so the benchmark cannot rot or measure a decode it says it
stands in for."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import simplejpeg

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT / "bench"))  # appended: never shadows a real module

import host_cost  # noqa: E402 (after the sys.path line above)


def test_thread_roles_group_the_workers_threads_and_keep_librdkafkas_apart() -> None:
    assert [host_cost.role_of(r) for r in ("loop", "preprocess", "decode", "infer-cpu", "infer-meta", "rdk:broker",
                                           "rdk:main", "python", "pt_main_thread")] == \
        ["loop", "preprocess", "decode", "inference", "inference", "librdkafka", "librdkafka", "other", "other"]


def test_the_stand_in_device_path_answers_every_frame_through_the_loop_without_decoding_one(monkeypatch) -> None:
    def no_decode(*args: object, **kwargs: object) -> None:
        raise AssertionError("the stand-in decoded a frame")

    monkeypatch.setattr(simplejpeg, "decode_jpeg", no_decode)
    result = host_cost.child({"tree": str(ROOT), "variant": "device", "kafka": "fakes", "frames": 120,
                              "cpu_model": "null"})
    assert result["faults"] == []
    assert result["answered"] == 120
    per_frame = result["cpu_ms_per_frame"]
    assert result["lock_cpu_ms_per_frame"] == pytest.approx(sum(v for k, v in per_frame.items() if k != "librdkafka"))
    assert result["ceiling_fps"] == host_cost.ceiling_fps(result["lock_cpu_ms_per_frame"])
    assert per_frame["decode"] == 0.0  # nothing ran on the CPU path's decode pool


def test_the_ceiling_is_a_second_over_the_lock_holding_time_and_unbounded_when_none_was_seen() -> None:
    # /proc counts thread CPU in 10 ms ticks: a short run can see none, which must not divide by zero.
    assert host_cost.ceiling_fps(0.2) == pytest.approx(5000.0)
    assert host_cost.ceiling_fps(0.0) == float("inf")


def test_the_summary_rows_name_each_variant_of_this_tree_only() -> None:
    run = {"answered": 10, "lock_cpu_ms_per_frame": 0.2, "ceiling_fps": 5000.0}
    result = {"kafka": "fakes", "cpu_model": "null", "rounds": 1,
              "runs": {"this/device": {1: run}, "base/device": {1: run}, "this/cpu": {1: {"error": "exit 1"}}}}
    rows = host_cost.summary(result)
    assert [r[0].split(", ")[2] for r in rows] == ["device path", "CPU path"]
    assert "**0.200 (1 round)**" in rows[0][1] and "ceiling 5000" in rows[0][1]
    assert rows[1][1].startswith("**n/a**")
