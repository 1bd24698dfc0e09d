"""The learned batch-cost model: pure, fed measured batches."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest

from worker.batching.costmodel import EXPLORE_AFTER, EXPLORE_SAMPLES, RETRY_AFTER, CostModel

SHAPE = (224, 224, 3)


def test_nothing_measured_predicts_nothing():
    cost = CostModel()
    assert cost.predict(SHAPE, 8) is None and cost.best_size(SHAPE, 32) is None


def test_a_line_is_fitted_through_the_measured_sizes():
    cost = CostModel()
    for n in (1, 2, 4, 8):
        cost.observe(SHAPE, n, 0.002 + 0.001 * n)

    a, b = cost.line(SHAPE)
    assert (a, b) == (pytest.approx(0.002), pytest.approx(0.001))
    assert cost.predict(SHAPE, 16) == pytest.approx(0.018)


def test_the_line_follows_every_observation_made_since_it_was_last_used():
    cost = CostModel(alpha=1.0)  # the mean is the latest measurement
    for n in (1, 2, 4, 8):
        cost.observe(SHAPE, n, 0.002 + 0.001 * n)
    assert cost.predict(SHAPE, 16) == pytest.approx(0.018)
    for n in (1, 2, 4, 8):  # twice as slow now
        cost.observe(SHAPE, n, 0.004 + 0.002 * n)
    assert cost.line(SHAPE) == (pytest.approx(0.004), pytest.approx(0.002))
    assert cost.predict(SHAPE, 16) == pytest.approx(0.036)
    assert cost.largest_within(SHAPE, 0.036, 32) == 16


def test_a_measured_size_predicts_its_own_recent_mean():
    cost = CostModel(alpha=0.5)
    cost.observe(SHAPE, 8, 0.010)
    cost.observe(SHAPE, 8, 0.020)
    assert cost.predict(SHAPE, 8) == pytest.approx(0.015)


def test_one_measured_size_scales_by_frames():
    cost = CostModel()
    cost.observe(SHAPE, 8, 0.016)
    assert cost.predict(SHAPE, 4) == pytest.approx(0.008)


def test_an_unmeasured_shape_is_scaled_from_the_closest_by_area():
    cost = CostModel()
    cost.observe((100, 100, 3), 4, 0.010)
    assert cost.predict((200, 100, 3), 4) == pytest.approx(0.020)
    assert cost.predict((100, 100, 1), 4) is None  # other channels: nothing to scale from


def test_best_size_is_the_most_frames_per_device_second_preferring_the_larger_on_a_tie():
    cost = CostModel()
    cost.observe(SHAPE, 4, 0.0050)   # 800/s
    cost.observe(SHAPE, 8, 0.0104)   # 769/s: within 15%, and fewer batches cost less outside the measurement
    cost.observe(SHAPE, 32, 0.080)   # 400/s: half the best
    assert cost.best_size(SHAPE, 32) == 8
    assert cost.best_size(SHAPE, 2) is None


def test_largest_within_a_time_budget():
    cost = CostModel()
    cost.observe(SHAPE, 1, 0.012)
    cost.observe(SHAPE, 32, 0.322)
    assert cost.largest_within(SHAPE, 0.070, 32) == 6
    assert cost.largest_within(SHAPE, 0.001, 32) == 0
    assert cost.largest_within((1, 1, 1), 1.0, 32) is None


def test_bad_measurements_are_ignored():
    cost = CostModel()
    cost.observe(SHAPE, 0, 0.01)
    cost.observe(SHAPE, 4, float("nan"))
    cost.observe(SHAPE, 4, 0.0)
    assert not cost.known(SHAPE) and cost.version == 0


def test_the_cost_model_imports_neither_kafka_nor_torch():
    code = "import sys, worker.batching.costmodel; print(any(m in sys.modules for m in ('confluent_kafka', 'torch')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_a_shape_seen_only_in_small_batches_still_chooses_among_the_calibrated_sizes():
    cost = CostModel()
    for n, t in ((1, 0.004), (4, 0.008), (16, 0.020)):  # warm-up calibration of 224x224
        cost.observe(SHAPE, n, t)
    small = (112, 112, 3)
    cost.observe(small, 1, 0.001)  # its first batches ran alone (rare-shape lane): a quarter of 224's time

    assert cost.best_size(small, 32) == 16
    assert cost.predict(small, 16) == pytest.approx(0.005)


def _calibrated(cost: CostModel, times: dict[int, float]) -> None:
    for n, t in times.items():
        cost.observe(SHAPE, n, t, calibration=True)


def _choose_and_run(cost: CostModel, cap: int, batches: int, seconds: Callable[[int, list[int]], float]) -> list[int]:
    """Run `batches` batches at the sizes the cost model chooses, each measured at seconds(size, sizes chosen
    before it); the sizes chosen."""
    chosen: list[int] = []
    for _ in range(batches):
        n = cost.best_size(SHAPE, cap)
        assert n is not None
        cost.observe(SHAPE, n, seconds(n, chosen))
        chosen.append(n)
    return chosen


def test_a_size_known_only_from_calibration_is_scaled_by_how_much_slower_live_batches_run():
    cost = CostModel()
    _calibrated(cost, {4: 0.100, 8: 0.160, 16: 0.400})  # 40, 50, 40 frames/s: 8 is best
    assert cost.best_size(SHAPE, 32) == 8
    cost.observe(SHAPE, 8, 0.240)  # live batches run 1.5x their calibration (real frames, overlap, load)
    assert cost.predict(SHAPE, 4) == pytest.approx(0.150) and cost.predict(SHAPE, 16) == pytest.approx(0.600)
    # Unscaled, 4 (40/s) and 16 (40/s) would now beat 8 (33/s), and the choice would walk off to an untried size.
    assert cost.best_size(SHAPE, 32) == 8


def test_the_size_in_use_is_kept_while_near_the_best_and_left_when_another_is_clearly_better():
    cost = CostModel(alpha=1.0)
    _calibrated(cost, {8: 0.100, 16: 0.210})  # 80/s and 76/s: 8 is best, 16 within 5%
    assert cost.best_size(SHAPE, 32) == 16  # the larger of two near-equal sizes: fewer batches
    cost.observe(SHAPE, 16, 0.205)  # 78/s now, 8 (scaled by 0.976) 82/s: still within 5%, kept
    assert cost.best_size(SHAPE, 32) == 16
    cost.observe(SHAPE, 16, 0.300)  # background load on the size in use: 53/s; 8 scaled the same way: 53/s too
    assert cost.best_size(SHAPE, 32) == 16
    cost.observe(SHAPE, 8, 0.080)  # measured live: 100/s, clearly better than 16's 53/s
    assert cost.best_size(SHAPE, 32) == 8
    cost.observe(SHAPE, 16, 0.165)  # 97/s: within 5% of 8's 100/s, but 8 is in use now: kept
    assert cost.best_size(SHAPE, 32) == 8


def test_a_larger_size_clearly_slower_per_frame_is_not_chosen_for_being_larger():
    cost = CostModel()
    cost.observe(SHAPE, 8, 0.080)    # 100/s
    cost.observe(SHAPE, 32, 0.360)   # 89/s: fewer batches, but 11% less throughput
    assert cost.best_size(SHAPE, 32) == 8


def test_a_size_that_only_looked_best_at_warm_up_is_left_by_trying_its_neighbours_live():
    """A noisy warm-up ranks 1 best; live, 4 is. Scaling keeps warm-up's ranking, so only live trials find 4."""
    true_s = {1: 0.040, 2: 0.070, 4: 0.120, 8: 0.264, 16: 0.592}  # per frame: 40, 35, 30, 33, 37 ms
    cost = CostModel()
    _calibrated(cost, {1: 0.030, 2: 0.090, 4: 0.150, 8: 0.300, 16: 0.650})  # 1 looks 50% better than 2
    chosen = _choose_and_run(cost, 16, 120, lambda n, _chosen: true_s[n])
    assert chosen[0] == 1
    assert chosen[-60:].count(4) >= 50  # settled on the best size, trying a neighbour now and then
    assert set(chosen) <= {1, 2, 4, 8}  # never strayed two sizes from the one in use


def test_a_neighbour_whose_trial_met_a_burst_of_load_is_tried_again_and_chosen_when_it_measures_better():
    true_s = {4: 0.120, 8: 0.200}  # per frame 30 and 25 ms: 8 is best
    cost = CostModel()
    _calibrated(cost, {4: 0.100, 8: 0.240})  # warm-up ranks 4 best

    def seconds(n: int, before: list[int]) -> float:  # the first trial of 8 meets a burst of load
        return 0.400 if n == 8 and before.count(8) < EXPLORE_SAMPLES else true_s[n]

    chosen = _choose_and_run(cost, 8, 300, seconds)
    assert chosen[:EXPLORE_AFTER] == [4] * EXPLORE_AFTER and chosen[EXPLORE_AFTER:EXPLORE_AFTER + 3] == [8, 8, 8]
    assert chosen[EXPLORE_AFTER + 3:EXPLORE_AFTER + 3 + 50] == [4] * 50  # the trial said 8 is worse: back to 4
    assert chosen[-100:].count(8) >= 90  # tried again later, measured at its true time, and kept


def test_trying_the_neighbours_again_costs_a_bounded_share_of_batches():
    true_s = {4: 0.150, 8: 0.200, 16: 0.480}  # per frame 37.5, 25 and 30 ms: 8 is best, both neighbours worse
    cost = CostModel()
    _calibrated(cost, true_s)
    chosen = _choose_and_run(cost, 16, 1000, lambda n, _chosen: true_s[n])
    tried = sum(n != 8 for n in chosen[-640:]) / 640
    assert 0 < tried <= 2 * EXPLORE_SAMPLES / RETRY_AFTER


def test_per_batch_work_outside_the_measurement_keeps_a_near_zero_model_off_small_batches():
    cost = CostModel()
    cost.observe(SHAPE, 8, 0.0016)   # 0.2 ms a frame: 5000/s measured, 3077/s with 1 ms of loop work a batch
    cost.observe(SHAPE, 32, 0.0070)  # 0.22 ms a frame: 4571/s measured, 4000/s with it
    assert cost.best_size(SHAPE, 32) == 32


# --- on a CPU device: sizes ranked by the CPU a frame costs ---

def _shared_cores(cost: CostModel, batches: int = 6) -> None:
    """Batch 32 finishes sooner per frame on the wall clock (the decode pool and another runner were idle beside
    it) but costs more CPU a frame than batch 8 (one onnxruntime thread's cache): 18.2 against 16.8 CPU-ms."""
    for _ in range(batches):
        cost.observe(SHAPE, 8, seconds=8 * 0.030, cpu_seconds=8 * 0.0168)
        cost.observe(SHAPE, 32, seconds=32 * 0.025, cpu_seconds=32 * 0.0182)


def test_on_a_cpu_device_the_size_with_the_least_cpu_a_frame_is_chosen():
    by_cpu, by_wall = CostModel(rank_by_cpu=True), CostModel()
    _shared_cores(by_cpu)
    _shared_cores(by_wall)
    assert by_cpu.best_size(SHAPE, 32) == 8
    assert by_wall.best_size(SHAPE, 32) == 32  # the wall clock alone favours the batch that ran on idle cores


def test_the_latency_budget_stays_in_wall_time_when_ranking_by_cpu():
    cost = CostModel(rank_by_cpu=True)
    _shared_cores(cost)
    assert cost.predict(SHAPE, 8) == pytest.approx(8 * 0.030)
    # 0.3 s of budget holds what the wall-clock line says fits (10 frames), not the 17 its CPU would allow
    k = cost.largest_within(SHAPE, 0.3, 32)
    assert k is not None and cost.predict(SHAPE, k) <= 0.3 < cost.predict(SHAPE, k + 1)
    assert k < 0.3 / 0.0168


def test_a_size_without_a_cpu_reading_is_ranked_by_its_time_at_the_cpu_share_of_the_others():
    cost = CostModel(rank_by_cpu=True)
    for _ in range(EXPLORE_AFTER):
        cost.observe(SHAPE, 8, seconds=0.240, cpu_seconds=0.120)  # half its wall time is CPU
    cost.observe(SHAPE, 16, seconds=0.400, calibration=True)  # no CPU: estimated 0.240 x 0.5 / ... -> 0.2 * 0.5
    # 16's time, scaled by live/calibrated (8 has none calibrated: 1.0), times 0.5: 0.2 CPU-s for 16 frames,
    # 12.5 ms a frame, against 8's 15 ms: 16 is ranked ahead.
    assert cost.best_size(SHAPE, 16) == 16


def test_cpu_readings_are_a_running_mean_per_size_like_the_times():
    cost = CostModel(alpha=0.5, rank_by_cpu=True)
    cost.observe(SHAPE, 8, seconds=0.2, cpu_seconds=0.10)
    cost.observe(SHAPE, 8, seconds=0.2, cpu_seconds=0.20)  # the plain mean of the first two
    cost.observe(SHAPE, 4, seconds=0.2, cpu_seconds=0.07)  # 17.5 ms a frame against 8's 18.75
    assert cost.best_size(SHAPE, 8) == 4
    cost.observe(SHAPE, 8, seconds=0.2, cpu_seconds=0.0)  # not a reading (a clock that did not move): ignored
    assert cost.best_size(SHAPE, 8) == 4
