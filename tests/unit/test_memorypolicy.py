"""Memory-aware caps, driven by a fake device memory probe (no GPU needed)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from worker.devices.memory import DeviceMemories, GraphBudget, MemoryPolicy, split_batch

SHAPE = (224, 224, 3)
GIB = 1 << 30


class FakeProbe:
    """A device holding `base` bytes (the model) whose batches peak at base + per_frame * n bytes."""

    def __init__(self, total: int, base: int, per_frame: int) -> None:
        self.total, self.base, self.per_frame = total, base, per_frame
        self.peak = 0

    def total_bytes(self) -> int:
        return self.total

    def reset_peak(self) -> None:
        self.peak = self.base  # what is allocated when no batch runs

    def peak_bytes(self) -> int:
        return self.peak

    def run(self, n: int) -> None:
        self.peak = max(self.peak, self.base + self.per_frame * n)


def test_the_largest_batch_keeps_the_measured_peak_under_the_memory_fraction():
    probe = FakeProbe(total=10 * GIB, base=2 * GIB, per_frame=GIB // 4)
    policy = MemoryPolicy(probe.total_bytes(), memory_fraction=0.8)
    for n in (1, 8):  # warm-up measures two sizes
        policy.measure(probe, SHAPE, n, lambda n=n: probe.run(n))

    # 8 GiB allowed: 2 GiB + 0.25 GiB * n <= 8 GiB  ->  n <= 24
    assert policy.max_batch(SHAPE, cap=64) == 24
    assert policy.max_batch(SHAPE, cap=16) == 16
    assert policy.max_batch((1, 1, 3), cap=64) is None  # never measured: no memory cap


def test_the_largest_batch_follows_a_peak_recorded_after_it_was_asked():
    policy = MemoryPolicy(10 * GIB, memory_fraction=0.8)
    policy.record_peak(SHAPE, 1, 2 * GIB + GIB // 4)
    policy.record_peak(SHAPE, 8, 4 * GIB)
    assert policy.max_batch(SHAPE, cap=64) == 24
    policy.record_peak(SHAPE, 16, 8 * GIB)  # larger batches cost more than the first two sizes said
    assert policy.max_batch(SHAPE, cap=64) == 16


def test_one_measured_size_predicts_the_next_from_what_was_allocated_before_it():
    # A model taking half the device: through the origin, a batch of 2 would look like the whole device.
    probe = FakeProbe(total=10 * GIB, base=5 * GIB, per_frame=GIB // 8)
    policy = MemoryPolicy(probe.total_bytes(), memory_fraction=0.8)
    policy.measure(probe, SHAPE, 1, lambda: probe.run(1))

    assert policy.predict_peak(SHAPE, 2) == 5 * GIB + GIB // 4
    assert policy.max_batch(SHAPE, cap=64) == 24  # 5 GiB + n / 8 GiB <= 8 GiB


def test_one_measurement_scales_up_by_frames_and_never_down():
    policy = MemoryPolicy(8 * GIB, memory_fraction=1.0)
    policy.record_peak(SHAPE, 4, GIB)
    assert policy.predict_peak(SHAPE, 8) == 2 * GIB
    assert policy.predict_peak(SHAPE, 2) == GIB


def test_runners_sharing_a_device_each_count_their_batch_memory_and_share_the_model_memory():
    probe = FakeProbe(total=10 * GIB, base=2 * GIB, per_frame=GIB // 4)
    alone, shared = MemoryPolicy(10 * GIB, 0.8), MemoryPolicy(10 * GIB, 0.8, runners=3)
    for policy in (alone, shared):
        policy.measure(probe, SHAPE, 8, lambda: probe.run(8))

    assert alone.max_batch(SHAPE, cap=64) == 24  # 2 GiB + 0.25 GiB * n <= 8 GiB
    assert shared.max_batch(SHAPE, cap=64) == 8  # 2 GiB + 3 * 0.25 GiB * n <= 8 GiB: three batches at once


def test_without_a_measured_model_point_shared_runners_count_the_whole_peak_per_batch():
    policy = MemoryPolicy(10 * GIB, 0.8, runners=2)
    policy.record_peak(SHAPE, 1, GIB)
    policy.record_peak(SHAPE, 2, 2 * GIB)
    assert policy.max_batch(SHAPE, cap=64) == 4  # 2 x n GiB <= 8 GiB


def test_over_several_devices_the_largest_batch_is_what_they_take_together():
    small, large = MemoryPolicy(1000, 1.0), MemoryPolicy(2000, 1.0)
    for policy in (small, large):
        policy.record_peak(SHAPE, 1, 100)
        policy.record_peak(SHAPE, 2, 200)
    devices = DeviceMemories([small, large])

    assert devices.max_batch(SHAPE, cap=64) == 10 + 20
    assert devices.max_batch(SHAPE, cap=16) == 16
    assert devices.max_batch((1, 1, 3), cap=64) is None  # measured on no device: no memory bound


def test_a_device_that_never_measured_a_shape_does_not_bound_it():
    measured, unmeasured = MemoryPolicy(1000, 1.0), MemoryPolicy(1000, 1.0)
    measured.record_peak(SHAPE, 1, 100)
    assert DeviceMemories([measured, unmeasured]).max_batch(SHAPE, cap=64) == 64


def test_a_batch_the_first_device_takes_is_not_split():
    assert split_batch(8, [8, 8]) == [(0, 8)]
    assert split_batch(100, [None, 4]) == [(0, 100)]


def test_a_batch_over_one_device_is_shared_evenly_by_as_few_devices_as_take_it():
    assert split_batch(10, [8, 8, 8]) == [(0, 5), (1, 5)]
    assert split_batch(20, [8, 8, 8]) == [(0, 7), (1, 7), (2, 6)]


def test_a_device_that_cannot_take_an_even_share_takes_its_cap_and_the_others_the_rest():
    assert split_batch(12, [10, 2]) == [(0, 10), (1, 2)]
    assert split_batch(30, [4, 16, 16]) == [(0, 4), (1, 13), (2, 13)]


def test_a_batch_larger_than_every_device_together_goes_round_them_in_full_parts():
    assert split_batch(20, [4, 8]) == [(0, 4), (1, 8), (0, 4), (1, 4)]


@given(n=st.integers(1, 200), caps=st.lists(st.none() | st.integers(1, 40), min_size=1, max_size=6))
def test_split_parts_hold_every_frame_once_in_order_within_their_device_caps(n, caps):
    parts = split_batch(n, caps)
    assert sum(count for _, count in parts) == n and all(count >= 1 for _, count in parts)
    assert all(0 <= d < len(caps) and (caps[d] is None or count <= caps[d]) for d, count in parts)
    together = sum(n if c is None else c for c in caps)
    if together >= n:  # one part per device at most, on the first devices
        assert [d for d, _ in parts] == list(range(len(parts)))


def test_captured_graphs_stay_under_their_budget_least_recently_used_out_first():
    budget: GraphBudget[str] = GraphBudget(30)
    assert budget.admit("a", 10) == []
    assert budget.admit("b", 10) == []
    assert budget.admit("c", 10) == []
    budget.touch("a")  # replayed: now the most recent
    assert budget.admit("d", 10) == ["b"]
    assert list(budget.graphs) == ["c", "a", "d"] and budget.used_bytes == 30 and budget.evictions == 1


def test_a_graph_larger_than_the_budget_alone_is_kept_and_the_rest_go():
    budget: GraphBudget[str] = GraphBudget(30)
    budget.admit("a", 10)
    assert budget.admit("big", 50) == ["a"]
    assert budget.graphs == {"big": 50}


def test_fits_says_whether_a_graph_needs_no_eviction():
    budget: GraphBudget[str] = GraphBudget(30)
    budget.admit("a", 20)
    assert budget.fits(10) and not budget.fits(11)
    assert GraphBudget(None).fits(1 << 50)


def test_memory_fraction_must_be_a_share():
    with pytest.raises(ValueError):
        MemoryPolicy(100, memory_fraction=0)


def test_the_memory_policy_imports_neither_kafka_nor_torch():
    code = "import sys, worker.devices.memory; print(any(m in sys.modules for m in ('confluent_kafka', 'torch')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_nvjpegs_buffers_outside_the_allocator_come_off_the_limit():
    """The device path's decoder holds memory no peak measured here sees (issue 45, item 8)."""
    from worker.devices.memory import NVJPEG_HEADROOM_BYTES

    per_frame = 64 << 20
    probe = FakeProbe(total=10 * GIB, base=2 * GIB, per_frame=per_frame)
    plain = MemoryPolicy(probe.total_bytes(), memory_fraction=0.8)
    decoding = MemoryPolicy(probe.total_bytes(), memory_fraction=0.8, headroom_bytes=NVJPEG_HEADROOM_BYTES)
    for policy in (plain, decoding):
        for n in (1, 8):
            policy.measure(probe, SHAPE, n, lambda n=n: probe.run(n))
    assert decoding.limit_bytes == plain.limit_bytes - NVJPEG_HEADROOM_BYTES
    assert plain.max_batch(SHAPE, 1000) - decoding.max_batch(SHAPE, 1000) == NVJPEG_HEADROOM_BYTES // per_frame
    with pytest.raises(ValueError, match="headroom_bytes"):
        MemoryPolicy(GIB, memory_fraction=0.5, headroom_bytes=GIB)
