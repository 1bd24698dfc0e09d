"""The models a batch runs through: one, or several (a classifier and a detector). A single model is a set of one.

Frames are read, batched and decoded once (`preprocess.Preprocessor`, or the device data path, fits each decoded
frame to every model's input). Each model has its own runner on each device, hence its own CUDA graphs per bucket;
they run one after another on the batch, a cascaded model only on the frames its condition lets through
(`worker.runtime.cascade`). `ModelSet.run` is the one run loop: a batch the model fails on is retried frame by frame, a
frame with a non-finite output fails alone, a classifier's scores are thresholded in one comparison and a
detector's boxes decoded after its runner, outside any graph (`worker.runtime.detection`).
`worker.runtime.cascade.combine` makes the frame's verdict: a set of one gives its model's own verdict, as results
always carried for one model.

Memory on a GPU: one MemoryPolicy per device. Its batch peaks are measured by `calibrate` over the whole set (the
models run in turn on one batch, so a batch's peak holds every model's weights and the largest model's
activations), keyed by the first model's input shape, which is what the batcher and the executor look up. Each
model's runner captures its own graphs and records their peaks under its own input shape (the largest is kept
where two models share one). The device's graph budget is shared equally by every runner of every model:
graph_budget_bytes // (instances_per_device x models).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from worker.config import ModelSettings
from worker.frames import (
    DECODE_ERROR,
    MODEL_ERROR,
    NON_FINITE_OUTPUT,
    BatchOutcome,
    Frame,
    FrameFailure,
    ModelVerdict,
    Verdict,
)
from worker.runtime.cascade import CascadeRule, combine
from worker.runtime.contract import ModelContract
from worker.runtime.detection import decode_detections, detection_verdict, input_transform
from worker.runtime.hostbatch import HostBatch, ModelInput
from worker.runtime.runners import ModelRunner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Member:
    """One model of the set: its name in the results, its contract and its cascade condition (None: every frame)."""

    name: str
    contract: ModelContract
    rule: CascadeRule | None = None

    @classmethod
    def from_settings(cls, m: ModelSettings) -> Member:
        rule = CascadeRule(m.run_if_model, m.run_if_label, m.run_if_score) if m.run_if_model else None
        return cls(m.name, ModelContract.from_settings(m), rule)

    def input_shape(self, batch_shape: tuple[int, int, int]) -> tuple[int, int, int]:
        """This model's runner input (H, W, C) for a batch of frames padded to `batch_shape`."""
        return (*self.contract.model_input_hw((batch_shape[0], batch_shape[1])), self.contract.channels)

    def verdicts(self, frames: Sequence[Frame], rows: list[int], outputs: np.ndarray
                 ) -> tuple[list[tuple[int, Verdict]], list[tuple[int, str]]]:
        """Each row's verdict from this model's outputs for it (a classifier's scores thresholded in one comparison,
        a detector's boxes decoded first); (row, reason) for a row whose output is not finite, which fails its frame."""
        finite = np.isfinite(outputs.reshape(len(rows), -1)).all(axis=1).tolist()
        not_finite = [(i, self._not_finite(out)) for i, out, ok in zip(rows, outputs, finite, strict=True) if not ok]
        kept = [i for i, ok in zip(rows, finite, strict=True) if ok]
        if not_finite:
            outputs = outputs[np.asarray(finite, dtype=bool)]
        if not kept:
            return [], not_finite
        c = self.contract
        if not c.detects:
            return list(zip(kept, c.verdicts(outputs), strict=True)), not_finite
        transforms = [input_transform(c, (frames[i].height, frames[i].width)) for i in kept]
        decoded = decode_detections(outputs, transforms, c)
        return [(i, detection_verdict(c, dets)) for i, dets in zip(kept, decoded, strict=True)], not_finite

    def _not_finite(self, output: np.ndarray) -> str:
        values = "" if self.contract.detects else f": {output.tolist()}"  # a detector's are thousands of numbers
        return f"model {self.name} output is not finite{values}"


class ModelSet:
    """The models every batch runs through, in order (one or more), and the one loop that runs them."""

    def __init__(self, members: Sequence[Member]):
        if not members:
            raise ValueError("a model set needs at least one model")
        self.members = tuple(members)
        self.name = "+".join(m.name for m in self.members)
        self.version = "+".join(m.contract.version for m in self.members)

    @classmethod
    def of(cls, contract: ModelContract) -> ModelSet:
        """A set of one: the model the contract describes."""
        return cls([Member(contract.name, contract)])

    @classmethod
    def from_settings(cls, models: Sequence[ModelSettings]) -> ModelSet:
        return cls([Member.from_settings(m) for m in models])

    @property
    def contracts(self) -> tuple[ModelContract, ...]:
        return tuple(m.contract for m in self.members)

    def run(self, batch: HostBatch, runners: Sequence[ModelRunner]) -> BatchOutcome:
        """Every model (`runners[m]` runs model m, on one device) on the frames its condition lets through, in the
        set's order; one verdict per frame that every model it reached ran on, a FrameFailure for each other."""
        failures = [FrameFailure(f, str(exc), DECODE_ERROR) for f, exc in batch.failures]
        t0, cpu0 = time.perf_counter(), time.thread_time()
        frames = batch.frames
        outputs: list[list[ModelVerdict]] = [[] for _ in frames]
        alive = [True] * len(frames)
        bucket, used_graph = 0, False
        for m, (member, runner, model_input) in enumerate(zip(self.members, runners, batch.inputs, strict=True)):
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
            ran, scores, errors, model_bucket, graph = _run_rows(runner, model_input, batch.ready_event, rows)
            if m == 0:
                bucket = model_bucket
            used_graph = used_graph or graph
            for i, message in errors:
                alive[i] = False
                failures.append(FrameFailure(frames[i], f"model {member.name} raised on this frame: {message}",
                                             MODEL_ERROR))
            verdicts, not_finite = member.verdicts(frames, ran, scores) if ran else ([], [])
            for i, reason in not_finite:
                alive[i] = False
                failures.append(FrameFailure(frames[i], reason, NON_FINITE_OUTPUT))
            for i, verdict in verdicts:
                outputs[i].append(ModelVerdict(member.name, member.contract.version, verdict,
                                               detector=member.contract.detects))
        return BatchOutcome(
            verdicts=[(frames[i], combine(outputs[i])) for i in range(len(frames)) if alive[i]],
            failures=failures,
            batch_size=len(frames),
            preprocess_ms=batch.preprocess_ms,
            inference_ms=(time.perf_counter() - t0) * 1000.0,
            started_at=batch.started_at,
            bucket=bucket,
            used_graph=used_graph,
            cpu_ms=None if batch.preprocess_cpu_ms is None
            else batch.preprocess_cpu_ms + (time.thread_time() - cpu0) * 1000.0,
        )


def _run_rows(runner: ModelRunner, model_input: ModelInput, ready: torch.cuda.Event | None, rows: list[int]
              ) -> tuple[list[int], np.ndarray, list[tuple[int, str]], int, bool]:
    """The model on `rows` of its staged input: the rows it ran on and their outputs (stacked), (row, error) for
    rows it failed on alone (after the batch raised, each row is run alone), the bucket and whether a graph ran."""
    pixels, regions = model_input.device_pixels, model_input.device_regions
    assert pixels is not None  # staged whenever the batch has frames
    if len(rows) < pixels.shape[0]:
        if ready is not None:
            ready.synchronize()  # the copy is done before its rows are gathered, off the runner's stream
            ready = None
        index = torch.tensor(rows, device=pixels.device)
        pixels = pixels.index_select(0, index)
        regions = None if regions is None else regions.index_select(0, index)
    try:
        result = runner.run(pixels, ready, regions)
        return rows, result.scores, [], result.bucket, result.used_graph
    except Exception as exc:  # noqa: BLE001 (any model error: retried frame by frame)
        log.warning("model failed on a batch; retrying frame by frame size=%d error=%s: %s", len(rows),
                    type(exc).__name__, exc)
    ran, outputs, errors, used_graph = [], [], [], False
    for k, i in enumerate(rows):
        try:
            result = runner.run(pixels[k:k + 1], ready, None if regions is None else regions[k:k + 1])
        except Exception as exc:  # noqa: BLE001 (this frame alone fails: dead-lettered)
            errors.append((i, f"{type(exc).__name__}: {exc}"))
            continue
        ran.append(i)
        outputs.append(result.scores[0])
        used_graph = used_graph or result.used_graph
    return ran, np.stack(outputs) if outputs else np.empty((0,)), errors, 1, used_graph
