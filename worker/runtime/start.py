"""Starting the runtime: the one way `worker run`, `worker check-model` and the GPU benchmarks get a loaded, warmed
and calibrated executor, so a benchmark measures what the worker runs (vLLM's single `EngineCore` start); and
`build_executor`, the one place the runtime is built from settings (devices resolved, a runner per device instance
and model)."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from worker.config import (
    BatchingSettings,
    ModelSettings,
    RuntimeSettings,
    Settings,
    preprocess_thread_count,
    warmup_frame_shapes,
)
from worker.devices.graphplan import BatchCaps
from worker.errors import StartError, StreamferError
from worker.runtime.deviceplan import (
    check_device_decode_at_start,
    describe,
    device_decode_serves,
    device_memories,
    graph_memory,
    loaded_precision,
    resolve_plan,
)
from worker.runtime.engine import load_engine_model, make_engine_runner, runner_layout
from worker.runtime.executor import InferenceExecutor
from worker.runtime.hostsync import HostSync, check_host_syncs
from worker.runtime.models import LoadedModel
from worker.runtime.modelset import ModelSet
from worker.runtime.runners import ModelRunner

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
    """Load and validate the model on every device (`build_executor` with the batching settings,
    so CUDA graphs are captured only for batch sizes the batcher can send), call `before_warm_up(executor)` (the
    worker serves /metrics from there; check-model reports what loaded, and may refuse by raising), warm up, then,
    where runtime.calibrate_batch_sizes and `calibrate`, time each batch size up to batching.largest_batch_size
    (the most frames a batch of any class may hold). An error
    after the load closes the executor and propagates: ModelContractError, or an OperatorError naming a setting;
    anything unexpected in the load, warm-up or calibration as a StartError naming the step (exit 70)."""
    t0 = time.perf_counter()
    models = "+".join(m.name for m in settings.models) or settings.model.name
    with _naming("loading the model", models):
        executor = build_executor(settings.model, settings.runtime, settings.batching, models=settings.models)
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


def build_executor(model: ModelSettings, runtime: RuntimeSettings, batching: BatchingSettings | None = None,
                   models: Sequence[ModelSettings] = ()) -> InferenceExecutor:
    """Resolve devices, load and validate each model on each, and build a runner per (device instance, model):
    the one place runners are made. `models`: a model set (settings.models, `model` its first); without one,
    `model` alone. `batching` tells the CUDA-graph runners which batch sizes can reach them (none: memory alone
    bounds them)."""
    settings = tuple(models) or (model,)
    model_set = ModelSet.from_settings(settings)
    plan = resolve_plan(runtime)
    if plan.decode_on_device:
        plan = dataclasses.replace(plan, decode_on_device=device_decode_serves(model_set.contracts, runtime))
    if plan.decode_on_device:
        check_device_decode_at_start(runtime, plan.devices)
    layout = runner_layout(settings, runtime, plan.devices[0])
    if runtime.torch_threads > 0:
        torch.set_num_threads(runtime.torch_threads)
    memory = device_memories(plan, runtime, layout.instances)
    caps = BatchCaps.from_settings(batching) if batching is not None else BatchCaps()
    slots: list[tuple[ModelRunner, ...]] = []
    first: list[LoadedModel] = []
    host_syncs: list[HostSync] = []
    for device in plan.devices:
        for _ in range(layout.instances):
            runners = []
            for m in settings:
                # Each runner gets its own copy of its model, loaded and validated on its device.
                # issue 61: the engine per (device, model): onnxruntime for ONNX on a CPU, else torch.
                loaded = load_engine_model(m, runtime, device, layout.session_threads)
                if not slots:  # every copy of a model is the same: checked and reported once
                    # Before any capture: refused when graphs are to be used, a warning otherwise.
                    host_syncs.extend(check_host_syncs(loaded, refuse=plan.cuda_graphs))
                    first.append(loaded)
                policy, budget = graph_memory(memory.get(device), layout.instances)
                # Every model's runners share the device's graph budget (worker.runtime.modelset).
                budget = None if budget is None else budget // len(settings)
                runners.append(make_engine_runner(loaded.module, loaded.contract, device, plan.precision,
                                                  plan.cuda_graphs, plan.buckets, runtime.warmup_batches, caps,
                                                  policy, budget))
            slots.append(tuple(runners))
    description = describe(loaded_precision(plan, [m.precision for m in first]), "+".join(m.kind for m in first),
                           "+".join(sorted({m.engine for m in first})), layout.instances, layout.session_threads)
    return InferenceExecutor(slots, model_set, preprocess_thread_count(runtime), runtime.warmup_batches,
                             warmup_batch_size=max(runtime.graph_batch_sizes), device_description=description,
                             memory=[memory[r[0].device] for r in slots] if memory else (),
                             decode_on_device=plan.decode_on_device, loaded=first, host_syncs=host_syncs)


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
