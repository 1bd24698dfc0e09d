"""Test and benchmark images beyond worker.tools.publish_frames's synthetic blocks."""

from __future__ import annotations

import numpy as np


def photo_like(width: int, height: int) -> np.ndarray:
    """Smooth gradients, a few hard-edged patches and mild sensor noise: what a video frame holds."""
    rng = np.random.default_rng(5)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    img = np.stack([128 + 90 * np.sin(x / 60), 128 + 90 * np.cos(y / 45), 128 + 70 * np.sin((x + y) / 80)], -1)
    for _ in range(12):
        top, left, size = rng.integers(0, height), rng.integers(0, width), rng.integers(20, 150)
        img[top:top + size, left:left + size] = rng.integers(0, 256, 3)
    return np.clip(img + rng.normal(0, 4, img.shape), 0, 255).astype(np.uint8)
