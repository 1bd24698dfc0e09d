"""Fitting a decoded frame to a model's input: its channels, the size it is resized to (stretch, letterbox, a
resize then centre crop, pad then stretch), the crop and the offset of its pixels in the input; and the JPEG round
trip a reference may make. The same geometry serves the host path and the device path (`devicepath`)."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from worker.frames import Frame
from worker.runtime.decode import FrameDecodeError
from worker.runtime.models import ModelContract
from worker.runtime.resample import as_image, resize, resize_centre_crop


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
        # Padded before the resize, as the reference does (NudeNet: cv2.copyMakeBorder, then cv2.resize), so the
        # border row blends image and black as there.
        return resize(pad_to_aspect(pixels, size), size, contract.resampler, out), (0, 0)
    if contract.resize in ("shorter_side_crop", "stretch_crop"):
        return resize_centre_crop(pixels, target, size, contract.resampler), (0, 0)
    resized = resize(pixels, target, contract.resampler, out if contract.resize == "stretch" else None)
    if contract.resize == "letterbox":
        return resized, ((size[0] - target[0]) // 2, (size[1] - target[1]) // 2)
    return resized, (0, 0)


def jpeg_roundtrip(pixels: np.ndarray, quality: int) -> np.ndarray:
    """Encode and decode as JPEG, as a reference preprocessing that does so (open_nsfw's) would."""
    buf = io.BytesIO()
    as_image(pixels).save(buf, format="JPEG", quality=quality)
    buf.seek(0)
    with Image.open(buf) as img:
        out = np.asarray(img, dtype=np.uint8)
    return out if out.ndim == 3 else out[:, :, None]
