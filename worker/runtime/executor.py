"""The pipeline's only entry point into torch: submit a batch of frames, get a Future of its outcome.

A preprocessing pool decodes and stages batch N+1 while a runner's inference thread executes batch N.
Both take the most urgent waiting batch first (by `Priority`, FIFO within one), so a realtime batch submitted
while bulk batches wait for a runner runs next: it waits for at most the batch already running.
It runs a set of models (`worker.runtime.modelset`; a single model is a set of one): each batch goes through every
model on one device instance, in the set's one run loop. A batch goes to the least loaded instance; on GPUs, one
larger than that instance's device takes at once (its memory policy's largest batch) is split across devices, the
least loaded first (`split_batch`), and its parts' outcomes are joined in frame order.
Bad frames never raise: undecodable ones, ones a model fails on alone, and ones with a non-finite output
come back as `FrameFailure`s beside the verdicts of the rest; so do the frames of a split batch's part whose
device failed.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from worker.devices.memory import DeviceMemories, split_batch
from worker.frames import MODEL_ERROR, BatchOutcome, Encoding, Frame, FrameFailure, Priority, SourceRef
from worker.runtime.deviceplan import (
    DeviceMemory,
)
from worker.runtime.hostbatch import HostBatch, HostBuffers, stage_to_device
from worker.runtime.hostsync import HostSync
from worker.runtime.models import LoadedModel, ModelContract
from worker.runtime.modelset import ModelSet
from worker.runtime.preprocess import Preprocessor
from worker.runtime.prioritypool import PriorityPool
from worker.runtime.profiling import ProfileRequest
from worker.runtime.runners import ModelRunner
from worker.threadnames import name_os_thread

if TYPE_CHECKING:
    from worker.runtime.devicepath import DevicePreprocessor, DeviceSteps

log = logging.getLogger(__name__)

# Batch sizes timed per warm-up shape by `calibrate` (up to max_batch_size), seeding the cost model.
CALIBRATION_SIZES = (1, 2, 4, 8, 16, 32, 64)

# torch.profiler.record_function, or no_ranges: a batch's profiler ranges.
Ranges = Callable[[str], AbstractContextManager[Any]]


def no_ranges(name: str) -> AbstractContextManager[None]:
    """What `torch.profiler.record_function` is outside a recorded batch: nothing."""
    return contextlib.nullcontext()


@dataclass
class _Slot:
    """One runner per model of the set, all on one device, with their inference thread, the device (an index into
    the executor's devices) and the number of frames submitted to it and not yet done."""

    runners: tuple[ModelRunner, ...]
    thread: PriorityPool
    device: int = 0
    load: int = 0

    @property
    def torch_device(self) -> torch.device:
        return self.runners[0].device


class InferenceExecutor:
    """Owns the runners and a preprocessing pool; the pipeline's only entry point into torch."""

    def __init__(self, runners: Sequence[ModelRunner | Sequence[ModelRunner]], models: ModelContract | ModelSet,
                 preprocess_threads: int = 1, warmup_batches: int = 8, warmup_batch_size: int = 1,
                 device_description: str = "", memory: Sequence[DeviceMemory] = (), decode_on_device: bool = False,
                 loaded: Sequence[LoadedModel] = (), host_syncs: Sequence[HostSync] = (),
                 device_steps: DeviceSteps | None = None):
        """`runners`: per device instance, one runner per model of `models` (a single model's: a runner each);
        `models`: the set, or the contract of a single model. `memory`: on GPUs, each instance's device memory
        (instances of one device share the same object); empty on CPU, where nothing bounds a batch by memory.
        `decode_on_device`: the device data path (runtime.decode), its device steps `device_steps` (default: the
        real decode and resize; bench/host_cost.py stands them in). `loaded` (one per model) and `host_syncs`: what
        start-up loaded and found (`start.build_executor` passes them; `worker check-model` reports them)."""
        self.model_set = models if isinstance(models, ModelSet) else ModelSet.of(models)
        per_slot = [tuple(r) if isinstance(r, Sequence) else (r,) for r in runners]
        if not per_slot:
            raise ValueError("InferenceExecutor needs at least one runner")
        if any(len(r) != len(self.model_set.members) for r in per_slot):
            raise ValueError("InferenceExecutor needs one runner per model on each device instance")
        if memory and len(memory) != len(per_slot):
            raise ValueError("InferenceExecutor needs one DeviceMemory per runner, or none")
        # The first model's contract: the batcher's view (its input size) and the metrics' labels.
        self.contract = contract = self.model_set.members[0].contract
        self.loaded = tuple(loaded)
        # Where the models' forwards read device values on the host (a warning where no CUDA graph is used).
        self.host_syncs: tuple[HostSync, ...] = tuple(host_syncs)
        self.model_name = self.model_set.name
        self.model_version = self.model_set.version
        self.labels = contract.labels
        self.device_description = device_description or ", ".join(str(r[0].device) for r in per_slot)
        graph_buckets = [getattr(r[0], "buckets", ()) for r in per_slot if r[0].uses_graphs]
        self.preferred_batch_sizes: tuple[int, ...] = tuple(graph_buckets[0]) if graph_buckets else ()
        self.model_input_hw: tuple[int, int] | None = contract.input_size
        self._warmup_batches = warmup_batches
        self._warmup_batch_size = warmup_batch_size
        if preprocess_threads < 1:
            raise ValueError("InferenceExecutor needs preprocess_threads >= 1")
        buffers = HostBuffers(pin_memory=any(r[0].device.type == "cuda" for r in per_slot))
        # Two pools, so a batch's preparation never waits on frames queued behind it in its own pool: one
        # thread per batch being prepared (mostly waiting; the most urgent batch first), and the threads that
        # decode the frames.
        self._decode_pool = concurrent.futures.ThreadPoolExecutor(preprocess_threads, thread_name_prefix="decode",
                                                                  initializer=name_os_thread)
        contracts = self.model_set.contracts
        self._preprocessor = Preprocessor(contracts, buffers, pool=self._decode_pool, workers=preprocess_threads)
        # The device data path (runtime.decode): decode and resize on the runners' device instead.
        self._device_preprocessor: DevicePreprocessor | None = (
            _device_preprocessor(contracts, buffers.pin_memory, self._decode_pool, preprocess_threads, device_steps)
            if decode_on_device else None)
        # Devices in the order first seen: each runner's DeviceMemory identifies its device (one device on CPU).
        self._device_memory: list[DeviceMemory] = list({id(m): m for m in memory}.values())
        device_of = {id(m): d for d, m in enumerate(self._device_memory)}
        self._slots = [_Slot(r, PriorityPool(1, f"infer-{r[0].device}-{i}"), device_of[id(memory[i])] if memory else 0)
                       for i, r in enumerate(per_slot)]
        self._devices = [[s for s in self._slots if s.device == d] for d in range(max(1, len(self._device_memory)))]
        self._prep_pool = PriorityPool(preprocess_threads, "preprocess")
        self._lock = threading.Lock()
        self._ready = False
        self._closed = False
        self._profile: ProfileRequest | None = None
        # GPUs: the batcher's view of every device's peak memory per (runner input shape, batch size), measured at
        # graph capture and by calibrate(); None on CPU.
        self.memory_policy: DeviceMemories | None = (
            DeviceMemories([m.policy for m in self._device_memory]) if self._device_memory else None)
        # Every runner on the CPU: the batcher ranks batch sizes by the CPU a frame costs (BatchOutcome.cpu_ms).
        self.batch_cost_by_cpu = all(r[0].device.type == "cpu" for r in per_slot)

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def capture_count(self) -> int:
        """CUDA graphs captured so far, over all runners (0 on CPU)."""
        return sum(r.capture_count for r in self.runners)

    @property
    def graph_evictions(self) -> int:
        """CUDA graphs released to keep captured graphs under their memory budget, over all runners."""
        return sum(r.graph_evictions for r in self.runners)

    @property
    def runners(self) -> tuple[ModelRunner, ...]:
        """Every runner: per device instance, one per model in the set's order (the first is the first model's)."""
        return tuple(r for s in self._slots for r in s.runners)

    @property
    def runner_count(self) -> int:
        """Device instances that execute batches at once (instances per device x devices): the pipeline feeds each."""
        return len(self._slots)

    def warm_up(self, shapes: Sequence[tuple[int, int, int]] = ((224, 224, 3),)) -> None:
        """Run warm-up batches for each (h, w, c) shape on every runner, capturing CUDA graphs where enabled."""
        t0 = time.perf_counter()
        futures = [s.thread.submit(Priority.REALTIME, self._warm_up_slot, s, shapes) for s in self._slots]
        for f in futures:
            f.result()
        self._ready = True
        # DEBUG: the app logs warm-up at INFO; this line adds what only the runtime knows (graphs captured).
        log.debug("runtime warm-up done model=%s version=%s device=%s shapes=%s graphs=%d ms=%.0f",
                 self.model_name, self.model_version, self.device_description, [list(s) for s in shapes],
                 self.capture_count, (time.perf_counter() - t0) * 1000.0)

    def submit(self, frames: Sequence[Frame], shape: tuple[int, int, int],
               priority: Priority = Priority.BULK) -> concurrent.futures.Future[BatchOutcome]:
        """Queue a batch padded to `shape` = (h, w, c); the Future resolves to its BatchOutcome. A more urgent
        batch overtakes less urgent ones still waiting for preprocessing or for the runner. A batch larger than
        the least loaded runner's device takes at once is split across devices (module docstring)."""
        frames = list(frames)
        with self._lock:
            if self._closed:
                raise RuntimeError("InferenceExecutor is closed")
            slot = min(self._slots, key=lambda s: s.load)
            parts = self._split(slot, len(frames), shape)
            if parts is None:
                return self._submit_to(slot, frames, shape, priority)
            futures, start = [], 0
            for device, count in parts:
                # The least loaded runner of the device now: a device used twice sees its first part's load.
                part_slot = min(self._devices[device], key=lambda s: s.load)
                part = frames[start:start + count]
                futures.append((part, str(part_slot.torch_device),
                                self._submit_to(part_slot, part, shape, priority)))
                start += count
        log.debug("batch split across devices size=%d parts=%s", len(frames), [(d, n) for d, n in parts])
        return _joined(futures)

    def _split(self, slot: _Slot, n: int, shape: tuple[int, int, int]) -> list[tuple[int, int]] | None:
        """(device, frames) parts of a batch of n frames when `slot`'s device cannot take it at once; None when it
        can (always on CPU, where no memory policy bounds a batch). Devices are used least loaded first."""
        if not self._device_memory or n <= 1:
            return None
        model_shape = self._model_shape(shape)
        fits = self._device_memory[slot.device].policy.max_batch(model_shape, n)
        if fits is None or fits >= n:
            return None
        order = sorted(range(len(self._devices)), key=lambda d: (sum(s.load for s in self._devices[d]), d))
        caps = [self._device_memory[d].policy.max_batch(model_shape, n) for d in order]
        return [(order[position], count) for position, count in split_batch(n, caps)]

    def _submit_to(self, slot: _Slot, frames: list[Frame], shape: tuple[int, int, int],
                   priority: Priority) -> concurrent.futures.Future[BatchOutcome]:
        """Queue the batch's preparation and inference on this runner. The caller holds the lock."""
        # issue 61: an idle CPU runner prepares the batch on its own thread: nothing runs there to overlap with, and
        # the hand-off through the preprocessing pool cost two thread wake-ups per batch at low load.
        idle_cpu = slot.load == 0 and not self._device_memory  # no memory policy: the runners are on a CPU
        slot.load += len(frames)
        if idle_cpu or (self._profile is not None and not self._profile.done.done()):
            # The torch profiler records only the thread it runs in: while recording, preprocessing runs on
            # the runner's thread so both stages are in the trace (those batches lose the overlap).
            prepared: concurrent.futures.Future[HostBatch] = concurrent.futures.Future()
            return slot.thread.submit(priority, self._infer, prepared, slot, len(frames), (frames, shape))
        prepared = self._prep_pool.submit(priority, self._prepare, frames, shape, slot)
        # The inference job waits for its own preprocessing; per runner, FIFO within a priority keeps one
        # class's batches in order.
        return slot.thread.submit(priority, self._infer, prepared, slot, len(frames))

    def calibrate(self, shapes: Sequence[tuple[int, int, int]], max_batch_size: int,
                  rounds: int = 2) -> list[tuple[tuple[int, int, int], int, float]]:
        """Time batches of CALIBRATION_SIZES (<= max_batch_size) of raw frames per (h, w, c) shape through
        submit, preprocessing included: (shape, size, seconds) to seed the cost model before the first real
        batch. The best of `rounds` after one untimed run per size (background load only ever slows a run).
        On GPUs the untimed run is one per device, on one of its runners, measuring that device's peak memory."""
        out = []
        for shape in shapes:
            frame = _calibration_frame(shape)
            for n in (n for n in CALIBRATION_SIZES if n <= max_batch_size):
                frames = [frame] * n
                for device, memory in enumerate(self._device_memory):
                    run = functools.partial(_run_on, self, self._devices[device][0], frames, shape)
                    # Keyed by what the device runs (the model's input), as the runners and the batcher look it up.
                    memory.policy.measure(memory.probe, self._model_shape(shape), n, run)
                if not self._device_memory:
                    self.submit(frames, shape).result()
                best = min(_timed(self.submit(frames, shape).result()) for _ in range(rounds))
                out.append((shape, n, best))
        return out

    def profile(self, batches: int, directory: str) -> concurrent.futures.Future[str]:
        """Record the next `batches` batches with the torch profiler (record_function ranges around
        preprocessing and inference) into a Chrome trace in `directory`; the Future gives its path."""
        request = ProfileRequest(max(1, batches), directory)
        with self._lock:
            if self._profile is not None and not self._profile.done.done():
                raise RuntimeError("a profile is already being recorded")
            self._profile = request
        return request.done

    def close(self) -> None:
        """Finish the batches already submitted, then stop the threads. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        # Preprocessing first: the inference jobs wait on it.
        self._prep_pool.shutdown()
        for slot in self._slots:
            slot.thread.shutdown()
        self._decode_pool.shutdown(wait=True)  # last: preparation waits on it

    def __enter__(self) -> InferenceExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- inside the threads ---

    def _warm_up_slot(self, slot: _Slot, shapes: Sequence[tuple[int, int, int]]) -> None:
        """Every model's runner on its own input for each frame shape."""
        for shape in shapes:
            for member, runner in zip(self.model_set.members, slot.runners, strict=True):
                runner.warm_up(member.input_shape(shape), self._warmup_batches, self._warmup_batch_size)

    def _prepare(self, frames: list[Frame], shape: tuple[int, int, int], slot: _Slot,
                 ranges: Ranges = no_ranges) -> HostBatch:
        """Each frame decoded once and fitted to every model's input, on the slot's device (its first runner's copy
        stream carries every model's pixels; each runner waits on the batch's one ready event)."""
        runner = slot.runners[0]
        with ranges("streamfer.preprocess"):
            if self._device_preprocessor is not None:
                return self._device_preprocessor.prepare(frames, shape, runner.device, runner.copy_stream)
            batch = self._preprocessor.prepare(frames, shape)
            if batch.frames:
                stage_to_device(batch, runner.device, runner.copy_stream)
        return batch

    def _infer(self, prepared: concurrent.futures.Future[HostBatch], slot: _Slot, submitted: int,
               inline: tuple[list[Frame], tuple[int, int, int]] | None = None) -> BatchOutcome:
        request = self._profile
        recording = request is not None and request.start()
        # The profiler's ranges only in a batch it records: each costs about 8 us of the runner thread's CPU.
        ranges: Ranges = torch.profiler.record_function if recording else no_ranges
        try:
            if inline is not None:
                batch = self._prepare(*inline, slot, ranges)
            else:
                with ranges("streamfer.wait_preprocess"):
                    batch = prepared.result()
            try:
                with ranges(f"streamfer.inference[n={len(batch.frames)}]"):
                    return self.model_set.run(batch, slot.runners)
            finally:
                batch.release()  # the device copy is done: the runner has read it
        finally:
            with self._lock:
                slot.load -= submitted
            if recording and request is not None:
                request.batch_done()

    def _model_shape(self, shape: tuple[int, int, int]) -> tuple[int, int, int]:
        """A frame shape (h, w, c) -> the first model's runner input, (H, W, C) uint8 pixels: what the memory
        policies key a batch by (worker.runtime.modelset)."""
        return self.model_set.members[0].input_shape(shape)


def _calibration_frame(shape: tuple[int, int, int]) -> Frame:
    h, w, c = shape
    return Frame(stream_id="calibration", frame_index=0, tenant="", priority=Priority.BULK, capture_ts_ms=0, width=w,
                 height=h, channels=c, encoding=Encoding.RAW_RGB8, data=bytes(h * w * c), source=SourceRef("", 0, 0))


def _run_on(ex: InferenceExecutor, slot: _Slot, frames: list[Frame], shape: tuple[int, int, int]) -> BatchOutcome:
    """Run a batch whole on this runner (never split) and wait for it."""
    with ex._lock:
        future = ex._submit_to(slot, frames, shape, Priority.BULK)
    return future.result()


def _joined(parts: list[tuple[list[Frame], str, concurrent.futures.Future[BatchOutcome]]]
            ) -> concurrent.futures.Future[BatchOutcome]:
    """One Future for the parts of a split batch ((frames, device, future) in frame order), resolved once every
    part is done (`_join_outcomes`)."""
    joined: concurrent.futures.Future[BatchOutcome] = concurrent.futures.Future()
    left = [len(parts)]
    lock = threading.Lock()

    def part_done(_future: concurrent.futures.Future[BatchOutcome]) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            joined.set_result(_join_outcomes(parts))

    for _frames, _device, future in parts:
        future.add_done_callback(part_done)
    return joined


def _join_outcomes(parts: list[tuple[list[Frame], str, concurrent.futures.Future[BatchOutcome]]]) -> BatchOutcome:
    """The outcome of a split batch: verdicts and failures in frame order, the frames of a part that raised as
    FrameFailures (its device failed, the other parts' frames are scored), times of the slowest part (the parts
    ran side by side), buckets summed."""
    verdicts: list[tuple[Frame, Any]] = []
    failures: list[FrameFailure] = []
    done: list[BatchOutcome] = []
    for frames, device, future in parts:
        exc = future.exception()
        if exc is not None:
            log.error("a device failed its part of a split batch; its frames are dead-lettered device=%s frames=%d "
                      "error=%s: %s", device, len(frames), type(exc).__name__, exc)
            reason = (f"the runtime failed on {device} for this frame's part of a split batch: "
                      f"{type(exc).__name__}: {exc}")
            failures.extend(FrameFailure(f, reason, MODEL_ERROR) for f in frames)
            continue
        outcome = future.result()
        verdicts.extend(outcome.verdicts)
        failures.extend(outcome.failures)
        done.append(outcome)
    return BatchOutcome(
        verdicts=verdicts,
        failures=failures,
        batch_size=sum(o.batch_size for o in done),
        preprocess_ms=max((o.preprocess_ms for o in done), default=0.0),
        inference_ms=max((o.inference_ms for o in done), default=0.0),
        started_at=min((o.started_at for o in done), default=time.time()),
        bucket=sum(o.bucket for o in done),
        used_graph=any(o.used_graph for o in done),
        cpu_ms=None if not done or any(o.cpu_ms is None for o in done) else sum(o.cpu_ms or 0.0 for o in done),
    )


def _timed(outcome: BatchOutcome) -> float:
    return (outcome.preprocess_ms + outcome.inference_ms) / 1000.0


def _device_preprocessor(contracts: Sequence[ModelContract], pin_memory: bool, pool: concurrent.futures.Executor,
                         workers: int, steps: DeviceSteps | None) -> DevicePreprocessor:
    # Imported here: torchvision takes ~1.3 s to import on the 2-core VM, which only the device path needs.
    from worker.runtime.devicepath import ByteStaging, DevicePreprocessor

    return DevicePreprocessor(contracts, ByteStaging(pin_memory=pin_memory), pool=pool, workers=workers, steps=steps)


