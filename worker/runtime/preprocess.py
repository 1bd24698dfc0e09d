"""Frame bytes -> one normalised float32 NCHW batch tensor, staged on the runner's device.

A frame whose pixels are unusable is reported as a `FrameDecodeError` beside the batch, never raised: the
other frames of the batch still run. Frames smaller than the batch shape are padded bottom/right with zeros
*in the normalised tensor* (the mean colour in pixel terms), the value the convolutions' own border padding
uses. With a fixed `input_size` each frame is resized on its own, so no padding reaches the model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
from PIL import Image

from worker.frames import Frame
from worker.runtime.decode import FrameDecodeError, decode_frame
from worker.runtime.models import ModelContract


def _resize(pixels: np.ndarray, size_hw: tuple[int, int]) -> np.ndarray:
    if pixels.shape[:2] == size_hw:
        return pixels
    img = Image.fromarray(pixels if pixels.shape[2] == 3 else pixels[:, :, 0])
    out = np.asarray(img.resize((size_hw[1], size_hw[0]), Image.Resampling.BILINEAR), dtype=np.uint8)
    return out if out.ndim == 3 else out[:, :, None]


@dataclass
class HostBatch:
    """The decodable frames of a batch as one host tensor (row i is frames[i]) plus the ones that were not."""

    frames: list[Frame]
    tensor: torch.Tensor
    failures: list[tuple[Frame, FrameDecodeError]]
    started_at: float
    preprocess_ms: float = 0.0
    # Set once the tensor is on the runner's device: the device tensor and the event its copy completes on.
    device_tensor: torch.Tensor | None = None
    ready_event: "torch.cuda.Event | None" = field(default=None, repr=False)


class Preprocessor:
    """Decodes, pads/resizes and normalises frames into an NCHW float32 tensor; thread-safe, stateless."""

    def __init__(self, contract: ModelContract, pin_memory: bool = False):
        self.contract = contract
        self.pin_memory = pin_memory
        c = contract.channels
        std = np.asarray(contract.std, dtype=np.float32).reshape(c, 1, 1)
        mean = np.asarray(contract.mean, dtype=np.float32).reshape(c, 1, 1)
        # (pixel / 255 - mean) / std  ==  pixel * scale - bias
        self._scale = (1.0 / (255.0 * std)).astype(np.float32)
        self._bias = (mean / std).astype(np.float32)

    def prepare(self, frames: Sequence[Frame], shape: tuple[int, int, int]) -> HostBatch:
        """Decode every frame; the tensor is [decodable frames, C, H, W] with H, W the model input size."""
        started_at = time.time()
        t0 = time.perf_counter()
        batch_h, batch_w = shape[0], shape[1]
        out_h, out_w = self.contract.model_input_hw((batch_h, batch_w))
        decoded: list[tuple[Frame, np.ndarray]] = []
        failures: list[tuple[Frame, FrameDecodeError]] = []
        for frame in frames:
            try:
                decoded.append((frame, self._decode_one(frame, batch_h, batch_w)))
            except FrameDecodeError as exc:
                failures.append((frame, exc))
        tensor = torch.empty(
            (len(decoded), self.contract.channels, out_h, out_w), dtype=torch.float32, pin_memory=self.pin_memory
        )
        view = tensor.numpy()
        for row, (_, pixels) in enumerate(decoded):
            self._write_row(view[row], pixels)
        return HostBatch(
            frames=[f for f, _ in decoded],
            tensor=tensor,
            failures=failures,
            started_at=started_at,
            preprocess_ms=(time.perf_counter() - t0) * 1000.0,
        )

    def _decode_one(self, frame: Frame, batch_h: int, batch_w: int) -> np.ndarray:
        pixels = decode_frame(frame, self.contract.channels)
        if self.contract.input_size is not None:
            return _resize(pixels, self.contract.input_size)
        if frame.height > batch_h or frame.width > batch_w:
            raise FrameDecodeError(
                f"frame {frame.width}x{frame.height} is larger than its batch shape {batch_w}x{batch_h}"
            )
        return pixels

    def _write_row(self, dst: np.ndarray, pixels: np.ndarray) -> None:
        h, w = pixels.shape[:2]
        region = dst[:, :h, :w]
        np.multiply(pixels.transpose(2, 0, 1), self._scale, out=region, casting="unsafe")
        np.subtract(region, self._bias, out=region)
        dst[:, h:, :] = 0.0
        dst[:, :h, w:] = 0.0


def stage_to_device(batch: HostBatch, device: torch.device, copy_stream: "torch.cuda.Stream | None") -> HostBatch:
    """Start the host->device copy of the batch on `copy_stream` (non-blocking from pinned memory).

    The runner must make its stream wait on `batch.ready_event` before reading `batch.device_tensor`.
    """
    if device.type != "cuda" or copy_stream is None:
        batch.device_tensor = batch.tensor if device.type == "cpu" else batch.tensor.to(device)
        return batch
    with torch.cuda.device(device), torch.cuda.stream(copy_stream):
        batch.device_tensor = batch.tensor.to(device, non_blocking=True)
        event = torch.cuda.Event()
        event.record(copy_stream)
    batch.ready_event = event
    return batch
