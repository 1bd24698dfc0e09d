"""Starting the runtime: the one way `worker run`, `worker check-model` and the GPU benchmarks get a loaded, warmed
and calibrated executor, so a benchmark measures what the worker runs (vLLM's single `EngineCore` start)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from worker.config import Settings, warmup_frame_shapes
from worker.errors import StartError, StreamferError
from worker.runtime.executor import InferenceExecutor

Shape = tuple[int, int, int]
# (frame shape, batch size, seconds): warm-up timings that seed the batcher's cost model (Pipeline.seed_costs).
Calibration = list[tuple[Shape, int, float]]


@dataclass(frozen=True)
class StartedRuntime:
    """The executor, warmed up for every runtime.warmup_shapes shape, and its calibration (empty when not
    calibrated). The caller owns the executor: close it."""

    executor: InferenceExecutor
    calibration: Calibration
    shapes: tuple[Shape, ...]
    seconds: float  # from the model's load to the end of calibration


def start_runtime(settings: Settings, *, before_warm_up: Callable[[InferenceExecutor], None] | None = None,
                  calibrate: bool = True) -> StartedRuntime:
    """Load and validate the model on every device (InferenceExecutor.from_settings with the batching settings,
    so CUDA graphs are captured only for batch sizes the batcher can send), call `before_warm_up(executor)` (the
    worker serves /metrics from there; check-model reports what loaded, and may refuse by raising), warm up, then,
    where runtime.calibrate_batch_sizes and `calibrate`, time each batch size up to batching.largest_batch_size
    (the most frames a batch of any class may hold). An error
    after the load closes the executor and propagates: ModelContractError, or an OperatorError naming a setting;
    anything unexpected in the load, warm-up or calibration as a StartError naming the step (exit 70)."""
    t0 = time.perf_counter()
    models = "+".join(m.name for m in settings.models) or settings.model.name
    with _naming("loading the model", models):
        executor = InferenceExecutor.from_settings(settings.model, settings.runtime, settings.batching,
                                                   models=settings.models)
    try:
        if before_warm_up is not None:
            before_warm_up(executor)  # the caller's errors are its own: they propagate as they are
        shapes = warmup_frame_shapes(settings)
        with _naming("warming up", f"{executor.model_name} on {executor.device_description}"):
            executor.warm_up(shapes)
        calibration: Calibration = []
        if calibrate and settings.runtime.calibrate_batch_sizes:
            with _naming("calibrating", f"{executor.model_name} on {executor.device_description}"):
                calibration = executor.calibrate(shapes, settings.batching.largest_batch_size)
    except BaseException:
        executor.close()
        raise
    return StartedRuntime(executor, calibration, tuple(shapes), time.perf_counter() - t0)


@contextlib.contextmanager
def _naming(step: str, what: str) -> Iterator[None]:
    """An unexpected error in `step` as a StartError naming it in one line (the worker's own errors pass as they
    are: an OperatorError names the setting to change)."""
    try:
        yield
    except StreamferError:
        raise
    except Exception as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else "no message"
        raise StartError(f"the runtime failed {step} {what}: {type(exc).__name__}: {text}") from exc
