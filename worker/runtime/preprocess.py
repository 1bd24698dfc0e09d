"""Frame bytes -> one normalised float32 batch tensor in the model's layout (NCHW or NHWC), staged on the
runner's device. The model's preprocessing contract (`ModelContract`) is applied here and nowhere else.

A frame whose pixels are unusable is reported as a `FrameDecodeError` beside the batch, never raised: the
other frames of the batch still run. Frames smaller than the batch shape are padded bottom/right with zeros
*in the normalised tensor* (the mean colour in pixel terms), the value the convolutions' own border padding
uses. With a fixed `input_size` each frame is resized (stretched, letterboxed or resized and centre-cropped)
on its own, so no batch padding reaches the model.
"""

from __future__ import annotations

import concurrent.futures
import io
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image

from worker.frames import Encoding, Frame
from worker.runtime.decode import FrameDecodeError, decode_frame
from worker.runtime.models import ModelContract


def _resize(pixels: np.ndarray, size_hw: tuple[int, int]) -> np.ndarray:
    """Bilinear resize with Pillow (antialiased when shrinking), the resampling reference preprocessing uses."""
    if pixels.shape[:2] == size_hw:
        return pixels
    out = np.asarray(_image(pixels).resize((size_hw[1], size_hw[0]), Image.Resampling.BILINEAR), dtype=np.uint8)
    return out if out.ndim == 3 else out[:, :, None]


def _image(pixels: np.ndarray) -> Image.Image:
    return Image.fromarray(pixels if pixels.shape[2] == 3 else pixels[:, :, 0])


def _centre_crop(pixels: np.ndarray, size_hw: tuple[int, int]) -> np.ndarray:
    h, w = pixels.shape[:2]
    top, left = (h - size_hw[0]) // 2, (w - size_hw[1]) // 2
    return pixels[top:top + size_hw[0], left:left + size_hw[1]]


def to_channels(pixels: np.ndarray, channels: int) -> np.ndarray:
    """Grey, grey+alpha, RGB or RGBA pixels -> `channels` (3: RGB, 1: grey); alpha is dropped."""
    c = pixels.shape[2]
    if c == channels:
        return pixels
    if c not in (1, 2, 3, 4):
        raise FrameDecodeError(f"frame has {c} channels; the worker reads 1 (grey), 2 (grey+alpha), 3 (RGB) or 4 "
                               "(RGBA)")
    if c in (1, 2):
        grey = pixels[:, :, :1]
        return grey if channels == 1 else np.ascontiguousarray(np.repeat(grey, 3, axis=2))
    rgb = np.ascontiguousarray(pixels[:, :, :3])
    if channels == 3:
        return rgb
    return np.asarray(Image.fromarray(rgb, "RGB").convert("L"), dtype=np.uint8)[:, :, None]


def resize_target(contract: ModelContract, frame_hw: tuple[int, int]) -> tuple[int, int] | None:
    """The (height, width) a frame of `frame_hw` is resized to before any crop; None when the model takes any
    size. Computed from the frame's declared size, so a JPEG decoded at a reduced scale lands on the same one."""
    size = contract.input_size
    if size is None:
        return None
    h, w = frame_hw
    if contract.resize == "letterbox":
        scale = min(size[0] / h, size[1] / w)
        return max(1, min(size[0], round(h * scale))), max(1, min(size[1], round(w * scale)))
    if contract.resize == "shorter_side_crop":
        scale = contract.resize_shorter_side / min(h, w)
        return max(size[0], round(h * scale)), max(size[1], round(w * scale))
    if contract.resize == "stretch_crop" and contract.resize_to is not None:
        return contract.resize_to
    return size


def fit_to_input(pixels: np.ndarray, contract: ModelContract,
                 frame_hw: tuple[int, int] | None = None) -> tuple[np.ndarray, tuple[int, int]]:
    """Resize (and crop) a decoded frame as the contract says; returns the pixels and their (top, left) offset
    in the model input (non-zero only for letterbox, whose border stays at the mean colour). `frame_hw` is the
    frame's full size when `pixels` were decoded at a reduced scale."""
    size = contract.input_size
    target = resize_target(contract, frame_hw or (pixels.shape[0], pixels.shape[1]))
    if size is None or target is None:
        return pixels, (0, 0)
    resized = _resize(pixels, target)
    if contract.resize == "letterbox":
        return resized, ((size[0] - target[0]) // 2, (size[1] - target[1]) // 2)
    if contract.resize in ("shorter_side_crop", "stretch_crop"):
        return _centre_crop(resized, size), (0, 0)
    return resized, (0, 0)


def jpeg_roundtrip(pixels: np.ndarray, quality: int) -> np.ndarray:
    """Encode and decode as JPEG, as a reference preprocessing that does so (open_nsfw's) would."""
    buf = io.BytesIO()
    _image(pixels).save(buf, format="JPEG", quality=quality)
    buf.seek(0)
    with Image.open(buf) as img:
        out = np.asarray(img, dtype=np.uint8)
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
    ready_event: torch.cuda.Event | None = field(default=None, repr=False)


class Preprocessor:
    """Decodes, resizes and normalises frames into one float32 batch in the model's layout; thread-safe, stateless.

    The whole preprocessing contract (channels, order, scale, mean/std, resize, layout) is applied here, on
    the host, for every device: the runners receive the finished tensor. With a `pool` of `workers` threads
    the frames of one batch are decoded in parallel (JPEG decode and resizing release the GIL); `prepare`
    must then not itself run on that pool, or it could wait on work queued behind it.
    """

    def __init__(self, contract: ModelContract, pin_memory: bool = False,
                 pool: concurrent.futures.Executor | None = None, workers: int = 1):
        self.contract = contract
        self.pin_memory = pin_memory
        self._pool = pool if workers > 1 else None
        self._workers = workers
        c = contract.channels
        std = np.asarray(contract.std, dtype=np.float32).reshape(c, 1, 1)
        mean = np.asarray(contract.mean, dtype=np.float32).reshape(c, 1, 1)
        unit = 1.0 / 255.0 if contract.pixel_range == "0-1" else 1.0
        # (pixel * unit - mean) / std  ==  pixel * scale - bias
        self._scale = (unit / std).astype(np.float32)
        self._bias = (mean / std).astype(np.float32)
        self._bgr = contract.channel_order == "BGR" and c == 3
        self._nhwc = contract.input_layout == "NHWC"

    def prepare(self, frames: Sequence[Frame], shape: tuple[int, int, int]) -> HostBatch:
        """Decode every frame; the tensor is [decodable frames, *input_shape] with H, W the model input size."""
        started_at = time.time()
        t0 = time.perf_counter()
        frames = list(frames)
        out_hw = self.contract.model_input_hw((shape[0], shape[1]))
        tensor = torch.empty(
            (len(frames), *self.contract.input_shape(out_hw)), dtype=torch.float32, pin_memory=self.pin_memory
        )
        errors = self._fill(tensor.numpy(), frames, (shape[0], shape[1]))
        failures = [(frame, exc) for frame, exc in zip(frames, errors) if exc is not None]
        if failures:
            tensor = _compact(tensor, [exc is None for exc in errors])
        return HostBatch(
            frames=[frame for frame, exc in zip(frames, errors) if exc is None],
            tensor=tensor,
            failures=failures,
            started_at=started_at,
            preprocess_ms=(time.perf_counter() - t0) * 1000.0,
        )

    def _fill(self, rows: np.ndarray, frames: list[Frame], batch_hw: tuple[int, int]) -> list[FrameDecodeError | None]:
        """Decode frame i into rows[i], in contiguous chunks across the pool; the error of each frame, or None."""
        chunks = min(len(frames), self._workers) if self._pool is not None else 1
        if chunks <= 1:
            return self._fill_range(rows, frames, batch_hw, 0, len(frames))
        bounds = [len(frames) * k // chunks for k in range(chunks + 1)]
        assert self._pool is not None
        futures = [self._pool.submit(self._fill_range, rows, frames, batch_hw, lo, hi)
                   for lo, hi in zip(bounds, bounds[1:])]
        return [err for f in futures for err in f.result()]

    def _fill_range(self, rows: np.ndarray, frames: list[Frame], batch_hw: tuple[int, int], lo: int,
                    hi: int) -> list[FrameDecodeError | None]:
        errors: list[FrameDecodeError | None] = []
        for i in range(lo, hi):
            try:
                pixels, offset = self._decode_one(frames[i], *batch_hw)
            except FrameDecodeError as exc:
                errors.append(exc)
                continue
            self._write_row(rows[i], pixels, offset)
            errors.append(None)
        return errors

    def _decode_one(self, frame: Frame, batch_h: int, batch_w: int) -> tuple[np.ndarray, tuple[int, int]]:
        # A raw frame decodes with its own channel count and is converted here; a JPEG decodes to the model's.
        channels = frame.channels if frame.encoding is Encoding.RAW_RGB8 else self.contract.channels
        if self.contract.input_size is None and (frame.height > batch_h or frame.width > batch_w):
            raise FrameDecodeError(
                f"frame {frame.width}x{frame.height} is larger than its batch shape {batch_w}x{batch_h}"
            )
        frame_hw = (frame.height, frame.width)
        # A JPEG bound for a smaller fixed input is decoded at the smallest DCT scale still >= the resize target.
        pixels = decode_frame(frame, channels, min_hw=resize_target(self.contract, frame_hw))
        pixels, offset = fit_to_input(to_channels(pixels, self.contract.channels), self.contract, frame_hw)
        if self.contract.jpeg_roundtrip_quality:
            pixels = jpeg_roundtrip(pixels, self.contract.jpeg_roundtrip_quality)
        return pixels, offset

    def _write_row(self, dst: np.ndarray, pixels: np.ndarray, offset: tuple[int, int]) -> None:
        chw = dst.transpose(2, 0, 1) if self._nhwc else dst  # a view: writing it fills dst in its own layout
        h, w = pixels.shape[:2]
        top, left = offset
        if (h, w) != chw.shape[1:]:
            chw.fill(0.0)  # padding / letterbox border: the mean colour
        region = chw[:, top:top + h, left:left + w]
        src = pixels.transpose(2, 0, 1)
        np.multiply(src[::-1] if self._bgr else src, self._scale, out=region, casting="unsafe")
        np.subtract(region, self._bias, out=region)


def _compact(tensor: torch.Tensor, keep: list[bool]) -> torch.Tensor:
    """The kept rows moved to the front, in order, in place (so a pinned buffer stays pinned); a view of them."""
    kept = [i for i, k in enumerate(keep) if k]
    for row, i in enumerate(kept):
        if row != i:
            tensor[row].copy_(tensor[i])
    return tensor[:len(kept)]


def stage_to_device(batch: HostBatch, device: torch.device, copy_stream: torch.cuda.Stream | None) -> HostBatch:
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
