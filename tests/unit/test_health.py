"""/healthz and /readyz over real HTTP, with a fake clock for the loop-stall check."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from tests.integration.helpers import http_get as get
from worker.metrics import Health, Metrics, MetricsServer
from worker.testing import FakeClock


@dataclass
class SourceStub:
    """What Health reads of the frame source (worker.metrics.Watched), set by a test."""

    assignment: frozenset[tuple[str, int]] = frozenset()
    cluster_problem: Callable[[], str | None] = lambda: None
    registry_problem: Callable[[], str | None] = lambda: None


OWNING = frozenset({("frames.bulk", 0)})


@pytest.fixture
def served() -> Iterator[tuple[Health, FakeClock, int]]:
    clock = FakeClock(1000.0)
    health = Health(stall_limit_s=300.0, clock=clock)
    server = MetricsServer(Metrics(), health, "127.0.0.1", 0).start()
    yield health, clock, server.port
    server.stop()


def test_a_loop_that_stops_turning_fails_liveness_and_readiness(served: tuple[Health, FakeClock, int]) -> None:
    health, clock, port = served
    health.warmed_up, health.source = True, SourceStub(OWNING)
    assert get(port, "/healthz") == (200, "ok\n")  # before the loop starts (warm-up) it is alive
    health.beat()
    clock.now += 300.0
    assert get(port, "/healthz")[0] == 200 and get(port, "/readyz")[0] == 200
    clock.now += 1.0
    status, body = get(port, "/healthz")
    assert status == 503 and "has not turned for 301s" in body
    assert get(port, "/readyz")[0] == 503
    health.beat()  # the loop turns again (the stuck call returned): healthy again
    assert get(port, "/healthz")[0] == 200


def test_a_stopped_pipeline_is_dead(served: tuple[Health, FakeClock, int]) -> None:
    health, _clock, port = served
    health.alive = False
    assert get(port, "/healthz") == (503, "dead\n")


def test_metrics_report_seconds_since_the_loop_last_turned(served: tuple[Health, FakeClock, int]) -> None:
    health, clock, port = served

    def stalled() -> float:
        lines = get(port, "/metrics")[1].splitlines()
        (line,) = [ln for ln in lines if ln.startswith("streamfer_loop_stalled_seconds ")]
        return float(line.split()[1])

    assert stalled() == 0.0  # the loop has not started: nothing is stalled
    health.beat()
    clock.now += 42.5
    assert stalled() == 42.5
    health.beat()
    assert stalled() == 0.0


def test_debug_profile_returns_the_trace_of_the_requested_batches() -> None:
    asked: list[int] = []

    def profile(batches: int) -> str:
        asked.append(batches)
        return "/tmp/trace.json"

    server = MetricsServer(Metrics(), Health(), "127.0.0.1", 0, profile=profile).start()
    try:
        assert get(server.port, "/debug/profile?batches=5") == (200, "/tmp/trace.json\n")
        assert get(server.port, "/debug/profile?batches=x")[0] == 400
        assert asked == [5]
    finally:
        server.stop()


def test_debug_profile_is_absent_without_a_runtime(served: tuple[Health, FakeClock, int]) -> None:
    assert get(served[2], "/debug/profile")[0] == 404


def test_readiness_reads_the_sources_assignment_at_each_probe() -> None:
    source = SourceStub()
    health = Health(warmed_up=True)
    assert not health.assigned and not health.ready  # no source yet (start-up)
    health.source = source
    assert not health.ready
    source.assignment = OWNING
    assert health.assigned and health.ready
    source.assignment = frozenset()  # revoked, lost, or the source closed
    assert not health.ready
