"""Load for `InferenceExecutor` alone (no Kafka): a workload's frames as a cycle of batches, a saturating closed
loop (the runtime's own best), a sweep of it over batch sizes with the model alone beside it. Used by batching_gain
(variant L) and the GPU check.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Sequence
from typing import Any

import stats
from stats import percentile
from workloads import Workload

from worker.codec.schemas import FrameRecord, decode_frame, encode_frame
from worker.frames import Frame, SourceRef
from worker.runtime.preprocess import Preprocessor
from worker.testing import synthetic_frames

INFLIGHT = 2  # the worker's in-flight batches per runner (delivery.inflight_batches_per_runner's default)


def as_frame(rec: FrameRecord) -> Frame:
    """A published record as the worker reads it (decoded and checked by worker.codec.schemas), read now."""
    return decode_frame(encode_frame(rec), SourceRef("bench", 0, 0), rec.priority, time.time())


def frame_cycle(workload: Workload) -> list[tuple[Frame, tuple[int, int, int]]]:
    """One frame per (class, shape) of the workload, repeated by share: a cycle of batches whose frame mix matches
    the Kafka runs' (the test kit's synthetic frames, as the benchmarks publish them)."""
    smallest = min(load.share / len(load.shapes) for load in workload.classes.values())
    cycle: list[tuple[Frame, tuple[int, int, int]]] = []
    for priority, load in workload.classes.items():
        for w, h in load.shapes:
            frame = as_frame(synthetic_frames(1, [(w, h)], load.encoding, priority, "bench")[0])
            cycle.extend([(frame, frame.shape)] * round(load.share / len(load.shapes) / smallest))
    return cycle


def executor_round(executor: Any, cycle: list, batch_size: int, seconds: float) -> dict[str, Any]:
    """Frames/s and CPU-ms per frame (this process, all threads) of the executor fed batches of `batch_size` frames
    cycling through the shapes, INFLIGHT batches in flight per runner (as the worker keeps them), a new one as soon
    as any finishes, for at least `seconds` and whole cycles; and each batch's submit -> outcome ms."""
    inflight = INFLIGHT * executor.runner_count
    pending: dict[concurrent.futures.Future, float] = {}
    done_frames, batch_ms, i = 0, [], 0
    for frame, shape in cycle:  # one untimed pass over every shape: first-call costs out of the figure
        executor.submit([frame] * batch_size, shape).result()
    t0, cpu0 = time.perf_counter(), time.process_time()
    while True:
        while len(pending) < inflight:
            frame, shape = cycle[i % len(cycle)]
            i += 1
            pending[executor.submit([frame] * batch_size, shape)] = time.perf_counter()
        finished, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
        now = time.perf_counter()
        for future in finished:
            done_frames += future.result().batch_size
            batch_ms.append((now - pending.pop(future)) * 1000.0)
        if now - t0 >= seconds and i % len(cycle) == 0:
            break
    for future, submitted in pending.items():
        done_frames += future.result().batch_size
        batch_ms.append((time.perf_counter() - submitted) * 1000.0)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    batch_ms.sort()
    return {"frames_per_s": done_frames / elapsed, "frames": done_frames, "seconds": elapsed,
            "cpu_ms_per_frame": stats.cpu_ms_per_frame(cpu, done_frames), "inflight": inflight,
            "batch_ms": {"p50": percentile(batch_ms, 0.5), "p99": percentile(batch_ms, 0.99)}}


def model_only_throughput(executor: Any, cycle: list, batch_size: int, seconds: float) -> float:
    """Frames/s of the first runner's `run` on tensors prepared beforehand, one at a time: the model alone, no
    decode and no preprocessing (what the executor's figure would be if they cost nothing)."""
    runner, prep = executor.runners[0], Preprocessor(executor.contract)  # the executor's own preprocessing
    tensors = []
    for frame, shape in cycle:
        hb = prep.prepare([frame] * batch_size, shape)
        tensors.append(hb.pixels.to(runner.device))  # the runner's input: uint8 pixels it normalises itself
        hb.release()
    for x in tensors:
        runner.run(x)
    n, t0, i = 0, time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds or i % len(tensors):
        runner.run(tensors[i % len(tensors)])
        n, i = n + batch_size, i + 1
    return n / (time.perf_counter() - t0)


def executor_sweep(executor: Any, cycle: list, sizes: Sequence[int], seconds: float, model_only: bool = False
                   ) -> tuple[dict[int, dict[str, Any]], int]:
    """executor_round at each batch size, once (a sweep), with the model alone beside it if asked
    (`model_only_fps`), and the size with the most frames/s."""
    by_size = {b: executor_round(executor, cycle, b, seconds) for b in sizes}
    if model_only:
        for b, figures in by_size.items():
            figures["model_only_fps"] = model_only_throughput(executor, cycle, b, seconds / 2)
    return by_size, max(by_size, key=lambda b: by_size[b]["frames_per_s"])
