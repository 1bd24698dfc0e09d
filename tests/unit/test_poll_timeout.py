"""How long the loop's poll blocks: while batches run, for part of their predicted time rather than a fixed 2 ms
slice (each slice is a loop turn of CPU), never past a batch becoming due or the idle bound."""

from __future__ import annotations

import pytest

from worker.batching import Batch
from worker.frames import Priority
from worker.loop.inflight import FINISH_CHECK_MIN_S, FINISH_CHECK_SHARE, InFlight
from worker.loop.pipeline import IDLE_POLL_S, poll_timeout
from worker.metrics import Metrics
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
    assert running().wait_for_finish(10.0) is None
    assert poll_timeout(now=10.0, due=None, running_wait=None, outputs_waiting=False) == IDLE_POLL_S
    assert poll_timeout(now=10.0, due=10.03, running_wait=None, outputs_waiting=False) == pytest.approx(0.03)
    assert poll_timeout(now=10.0, due=9.0, running_wait=None, outputs_waiting=False) == 0.0


def test_a_running_batch_is_waited_for_in_halves_of_its_predicted_remaining_time() -> None:
    inflight = running(batch(10.0, 0.4))
    assert inflight.wait_for_finish(10.0) == pytest.approx(0.2)
    assert inflight.wait_for_finish(10.3) == pytest.approx(0.05)


def test_near_or_past_its_prediction_a_batch_is_looked_for_every_share_of_its_predicted_time() -> None:
    assert running(batch(10.0, 0.4)).wait_for_finish(10.39) == pytest.approx(0.4 * FINISH_CHECK_SHARE)
    assert running(batch(10.0, 0.4)).wait_for_finish(10.9) == pytest.approx(0.4 * FINISH_CHECK_SHARE)
    assert running(batch(10.0, 0.004)).wait_for_finish(10.01) == FINISH_CHECK_MIN_S  # a short batch: the floor


def test_the_first_running_batch_to_finish_sets_the_wait_and_one_without_a_prediction_is_looked_for_soon() -> None:
    assert running(batch(10.0, 0.5), batch(10.1, 0.2)).wait_for_finish(10.1) == pytest.approx(0.1)
    assert running(batch(10.0, 0.5), batch(10.1, None)).wait_for_finish(10.1) == FINISH_CHECK_MIN_S


def test_a_batch_becoming_due_or_outputs_waiting_cut_the_wait_short_and_one_already_due_does_not() -> None:
    assert poll_timeout(now=10.0, due=10.005, running_wait=0.2, outputs_waiting=False) == pytest.approx(0.005)
    # a batch already due while others run waits for a slot, which only a finished batch frees: no busy turns
    assert poll_timeout(now=10.0, due=9.9, running_wait=0.04, outputs_waiting=False) == pytest.approx(0.04)
    assert poll_timeout(now=10.0, due=None, running_wait=0.2, outputs_waiting=True) == FINISH_CHECK_MIN_S
    assert poll_timeout(now=10.0, due=None, running_wait=2.0, outputs_waiting=False) == IDLE_POLL_S
