"""How long the loop's poll blocks: while batches run, for part of their predicted time rather than a fixed 2 ms
slice (each slice is a loop turn of CPU), never past a batch due or the idle bound."""

from __future__ import annotations

import pytest

from worker.batching import Batch
from worker.frames import Priority
from worker.inflight import InFlight
from worker.metrics import Metrics
from worker.pipeline import IDLE_POLL_S, INFLIGHT_POLL_S, poll_timeout
from worker.testing.fakes import FakeExecutor


def batch(released_at: float, predicted_s: float | None) -> Batch:
    return Batch(frames=(), shape=(8, 8, 3), priority=Priority.STANDARD, lane="main", padding_waste=0.0,
                 released_at=released_at, reason="full", predicted_s=predicted_s)


def running(*batches: Batch) -> InFlight:
    inflight = InFlight(batcher=None, runtime=FakeExecutor(hold=True), limit=4,  # type: ignore[arg-type]
                        release_when_idle=True, metrics=Metrics())
    for b in batches:
        inflight.dispatch(b)
    return inflight


def test_nothing_running_blocks_until_the_next_batch_is_due_at_most_the_idle_bound() -> None:
    assert poll_timeout(now=10.0, due=None, next_finish=None, outputs_waiting=False) == IDLE_POLL_S
    assert poll_timeout(now=10.0, due=10.03, next_finish=None, outputs_waiting=False) == pytest.approx(0.03)
    assert poll_timeout(now=10.0, due=9.0, next_finish=None, outputs_waiting=False) == 0.0


def test_a_long_running_batch_is_waited_for_in_halves_of_its_predicted_remaining_time() -> None:
    assert poll_timeout(now=10.0, due=None, next_finish=10.08, outputs_waiting=False) == pytest.approx(0.04)
    assert poll_timeout(now=10.04, due=None, next_finish=10.08, outputs_waiting=False) == pytest.approx(0.02)
    # near or past its prediction: the short slice, so an overrunning batch is collected soon after it ends
    assert poll_timeout(now=10.079, due=None, next_finish=10.08, outputs_waiting=False) == INFLIGHT_POLL_S
    assert poll_timeout(now=10.2, due=None, next_finish=10.08, outputs_waiting=False) == INFLIGHT_POLL_S


def test_a_batch_due_or_outputs_waiting_cut_the_wait_for_a_running_batch_short() -> None:
    assert poll_timeout(now=10.0, due=10.005, next_finish=10.5, outputs_waiting=False) == pytest.approx(0.005)
    # a batch already due while others run waits for a slot, which only a finished batch frees: no busy turns
    assert poll_timeout(now=10.0, due=9.9, next_finish=10.08, outputs_waiting=False) == pytest.approx(0.04)
    assert poll_timeout(now=10.0, due=None, next_finish=10.5, outputs_waiting=True) == INFLIGHT_POLL_S
    assert poll_timeout(now=10.0, due=None, next_finish=12.0, outputs_waiting=False) == IDLE_POLL_S


def test_the_first_running_batch_to_finish_sets_the_wait_and_one_without_a_prediction_polls_soon() -> None:
    assert running().next_finish() is None
    assert running(batch(10.0, 0.5), batch(10.1, 0.2)).next_finish() == pytest.approx(10.3)
    unknown = running(batch(10.0, 0.5), batch(10.1, None)).next_finish()
    assert unknown is not None
    assert poll_timeout(now=10.2, due=None, next_finish=unknown, outputs_waiting=False) == INFLIGHT_POLL_S
