"""The lanes a batch leaves by, and which frames go to the fallback lane: one too big for any batch, or of a
shape too rare to wait for partners (the Fallback lane rule of the package docstring)."""

from __future__ import annotations

from collections import deque

from worker.config import BatchingSettings

LANE_EXACT = "exact"
LANE_PADDED = "padded"
LANE_FALLBACK = "fallback"


class FallbackLane:
    """Decides, per frame, whether it joins its shape's fallback group instead of its exact group."""

    def __init__(self, settings: BatchingSettings):
        self._max_batch_bytes = settings.max_batch_bytes
        self._rare_window_s = settings.rare_shape_window_ms / 1000.0
        self._rare_min = settings.rare_shape_min_count
        self._shape_seen: dict[tuple[int, int, int], deque[float]] = {}
        self._shape_sweep_at = 1024

    def takes(self, shape: tuple[int, int, int], frame_bytes: int, t: float) -> bool:
        """Whether a frame of `shape` arriving at `t` goes to the fallback lane (its arrival is counted)."""
        if frame_bytes > self._max_batch_bytes:
            return True
        # A shape is rare when fewer than rare_shape_min_count frames of it (this one included) arrived within
        # rare_shape_window_ms. Only the last rare_shape_min_count arrival times matter: rare iff the oldest of them
        # is out of the window.
        seen = self._shape_seen.get(shape)
        if seen is None:
            if len(self._shape_seen) >= self._shape_sweep_at:
                self._sweep_shapes(t)
            seen = self._shape_seen[shape] = deque(maxlen=self._rare_min)
        seen.append(t)
        return len(seen) < self._rare_min or t - seen[0] > self._rare_window_s

    def _sweep_shapes(self, t: float) -> None:
        horizon = t - self._rare_window_s
        self._shape_seen = {k: v for k, v in self._shape_seen.items() if v[-1] >= horizon}
        self._shape_sweep_at = max(1024, 2 * len(self._shape_seen))
