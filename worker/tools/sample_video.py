"""Short H.264 clips of real photos, made locally with PyAV from scikit-image's bundled public-domain photos
(nothing is downloaded; worker.photos): the demo's and the tests' video input.

Each photo is shown for `seconds_per_photo` as a slow pan across it, so consecutive frames differ like a
camera's. Needs the `models` extra (av, scikit-image).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from worker.photos import PHOTOS, photo

# The pan covers this much more than the frame, so each photo is seen moving.
PAN_MARGIN = 1.25


@dataclass(frozen=True)
class SampleClip:
    path: Path
    photos: tuple[str, ...]
    frames_per_photo: int
    fps: int
    size: tuple[int, int]  # (width, height)

    def photo_at(self, frame_index: int) -> str:
        return self.photos[min(len(self.photos) - 1, frame_index // self.frames_per_photo)]


def photo_clip(path: Path, size: tuple[int, int] = (1280, 720), fps: int = 10, seconds_per_photo: float = 1.0,
               photos: Sequence[str] = PHOTOS) -> SampleClip:
    """What `make_photo_clip` with these arguments writes (to describe a clip made before)."""
    return SampleClip(path=Path(path), photos=tuple(photos), frames_per_photo=max(1, round(fps * seconds_per_photo)),
                      fps=fps, size=size)


def make_photo_clip(path: Path, size: tuple[int, int] = (1280, 720), fps: int = 10, seconds_per_photo: float = 1.0,
                    photos: Sequence[str] = PHOTOS) -> SampleClip:
    """Write an H.264 (yuv420p) clip panning across each photo in turn; returns what it holds."""
    import av

    clip = photo_clip(path, size, fps, seconds_per_photo, photos)
    width, height = size
    per_photo = clip.frames_per_photo
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps, options={"preset": "ultrafast", "crf": "23"})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for name in photos:
            for pixels in _pan(photo(name), width, height, per_photo):
                for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                    container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return clip


def _pan(img: np.ndarray, width: int, height: int, frames: int) -> list[np.ndarray]:
    h, w = img.shape[:2]
    scale = max(width * PAN_MARGIN / w, height * PAN_MARGIN / h)
    big = np.asarray(Image.fromarray(img).resize((round(w * scale), round(h * scale)), Image.Resampling.BILINEAR))
    top = (big.shape[0] - height) // 2
    span = big.shape[1] - width
    lefts = [round(span * i / max(1, frames - 1)) for i in range(frames)]
    return [np.ascontiguousarray(big[top:top + height, left:left + width]) for left in lefts]
