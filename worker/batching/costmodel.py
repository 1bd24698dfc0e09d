"""Batch cost, learned online: how long a batch of n frames of one shape takes to run (preprocessing +
inference), so the batcher can size batches for a latency budget and for throughput. Pure: no Kafka, no
torch; fed with measured batches (warm-up seeds it, every finished batch updates it).

Per shape (height, width, channels) it keeps an exponentially weighted mean of the measured time of each
batch size seen, and a least-squares line a + b*n through those means:
  - profiles: a shape's own measurements are completed with the sizes only a reference shape has (the one
    with the most sizes measured, the same channels: the warm-up calibration), scaled by the two shapes' time
    ratio at the sizes both measured (else by pixel area). A shape never measured is the reference, scaled.
  - predict(shape, n): the size's mean when it was measured (or completed), else the line (one size: scaled
    by n). None when no shape of its channels is known: callers fall back to their static settings.
  - calibration vs live: warm-up times each size alone, on blank frames, best of a few runs; a live batch decodes
    real frames while the next one is prepared, and runs slower (1.2-2x on a 2-core CPU with open_nsfw). So a
    size known only from calibration is estimated as its calibrated time times the median live/calibrated
    ratio of the sizes measured both ways: otherwise every size not yet tried looks better than the one in use,
    and the choice walks through all of them, the worst included.
  - best_size(shape, cap): among the sizes <= cap, the one with the most frames per second of device time,
    n / (its estimated time + BATCH_OVERHEAD_S, the per-batch work outside the measurement). Sizes within
    `tolerance` of the best count as equal: the size chosen last time for this shape and cap is kept among
    them (measurements of the size in use follow background load, the others' do not: without this the
    choice would chase noise), else the largest. Once the size in use is well measured, its neighbours are
    tried live a few times, and again now and then (EXPLORE_*, RETRY_AFTER), so the choice climbs to the best
    size instead of staying where a noisy warm-up or a noisy trial put it. The line alone always favours the
    largest size, so the choice uses measurements: on CPUs a large batch is often slower per frame (cache),
    which only a measurement shows.
  - rank_by_cpu (a CPU device): best_size ranks sizes by frames per CPU second instead, the thread CPU of each
    live batch's preparation and inference (`cpu_seconds`): on cores that the runners and the decode pool share,
    a batch's wall time follows whatever else runs beside it, its CPU what the size costs the machine (one
    onnxruntime thread spends more per frame at 32 than at 8). Sizes without a CPU reading are ranked by their
    time times the median CPU / time of the sizes with one. The budget (largest_within, predict) stays in wall
    time: a frame waits for the wall clock.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

Shape = tuple[int, int, int]

# Weight of the newest measurement in a size's running mean ("recent batches").
EWMA_ALPHA = 0.2
# Sizes within this share of the best estimated throughput count as equal: the one in use is kept, else the
# largest (per-batch costs the measurement leaves out, the loop, produce and commit, favour fewer batches).
# Small: a wider band trades real throughput (open_nsfw on CPU: batch 32 costs 1.2x the CPU per frame of 8).
THROUGHPUT_TOLERANCE = 0.05
# Per-batch work the measurement leaves out (the loop building results, dispatch, produce, commit, thread
# hand-offs): ~0.6 ms of loop CPU a batch on the 2-core VM, rounded up (loop phase timers, bench/HISTORY.md).
# Added to every size's time when ranking throughput: negligible for a real model (tens of ms a batch), but it
# keeps a near-zero model from choosing small batches whose loop costs exceed their model time.
BATCH_OVERHEAD_S = 0.001
# Exploration: once the size in use has EXPLORE_AFTER live batches, each neighbouring size (the next smaller
# and larger one known) is tried for EXPLORE_SAMPLES batches, and again whenever its measurement is older than
# RETRY_AFTER batches of the shape (then it starts afresh: the mean of the new trial's batches). Scaling keeps
# the warm-up ranking, and warm-up timings are noisy (best of two runs on a shared machine, 30% and more apart
# between runs): without live trials a size that only looked best at warm-up is kept for good (open_nsfw ran a
# whole run at batch 2, 24 frames/s against 33 at 4); without the retries, so is a neighbour whose three trial
# batches met a burst of load (open_nsfw: a run at batch 4, 29 frames/s against 32 at 8). Its cost is bounded:
# 2 x EXPLORE_SAMPLES batches of RETRY_AFTER + 6 are at a neighbouring size, ~9% (1-2% of throughput when
# the neighbours are 10-20% slower per frame).
EXPLORE_AFTER = 5
EXPLORE_SAMPLES = 3
RETRY_AFTER = 64


@dataclass
class _ShapeCost:
    # Batch size -> estimated seconds: the live mean where measured live, else calibrated x live/calibrated.
    mean_s: dict[int, float] = field(default_factory=dict)
    live_count: dict[int, int] = field(default_factory=dict)  # batch size -> live batches measured
    live_s: dict[int, float] = field(default_factory=dict)  # batch size -> EWMA of live batches' seconds
    batches: int = 0  # live batches of this shape, all sizes
    last_at: dict[int, int] = field(default_factory=dict)  # batch size -> `batches` at its last live batch
    run: dict[int, int] = field(default_factory=dict)  # batch size -> live batches since its mean started afresh
    calibrated_s: dict[int, float] = field(default_factory=dict)  # batch size -> warm-up calibration's seconds
    cpu_s: dict[int, float] = field(default_factory=dict)  # batch size -> EWMA of live batches' CPU seconds
    # The fitted (a, b), or None until it is next needed: fitted lazily, as every batch changes mean_s and most
    # predictions are of measured sizes.
    _fit: tuple[float, float] | None = field(default=None, repr=False, compare=False)

    def measured(self, n: int, seconds: float, alpha: float, calibration: bool = False,
                 cpu_seconds: float | None = None) -> None:
        if calibration:
            self.calibrated_s[n] = min(seconds, self.calibrated_s.get(n, seconds))
        else:
            if self.stale(n):  # no history, or too old to mean anything now: start afresh
                self.run[n] = 0
            self.batches += 1
            self.run[n] += 1
            self.last_at[n] = self.batches
            weight = 1.0 if self.run[n] == 1 else max(alpha, 1.0 / self.run[n])
            # a plain mean until the EWMA's own weight is smaller: a first batch alone decides nothing
            self.live_s[n] = seconds if weight == 1.0 else self.live_s[n] + weight * (seconds - self.live_s[n])
            if cpu_seconds is not None:
                cpu = self.cpu_s.get(n, cpu_seconds) if weight < 1.0 else cpu_seconds
                self.cpu_s[n] = cpu + weight * (cpu_seconds - cpu)
            elif weight == 1.0:
                self.cpu_s.pop(n, None)  # a fresh run without CPU readings: an old one would outlive its batches
            self.live_count[n] = self.live_count.get(n, 0) + 1
        shared = [m for m in self.live_s if m in self.calibrated_s]
        ratio = statistics.median(self.live_s[m] / self.calibrated_s[m] for m in shared) if shared else 1.0
        self.mean_s = {m: t * ratio for m, t in self.calibrated_s.items()}
        self.mean_s.update(self.live_s)
        self._fit = None

    def stale(self, n: int) -> bool:
        """No live measurement of size n, or none in the last RETRY_AFTER live batches of the shape."""
        return n not in self.last_at or self.batches - self.last_at[n] >= RETRY_AFTER

    def wants_trial(self, n: int) -> bool:
        """Size n, next to the one in use, is tried: never measured live, mid-trial, or measured too long ago."""
        return self.stale(n) or self.run.get(n, 0) < EXPLORE_SAMPLES

    @property
    def line(self) -> tuple[float, float]:
        """Least squares (a, b) of mean_s over sizes; a >= 0 and b >= 0 (time never shrinks with more frames)."""
        if self._fit is None:
            self._fit = _least_squares(sorted(self.mean_s.items()))
        return self._fit

    def cpu(self, n: int) -> float:
        """Size n's CPU seconds a batch: measured live, else its estimated time times the median CPU / time of the
        sizes measured both ways (else its time: nothing known of the CPU yet)."""
        if n in self.cpu_s:
            return self.cpu_s[n]
        shared = [m for m in self.cpu_s if m in self.live_s and self.live_s[m] > 0]
        ratio = statistics.median(self.cpu_s[m] / self.live_s[m] for m in shared) if shared else 1.0
        return self.mean_s[n] * ratio

    def predict(self, n: int) -> float:
        measured = self.mean_s.get(n)
        if measured is not None:
            return measured
        a, b = self.line
        return a + b * n


def _least_squares(points: list[tuple[int, float]]) -> tuple[float, float]:
    if len(points) == 1:
        n, t = points[0]
        return 0.0, t / n
    mx = sum(n for n, _ in points) / len(points)
    my = sum(t for _, t in points) / len(points)
    sxx = sum((n - mx) ** 2 for n, _ in points)
    b = sum((n - mx) * (t - my) for n, t in points) / sxx
    b = max(b, 0.0)
    a = my - b * mx
    if a < 0:  # through the origin instead
        a, b = 0.0, sum(n * t for n, t in points) / sum(n * n for n, _ in points)
    return a, b


class CostModel:
    """Learned batch times per shape; see the module docstring. Not thread-safe: the loop owns it."""

    def __init__(self, alpha: float = EWMA_ALPHA, tolerance: float = THROUGHPUT_TOLERANCE,
                 rank_by_cpu: bool = False) -> None:
        self._alpha = alpha
        self._tolerance = tolerance
        self.rank_by_cpu = rank_by_cpu
        self._shapes: dict[Shape, _ShapeCost] = {}
        self._profiles: dict[Shape, _ShapeCost | None] = {}  # merged views, dropped on every observation
        # Bumped on every observation, so a caller can tell its cached choices are stale.
        self.version = 0
        self._chosen: dict[tuple[Shape, int], int] = {}  # (shape, cap) -> the size best_size chose last

    def observe(self, shape: Shape, n: int, seconds: float, calibration: bool = False,
                cpu_seconds: float | None = None) -> None:
        """Record one measured batch of `n` frames of `shape` that took `seconds` (preprocess + inference) and
        `cpu_seconds` of thread CPU (its preparation's and its inference's threads; None: not measured); with
        `calibration`, a warm-up timing (see the module docstring)."""
        if n < 1 or not math.isfinite(seconds) or seconds <= 0:
            return
        if cpu_seconds is not None and (not math.isfinite(cpu_seconds) or cpu_seconds <= 0):
            cpu_seconds = None
        key: Shape = tuple(shape)  # type: ignore[assignment]
        cost = self._shapes.get(key)
        if cost is None:
            cost = self._shapes[key] = _ShapeCost()
        cost.measured(n, seconds, self._alpha, calibration, cpu_seconds)
        self._profiles.clear()
        self.version += 1

    def known(self, shape: Shape) -> bool:
        return tuple(shape) in self._shapes

    def predict(self, shape: Shape, n: int) -> float | None:
        """Predicted seconds for a batch of `n` frames of `shape`; None when no shape of its channels is known."""
        if n < 1:
            return 0.0
        profile = self._profile(tuple(shape))  # type: ignore[arg-type]
        return None if profile is None else profile.predict(n)

    def line(self, shape: Shape) -> tuple[float, float] | None:
        """The fitted (a seconds, b seconds per frame) of a measured shape."""
        cost = self._shapes.get(tuple(shape))  # type: ignore[arg-type]
        return None if cost is None else cost.line

    def best_size(self, shape: Shape, cap: int) -> int | None:
        """The size <= cap with the most frames per second of device time (`rank_by_cpu`: per CPU second); None if
        nothing is known."""
        profile = self._profile(tuple(shape))  # type: ignore[arg-type]
        if profile is None:
            return None
        sizes = [n for n in profile.mean_s if n <= cap]
        if not sizes:
            return None
        cost = profile.cpu if self.rank_by_cpu else profile.mean_s.__getitem__
        rate = {n: n / (cost(n) + BATCH_OVERHEAD_S) for n in sizes}
        best = max(rate.values())
        near = [n for n in sizes if rate[n] >= best * (1.0 - self._tolerance)]
        key = (tuple(shape), cap)
        last = self._chosen.get(key)  # type: ignore[arg-type]
        chosen = last if last in near else max(near)
        self._chosen[key] = chosen  # type: ignore[index]
        own = self._shapes.get(tuple(shape))  # type: ignore[arg-type]
        if own is not None and own.live_count.get(chosen, 0) >= EXPLORE_AFTER:
            ordered = sorted(sizes)
            i = ordered.index(chosen)
            for n in ordered[i + 1:i + 2] + ordered[max(0, i - 1):i]:  # the larger neighbour first
                if own.wants_trial(n):
                    return n  # a trial: the choice stays until the trial's measurements say otherwise
        return chosen

    def _profile(self, shape: Shape) -> _ShapeCost | None:
        """The shape's own measurements, completed with the sizes only a reference shape (the same channels, the
        most sizes measured: the warm-up calibration) has, scaled to this shape. Without the completion a shape
        first seen in small batches would only ever know small sizes and keep choosing them."""
        if shape in self._profiles:
            return self._profiles[shape]
        own = self._shapes.get(shape)
        others = [s for s in self._shapes if s != shape and s[2] == shape[2]]
        area = shape[0] * shape[1]
        ref_shape = max(others, key=lambda s: (len(self._shapes[s].mean_s),
                                               -abs(math.log(max(1, s[0] * s[1]) / max(1, area)))), default=None)
        ref = None if ref_shape is None else self._shapes[ref_shape]
        if ref is None or (own is not None and set(ref.mean_s) <= set(own.mean_s)):
            profile = own
        else:
            assert ref_shape is not None
            shared = [n for n in ref.mean_s if own is not None and n in own.mean_s]
            if shared and own is not None:
                ratio = statistics.median(own.mean_s[n] / ref.mean_s[n] for n in shared)
            else:
                ratio = area / max(1, ref_shape[0] * ref_shape[1])
            profile = _ShapeCost()
            for n in ref.mean_s:
                profile.mean_s[n] = ref.mean_s[n] * ratio
            if own is not None:
                profile.mean_s.update(own.mean_s)
                profile.live_s, profile.cpu_s = own.live_s, own.cpu_s
        self._profiles[shape] = profile
        return profile

    def largest_within(self, shape: Shape, seconds: float, cap: int) -> int | None:
        """The largest n <= cap predicted to take at most `seconds`; 0 if not even one frame; None if unknown."""
        profile = self._profile(tuple(shape))  # type: ignore[arg-type]
        if profile is None:
            return None
        lo, hi = 0, cap
        while lo < hi:  # predictions grow with n (b >= 0, means of larger sizes are larger in practice)
            mid = (lo + hi + 1) // 2
            if profile.predict(mid) <= seconds + 1e-9:  # clock rounding must not cost a frame
                lo = mid
            else:
                hi = mid - 1
        return lo

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Per shape "HxWxC": the line and the measured means (for logs and benchmarks)."""
        return {f"{h}x{w}x{c}": {"a_ms": cost.line[0] * 1000.0, "b_ms": cost.line[1] * 1000.0,
                                 **{f"n{n}_ms": t * 1000.0 for n, t in sorted(cost.mean_s.items())}}
                for (h, w, c), cost in self._shapes.items()}
