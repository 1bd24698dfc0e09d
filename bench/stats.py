"""How the benchmarks turn rounds into figures: interleaved rounds, per-round ratios, median with min and max,
CPU time per frame. Pure (no Kafka, no torch), so it is unit-tested (tests/unit/test_bench_stats.py).

Every ratio is the median of per-round ratios of interleaved rounds (A B C A B C ...), shown with its min and
max; never the best round. Background load on a shared machine hits the variants of one round alike, so a
per-round ratio cancels much of it; the spread says how much was left.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Spread:
    """Median, min and max of a figure over rounds (NaN rounds left out; `n` counts the ones kept)."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        kept = [float(v) for v in values if v is not None and not math.isnan(v)]
        if not kept:
            return cls(float("nan"), float("nan"), float("nan"), 0)
        return cls(statistics.median(kept), min(kept), max(kept), len(kept))

    def text(self, digits: int | None = None, suffix: str = "") -> str:
        """'0.55 (0.44-0.87)': the median, then min-max over the rounds ('n/a' with no rounds)."""
        if self.n == 0:
            return "n/a"
        f = _formatter(self.median, digits)
        if self.n == 1:
            return f"{f(self.median)}{suffix} (1 round)"
        return f"{f(self.median)}{suffix} ({f(self.low)}-{f(self.high)})"

    def as_dict(self) -> dict[str, Any]:
        return {"median": _finite(self.median), "min": _finite(self.low), "max": _finite(self.high), "rounds": self.n}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Spread:
        """as_dict() back to a Spread (a figure read from a benchmark's JSON)."""
        def value(key: str) -> float:
            return float("nan") if d[key] is None else float(d[key])

        return cls(value("median"), value("min"), value("max"), int(d["rounds"]))


def _finite(v: float) -> float | None:
    return None if math.isnan(v) else v


def _formatter(v: float, digits: int | None) -> Callable[[float], str]:
    if digits is None:
        digits = 0 if abs(v) >= 100 else (1 if abs(v) >= 10 else 2)
    return lambda x: f"{x:.{digits}f}"


def interleaved(variants: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """The order to run variants in: round 1 A B C, round 2 A B C, ... as (round, variant), rounds from 1."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    return [(r, v) for r in range(1, rounds + 1) for v in variants]


def rotating(variants: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """The order to run variants in when which goes first matters (a machine drifting during a round): each round
    runs every variant once, round r starting r-1 places further along (A B C, B C A, C A B, ...; for two: A B,
    B A), so each goes first equally often. As (round, variant), rounds from 1."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    k = len(variants)
    return [(r, variants[(r - 1 + i) % k]) for r in range(1, rounds + 1) for i in range(k)]


def rounds(n: int) -> str:
    """'1 round', '3 rounds': the rounds column of the summary."""
    return f"{n} round" if n == 1 else f"{n} rounds"


def met(ok: bool) -> str:
    """A goal's verdict as every table writes it: 'met' or 'NOT met'."""
    return "met" if ok else "NOT met"


def run_rounds(order: Sequence[tuple[int, str]], measure: Callable[[str], dict[str, Any]],
               log: Callable[[str], None] = print) -> dict[str, dict[int, dict[str, Any]]]:
    """Measure each (round, variant) of `order` (interleaved or rotating): {variant: {round: figures}}. A run that
    raises RuntimeError (a consumer that crashed or stalled) is kept as {"failed": its message}: a finding, listed
    with the table and left out of the medians (its figures are NaN)."""
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    for r, variant in order:
        try:
            runs.setdefault(variant, {})[r] = measure(variant)
        except RuntimeError as exc:
            runs.setdefault(variant, {})[r] = {"failed": str(exc)}
            log(f"round {r} {variant} FAILED: {failure_line(str(exc))}")
    return runs


def failure_line(text: str) -> str:
    """The line of a failure's text (a process's log tail) that names the error, else its first line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "Exception" in ln]
    return (errors[-1] if errors else lines[0] if lines else "")[:300]


def figure(runs: Mapping[int, Mapping[str, Any]], key: str) -> dict[int, float]:
    """One figure of every round of one variant, {round: value}; NaN for a failed round or a missing figure."""
    return {r: float(t.get(key, float("nan"))) for r, t in runs.items()}


def spread(runs: Mapping[int, Mapping[str, Any]], key: str) -> Spread:
    """Median (min-max) of one figure over a variant's rounds (failed ones left out)."""
    return Spread.of(list(figure(runs, key).values()))


def failures(runs: Mapping[str, Mapping[int, Mapping[str, Any]]]) -> list[str]:
    """'round 2 b: <error line>' for every failed run."""
    return [f"round {r} {v}: {failure_line(t['failed'])}" for v, by in runs.items() for r, t in by.items()
            if "failed" in t]


def round_ratios(numerator: Mapping[int, float], denominator: Mapping[int, float]) -> list[float]:
    """numerator / denominator of each round both were measured in (rounds keyed by number), in round order."""
    out = []
    for r in sorted(set(numerator) & set(denominator)):
        a, b = numerator[r], denominator[r]
        out.append(a / b if b and not math.isnan(a) and not math.isnan(b) else float("nan"))
    return out


def ratio_spread(numerator: Mapping[int, float], denominator: Mapping[int, float]) -> Spread:
    """Median (min-max) of the per-round ratios: the way every ratio in bench/ is reported."""
    return Spread.of(round_ratios(numerator, denominator))


def cpu_ms_per_frame(cpu_s: float | None, frames: int) -> float:
    """Process CPU time per frame in milliseconds (NaN when unknown or no frames)."""
    if cpu_s is None or frames <= 0 or math.isnan(cpu_s):
        return float("nan")
    return cpu_s * 1000.0 / frames


def cpu_between(samples: Sequence[tuple[float, float]], t0: float, t1: float) -> float:
    """CPU seconds used between wall times t0 and t1, from (wall time, cumulative CPU seconds) samples in time
    order, linearly interpolated between samples. NaN when [t0, t1] is not inside the sampled span."""
    if len(samples) < 2 or t1 < t0 or t0 < samples[0][0] or t1 > samples[-1][0]:
        return float("nan")
    return _cpu_at(samples, t1) - _cpu_at(samples, t0)


def _cpu_at(samples: Sequence[tuple[float, float]], t: float) -> float:
    times = [s[0] for s in samples]
    i = bisect.bisect_left(times, t)
    if i < len(samples) and times[i] == t:
        return samples[i][1]
    (ta, ca), (tb, cb) = samples[i - 1], samples[i]
    return ca + (cb - ca) * (t - ta) / (tb - ta) if tb > ta else cb


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted sequence (NaN when empty)."""
    if not sorted_values:
        return float("nan")
    return float(sorted_values[max(0, min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1))])
