"""What the batcher hands out: `Batch`, and the shape a frame is batched by."""

from __future__ import annotations

from dataclasses import dataclass

from worker.errors import StreamferError
from worker.frames import Frame, Priority


class BatcherFullError(StreamferError):
    """add() was called past the hard cap: the source kept consuming while classes_to_pause() said stop."""


@dataclass(frozen=True)
class Batch:
    """Frames of one class to run together, padded to `shape` = (height, width, channels)."""

    frames: tuple[Frame, ...]
    shape: tuple[int, int, int]
    priority: Priority
    lane: str
    padding_waste: float
    released_at: float
    reason: str
    # The cost model's predicted run time (preprocess + inference) for this size and shape; None if unknown.
    predicted_s: float | None = None

    @property
    def size(self) -> int:
        return len(self.frames)


def batch_shape(frame_shape: tuple[int, int, int], input_hw: tuple[int, int] | None) -> tuple[int, int, int]:
    """The (height, width, channels) a frame is batched by: the model's fixed input when it has one (every frame
    becomes that input, whatever its resolution), else the frame's own shape; the channels are the frame's."""
    return (input_hw[0], input_hw[1], frame_shape[2]) if input_hw else frame_shape
