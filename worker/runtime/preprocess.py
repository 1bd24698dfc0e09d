"""Frame bytes -> one normalised float32 batch tensor in the model's layout (NCHW or NHWC) on the runner's
device. The model's preprocessing contract (`ModelContract`) is applied here and nowhere else.

A frame whose pixels are unusable is reported as a `FrameDecodeError` beside the batch, never raised: the
other frames of the batch still run. Frames smaller than the batch shape are padded bottom/right with zeros
*in the normalised tensor* (the mean colour in pixel terms), the value the convolutions' own border padding
uses. With a fixed `input_size` each frame is resized (stretched, letterboxed or resized and centre-cropped)
on its own, so no batch padding reaches the model.

Two halves: `Preprocessor` (host threads, here) decodes and fits each frame (`fitting`, `resample`) into a uint8
NHWC batch in a reused buffer (`hostbatch`), which travels to the device as uint8 (a quarter of float32's bytes);
`normalise.Normaliser` (torch, on the runner's device, inside its CUDA graph where it captures one) turns it into
the model's input.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import numpy as np
import torch

from worker.frames import Encoding, Frame
from worker.runtime.decode import FrameDecodeError, decode_pixels
from worker.runtime.fitting import check_fits_batch, fit_to_input, jpeg_roundtrip, resize_target, to_channels
from worker.runtime.hostbatch import HostBatch, HostBuffers, ModelInput, compact
from worker.runtime.models import ModelContract
from worker.runtime.resample import opencv

T = TypeVar("T")


class Preprocessor:
    """Decodes each frame of a batch once and fits it to every model's input (one contract, or a set's), into one
    uint8 NHWC host batch per model; thread-safe.

    Channels, resize, crop and letterbox are applied here (the `Normaliser` does the rest, on the device). A JPEG
    is decoded to the most channels any model takes, at a reduced scale only when every model allows it and at
    the largest scale any needs. With a `pool` of `workers` threads the frames of one batch are decoded in parallel
    (JPEG decode and resizing release the GIL); `prepare` must then not itself run on that pool, or it could wait
    on work queued behind it.
    """

    def __init__(self, contracts: ModelContract | Sequence[ModelContract], buffers: HostBuffers | None = None,
                 pool: concurrent.futures.Executor | None = None, workers: int = 1):
        self.contracts = (contracts,) if isinstance(contracts, ModelContract) else tuple(contracts)
        self.contract = self.contracts[0]
        self.buffers = buffers or HostBuffers()
        self._pool = pool if workers > 1 else None
        self._workers = workers
        self._jpeg_channels = max(c.channels for c in self.contracts)
        self._scaled_decode = all(c.jpeg_scaled_decode for c in self.contracts)
        if any(c.resampler == "opencv" for c in self.contracts):
            opencv()  # at start: a ConfigError if cv2 is missing, and cv2's threads set once

    def prepare(self, frames: Sequence[Frame], shape: tuple[int, int, int]) -> HostBatch:
        """Decode every frame; model m's pixels are [decodable frames, H, W, C] with H, W its input size."""
        started_at = time.time()
        t0, cpu0 = time.perf_counter(), time.thread_time()
        frames = list(frames)
        batch_hw = (shape[0], shape[1])
        shapes = [(*c.model_input_hw(batch_hw), c.channels) for c in self.contracts]
        buffers = [self.buffers.take(len(frames), hwc) for hwc in shapes]
        placed, pool_cpu_s = self._fill([b.numpy() for b in buffers], frames, batch_hw)
        kept = [i for i, p in enumerate(placed) if not isinstance(p, FrameDecodeError)]
        inputs = []
        for m, (buffer, hwc) in enumerate(zip(buffers, shapes, strict=True)):
            regions = [cast(list, placed[i])[m] for i in kept]
            full = (0, 0, hwc[0], hwc[1])
            inputs.append(ModelInput(
                pixels=compact(buffer, kept) if len(kept) < len(frames) else buffer[:len(frames)],
                regions=None if all(r == full for r in regions) else torch.tensor(regions, dtype=torch.int32)))

        def release() -> None:
            for buffer in buffers:
                self.buffers.give_back(buffer)

        return HostBatch(
            frames=[frames[i] for i in kept],
            inputs=inputs,
            failures=[(frame, p) for frame, p in zip(frames, placed) if isinstance(p, FrameDecodeError)],
            started_at=started_at,
            preprocess_ms=(time.perf_counter() - t0) * 1000.0,
            preprocess_cpu_ms=(time.thread_time() - cpu0 + pool_cpu_s) * 1000.0,
            release=release,
        )

    def _fill(self, rows: list[np.ndarray], frames: list[Frame], batch_hw: tuple[int, int]
              ) -> tuple[list[list[tuple[int, int, int, int]] | FrameDecodeError], float]:
        """Decode frame i into row i of every model's buffer, in contiguous chunks across the pool; each frame's
        regions (one per model) or its error, and the pool threads' CPU seconds for it (0 on the calling thread,
        which measures its own)."""
        chunks = min(len(frames), self._workers) if self._pool is not None else 1
        if chunks <= 1:
            return self._fill_range(rows, frames, batch_hw, 0, len(frames)), 0.0
        bounds = [len(frames) * k // chunks for k in range(chunks + 1)]
        assert self._pool is not None
        futures = [self._pool.submit(_thread_cpu, self._fill_range, rows, frames, batch_hw, lo, hi)
                   for lo, hi in zip(bounds, bounds[1:])]
        done = [f.result() for f in futures]
        return [placed for chunk, _ in done for placed in chunk], sum(cpu for _, cpu in done)

    def _fill_range(self, rows: list[np.ndarray], frames: list[Frame], batch_hw: tuple[int, int], lo: int,
                    hi: int) -> list[list[tuple[int, int, int, int]] | FrameDecodeError]:
        placed: list[list[tuple[int, int, int, int]] | FrameDecodeError] = []
        for i in range(lo, hi):
            try:
                decoded = self._decode_one(frames[i], batch_hw, rows[0][i] if len(rows) == 1 else None)
                placed.append([_place(self._fit(decoded, c, frames[i], model_rows[i]), model_rows[i])
                               for c, model_rows in zip(self.contracts, rows, strict=True)])
            except FrameDecodeError as exc:
                placed.append(exc)
        return placed

    def _decode_one(self, frame: Frame, batch_hw: tuple[int, int], out: np.ndarray | None) -> np.ndarray:
        """The frame's pixels, decoded once for every model (into `out`, a batch row, where they fit it)."""
        for c in self.contracts:
            check_fits_batch(c, frame, batch_hw)
        # A raw frame decodes with its own channel count and is converted per model; a JPEG decodes to the models'.
        channels = frame.channels if frame.encoding is Encoding.RAW_RGB8 else self._jpeg_channels
        # A JPEG bound for smaller fixed inputs is decoded at the smallest DCT scale still >= every resize target.
        min_hw = None
        if self._scaled_decode:
            targets = [resize_target(c, (frame.height, frame.width)) for c in self.contracts]
            if all(t is not None for t in targets):
                min_hw = (max(cast(tuple, t)[0] for t in targets), max(cast(tuple, t)[1] for t in targets))
        return decode_pixels(frame, channels, min_hw=min_hw, out=out)

    @staticmethod
    def _fit(decoded: np.ndarray, contract: ModelContract, frame: Frame,
             out: np.ndarray | None = None) -> tuple[np.ndarray, tuple[int, int]]:
        """The decoded pixels fitted to one model's input (a stretch resized straight into `out`, its batch row),
        and their (top, left) offset in it."""
        pixels, offset = fit_to_input(to_channels(decoded, contract.channels), contract, (frame.height, frame.width),
                                      out)
        if contract.jpeg_roundtrip_quality:
            pixels = jpeg_roundtrip(pixels, contract.jpeg_roundtrip_quality)
        return pixels, offset


def _thread_cpu(fn: Callable[..., T], *args: Any) -> tuple[T, float]:
    """fn(*args) and the CPU seconds the calling (pool) thread spent on it."""
    cpu0 = time.thread_time()
    result = fn(*args)
    return result, time.thread_time() - cpu0


def _place(fitted: tuple[np.ndarray, tuple[int, int]], dst: np.ndarray) -> tuple[int, int, int, int]:
    """Write a frame's fitted pixels into its batch row (unless they are that row already); their region."""
    pixels, (top, left) = fitted
    h, w = pixels.shape[:2]
    if pixels is not dst:
        if (h, w) != dst.shape[:2]:
            dst.fill(0)  # never read (the Normaliser zeroes padding), but a reused buffer holds old frames
        dst[top:top + h, left:left + w] = pixels
    return top, left, h, w
