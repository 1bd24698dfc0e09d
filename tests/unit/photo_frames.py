"""A Frame from an image array, raw or JPEG-encoded, for the runtime's tests."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from worker.frames import Encoding, Frame, Priority, SourceRef


def frame_of(pixels: np.ndarray, encoding: Encoding, index: int = 0) -> Frame:
    """`pixels` (HxW or HxWxC uint8) as a standard-class frame; JPEG at quality 90."""
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    h, w, c = pixels.shape
    if encoding is Encoding.JPEG:
        buf = io.BytesIO()
        Image.fromarray(pixels if c == 3 else pixels[:, :, 0]).save(buf, format="JPEG", quality=90)
        data = buf.getvalue()
    else:
        data = pixels.tobytes()
    return Frame(stream_id="s", frame_index=index, tenant="t", priority=Priority.STANDARD, capture_ts_ms=0,
                 width=w, height=h, channels=c, encoding=encoding, data=data, source=SourceRef("in", 0, index))
