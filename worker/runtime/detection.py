"""Detector outputs: YOLOv8-style boxes decoded with non-maximum suppression and mapped back to the frame's pixels.

A detector (`model.output = "detections"`) returns [N, 4 + labels, anchors]: each anchor's box centre x, y, width
and height in model-input pixels, then one score per label. Decoding runs after the model, on the host, outside
any CUDA graph (how many boxes survive depends on the data). Boxes are mapped back through the resize (and
letterbox, crop or padding) that preprocessing applied (`InputTransform`), clipped to the frame, then suppressed
(`torchvision.ops.batched_nms` per label, or `nms` across labels), best first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from worker.frames import Detection, Verdict
from worker.runtime.contract import ModelContract
from worker.runtime.fitting import padded_hw, resize_target


@dataclass(frozen=True)
class InputTransform:
    """How a frame's pixel (x, y) lands in the model input: x * scale_x + left, y * scale_y + top."""

    scale_x: float
    scale_y: float
    left: float
    top: float
    frame_w: int
    frame_h: int

    def to_frame(self, xyxy: torch.Tensor) -> torch.Tensor:
        """[k, 4] input-pixel boxes -> frame-pixel boxes, clipped to the frame."""
        out = torch.empty_like(xyxy)
        out[:, 0::2] = ((xyxy[:, 0::2] - self.left) / self.scale_x).clamp(0.0, float(self.frame_w))
        out[:, 1::2] = ((xyxy[:, 1::2] - self.top) / self.scale_y).clamp(0.0, float(self.frame_h))
        return out


def input_transform(contract: ModelContract, frame_hw: tuple[int, int]) -> InputTransform:
    """The transform `worker.runtime.fitting.fit_to_input` applies to a frame of `frame_hw` for this contract."""
    h, w = frame_hw
    size = contract.input_size
    target = resize_target(contract, frame_hw)
    if size is None or target is None:
        return InputTransform(1.0, 1.0, 0.0, 0.0, w, h)
    if contract.resize == "pad_stretch":
        ph, pw = padded_hw(frame_hw, size)
        return InputTransform(size[1] / pw, size[0] / ph, 0.0, 0.0, w, h)
    sx, sy = target[1] / w, target[0] / h
    if contract.resize == "letterbox":
        return InputTransform(sx, sy, float((size[1] - target[1]) // 2), float((size[0] - target[0]) // 2), w, h)
    if contract.resize in ("shorter_side_crop", "stretch_crop"):
        return InputTransform(sx, sy, -float((target[1] - size[1]) // 2), -float((target[0] - size[0]) // 2), w, h)
    return InputTransform(sx, sy, 0.0, 0.0, w, h)


def decode_detections(raw: np.ndarray | torch.Tensor, transforms: Sequence[InputTransform],
                      contract: ModelContract) -> list[tuple[Detection, ...]]:
    """[n, 4 + labels, anchors] model outputs -> each frame's detections, best first, in its own pixels."""
    # Imported here: torchvision takes ~1.3 s to import on the 2-core VM, which only a detector needs.
    from torchvision.ops import batched_nms, nms

    out = torch.as_tensor(raw).float()
    boxes_c = out[:, :4, :].transpose(1, 2)  # [n, anchors, 4]: centre x, centre y, width, height
    best, label = out[:, 4:, :].max(dim=1)  # each anchor's best label and its score
    frames: list[tuple[Detection, ...]] = []
    for i, transform in enumerate(transforms):
        keep = best[i] >= contract.score_threshold
        c, scores, labels = boxes_c[i][keep], best[i][keep], label[i][keep]
        half = c[:, 2:] / 2.0
        boxes = transform.to_frame(torch.cat([c[:, :2] - half, c[:, :2] + half], dim=1))
        if contract.class_agnostic_nms:
            kept = nms(boxes, scores, contract.iou_threshold)
        else:
            kept = batched_nms(boxes, scores, labels, contract.iou_threshold)
        kept = kept[:contract.max_detections]
        frames.append(tuple(
            Detection(label=contract.labels[int(k)], score=float(s), x=float(b[0]), y=float(b[1]),
                      width=float(b[2] - b[0]), height=float(b[3] - b[1]))
            for b, s, k in zip(boxes[kept].tolist(), scores[kept].tolist(), labels[kept].tolist(), strict=True)))
    return frames


def detection_verdict(contract: ModelContract, detections: Sequence[Detection]) -> Verdict:
    """A detector's verdict: per label its best box's score (0 without one), thresholded as a classifier's."""
    best = dict.fromkeys(contract.labels, 0.0)
    for d in detections:
        best[d.label] = max(best[d.label], d.score)
    verdict = contract.verdict([best[label] for label in contract.labels])
    return Verdict(scores=verdict.scores, flagged_labels=verdict.flagged_labels, detections=tuple(detections))
