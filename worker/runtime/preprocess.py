"""Frame bytes -> one normalised float32 batch tensor in the model's layout (NCHW or NHWC) on the runner's
device. The model's preprocessing contract (`ModelContract`) is applied here and nowhere else.

A frame whose pixels are unusable is reported as a `FrameDecodeError` beside the batch, never raised: the
other frames of the batch still run. Frames smaller than the batch shape are padded bottom/right with zeros
*in the normalised tensor* (the mean colour in pixel terms), the value the convolutions' own border padding
uses. With a fixed `input_size` each frame is resized (stretched, letterboxed or resized and centre-cropped)
on its own, so no batch padding reaches the model.

Two halves: `Preprocessor` (host threads) decodes and resizes into a uint8 NHWC batch in a reused buffer,
which travels to the device as uint8 (a quarter of float32's bytes); `Normaliser` (torch, on the runner's
device, inside its CUDA graph where it captures one) turns it into the model's input.
"""

from __future__ import annotations

import concurrent.futures
import functools
import io
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch
from PIL import Image

from worker.frames import Encoding, Frame
from worker.runtime.decode import FrameDecodeError, decode_pixels, fitting_row
from worker.runtime.models import ModelContract


def _resize(pixels: np.ndarray, size_hw: tuple[int, int], resampler: str = "torch",
            out: np.ndarray | None = None) -> np.ndarray:
    """Bilinear resize, antialiased when shrinking: Pillow's (what reference preprocessing uses), or torch's uint8
    kernel at about a quarter of its cost here. Both round after each pass, so each is within one grey level of the
    exact filter; the two differ by two at rare pixels (1 in 10^7 on noise), by one at 6%.

    torch and opencv write into `out` when it is a C-contiguous (height, width, channels) uint8 array of the target
    size (a batch row: no copy afterwards), else into a new one; Pillow always returns a new array."""
    if pixels.shape[:2] == size_hw:
        return pixels
    if resampler == "opencv":
        return _resize_like_opencv(pixels, size_hw, out)
    if resampler == "torch":
        # torch wants writable memory (a raw frame is a read-only view of its message): copied then, only read.
        x = torch.from_numpy(pixels if pixels.flags.writeable else pixels.copy()).permute(2, 0, 1).unsqueeze(0)
        hwc = (*size_hw, pixels.shape[2])
        out = fitting_row(out, hwc)
        if out is None:
            out = np.empty(hwc, dtype=np.uint8)
        # F.interpolate returns contiguous NCHW whatever the input's layout, and copying that into an HWC row is a
        # transposing copy that cost as much as the resize itself (0.12-0.3 ms per 224x224 frame here). The same
        # kernel's out= form writes HWC (channels_last) memory directly, with the same values.
        torch.ops.aten._upsample_bilinear2d_aa.out(x, list(size_hw), False, None, None,
                                                   out=torch.from_numpy(out).permute(2, 0, 1).unsqueeze(0))
        return out
    out = np.asarray(_image(pixels).resize((size_hw[1], size_hw[0]), Image.Resampling.BILINEAR), dtype=np.uint8)
    return out if out.ndim == 3 else out[:, :, None]


def _opencv_taps(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """cv2.resize INTER_LINEAR's source indices and 11-bit fixed-point weights along one axis."""
    pos = (np.arange(n_out) + 0.5) * (n_in / n_out) - 0.5
    i0 = np.floor(pos).astype(np.int64)
    frac = pos - i0
    low, high = i0 < 0, i0 >= n_in - 1
    frac[low | high] = 0.0
    i0 = np.clip(i0, 0, n_in - 1)
    w1 = np.round(frac * 2048).astype(np.int32)
    w0 = np.round((1.0 - frac) * 2048).astype(np.int32)
    return i0, np.minimum(i0 + 1, n_in - 1), w0, w1


@dataclass(frozen=True)
class _OpencvPlan:
    """One (source shape, canvas, target size)'s taps for `_resize_like_opencv`, laid out for its passes: the
    source rows any output row reads (`rows`, None for all) and, per output row, its two among them with their
    weights; per output value of a row (pixel x channel), its two source values in the flattened row with their
    weights. A tap on the canvas's zero padding has weight 0 (and any real index): it adds 0, as the zeros did."""

    rows: np.ndarray | None
    y0: np.ndarray
    y1: np.ndarray
    wy0: np.ndarray
    wy1: np.ndarray
    x0: np.ndarray
    x1: np.ndarray
    wx0: np.ndarray
    wx1: np.ndarray


def _real_taps(n_real: int, n_canvas: int, n_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`_opencv_taps` over a canvas of `n_canvas` whose values from `n_real` on are zero: those taps weigh 0."""
    i0, i1, w0, w1 = _opencv_taps(n_canvas, n_out)
    pad0, pad1 = i0 >= n_real, i1 >= n_real
    return np.where(pad0, 0, i0), np.where(pad1, 0, i1), np.where(pad0, 0, w0), np.where(pad1, 0, w1)


@functools.lru_cache(maxsize=64)
def _opencv_plan(height: int, width: int, channels: int, size_hw: tuple[int, int],
                 canvas_hw: tuple[int, int]) -> _OpencvPlan:
    x0, x1, ax0, ax1 = _real_taps(width, canvas_hw[1], size_hw[1])
    y0, y1, by0, by1 = _real_taps(height, canvas_hw[0], size_hw[0])
    used, where = np.unique(np.concatenate([y0, y1]), return_inverse=True)
    channel = np.arange(channels)
    plan = _OpencvPlan(
        rows=None if len(used) == height else used, y0=where[:size_hw[0]], y1=where[size_hw[0]:],
        wy0=by0[:, None], wy1=by1[:, None],
        x0=(x0[:, None] * channels + channel).ravel(), x1=(x1[:, None] * channels + channel).ravel(),
        wx0=np.repeat(ax0, channels), wx1=np.repeat(ax1, channels))
    for a in vars(plan).values():
        if a is not None:
            a.flags.writeable = False  # shared by every thread that resizes this shape
    return plan


def _resize_like_opencv(pixels: np.ndarray, size_hw: tuple[int, int], out: np.ndarray | None = None,
                        canvas_hw: tuple[int, int] | None = None) -> np.ndarray:
    """Bilinear without antialiasing in OpenCV's cv2.resize INTER_LINEAR arithmetic on uint8 (its vectorised fixed
    point: 11-bit weights, a horizontal pass kept in 16 bits, then a vertical one), which references built on cv2
    (cv2.dnn.blobFromImage: NudeNet's) use. A grey level off here moved NudeNet's scores by up to 0.013. Against
    cv2 5.1 it is equal when shrinking; when enlarging, about 0.1% of pixels differ by one grey level (seen at
    224 and 100 -> 320; not explained yet). With `canvas_hw`, the pixels padded bottom/right with zeros to that
    size are resized, without making the canvas (pad_stretch).

    In numpy, in int32 on only what is read: the uint8 values each output pixel needs gathered once per pass from the
    source rows some output row uses, the taps cached per shape, into the calling thread's scratch arrays (fresh ones
    cost page faults: twice the time); written into `out` when it is a C-contiguous uint8 array of the target size
    (a batch row). For 224x224 -> 320x320, 0.92 CPU-ms against 4.0 before (2.0 with warm allocations)."""
    h, w, c = pixels.shape
    oh, ow = size_hw
    plan = _opencv_plan(h, w, c, (oh, ow), canvas_hw or (h, w))
    src = pixels.reshape(h, w * c)
    if plan.rows is not None:
        src = np.take(src, plan.rows, axis=0, out=_scratch("src", (len(plan.rows), w * c), np.uint8), mode="clip")
    n = src.shape[0]
    # (mode="clip": the indices are in range, and take's default mode copies through a temporary for out=.)
    # Horizontal: a*w0 + b*w1 < 2^20, >> 4 leaves at most 32640 (cv2's int16 buffer row).
    gathered = _scratch("gathered", (n, ow * c), np.uint8)
    rows, right = _scratch("rows", (n, ow * c), np.int32), _scratch("right", (n, ow * c), np.int32)
    np.copyto(rows, np.take(src, plan.x0, axis=1, out=gathered, mode="clip"))
    rows *= plan.wx0
    np.copyto(right, np.take(src, plan.x1, axis=1, out=gathered, mode="clip"))
    right *= plan.wx1
    rows += right
    rows >>= 4
    # Vertical: each product < 2^26, shifted on its own as cv2's 16-bit multiply-high does; the sum is at most 1020.
    top = np.take(rows, plan.y0, axis=0, out=_scratch("top", (oh, ow * c), np.int32), mode="clip")
    top *= plan.wy0
    top >>= 16
    bottom = np.take(rows, plan.y1, axis=0, out=_scratch("bottom", (oh, ow * c), np.int32), mode="clip")
    bottom *= plan.wy1
    bottom >>= 16
    top += bottom
    top += 2
    top >>= 2
    hwc = (oh, ow, c)
    out = fitting_row(out, hwc)
    if out is None:
        out = np.empty(hwc, dtype=np.uint8)
    np.copyto(out.reshape(oh, ow * c), top, casting="unsafe")  # 0..255: exact
    return out


_SCRATCH = threading.local()


def _scratch(name: str, shape: tuple[int, int], dtype: type[np.generic]) -> np.ndarray:
    """A `shape` array of `dtype` (contents undefined) kept by the calling thread under `name` for its next call:
    each preprocessing thread holds one per name, as large as the largest asked (4.4 MB in all for 320x320 RGB)."""
    size = shape[0] * shape[1]
    buf = getattr(_SCRATCH, name, None)
    if buf is None or buf.size < size or buf.dtype != dtype:
        buf = np.empty(size, dtype=dtype)
        setattr(_SCRATCH, name, buf)
    return buf[:size].reshape(shape)


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
    if contract.resize == "pad_stretch":
        # The frame padded to the input's aspect ratio, then stretched: its own pixels end up scale x its size.
        scale = min(size[0] / h, size[1] / w)
        return max(1, min(size[0], round(h * scale))), max(1, min(size[1], round(w * scale)))
    return size


def padded_hw(frame_hw: tuple[int, int], size_hw: tuple[int, int]) -> tuple[int, int]:
    """The smallest canvas holding a frame of `frame_hw` with `size_hw`'s aspect ratio (pad_stretch)."""
    h, w = frame_hw
    scale = min(size_hw[0] / h, size_hw[1] / w)
    return max(h, round(size_hw[0] / scale)), max(w, round(size_hw[1] / scale))


def pad_to_aspect(pixels: np.ndarray, size_hw: tuple[int, int]) -> np.ndarray:
    """The pixels padded bottom/right with black to `size_hw`'s aspect ratio (the smallest such canvas)."""
    h, w = pixels.shape[:2]
    ph, pw = padded_hw((h, w), size_hw)
    if (ph, pw) == (h, w):
        return pixels
    canvas = np.zeros((ph, pw, pixels.shape[2]), dtype=np.uint8)
    canvas[:h, :w] = pixels
    return canvas


def check_fits_batch(contract: ModelContract, frame: Frame, batch_hw: tuple[int, int]) -> None:
    """A model that takes any size gets the frame padded to its batch's shape: FrameDecodeError if it is larger."""
    if contract.input_size is None and (frame.height > batch_hw[0] or frame.width > batch_hw[1]):
        raise FrameDecodeError(
            f"frame {frame.width}x{frame.height} is larger than its batch shape {batch_hw[1]}x{batch_hw[0]}")


def fit_to_input(pixels: np.ndarray, contract: ModelContract, frame_hw: tuple[int, int] | None = None,
                 out: np.ndarray | None = None) -> tuple[np.ndarray, tuple[int, int]]:
    """Resize (and crop) a decoded frame as the contract says; returns the pixels and their (top, left) offset
    in the model input (non-zero only for letterbox, whose border stays at the mean colour). `frame_hw` is the
    frame's full size when `pixels` were decoded at a reduced scale. A stretch or pad_stretch resize may be written
    into `out` (the frame's batch row), which is then what is returned."""
    size = contract.input_size
    target = resize_target(contract, frame_hw or (pixels.shape[0], pixels.shape[1]))
    if size is None or target is None:
        return pixels, (0, 0)
    if contract.resize == "pad_stretch":
        # Padded before the resize, as the reference does, so the border row blends image and black as there; the
        # opencv resampler reads the padding as zeros without the canvas (1280x1280 for a 720p frame).
        canvas = padded_hw((pixels.shape[0], pixels.shape[1]), size)
        if contract.resampler == "opencv" and canvas != size:
            return _resize_like_opencv(pixels, size, out, canvas), (0, 0)
        return _resize(pad_to_aspect(pixels, size), size, contract.resampler, out), (0, 0)
    resized = _resize(pixels, target, contract.resampler, out if contract.resize == "stretch" else None)
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

    def prepare(self, frames: Sequence[Frame], shape: tuple[int, int, int]) -> HostBatch:
        """Decode every frame; model m's pixels are [decodable frames, H, W, C] with H, W its input size."""
        started_at = time.time()
        t0 = time.perf_counter()
        frames = list(frames)
        batch_hw = (shape[0], shape[1])
        shapes = [(*c.model_input_hw(batch_hw), c.channels) for c in self.contracts]
        buffers = [self.buffers.take(len(frames), hwc) for hwc in shapes]
        placed = self._fill([b.numpy() for b in buffers], frames, batch_hw)
        kept = [i for i, p in enumerate(placed) if not isinstance(p, FrameDecodeError)]
        inputs = []
        for m, (buffer, hwc) in enumerate(zip(buffers, shapes, strict=True)):
            regions = [cast(list, placed[i])[m] for i in kept]
            full = (0, 0, hwc[0], hwc[1])
            inputs.append(ModelInput(
                pixels=_compact(buffer, kept) if len(kept) < len(frames) else buffer[:len(frames)],
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
            release=release,
        )

    def _fill(self, rows: list[np.ndarray], frames: list[Frame], batch_hw: tuple[int, int]
              ) -> list[list[tuple[int, int, int, int]] | FrameDecodeError]:
        """Decode frame i into row i of every model's buffer, in contiguous chunks across the pool; each frame's
        regions (one per model) or its error."""
        chunks = min(len(frames), self._workers) if self._pool is not None else 1
        if chunks <= 1:
            return self._fill_range(rows, frames, batch_hw, 0, len(frames))
        bounds = [len(frames) * k // chunks for k in range(chunks + 1)]
        assert self._pool is not None
        futures = [self._pool.submit(self._fill_range, rows, frames, batch_hw, lo, hi)
                   for lo, hi in zip(bounds, bounds[1:])]
        return [placed for f in futures for placed in f.result()]

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


def _place(fitted: tuple[np.ndarray, tuple[int, int]], dst: np.ndarray) -> tuple[int, int, int, int]:
    """Write a frame's fitted pixels into its batch row (unless they are that row already); their region."""
    pixels, (top, left) = fitted
    h, w = pixels.shape[:2]
    if pixels is not dst:
        if (h, w) != dst.shape[:2]:
            dst.fill(0)  # never read (the Normaliser zeroes padding), but a reused buffer holds old frames
        dst[top:top + h, left:left + w] = pixels
    return top, left, h, w


# The largest float batch a CPU runner's Normaliser keeps between batches (a larger one is allocated per batch).
REUSED_INPUT_MAX_BYTES = 256 << 20


class Normaliser:
    """uint8 NHWC pixels -> the model's float32 input (channel order, scale, mean/std, layout), in torch on the
    pixels' device; zero outside each row's region. Computes pixel * (unit / std) - mean / std in float32,
    the same two roundings the reference preprocessing makes. Build one per device before any graph capture.

    The arithmetic runs on the contiguous NHWC tensor, each image row as one vector with scale and bias tiled
    along it: on CPU a per-channel broadcast over an innermost dimension of 3, or a strided NHWC -> NCHW copy,
    costs two to four times as much. An NCHW model therefore gets an NCHW-shaped tensor in channels_last memory
    format (torch.channels_last: the layout convolutions prefer on CPU and GPU); `validate_output` feeds the
    same at load, so a model that needs contiguous NCHW memory fails there, not on the first batch."""

    def __init__(self, contract: ModelContract, device: torch.device | str = "cpu"):
        c = contract.channels
        unit = 1.0 / 255.0 if contract.pixel_range == "0-1" else 1.0
        std = np.asarray(contract.std, dtype=np.float32)
        mean = np.asarray(contract.mean, dtype=np.float32)
        self._nchw = contract.input_layout == "NCHW"
        # (pixel * unit - mean) / std  ==  pixel * scale - bias, with scale and bias rounded to float32 once.
        self._scale = torch.from_numpy((unit / std).astype(np.float32)).to(device)
        self._bias = torch.from_numpy((mean / std).astype(np.float32)).to(device)
        self._bgr = contract.channel_order == "BGR" and c == 3
        self._rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # width -> scale and bias tiled along a row
        # On a CPU, the float batch is written into one buffer kept from batch to batch (see _output).
        self._reuse = torch.device(device).type == "cpu"
        self._buffer: torch.Tensor | None = None

    def __call__(self, pixels: torch.Tensor, regions: torch.Tensor | None = None) -> torch.Tensor:
        n, h, w, c = pixels.shape
        out = self._output((n, h, w, c), pixels.device)
        if self._bgr:
            for i in range(3):  # channel by channel: half the cost of pixels.flip(-1) on CPU
                out[..., i].copy_(pixels[..., 2 - i])
        else:
            out.copy_(pixels)
        scale, bias = self._tiled(w)
        rows = out.view(n * h, w * c)
        rows.mul_(scale).sub_(bias)
        if regions is not None:
            # A region is a rectangle: multiply the image rows by 1 inside it and 0 outside, then the columns
            # (each widened to its c values first: a broadcast over an innermost dimension of c is slow); adding
            # 0.0 turns the -0.0 of negative values times 0 into 0.0 and changes nothing else. Four times
            # cheaper on CPU than masked_fill_.
            rows_in, cols_in = _inside(regions, h, w)
            image = out.view(n, h, w * c)
            image.mul_(rows_in.to(out.dtype).unsqueeze(2))
            image.mul_(cols_in.to(out.dtype).unsqueeze(2).expand(n, w, c).reshape(n, 1, w * c))
            image.add_(0.0)
        return out.permute(0, 3, 1, 2) if self._nchw else out

    def _output(self, shape: tuple[int, int, int, int], device: torch.device) -> torch.Tensor:
        """The float batch's memory. On a CPU, a view of one buffer kept from batch to batch (up to
        REUSED_INPUT_MAX_BYTES): a fresh one is fresh pages, whose first touch made normalising a 224x224 frame cost
        77-84 us instead of 42-47. The runner's thread alone uses it, and the batch's scores are copied off it
        (ScoresToHost) before the next batch. On CUDA the caching allocator hands back warm memory already, and a
        graph's capture must allocate from its own pool: a fresh tensor there."""
        numel = shape[0] * shape[1] * shape[2] * shape[3]
        if not self._reuse or 4 * numel > REUSED_INPUT_MAX_BYTES:
            return torch.empty(shape, dtype=torch.float32, device=device)
        if self._buffer is None or self._buffer.numel() < numel:
            self._buffer = torch.empty(numel, dtype=torch.float32, device=device)
        return self._buffer[:numel].view(shape)

    def _tiled(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale and bias repeated for one image row of `width` pixels (made once per width; a graph's warm-up
        makes its widths' before capture)."""
        tiled = self._rows.get(width)
        if tiled is None:
            tiled = self._rows[width] = (self._scale.repeat(width), self._bias.repeat(width))
        return tiled


def _inside(regions: torch.Tensor, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, H] and [n, W] bool: the rows and the columns inside each row's (top, left, height, width) region.
    Shape-static (graph-safe)."""
    top, left, h, w = (regions[:, i:i + 1] for i in range(4))
    ys = torch.arange(height, device=regions.device)
    xs = torch.arange(width, device=regions.device)
    return (ys >= top) & (ys < top + h), (xs >= left) & (xs < left + w)


def _compact(buffer: torch.Tensor, kept: list[int]) -> torch.Tensor:
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
