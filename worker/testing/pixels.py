"""Test and benchmark images beyond worker.tools.publish_frames's synthetic blocks (part of the kit: worker.testing)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from worker.frames import Encoding, Frame, Priority, SourceRef


def photo_like(width: int, height: int) -> np.ndarray:
    """Smooth gradients, a few hard-edged patches and mild sensor noise: what a video frame holds."""
    rng = np.random.default_rng(5)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    img = np.stack([128 + 90 * np.sin(x / 60), 128 + 90 * np.cos(y / 45), 128 + 70 * np.sin((x + y) / 80)], -1)
    for _ in range(12):
        top, left, size = rng.integers(0, height), rng.integers(0, width), rng.integers(20, 150)
        img[top:top + size, left:left + size] = rng.integers(0, 256, 3)
    return np.clip(img + rng.normal(0, 4, img.shape), 0, 255).astype(np.uint8)


# The device data path's equivalence figures (tests/unit/test_runtime_devicepath.py, bench/preprocess_cost.py): real
# photos and frames of the demo clip, as JPEG at these sizes (width, height).
EQUIVALENCE_SIZES = {"224": (224, 224), "720p": (1280, 720), "1080p": (1920, 1080)}
# Public-domain photos bundled with scikit-image (no download): people, food, a cat, a rocket, grey, space.
EQUIVALENCE_PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "camera", "hubble_deep_field")


def photo_frames(size: tuple[int, int], quality: int = 85) -> list[Frame]:
    """The scikit-image photos stretched to `size` (width, height), as JPEG frames at the producer's quality."""
    from PIL import Image

    from worker.photos import photo
    from worker.tools.publish_frames import encode_pixels

    frames = []
    for i, name in enumerate(EQUIVALENCE_PHOTOS):
        pixels = np.asarray(Image.fromarray(photo(name)).resize(size, Image.Resampling.BILINEAR))
        frames.append(_jpeg_frame(f"photo-{name}", i, encode_pixels(pixels, Encoding.JPEG, quality), size))
    return frames


def clip_frames(directory: str | Path, size: tuple[int, int], fps: int = 1) -> list[Frame]:
    """Frames of the demo clip (worker.tools.sample_video: a pan across each photo, H.264) made at `size` (width,
    height), decoded and sent as JPEG as `worker produce --from-video` does (its default quality)."""
    from worker.tools.publish_frames import video_frames
    from worker.tools.sample_video import make_photo_clip

    clip = make_photo_clip(Path(directory) / f"clip-{size[0]}x{size[1]}.mp4", size=size, fps=fps)
    records = video_frames([clip.path], Priority.STANDARD, "eq", "t")
    return [_jpeg_frame(f"clip-{clip.photo_at(r.frame_index)}-{r.frame_index}", r.frame_index, r.data, size)
            for r in records]


def _jpeg_frame(stream_id: str, index: int, data: bytes, size: tuple[int, int]) -> Frame:
    return Frame(stream_id=stream_id, frame_index=index, tenant="t", priority=Priority.STANDARD, capture_ts_ms=0,
                 width=size[0], height=size[1], channels=3, encoding=Encoding.JPEG, data=data,
                 source=SourceRef("eq", 0, index))
