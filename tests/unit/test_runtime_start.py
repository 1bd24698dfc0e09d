"""worker.runtime.start_runtime: the one start of the runtime. It calibrates to the largest batch any class may send
(what the worker runs), warms up every warm-up shape, closes the executor when a step after the load fails, and is the
only way the worker, `worker check-model` and the GPU benchmarks build an executor."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from worker.config import ConfigError, Settings, load_settings
from worker.runtime import InferenceExecutor, start_runtime

sys.path.insert(0, str(Path(__file__).parent))  # model_factories, as model.source imports it

ROOT = Path(__file__).resolve().parents[2]
# Every place that starts the runtime for the worker or for a figure of what the worker does.
STARTERS = ("worker/app.py", "worker/tools/check_model.py", "bench/gpu_check.py", "bench/gpu_e2e.py",
            "bench/gpu_smoke.py")


def tiny(**batching: object) -> Settings:
    return load_settings(env={}, overrides={
        "model": {"source": "model_factories:tiny_model"},
        "runtime": {"device": "cpu", "warmup_batches": 1, "warmup_shapes": ["12x8", "16x16"]},
        "batching": {"max_batch_size": 2, "fallback_max_batch_size": 2, **batching}})


def test_calibration_reaches_the_largest_batch_a_class_may_send_not_the_default_max_batch_size() -> None:
    settings = tiny(realtime={"max_batch_size": 4})
    assert settings.batching.max_batch_size == 2 and settings.batching.largest_batch_size == 4
    runtime = start_runtime(settings)
    try:
        assert runtime.executor.ready and runtime.shapes == ((8, 12, 3), (16, 16, 3))
        assert sorted({(shape, n) for shape, n, _s in runtime.calibration}) == [
            (shape, n) for shape in sorted(runtime.shapes) for n in (1, 2, 4)]
        assert all(seconds > 0 for _shape, _n, seconds in runtime.calibration)
    finally:
        runtime.executor.close()


def test_no_calibration_when_the_settings_or_the_caller_turn_it_off() -> None:
    off = load_settings(env={}, overrides={"model": {"source": "model_factories:tiny_model"},
                                           "runtime": {"device": "cpu", "warmup_batches": 1,
                                                       "calibrate_batch_sizes": False}})
    for settings, calibrate in ((off, True), (tiny(), False)):
        runtime = start_runtime(settings, calibrate=calibrate)
        runtime.executor.close()
        assert runtime.calibration == [] and runtime.executor.ready


def test_before_warm_up_sees_the_loaded_executor_not_yet_ready_and_its_error_closes_the_executor() -> None:
    seen: list[InferenceExecutor] = []

    def refuse(executor: InferenceExecutor) -> None:
        seen.append(executor)
        assert not executor.ready
        raise ConfigError(["model.source: refused by the caller"])

    with pytest.raises(ConfigError, match="refused by the caller"):
        start_runtime(tiny(), before_warm_up=refuse)
    with pytest.raises(RuntimeError, match="closed"):
        seen[0].submit([], (8, 12, 3))


@pytest.mark.parametrize("path", STARTERS)
def test_the_worker_check_model_and_the_gpu_benchmarks_build_executors_only_through_start_runtime(path: str) -> None:
    source = (ROOT / path).read_text()
    assert "start_runtime(" in source
    other = re.findall(r"InferenceExecutor\(|build_executor\(|\.calibrate\(", source)
    assert other == [], f"{path} starts the runtime another way: {other}"
