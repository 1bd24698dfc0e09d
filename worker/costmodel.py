"""Batch cost, learned online: how long a batch of n frames of one shape takes to run (preprocessing +
inference), so the batcher can size batches for a latency budget and for throughput. Pure: no Kafka, no
torch; fed with measured batches (warm-up seeds it, every finished batch updates it).

Per shape (height, width, channels) it keeps an exponentially weighted mean of the measured time of each
batch size seen, and a least-squares line a + b*n through those means:
  - predict(shape, n): the size's own mean when it was measured, else the line (a shape with one size
    measured scales it by n); a shape never measured is scaled from the closest measured shape with the same
    channels by pixel area. None when nothing is known: callers fall back to their static settings.
  - best_size(shape, cap): among the measured sizes <= cap, the one with the most frames per second of device
    time (n / its fastest measured time: background load only ever slows a batch); the largest size within
    `tolerance` of the best wins (per-batch costs outside the measurement favour fewer batches; latency
    budgets cut batches where needed). The line alone always favours the largest size, so the choice uses
    measurements: on CPUs a large batch is often slower per frame (cache), which only a measurement shows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

Shape = tuple[int, int, int]

# Weight of the newest measurement in a size's running mean ("recent batches").
EWMA_ALPHA = 0.2
# The largest size within this share of the best measured throughput is chosen: per-batch costs the
# measurement leaves out (the loop, produce, commit) favour fewer batches, and budgets cut a batch when a
# class's latency needs it.
THROUGHPUT_TOLERANCE = 0.05


@dataclass
class _ShapeCost:
    mean_s: dict[int, float] = field(default_factory=dict)  # batch size -> EWMA of measured seconds
    # batch size -> fastest measured seconds: background load only ever slows a batch, so sizes are ranked
    # on these (a noisy neighbour during one size's measurements must not make a small size look best)
    best_s: dict[int, float] = field(default_factory=dict)
    count: dict[int, int] = field(default_factory=dict)
    a: float = 0.0
    b: float = 0.0

    def refit(self) -> None:
        """Least squares of mean_s over sizes; a >= 0 and b >= 0 (time never shrinks with more frames)."""
        points = sorted(self.mean_s.items())
        if len(points) == 1:
            n, t = points[0]
            self.a, self.b = 0.0, t / n
            return
        mx = sum(n for n, _ in points) / len(points)
        my = sum(t for _, t in points) / len(points)
        sxx = sum((n - mx) ** 2 for n, _ in points)
        b = sum((n - mx) * (t - my) for n, t in points) / sxx
        b = max(b, 0.0)
        a = my - b * mx
        if a < 0:  # through the origin instead
            a, b = 0.0, sum(n * t for n, t in points) / sum(n * n for n, _ in points)
        self.a, self.b = a, b

    def predict(self, n: int) -> float:
        measured = self.mean_s.get(n)
        return measured if measured is not None else self.a + self.b * n


class CostModel:
    """Learned batch times per shape; see the module docstring. Not thread-safe: the loop owns it."""

    def __init__(self, alpha: float = EWMA_ALPHA, tolerance: float = THROUGHPUT_TOLERANCE) -> None:
        self._alpha = alpha
        self._tolerance = tolerance
        self._shapes: dict[Shape, _ShapeCost] = {}
        # Bumped on every observation, so a caller can tell its cached choices are stale.
        self.version = 0

    def observe(self, shape: Shape, n: int, seconds: float) -> None:
        """Record one measured batch of `n` frames of `shape` that took `seconds` (preprocess + inference)."""
        if n < 1 or not math.isfinite(seconds) or seconds <= 0:
            return
        cost = self._shapes.setdefault(tuple(shape), _ShapeCost())  # type: ignore[arg-type]
        old = cost.mean_s.get(n)
        cost.mean_s[n] = seconds if old is None else old + self._alpha * (seconds - old)
        cost.count[n] = cost.count.get(n, 0) + 1
        cost.best_s[n] = min(seconds, cost.best_s.get(n, seconds))
        cost.refit()
        self.version += 1

    def known(self, shape: Shape) -> bool:
        return tuple(shape) in self._shapes

    def predict(self, shape: Shape, n: int) -> float | None:
        """Predicted seconds for a batch of `n` frames of `shape`; None when no shape of its channels is known."""
        if n < 1:
            return 0.0
        cost = self._shapes.get(tuple(shape))  # type: ignore[arg-type]
        if cost is not None:
            return cost.predict(n)
        near = self._nearest(shape)
        if near is None:
            return None
        other, ratio = near
        return self._shapes[other].predict(n) * ratio

    def line(self, shape: Shape) -> tuple[float, float] | None:
        """The fitted (a seconds, b seconds per frame) of a measured shape."""
        cost = self._shapes.get(tuple(shape))  # type: ignore[arg-type]
        return None if cost is None else (cost.a, cost.b)

    def best_size(self, shape: Shape, cap: int) -> int | None:
        """The measured size <= cap with the most frames per second of device time; None if none is measured."""
        cost = self._shapes.get(tuple(shape))  # type: ignore[arg-type]
        if cost is None:
            near = self._nearest(shape)
            if near is None:
                return None
            cost = self._shapes[near[0]]  # throughput by size scales with area alike: same argmax
        sizes = [n for n in cost.best_s if n <= cap]
        if not sizes:
            return None
        best = max(n / cost.best_s[n] for n in sizes)
        return max(n for n in sizes if n / cost.best_s[n] >= best * (1.0 - self._tolerance))

    def largest_within(self, shape: Shape, seconds: float, cap: int) -> int | None:
        """The largest n <= cap predicted to take at most `seconds`; 0 if not even one frame; None if unknown."""
        one = self.predict(shape, 1)
        if one is None:
            return None
        lo, hi = 0, cap
        while lo < hi:  # predictions grow with n (b >= 0, means of larger sizes are larger in practice)
            mid = (lo + hi + 1) // 2
            t = self.predict(shape, mid)
            if t is not None and t <= seconds + 1e-9:  # clock rounding must not cost a frame
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _nearest(self, shape: Shape) -> tuple[Shape, float] | None:
        area = shape[0] * shape[1]
        candidates = [s for s in self._shapes if s[2] == shape[2]]
        if not candidates or area <= 0:
            return None
        other = min(candidates, key=lambda s: abs(math.log((s[0] * s[1]) / area)))
        return other, area / (other[0] * other[1])

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Per shape "HxWxC": the line and the measured means (for logs and benchmarks)."""
        return {f"{h}x{w}x{c}": {"a_ms": cost.a * 1000.0, "b_ms": cost.b * 1000.0,
                                 **{f"n{n}_ms": t * 1000.0 for n, t in sorted(cost.mean_s.items())}}
                for (h, w, c), cost in self._shapes.items()}
