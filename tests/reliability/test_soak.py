"""Soak: a steady open-loop rate (capture_ts_ms is the intended send time) for a minute. Nothing lost, the
worker's RSS flat after warm-up (the first third), p99 latency of the last third no worse than the first's,
lag bounded."""

from __future__ import annotations

import pytest

from . import faults
from .conftest import assert_kept
from .harness import MODES, Lab

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SOAK_S = 60.0
RATE_FPS = 100.0
MIB = 1.0


def rss_growth_allowed(warm_mib: float) -> float:
    """Allocator noise, not a leak: 16 MiB or 5% of the warmed-up RSS, whichever is larger."""
    return max(16.0 * MIB, 0.05 * warm_mib)


def p99_drift_allowed(first_p99_ms: float) -> float:
    """Scheduling noise on a shared 2-core machine, not a trend: 50 ms or half the first third's p99."""
    return max(50.0, 0.5 * first_p99_ms)


@pytest.mark.parametrize("mode", MODES)
def test_a_steady_rate_for_a_minute_keeps_memory_flat_and_p99_steady(lab: Lab, mode: str) -> None:
    outcome = assert_kept(faults.soak(lab, mode, SOAK_S, RATE_FPS))
    soak = outcome.notes["soak"]
    assert all(n > 0 for n in soak["results_per_third"]), soak
    assert soak["rss_growth_mib"] <= rss_growth_allowed(soak["rss_warm_mib"]), soak
    assert soak["p99_drift_ms"] <= p99_drift_allowed(soak["p99_ms"][0]), soak
    assert soak["max_lag"] <= RATE_FPS * 2, soak
