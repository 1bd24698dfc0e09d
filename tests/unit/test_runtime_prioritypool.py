"""PriorityPool: the most urgent job first, FIFO within a priority, and close() finishes what was queued."""

from __future__ import annotations

import threading

import pytest

from worker.runtime.prioritypool import PriorityPool


def test_the_most_urgent_waiting_job_runs_next_fifo_within_a_priority_and_close_finishes_the_queue() -> None:
    pool = PriorityPool(1, "test-pool")
    gate, order = threading.Event(), []
    blocker = pool.submit(0, gate.wait)  # holds the only thread while the rest queue up
    futures = [pool.submit(p, order.append, name) for p, name in ((2, "bulk-1"), (1, "standard"), (2, "bulk-2"),
                                                                   (0, "realtime"))]
    gate.set()
    pool.shutdown()
    assert blocker.done() and all(f.done() for f in futures)
    assert order == ["realtime", "standard", "bulk-1", "bulk-2"]
    with pytest.raises(RuntimeError, match="closed pool"):
        pool.submit(0, order.append, "late")


def test_a_job_that_raises_hands_its_error_to_the_caller_and_the_thread_serves_on() -> None:
    pool = PriorityPool(1, "test-pool")
    try:
        failing = pool.submit(0, lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            failing.result(timeout=30)
        assert pool.submit(0, lambda: 42).result(timeout=30) == 42
    finally:
        pool.shutdown()
