"""Load for `InferenceExecutor` alone (no Kafka): a workload's frames as a cycle of batches, a saturating closed
loop (the runtime's own best) and a sweep of it over batch sizes, and an open loop at a fixed offered rate that
batches like the worker. Used by batching_gain (variant L), model_limit, contention and the GPU check.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import stats
from stats import percentile
from workloads import Workload

from worker.frames import Frame, SourceRef
from worker.schemas import FrameRecord, decode_frame, encode_frame
from worker.testing import synthetic_frames

INFLIGHT = 2  # the worker's in-flight batches per runner (delivery.inflight_batches_per_runner's default)


def as_frame(rec: FrameRecord) -> Frame:
    """A published record as the worker reads it (decoded and checked by worker.schemas), read now."""
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


def executor_sweep(executor: Any, cycle: list, sizes: Sequence[int], seconds: float
                   ) -> tuple[dict[int, dict[str, Any]], int]:
    """executor_round at each batch size, once (a sweep), and the size with the most frames/s."""
    by_size = {b: executor_round(executor, cycle, b, seconds) for b in sizes}
    return by_size, max(by_size, key=lambda b: by_size[b]["frames_per_s"])


@dataclass(frozen=True)
class BatchPolicy:
    """How the open loop forms batches: the worker's defaults for one priority class."""

    max_batch_size: int = 32
    max_wait_ms: float = 15.0
    max_inflight: int = INFLIGHT  # the worker's for one runner


def open_loop(executor: Any, frame: Frame, rate_fps: float, seconds: float, policy: BatchPolicy,
              warmup_share: float = 0.1) -> dict[str, Any]:
    """Frame i is due at start + i / rate (open loop: a late dispatch counts against the executor). Pending
    frames go out as one batch when max_batch_size are waiting or the oldest has waited max_wait_ms, with at
    most max_inflight batches in flight. Batch latency = submit -> outcome; frame latency = due -> outcome.
    Frames due in the first `warmup_share` of the run are left out of the percentiles and of sustained_fps."""
    total = max(1, int(rate_fps * seconds))
    pending: collections.deque[float] = collections.deque()
    inflight: collections.deque[tuple[concurrent.futures.Future, float, list[float]]] = collections.deque()
    finished_at: dict[int, float] = {}
    batches: list[tuple[float, float, list[float]]] = []  # (submit, done, due times)
    cpu0 = time.process_time()
    t0 = time.perf_counter() + 0.05
    next_i = 0

    def due(i: int) -> float:
        return t0 + i / rate_fps

    while next_i < total or pending or inflight:
        now = time.perf_counter()
        while next_i < total and due(next_i) <= now:
            pending.append(due(next_i))
            next_i += 1
        while inflight and inflight[0][0].done():
            fut, submitted, dues = inflight.popleft()
            fut.result()
            # The done callback may still be running in the executor's thread: then it finished just now.
            batches.append((submitted, finished_at.pop(id(fut), 0.0) or time.perf_counter(), dues))
        full = len(pending) >= policy.max_batch_size
        waited = bool(pending) and (now - pending[0]) * 1000.0 >= policy.max_wait_ms
        if pending and len(inflight) < policy.max_inflight and (full or waited or next_i >= total):
            take = [pending.popleft() for _ in range(min(policy.max_batch_size, len(pending)))]
            fut = executor.submit([frame] * len(take), frame.shape)
            fut.add_done_callback(lambda f: finished_at.__setitem__(id(f), time.perf_counter()))
            inflight.append((fut, time.perf_counter(), take))
            continue
        # Sleep until the next arrival, the oldest frame's deadline or a batch finishing, whichever is first.
        wake = [due(next_i)] if next_i < total else []
        if pending:
            wake.append(pending[0] + policy.max_wait_ms / 1000.0)
        timeout = max(0.0, min(wake) - time.perf_counter()) if wake else 0.05
        if inflight:
            concurrent.futures.wait([inflight[0][0]], timeout=min(timeout, 0.05))
        elif timeout > 0:
            time.sleep(min(timeout, 0.05))
    cpu = time.process_time() - cpu0
    load_end = due(total - 1)
    last_done = max(done for _, done, _ in batches)
    warm_until = t0 + warmup_share * seconds
    kept = [(s, d, dues) for s, d, dues in batches if dues[0] >= warm_until]
    batch_ms = sorted((d - s) * 1000.0 for s, d, _ in kept)
    frame_ms = sorted((d - t) * 1000.0 for _, d, dues in kept for t in dues)
    frames_done = sum(len(dues) for _, _, dues in batches)
    # Sustained: frames finished while the load ran (after the warm-up share) per second of it; equals the
    # offered rate when the executor keeps up, its capacity when it does not.
    in_window = sum(len(dues) for _, done, dues in batches if warm_until <= done <= load_end)
    sustained = in_window / (load_end - warm_until) if load_end > warm_until else float("nan")
    # Kept up: the last frame was done about one wait and two batches after it was due. An executor that
    # falls behind builds a queue, and the drain grows with the run's length instead.
    allowed_drain_s = policy.max_wait_ms / 1000.0 + 2 * percentile(batch_ms, 0.99) / 1000.0 + 0.05
    return {
        "offered_fps": rate_fps, "seconds": seconds, "frames": frames_done, "sustained_fps": sustained,
        "kept_up": bool(last_done - load_end <= allowed_drain_s),
        "achieved_fps": frames_done / (last_done - t0) if last_done > t0 else float("nan"),
        "drain_after_load_s": last_done - load_end,
        "batches": len(batches), "mean_batch": frames_done / len(batches) if batches else float("nan"),
        "batch_ms": {"p50": percentile(batch_ms, 0.5), "p99": percentile(batch_ms, 0.99),
                     "max": batch_ms[-1] if batch_ms else float("nan")},
        "frame_ms": {"p50": percentile(frame_ms, 0.5), "p99": percentile(frame_ms, 0.99),
                     "max": frame_ms[-1] if frame_ms else float("nan")},
        "cpu_ms_per_frame": stats.cpu_ms_per_frame(cpu, frames_done),
        "policy": asdict(policy),
    }

