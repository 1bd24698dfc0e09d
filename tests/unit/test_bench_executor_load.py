"""bench/executor_load.py (the executor's saturating load, used by batching gain's (L) and the GPU check) against
a fake executor (the model-only figure on the real one), and how bench/workloads.py hands a benchmark model to a
worker process."""

from __future__ import annotations

import concurrent.futures
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))  # appended: never shadows a real module

import executor_load
from workloads import WORKLOADS

from worker.frames import Encoding, Priority
from worker.runtime.start import build_executor


class FakeExecutor:
    """Takes `batch_s` per batch on each of its `runners` threads, whatever its size (a GPU-like cost); counts the
    most batches submitted and not yet done at once."""

    def __init__(self, batch_s: float, runners: int = 1) -> None:
        self.batch_s = batch_s
        self.runner_count = runners
        self.sizes: list[int] = []
        self.outstanding = self.most_outstanding = 0
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(runners)

    def submit(self, frames: list, shape: tuple[int, int, int]) -> concurrent.futures.Future[SimpleNamespace]:
        self.sizes.append(len(frames))
        with self._lock:
            self.outstanding += 1
            self.most_outstanding = max(self.most_outstanding, self.outstanding)
        return self._pool.submit(self._run, len(frames))

    def _run(self, n: int) -> SimpleNamespace:
        time.sleep(self.batch_s)
        with self._lock:
            self.outstanding -= 1
        return SimpleNamespace(batch_size=n)  # the fields the load reads of a BatchOutcome


@pytest.fixture
def frame():
    return executor_load.frame_cycle(WORKLOADS["jpeg224"])[0][0]


def test_a_saturated_round_keeps_two_batches_per_runner_in_flight_as_the_worker_does(frame) -> None:
    ex = FakeExecutor(0.01, runners=3)
    r = executor_load.executor_round(ex, [(frame, frame.shape)], batch_size=4, seconds=0.3)
    assert r["inflight"] == 6 == ex.most_outstanding
    assert r["frames"] == sum(ex.sizes) - 4  # all but the untimed first batch
    assert 0 < r["batch_ms"]["p50"] <= r["batch_ms"]["p99"]


def test_frame_cycle_matches_the_workload() -> None:
    (frame, shape), = executor_load.frame_cycle(WORKLOADS["jpeg1080"])
    assert shape == (1080, 1920, 3) and frame.encoding is Encoding.JPEG and frame.priority is Priority.STANDARD
    mixed = executor_load.frame_cycle(WORKLOADS["mixed"])
    realtime = sum(1 for f, _ in mixed if f.priority is Priority.REALTIME)
    assert realtime / len(mixed) == pytest.approx(0.2)


def test_a_benchmark_model_reaches_a_worker_process_through_its_environment() -> None:
    from workloads import model_env, model_settings

    from worker.config import load_settings

    toy = model_settings("toy", WORKLOADS["jpeg1080"])
    settings = load_settings(env=model_env(toy))
    assert settings.model.source == "builtin" and settings.model.input_size == (224, 224)
    assert model_settings("toy", WORKLOADS["mixed"]) == {"source": "builtin"}  # any size, batched by shape
    assert load_settings(env=model_env(model_settings("opennsfw", WORKLOADS["jpeg224"]))).model.name == "open_nsfw"


def test_a_sweep_measures_the_model_alone_beside_each_size_and_the_gain_summary_names_its_best() -> None:
    """The real executor (the builtin CNN, 224x224 JPEG): (L)'s sweep carries the model-only figure that the
    batching gain's summary reports, from the size where the model alone ran fastest."""
    import batching_gain
    from workloads import model_settings

    from worker.config import load_settings

    settings = load_settings(env={}, overrides={"model": model_settings("toy", WORKLOADS["jpeg224"]),
                                                "runtime": {"torch_threads": 1, "warmup_batches": 1}})
    with build_executor(settings.model, settings.runtime) as executor:
        executor.warm_up()
        sweep, best = executor_load.executor_sweep(executor, executor_load.frame_cycle(WORKLOADS["jpeg224"]),
                                                   (1, 4), 0.05, model_only=True)
    assert best in (1, 4) and all(sweep[b]["model_only_fps"] > 0 for b in (1, 4))
    fastest = max((1, 4), key=lambda b: sweep[b]["model_only_fps"])
    spread = {"median": 1.0, "min": 1.0, "max": 1.0, "rounds": 1}
    result = {"limit_sweep": sweep, "rounds": 1, "goal_of_limit": 0.85,
              "throughput_spread": dict.fromkeys(batching_gain.VARIANTS, spread),
              "cpu_ms_per_frame": dict.fromkeys(batching_gain.VARIANTS, spread),
              "ratios": dict.fromkeys(("c/L", "c/a", "c/b"), spread)}
    figure, value, rounds = batching_gain.summary(result)[0]
    assert figure.startswith("the model alone") and rounds == "1 sweep"
    assert value == f"{sweep[fastest]['model_only_fps']:.0f} frames/s (batch {fastest})"
