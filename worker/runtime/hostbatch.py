"""A prepared batch on the host: each model's uint8 NHWC rows (`ModelInput`, `HostBatch`), the pool of reused batch
buffers they live in (`HostBuffers`, pinned for CUDA), and their copy to the runner's device."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from worker.frames import Frame
from worker.runtime.decode import FrameDecodeError


def _no_buffer_to_return() -> None:
    pass


@dataclass
class ModelInput:
    """One model's rows of a batch: [n, H, W, C] uint8 `pixels` (H, W that model's input), a view of a reused host
    buffer (`Preprocessor`) or already on the device (`devicepath.DevicePreprocessor`); `regions` holds each row's
    (top, left, height, width) of real pixels, the rest being padding, None when every row fills the input."""

    pixels: torch.Tensor
    regions: torch.Tensor | None
    # Set once staged on the runner's device (`stage_to_device`).
    device_pixels: torch.Tensor | None = None
    device_regions: torch.Tensor | None = None


@dataclass
class HostBatch:
    """The decodable frames of a batch (row i is frames[i]), fitted to each model's input, plus the ones that were
    not decodable. `inputs[m]` is model m's (a single model is a set of one: `inputs` then has one); `pixels`,
    `regions` and their device copies are the first model's. Call `release` once the runners have read it; the
    runners wait on `ready_event` (CUDA) before reading the device tensors."""

    frames: list[Frame]
    inputs: list[ModelInput]
    failures: list[tuple[Frame, FrameDecodeError]]
    started_at: float
    preprocess_ms: float = 0.0
    preprocess_cpu_ms: float | None = None  # thread CPU of the preparation, every thread's (None: not measured)
    ready_event: torch.cuda.Event | None = field(default=None, repr=False)
    release: Callable[[], None] = field(default=_no_buffer_to_return, repr=False)

    @property
    def pixels(self) -> torch.Tensor:
        return self.inputs[0].pixels

    @property
    def regions(self) -> torch.Tensor | None:
        return self.inputs[0].regions

    @property
    def device_pixels(self) -> torch.Tensor | None:
        return self.inputs[0].device_pixels

    @property
    def device_regions(self) -> torch.Tensor | None:
        return self.inputs[0].device_regions


class HostBuffers:
    """uint8 batch buffers reused across batches (pinned when the runner is on CUDA, where allocating pinned
    memory costs more than copying into it). Thread-safe; holds at most `max_bytes` of idle buffers."""

    def __init__(self, pin_memory: bool = False, max_bytes: int = 256 << 20):
        self.pin_memory = pin_memory
        self.max_bytes = max_bytes
        self._idle: OrderedDict[tuple[int, int, int], list[torch.Tensor]] = OrderedDict()
        self._idle_bytes = 0
        self._lock = threading.Lock()

    def take(self, rows: int, hwc: tuple[int, int, int]) -> torch.Tensor:
        """A buffer of at least `rows` rows of `hwc` pixels (contents undefined)."""
        with self._lock:
            idle = self._idle.get(hwc, [])
            for i, buf in enumerate(idle):
                if buf.shape[0] >= rows:
                    del idle[i]
                    self._idle_bytes -= buf.nbytes
                    return buf
        capacity = 1 << max(0, rows - 1).bit_length()  # powers of two: few distinct buffers per shape
        return torch.empty((capacity, *hwc), dtype=torch.uint8, pin_memory=self.pin_memory)

    def give_back(self, buf: torch.Tensor) -> None:
        hwc = (int(buf.shape[1]), int(buf.shape[2]), int(buf.shape[3]))
        with self._lock:
            self._idle.setdefault(hwc, []).append(buf)
            self._idle.move_to_end(hwc)
            self._idle_bytes += buf.nbytes
            while self._idle_bytes > self.max_bytes:  # drop the least recently used shape's buffers first
                oldest = next(iter(self._idle.values()))
                self._idle_bytes -= oldest.pop(0).nbytes
                if not oldest:
                    self._idle.popitem(last=False)


def compact(buffer: torch.Tensor, kept: list[int]) -> torch.Tensor:
    """The `kept` rows moved to the front, in order, in place (a pinned buffer stays pinned); a view of them."""
    for row, i in enumerate(kept):
        if row != i:
            buffer[row].copy_(buffer[i])
    return buffer[:len(kept)]


def stage_to_device(batch: HostBatch, device: torch.device, copy_stream: torch.cuda.Stream | None) -> HostBatch:
    """Start the host->device copy of every model's uint8 pixels on `copy_stream` (non-blocking from pinned memory).

    The runners must make their streams wait on `batch.ready_event` before reading the device tensors.
    """
    if device.type != "cuda" or copy_stream is None:
        for x in batch.inputs:
            x.device_pixels = x.pixels.to(device)
            x.device_regions = None if x.regions is None else x.regions.to(device)
        return batch
    with torch.cuda.device(device), torch.cuda.stream(copy_stream):
        for x in batch.inputs:
            x.device_pixels = x.pixels.to(device, non_blocking=True)
            # regions are a few bytes in pageable memory: this copy is synchronous, and done before the event.
            x.device_regions = None if x.regions is None else x.regions.to(device, non_blocking=True)
        event = torch.cuda.Event()
        event.record(copy_stream)
    batch.ready_event = event
    return batch
