"""Resampling a decoded frame's pixels to a size: Pillow's bilinear (what reference preprocessing uses), torch's
uint8 kernel, or `cv2.resize` itself (what references built on cv2 use). Pure pixel arithmetic:
which size a frame goes to is `fitting`'s."""

from __future__ import annotations

import functools
import threading
from typing import Any

import numpy as np
import torch
from PIL import Image

from worker.config.fields import ConfigError
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


def resize_centre_crop(pixels: np.ndarray, size_hw: tuple[int, int], crop_hw: tuple[int, int],
                       resampler: str) -> np.ndarray:
    """The centre `crop_hw` of `pixels` resized to `size_hw`. With Pillow, where computing only the kept pixels
    (`resize(box=...)`) gives the same bits as resizing it all and cropping (`_box_is_exact`: open_nsfw's 256x256
    then 224x224 from the usual camera sizes), only those are computed: no pixels resized to be cropped off, no copy
    of the crop (bench/host_parts.py: open_nsfw's fit at 224x224 and 720p)."""
    if resampler == "pillow" and pixels.shape[:2] != size_hw and _box_is_exact(pixels.shape, size_hw, crop_hw):
        return _pillow_box(pixels, size_hw, crop_hw)
    top, left = _centre(size_hw, crop_hw)
    return resize(pixels, size_hw, resampler)[top:top + crop_hw[0], left:left + crop_hw[1]]


def _centre(size_hw: tuple[int, int], crop_hw: tuple[int, int]) -> tuple[int, int]:
    """The (top, left) of the centre `crop_hw` of `size_hw`."""
    return (size_hw[0] - crop_hw[0]) // 2, (size_hw[1] - crop_hw[1]) // 2


def _pillow_box(pixels: np.ndarray, size_hw: tuple[int, int], crop_hw: tuple[int, int]) -> np.ndarray:
    """Pillow's bilinear resize of the source box that lands on the centre `crop_hw` of `size_hw`."""
    (h, w), (th, tw), (ch, cw) = pixels.shape[:2], size_hw, crop_hw
    top, left = _centre(size_hw, crop_hw)
    sx, sy = w / tw, h / th
    box = (left * sx, top * sy, (left + cw) * sx, (top + ch) * sy)
    out = np.asarray(as_image(pixels).resize((cw, ch), Image.Resampling.BILINEAR, box=box), dtype=np.uint8)
    return out if out.ndim == 3 else out[:, :, None]


def _box_is_exact(shape: tuple[int, ...], size_hw: tuple[int, int], crop_hw: tuple[int, int]) -> bool:
    """Whether Pillow computes the kept pixels to the same bits from the box as in a full resize. Its resampling
    (libImaging/Resample.c) is two fixed-point passes whose coefficients follow from each output pixel's filter
    centre: the same centres on both axes and the same order of the passes (Pillow runs the vertical one first
    when the height shrinks more than twice as much as the width) give the same bits. Exact for open_nsfw's
    256x256 then 224x224 from the usual camera sizes; not in general (a scale that is not a binary fraction)."""
    (h, w), (th, tw), (ch, cw) = shape[:2], size_hw, crop_hw
    top, left = _centre(size_hw, crop_hw)
    return (_same_centres(w, tw, left, cw) and _same_centres(h, th, top, ch)
            and _horizontal_first((h, w), size_hw) == _horizontal_first((h, w), crop_hw))


def _horizontal_first(in_hw: tuple[int, int], out_hw: tuple[int, int]) -> bool:
    """Pillow's choice of which pass runs first (ImagingResampleInner)."""
    shrink_y, shrink_x = in_hw[0] - out_hw[0], in_hw[1] - out_hw[1]
    return not (shrink_y > 0 and shrink_y > shrink_x * 2)


@functools.lru_cache(maxsize=1024)
def _same_centres(size: int, target: int, start: int, kept: int) -> bool:
    """Whether each of the `kept` outputs from `start` gets the same filter centre, to the bit, when `size` is
    resized to `target` and when the box that lands on them is resized to `kept` (Pillow's precompute_coeffs:
    centre = in0 + (x + 0.5) * (in1 - in0) / out, the box's ends C floats, the rest doubles)."""
    scale = size / target
    in0, in1 = np.float32(start * scale), np.float32((start + kept) * scale)
    box_scale = float(np.float32(in1 - in0)) / kept
    return all(float(in0) + (x + 0.5) * box_scale == (start + x + 0.5) * scale for x in range(kept))


_CV2_THREADS = 0  # cv2.setNumThreads(0): its functions run in the calling thread, no pool of its own
_cv2_lock = threading.Lock()
_cv2: Any = None


def opencv() -> Any:
    """The cv2 module, set once (on first use: the Preprocessor's start) to run each call in the calling thread.
    The preprocessing threads are already one per core; cv2's own pool (a thread per core) would compete with them
    and with the runners. A ConfigError naming the extra where cv2 is not installed."""
    global _cv2
    with _cv2_lock:
        if _cv2 is None:
            try:
                import cv2
            except ImportError as exc:
                raise ConfigError([
                    'model.resampler: "opencv" needs OpenCV (cv2), which is not installed: install the models extra '
                    "(pip install 'streamfer[models]', which brings opencv-python-headless), or choose another "
                    f"model.resampler ({exc})"]) from exc
            cv2.setNumThreads(_CV2_THREADS)
            _cv2 = cv2
    return _cv2


def resize_like_opencv(pixels: np.ndarray, size_hw: tuple[int, int], out: np.ndarray | None = None) -> np.ndarray:
    """`cv2.resize` INTER_LINEAR (bilinear, no antialiasing, OpenCV's fixed point), as references built on cv2 do
    (`cv2.dnn.blobFromImage`: NudeNet's): bit for bit theirs, since it is their call. Written into `out` when it is
    a C-contiguous uint8 array of the target size (a batch row)."""
    cv2 = opencv()
    c = pixels.shape[2]
    hwc = (*size_hw, c)
    out = fitting_row(out, hwc)
    if out is None:
        out = np.empty(hwc, dtype=np.uint8)
    # cv2 reads and writes (H, W) for one channel: the same memory, viewed without the channel axis.
    src = pixels[:, :, 0] if c == 1 else pixels
    cv2.resize(src, (size_hw[1], size_hw[0]), dst=out[:, :, 0] if c == 1 else out, interpolation=cv2.INTER_LINEAR)
    return out


def as_image(pixels: np.ndarray) -> Image.Image:
    return Image.fromarray(pixels if pixels.shape[2] == 3 else pixels[:, :, 0])
