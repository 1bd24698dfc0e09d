"""A model set: several models on one batch (a classifier and a detector), one verdict per frame.

Frames are read, batched and decoded once (`SetPreprocessor`: each frame decoded once on the host, then resized
for each model from the same pixels into that model's own batch buffer). Each model has its own runner on each
device (`ModelSetRunner`), hence its own CUDA graphs per bucket; they run one after another on the batch, a
cascaded model only on the frames its condition lets through (`worker.cascade`). A detector's output is decoded
after its runner (`worker.runtime.detection`), outside any graph. `worker.cascade.combine` makes the frame's
verdict, carrying every model's output.

Memory on a GPU: one MemoryPolicy per device as for one model. Its batch peaks are measured by `calibrate` over
the whole set (the models run in turn on one batch, so a batch's peak holds every model's weights and the
largest model's activations), keyed by the first model's input shape, which is what the batcher and the
executor look up. Each model's runner captures its own graphs and records their peaks under its own input shape
(the largest is kept where two models share one). The device's graph budget is shared equally by every runner of
every model: graph_budget_bytes // (instances_per_device x models).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

from worker.cascade import CascadeRule, combine
from worker.config import BatchingSettings, ConfigError, ModelSettings, RuntimeSettings, preprocess_thread_count
from worker.frames import (
    DECODE_ERROR,
    MODEL_ERROR,
    NON_FINITE_OUTPUT,
    BatchOutcome,
    Encoding,
    Frame,
    FrameFailure,
    ModelVerdict,
    Verdict,
)
from worker.graphplan import BatchCaps
from worker.runtime.contract import ModelContract
from worker.runtime.decode import FrameDecodeError, decode_frame
from worker.runtime.detection import decode_detections, detection_verdict, input_transform
from worker.runtime.deviceplan import DevicePlan, describe, device_memories, graph_memory
from worker.runtime.engine import load_engine_model, make_engine_runner
from worker.runtime.hostsync import check_host_syncs
from worker.runtime.preprocess import (
    HostBatch,
    HostBuffers,
    check_fits_batch,
    fit_to_input,
    jpeg_roundtrip,
    resize_target,
    stage_to_device,
    to_channels,
)
from worker.runtime.runners import EagerRunner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SetMember:
    """One model of the set: its name in the results, its contract and its cascade condition (None: every frame)."""

    name: str
    contract: ModelContract
    rule: CascadeRule | None = None

    @classmethod
    def from_settings(cls, m: ModelSettings) -> SetMember:
        rule = CascadeRule(m.run_if_model, m.run_if_label, m.run_if_score) if m.run_if_model else None
        return cls(m.name, ModelContract.from_settings(m), rule)

    def input_shape(self, batch_shape: tuple[int, int, int]) -> tuple[int, int, int]:
        """This model's runner input (H, W, C) for a batch of frames padded to `batch_shape`."""
        return (*self.contract.model_input_hw((batch_shape[0], batch_shape[1])), self.contract.channels)


@dataclass
class SetBatch(HostBatch):
    """A batch prepared for every model: `members[i]` is model i's HostBatch of the same frames (its pixels and
    regions; `pixels` and `regions` here are the first model's)."""

    members: list[HostBatch] = field(default_factory=list)


class SetPreprocessor:
    """Decodes each frame of a batch once, then fits it to each model's input into that model's buffer."""

    def __init__(self, members: Sequence[SetMember], buffers: HostBuffers,
                 pool: concurrent.futures.Executor | None = None, workers: int = 1):
        self.members = list(members)
        self.buffers = buffers
        self._pool = pool if workers > 1 else None
        self._workers = workers
        contracts = [m.contract for m in self.members]
        self._jpeg_channels = max(c.channels for c in contracts)
        # A JPEG is decoded at a reduced scale only when every model allows it, at the largest scale any needs.
        self._scaled_decode = all(c.jpeg_scaled_decode and c.input_size is not None for c in contracts)

    def prepare(self, frames: Sequence[Frame], shape: tuple[int, int, int]) -> SetBatch:
        started_at, t0 = time.time(), time.perf_counter()
        frames = list(frames)
        batch_hw = (shape[0], shape[1])
        buffers = [self.buffers.take(len(frames), m.input_shape(shape)) for m in self.members]
        rows = [b.numpy() for b in buffers]
        placed = self._fill(rows, frames, batch_hw)
        ok = [not isinstance(p, FrameDecodeError) for p in placed]
        kept = [i for i, good in enumerate(ok) if good]
        good_frames = [frames[i] for i in kept]
        members = []
        for m, (member, buf) in enumerate(zip(self.members, buffers, strict=True)):
            pixels = _compact(buf, kept)
            regions = [cast(list, placed[i])[m] for i in kept]
            hwc = member.input_shape(shape)
            full = (0, 0, hwc[0], hwc[1])
            members.append(HostBatch(
                frames=good_frames, pixels=pixels,
                regions=None if all(r == full for r in regions) else torch.tensor(regions, dtype=torch.int32),
                failures=[], started_at=started_at,
                release=lambda b=buf: self.buffers.give_back(b)))  # type: ignore[misc]

        def release() -> None:
            for mb in members:
                mb.release()

        return SetBatch(frames=good_frames, pixels=members[0].pixels, regions=members[0].regions,
                        failures=[(frames[i], cast(FrameDecodeError, placed[i])) for i in range(len(frames))
                                  if not ok[i]],
                        started_at=started_at, preprocess_ms=(time.perf_counter() - t0) * 1000.0,
                        release=release, members=members)

    def _fill(self, rows: list[np.ndarray], frames: list[Frame], batch_hw: tuple[int, int]
              ) -> list[list[tuple[int, int, int, int]] | FrameDecodeError]:
        chunks = min(len(frames), self._workers) if self._pool is not None else 1
        if chunks <= 1:
            return [self._fill_one(rows, frames[i], i, batch_hw) for i in range(len(frames))]
        bounds = [len(frames) * k // chunks for k in range(chunks + 1)]
        assert self._pool is not None
        futures = [self._pool.submit(lambda lo, hi: [self._fill_one(rows, frames[i], i, batch_hw)
                                                     for i in range(lo, hi)], lo, hi)
                   for lo, hi in zip(bounds, bounds[1:])]
        return [p for f in futures for p in f.result()]

    def _fill_one(self, rows: list[np.ndarray], frame: Frame, i: int, batch_hw: tuple[int, int]
                  ) -> list[tuple[int, int, int, int]] | FrameDecodeError:
        """Decode frame i once and place it in row i of every model's buffer; each model's region, or the error."""
        frame_hw = (frame.height, frame.width)
        try:
            for member in self.members:
                check_fits_batch(member.contract, frame, batch_hw)
            channels = frame.channels if frame.encoding is Encoding.RAW_RGB8 else self._jpeg_channels
            min_hw = None
            if self._scaled_decode:
                targets = [resize_target(m.contract, frame_hw) or frame_hw for m in self.members]
                min_hw = (max(t[0] for t in targets), max(t[1] for t in targets))
            decoded = decode_frame(frame, channels, min_hw=min_hw)
            regions = []
            for member, model_rows in zip(self.members, rows, strict=True):
                c, dst = member.contract, model_rows[i]
                pixels, (top, left) = fit_to_input(to_channels(decoded, c.channels), c, frame_hw, out=dst)
                if c.jpeg_roundtrip_quality:
                    pixels = jpeg_roundtrip(pixels, c.jpeg_roundtrip_quality)
                h, w = pixels.shape[:2]
                if pixels is not dst:
                    if (h, w) != dst.shape[:2]:
                        dst.fill(0)
                    dst[top:top + h, left:left + w] = pixels
                regions.append((top, left, h, w))
            return regions
        except FrameDecodeError as exc:
            return exc


def _compact(buffer: torch.Tensor, kept: list[int]) -> torch.Tensor:
    for row, i in enumerate(kept):
        if row != i:
            buffer[row].copy_(buffer[i])
    return buffer[:len(kept)]


class ModelSetRunner:
    """One runner per model of the set, on one device; the executor drives it as it drives one runner."""

    def __init__(self, members: Sequence[SetMember], runners: Sequence[EagerRunner]):
        self.members = list(members)
        self.runners = list(runners)
        self.device = self.runners[0].device
        self.copy_stream = self.runners[0].copy_stream
        self.uses_graphs = self.runners[0].uses_graphs

    @property
    def buckets(self) -> tuple[int, ...]:
        return tuple(getattr(self.runners[0], "buckets", ()))

    @property
    def capture_count(self) -> int:
        return sum(r.capture_count for r in self.runners)

    @property
    def graph_evictions(self) -> int:
        return sum(r.graph_evictions for r in self.runners)

    def warm_up(self, shape: tuple[int, int, int], batches: int, batch_size: int) -> None:
        """`shape` is the first model's input; every model warms up on its own input for the same frames."""
        for member, runner in zip(self.members, self.runners, strict=True):
            runner.warm_up(member.input_shape(shape), batches, batch_size)


class ModelSet:
    """The executor's hooks for a model set: prepare a batch for every model, run them, combine their verdicts."""

    def __init__(self, members: Sequence[SetMember], preprocessor: SetPreprocessor):
        self.members = list(members)
        self.preprocessor = preprocessor
        self.name = "+".join(m.name for m in self.members)
        self.version = "+".join(m.contract.version for m in self.members)

    def prepare(self, frames: list[Frame], shape: tuple[int, int, int], runner: ModelSetRunner) -> SetBatch:
        batch = self.preprocessor.prepare(frames, shape)
        if batch.frames:
            for mb, model_runner in zip(batch.members, runner.runners, strict=True):
                stage_to_device(mb, model_runner.device, model_runner.copy_stream)
        return batch

    def run(self, batch: SetBatch, runner: ModelSetRunner) -> BatchOutcome:
        """Every model on the frames its condition lets through, in the set's order; one verdict per frame."""
        failures = [FrameFailure(f, str(exc), DECODE_ERROR) for f, exc in batch.failures]
        t0 = time.perf_counter()
        frames = batch.frames
        outputs: list[list[ModelVerdict]] = [[] for _ in frames]
        alive = [True] * len(frames)
        bucket, used_graph = 0, False
        for m, (member, model_runner, mb) in enumerate(zip(self.members, runner.runners, batch.members,
                                                           strict=True)):
            rows = []
            for i in range(len(frames)):
                if not alive[i]:
                    continue
                reason = member.rule.skip_reason({o.model: o for o in outputs[i]}) if member.rule else ""
                if reason:
                    outputs[i].append(ModelVerdict(member.name, member.contract.version, None, reason))
                else:
                    rows.append(i)
            if not rows:
                continue
            scored, errors, model_bucket, graph = _run_rows(model_runner, mb, rows)
            if m == 0:
                bucket = model_bucket
            used_graph = used_graph or graph
            for i, message in errors:
                alive[i] = False
                failures.append(FrameFailure(frames[i], f"model {member.name} raised on this frame: {message}",
                                             MODEL_ERROR))
            for i, verdict in self._verdicts(member, frames, scored, failures, alive):
                outputs[i].append(ModelVerdict(member.name, member.contract.version, verdict,
                                               detector=member.contract.detects))
        verdicts = [(frames[i], combine(outputs[i])) for i in range(len(frames)) if alive[i]]
        return BatchOutcome(verdicts=verdicts, failures=failures, batch_size=len(frames),
                            preprocess_ms=batch.preprocess_ms, inference_ms=(time.perf_counter() - t0) * 1000.0,
                            started_at=batch.started_at, bucket=bucket, used_graph=used_graph)

    @staticmethod
    def _verdicts(member: SetMember, frames: list[Frame], scored: list[tuple[int, np.ndarray]],
                  failures: list[FrameFailure], alive: list[bool]) -> list[tuple[int, Verdict]]:
        """Each scored row's verdict (a detector's decoded first); a non-finite output fails its frame."""
        finite = []
        for i, out in scored:
            if np.isfinite(out).all():
                finite.append((i, out))
            else:
                alive[i] = False
                failures.append(FrameFailure(frames[i], f"model {member.name} output is not finite", NON_FINITE_OUTPUT))
        if not finite:
            return []
        c = member.contract
        if not c.detects:
            return list(zip([i for i, _ in finite], c.verdicts(np.stack([out for _, out in finite])), strict=True))
        transforms = [input_transform(c, (frames[i].height, frames[i].width)) for i, _ in finite]
        decoded = decode_detections(np.stack([out for _, out in finite]), transforms, c)
        return [(i, detection_verdict(c, dets)) for (i, _), dets in zip(finite, decoded, strict=True)]


def _run_rows(runner: EagerRunner, batch: HostBatch, rows: list[int]
              ) -> tuple[list[tuple[int, np.ndarray]], list[tuple[int, str]], int, bool]:
    """The model on `rows` of its staged batch: (row, output) pairs, (row, error) for rows it failed on alone
    (after the batch raised, each row is run alone), the bucket and whether a graph ran."""
    pixels, regions = batch.device_pixels, batch.device_regions
    assert pixels is not None
    if len(rows) < pixels.shape[0]:
        index = torch.tensor(rows, device=pixels.device)
        pixels = pixels.index_select(0, index)
        regions = None if regions is None else regions.index_select(0, index)
    try:
        result = runner.run(pixels, batch.ready_event, regions)
        return list(zip(rows, result.scores, strict=True)), [], result.bucket, result.used_graph
    except Exception as exc:  # noqa: BLE001 (any model error: retried frame by frame)
        log.warning("model failed on a batch; retrying frame by frame size=%d error=%s: %s", len(rows),
                    type(exc).__name__, exc)
    scored, errors, used_graph = [], [], False
    for k, i in enumerate(rows):
        try:
            result = runner.run(pixels[k:k + 1], None, None if regions is None else regions[k:k + 1])
        except Exception as exc:  # noqa: BLE001 (this frame alone fails: dead-lettered)
            errors.append((i, f"{type(exc).__name__}: {exc}"))
            continue
        scored.append((i, result.scores[0]))
        used_graph = used_graph or result.used_graph
    return scored, errors, 1, used_graph


def model_set_executor(executor_class: Any, models: Sequence[ModelSettings],
                       runtime: RuntimeSettings, batching: BatchingSettings | None,
                       on_graph_evicted: Callable[[int], None] | None, plan: DevicePlan) -> Any:
    """The executor of a model set: each model loaded and validated on every device, one ModelSetRunner per
    runner slot, frames decoded on the host (the device data path decodes for one model only). The executor
    passes its class and resolved plan (this module never imports it)."""
    if runtime.decode == "device":
        raise ConfigError(["runtime.decode: \"device\" decodes for one model; a model set ([models.<name>]) decodes "
                           "each frame once on the host for all its models: set runtime.decode = \"cpu\" or \"auto\""])
    if runtime.torch_threads > 0:
        torch.set_num_threads(runtime.torch_threads)
    memory = device_memories(plan, runtime)
    caps = BatchCaps.from_settings(batching) if batching is not None else BatchCaps()
    members = [SetMember.from_settings(m) for m in models]
    set_runners: list[ModelSetRunner] = []
    host_syncs: list[Any] = []
    kinds: list[str] = []
    engines: list[str] = []
    for device in plan.devices:
        for _ in range(runtime.instances_per_device):
            runners = []
            for m in models:
                loaded = load_engine_model(m, runtime, device)  # issue 61: worker.runtime.engine
                if not set_runners:
                    host_syncs.extend(check_host_syncs(loaded, refuse=plan.cuda_graphs))
                    kinds.append(loaded.kind if loaded.engine == "torch" else f"{loaded.kind} on {loaded.engine}")
                    engines.append(loaded.engine)
                policy, budget = graph_memory(memory.get(device), runtime)
                # Every model's runners share the device's graph budget (module docstring).
                budget = None if budget is None else budget // len(models)
                runners.append(make_engine_runner(loaded.module, loaded.contract, device, plan.precision,
                                                  plan.cuda_graphs, plan.buckets, runtime.warmup_batches, caps, policy,
                                                  budget, on_graph_evicted))
            set_runners.append(ModelSetRunner(members, runners))
    buffers = HostBuffers(pin_memory=plan.devices[0].type == "cuda")
    threads = preprocess_thread_count(runtime)
    executor = executor_class(
        cast(list[EagerRunner], set_runners), members[0].contract, threads, runtime.warmup_batches,
        warmup_batch_size=max(runtime.graph_batch_sizes),
        device_description=describe(plan, f"{len(models)}-model set ({'+'.join(kinds)})",
                                    "+".join(sorted(set(engines)))),
        memory=[memory[r.device] for r in set_runners] if memory else (), host_syncs=host_syncs)
    model_set = ModelSet(members, SetPreprocessor(members, buffers, executor._decode_pool, threads))
    executor.attach_model_set(model_set)
    return executor
