"""The kit's fake clock: seconds moved by hand, callable like time.time, for every part that takes a clock."""

from __future__ import annotations

# 2027-01-15: the kit's frames (worker.testing.fakes.frame_value) were captured a second before it.
START = 1_800_000_000.0


class FakeClock:
    """Seconds, moved by hand (`advance`, or set `now`); callable like time.time."""

    def __init__(self, now: float = START) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
