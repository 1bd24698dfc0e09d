"""A frame's thumbnail for verdict reuse (worker.reuse.policy): a small grayscale picture, and how much two differ.

A JPEG is decoded by libjpeg-turbo at 1/8 scale in grayscale (its scaled IDCT skips most of the pixel work, after
the same safety checks as a full decode), a raw frame is subsampled; either is then area-averaged to at most
THUMB_SIDE x THUMB_SIDE. Averaging hundreds of pixels per thumbnail cell is what makes the difference robust to
sensor noise and compression noise while a cut, a flash or an object entering moves some cell far.

`Thumbnails` computes a poll's thumbnails off the loop thread, on threads of its own (libjpeg-turbo's decode releases
the interpreter lock): on the loop they capped a reuse class at 450-850 frames/s per worker (issue 68).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence

import numpy as np

from worker.frames import Encoding, Frame
from worker.runtime.decode import FrameDecodeError, decode_pixels

THUMB_SIDE = 32
# A raw frame is read every RAW_STEP-th pixel before averaging: the thumbnail averages blocks anyway.
RAW_STEP = 4

# libjpeg's grayscale is the luma of JFIF's YCbCr: raw RGB frames are weighed the same.
_LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)

Thumbnail = np.ndarray  # (h, w) float32, 0..255


def thumbnail(frame: Frame) -> Thumbnail | None:
    """The frame's thumbnail, or None when its pixels do not decode (the runtime dead-letters it, with the reason)."""
    try:
        return _area_average(_gray(frame, decode_pixels))
    except FrameDecodeError:
        return None


class Thumbnails:
    """The thumbnails of many frames at once, in their order, computed in contiguous chunks on `threads` threads
    (`thumbnail-N`, started on first use) while the caller waits: the caller's own CPU is a hand-off per chunk.
    close() stops the threads."""

    def __init__(self, threads: int) -> None:
        self._threads = max(1, threads)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def of(self, frames: Sequence[Frame]) -> list[Thumbnail | None]:
        if not frames:
            return []
        with self._lock:
            if self._pool is None:
                from worker.threadnames import name_os_thread

                self._pool = concurrent.futures.ThreadPoolExecutor(self._threads, thread_name_prefix="thumbnail",
                                                                   initializer=name_os_thread)
            pool = self._pool
        chunks = min(len(frames), self._threads)
        bounds = [len(frames) * k // chunks for k in range(chunks + 1)]
        futures = [pool.submit(_thumbnails, frames[lo:hi]) for lo, hi in zip(bounds, bounds[1:])]
        return [thumb for f in futures for thumb in f.result()]

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def _thumbnails(frames: Sequence[Frame]) -> list[Thumbnail | None]:
    return [thumbnail(frame) for frame in frames]


def _gray(frame: Frame, decode_pixels: Callable[..., np.ndarray]) -> np.ndarray:
    if frame.encoding is Encoding.JPEG:
        return decode_pixels(frame, channels=1, min_hw=(1, 1))[:, :, 0]  # 1/8 scale: jpeg_scale picks 8
    sub = decode_pixels(frame, channels=frame.channels)[::RAW_STEP, ::RAW_STEP].astype(np.float32)
    return sub @ _LUMA if sub.shape[2] == 3 else sub.mean(axis=2)


def _area_average(gray: np.ndarray) -> Thumbnail:
    """Blocks of the image averaged to at most THUMB_SIDE per side (the ragged last rows and columns dropped)."""
    h, w = gray.shape
    by, bx = -(-h // THUMB_SIDE), -(-w // THUMB_SIDE)
    th, tw = max(1, h // by), max(1, w // bx)
    blocks = gray[:th * by, :tw * bx].reshape(th, by, tw, bx)
    return blocks.mean(axis=(1, 3), dtype=np.float32)


def change(a: Thumbnail, b: Thumbnail) -> float:
    """The largest absolute difference between two thumbnails' cells, 0..255 (different sizes: 255).

    The largest cell, not the mean: an object entering a corner changes a few cells a lot and the mean little (a
    square of 5% of a 720p frame moved the mean by 1.1 on bench/reuse.py's clip, within 5x of sensor noise's 0.23,
    and the largest cell by 84, 63x noise's 1.3), while noise, averaged over a whole cell, stays small in every
    cell."""
    if a.shape != b.shape:
        return 255.0
    return float(np.abs(a - b).max())
