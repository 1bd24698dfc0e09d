"""Resampling a decoded frame's pixels to a size: Pillow's bilinear (what reference preprocessing uses), torch's
uint8 kernel, or OpenCV's INTER_LINEAR arithmetic (what references built on cv2 use). Pure pixel arithmetic:
which size a frame goes to is `fitting`'s."""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from worker.runtime.decode import fitting_row


def resize(pixels: np.ndarray, size_hw: tuple[int, int], resampler: str = "torch",
            out: np.ndarray | None = None) -> np.ndarray:
    """Bilinear resize, antialiased when shrinking: Pillow's (what reference preprocessing uses), or torch's uint8
    kernel at about a quarter of its cost here. Both round after each pass, so each is within one grey level of the
    exact filter; the two differ by two at rare pixels (1 in 10^7 on noise), by one at 6%.

    torch and opencv write into `out` when it is a C-contiguous (height, width, channels) uint8 array of the target
    size (a batch row: no copy afterwards), else into a new one; Pillow always returns a new array."""
    if pixels.shape[:2] == size_hw:
        return pixels
    if resampler == "opencv":
        return resize_like_opencv(pixels, size_hw, out)
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
    out = np.asarray(as_image(pixels).resize((size_hw[1], size_hw[0]), Image.Resampling.BILINEAR), dtype=np.uint8)
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
    """One (source shape, canvas, target size)'s taps for `resize_like_opencv`, laid out for its passes: the
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


def resize_like_opencv(pixels: np.ndarray, size_hw: tuple[int, int], out: np.ndarray | None = None,
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


def as_image(pixels: np.ndarray) -> Image.Image:
    return Image.fromarray(pixels if pixels.shape[2] == 3 else pixels[:, :, 0])
