"""The contract between the worker and a model, below everything that loads or checks one.

`ModelContract` is what the worker assumes about a model's input and output (from `ModelSettings`);
`ModelContractError` is how any part of the runtime says a model does not fit it. The loaders
(`worker.runtime.models`, `worker.runtime.onnx_cache`) and the start-up checks (`worker.runtime.hostsync`) all
import from here, so none of them imports another to reach these.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from worker.config import ModelSettings
from worker.errors import OperatorError
from worker.frames import Verdict

# Batch size of the start-up forward: 2 rather than 1, so a model exported with a fixed batch of 1 is caught.
VALIDATION_BATCH = 2
# Image size of the start-up forward when the contract has no fixed input size (the default warm-up shape).
VALIDATION_HW = (224, 224)


class ModelContractError(OperatorError):
    """The model file, factory or contract is unusable; the message says what was wrong and what to change."""

    def __init__(self, message: str, setting: str | None = "model.source") -> None:
        super().__init__(message, setting=setting)


@dataclass(frozen=True)
class ModelContract:
    """What the worker assumes about the model's inputs and outputs, taken from (validated) `ModelSettings`."""

    name: str
    version: str
    labels: tuple[str, ...]
    thresholds: Mapping[str, float] = field(default_factory=dict)
    default_threshold: float = 0.5
    never_flag: frozenset[str] = frozenset()
    # (height, width) every frame is resized to, or None when the model takes any size.
    input_size: tuple[int, int] | None = None
    input_layout: str = "NCHW"
    channel_order: str = "RGB"
    pixel_range: str = "0-1"
    mean: tuple[float, ...] = (0.485, 0.456, 0.406)
    std: tuple[float, ...] = (0.229, 0.224, 0.225)
    resize: str = "stretch"
    resize_shorter_side: int = 0
    resize_to: tuple[int, int] | None = None
    jpeg_roundtrip_quality: int = 0
    jpeg_scaled_decode: bool = True
    resampler: str = "torch"
    activation: str = "sigmoid"
    # "scores" ([N, labels]) or "detections" (YOLOv8-style, decoded by worker.runtime.detection) and its decoding.
    output: str = "scores"
    score_threshold: float = 0.25
    iou_threshold: float = 0.45
    class_agnostic_nms: bool = False
    max_detections: int = 100

    @classmethod
    def from_settings(cls, settings: ModelSettings) -> ModelContract:
        """The settings were validated by worker.config; this only converts them."""
        input_size = (int(settings.input_size[0]), int(settings.input_size[1])) if settings.input_size else None
        resize_to = (int(settings.resize_to[0]), int(settings.resize_to[1])) if settings.resize_to else None
        return cls(
            name=settings.name,
            version=settings.version,
            labels=tuple(settings.labels),
            thresholds=dict(settings.thresholds),
            default_threshold=settings.default_threshold,
            never_flag=frozenset(settings.never_flag),
            input_size=input_size,
            input_layout=settings.input_layout,
            channel_order=settings.channel_order,
            pixel_range=settings.pixel_range,
            mean=tuple(settings.mean),
            std=tuple(settings.std),
            resize=settings.resize,
            resize_shorter_side=settings.resize_shorter_side or (max(input_size) if input_size else 0),
            resize_to=resize_to,
            jpeg_roundtrip_quality=settings.jpeg_roundtrip_quality,
            jpeg_scaled_decode=settings.jpeg_scaled_decode,
            resampler=settings.resampler,
            activation=settings.activation,
            output=settings.output,
            score_threshold=settings.score_threshold,
            iou_threshold=settings.iou_threshold,
            class_agnostic_nms=settings.class_agnostic_nms,
            max_detections=settings.max_detections,
        )

    @property
    def detects(self) -> bool:
        """True for a detector: its output is boxes (worker.runtime.detection), not one score per label."""
        return self.output == "detections"

    @property
    def channels(self) -> int:
        return len(self.mean)

    def threshold_for(self, label: str) -> float:
        return self.thresholds.get(label, self.default_threshold)

    def verdict(self, scores: Sequence[float] | np.ndarray) -> Verdict:
        """Scores in label order -> a Verdict flagging every label at or above its threshold (never_flag aside)."""
        by_label = {label: float(s) for label, s in zip(self.labels, scores, strict=False)}
        flagged = tuple(label for label in self.labels
                        if label not in self.never_flag and by_label[label] >= self.threshold_for(label))
        return Verdict(scores=by_label, flagged_labels=flagged)

    def verdicts(self, scores: np.ndarray) -> list[Verdict]:
        """`verdict` of each row of a (frames, labels) score matrix, thresholded in one comparison: the batch's
        verdicts cost a few microseconds each instead of ten (issue 47). Rows must be finite."""
        rows = np.asarray(scores, dtype=np.float64)
        flags = (rows >= self._thresholds_row) & self._flaggable_row
        labels = self.labels
        return [Verdict(scores=dict(zip(labels, row, strict=False)),
                        flagged_labels=tuple(itertools.compress(labels, flagged)))
                for row, flagged in zip(rows.tolist(), flags.tolist(), strict=True)]

    @functools.cached_property
    def _thresholds_row(self) -> np.ndarray:
        return np.array([self.threshold_for(label) for label in self.labels], dtype=np.float64)

    @functools.cached_property
    def _flaggable_row(self) -> np.ndarray:
        return np.array([label not in self.never_flag for label in self.labels], dtype=bool)

    def model_input_hw(self, batch_hw: tuple[int, int]) -> tuple[int, int]:
        """The (height, width) the model sees for a batch padded to `batch_hw`."""
        return self.input_size if self.input_size is not None else batch_hw

    def input_shape(self, hw: tuple[int, int]) -> tuple[int, int, int]:
        """One sample's tensor shape for a model input of `hw`, in the model's layout: (C, H, W) or (H, W, C)."""
        h, w = hw
        return (self.channels, h, w) if self.input_layout == "NCHW" else (h, w, self.channels)

    def describe_input(self) -> str:
        """The input as a user would write it in a config, for error messages."""
        hw = list(self.input_size) if self.input_size else "any size"
        return (f"model.input_layout = {self.input_layout!r}, model.input_size = {hw}, "
                f"{self.channels} channel(s) {self.channel_order if self.channels == 3 else 'grey'}")
