"""Worker processes dying, stopping, freezing, joining and leaving while frames flow: nothing is lost, and in
exactly-once mode a read_committed reader sees every frame answered once."""

from __future__ import annotations

import pytest

from . import faults
from .conftest import assert_kept
from .harness import MODES, WORKER_IDS, Lab
from .recovery import RecoverySummary

pytestmark = pytest.mark.integration

ALO, EOS = MODES


# -- SIGKILL ----------------------------------------------------------------------------------------------------
def test_sigkill_at_20_50_80_percent_loses_nothing(lab: Lab) -> None:
    """Three kills (mid-batch, at a random moment, after produce before commit), a new process each time."""
    outcome = assert_kept(faults.sigkill(lab, ALO, faults.QUICK))
    assert outcome.faults_injected == 3, outcome.notes


# A process restarted by a supervisor (the same command, on the same host) answers again this soon when it has the
# dead one's transactional id; with a fresh id the dead one's transaction holds its partitions for up to
# transaction.timeout.ms (30 s) plus the broker's abort check (10 s).
SUPERVISED_RESTART_RECOVERY_S = 10.0


@pytest.mark.slow
@pytest.mark.parametrize("worker_ids", WORKER_IDS)
def test_sigkill_at_20_50_80_percent_exactly_once_answers_each_frame_once(lab: Lab, worker_ids: str) -> None:
    """Each kill is followed at once by a new process, as a supervisor restarts one. With default settings (no worker
    id) it takes the dead one's slot, hence its worker and transactional ids, and fences its open transaction, as
    with a fixed id; with fresh ids the dead one's transaction stays open and holds the committed offsets of its
    partitions until the broker aborts it."""
    outcome = assert_kept(faults.sigkill(lab.with_worker_ids(worker_ids), EOS, faults.QUICK))
    if worker_ids != "fresh":
        recovery = RecoverySummary.of(outcome.recovery)
        assert recovery.partitions and not recovery.unanswered, outcome.recovery
        assert recovery.median_s is not None and recovery.median_s <= SUPERVISED_RESTART_RECOVERY_S, recovery


@pytest.mark.slow
def test_sigkill_with_default_worker_ids_loses_nothing(lab: Lab) -> None:
    assert_kept(faults.sigkill(lab.with_worker_ids("default"), ALO, faults.QUICK))


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("worker_ids", ["default", "fresh"])
def test_three_workers_sigkilled_in_turn_every_few_seconds_keep_the_promise(lab: Lab, mode: str,
                                                                          worker_ids: str) -> None:
    outcome = assert_kept(faults.sigkill_churn(lab.with_worker_ids(worker_ids), mode, faults.QUICK))
    assert outcome.faults_injected >= faults.MIN_CHURNS, outcome.notes


def test_exactly_once_kill_while_an_earlier_frame_is_held_answers_each_frame_once(lab: Lab) -> None:
    outcome = faults.kill_with_held_frame(lab, EOS, faults.QUICK)
    assert outcome.notes.get("held_ran_before_kill") is False, f"the kill missed its window: {outcome.notes}"
    assert_kept(outcome)


@pytest.mark.slow
def test_kill_while_an_earlier_frame_is_held_loses_nothing(lab: Lab) -> None:
    assert_kept(faults.kill_with_held_frame(lab, ALO, faults.QUICK))


# -- SIGTERM ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [ALO, pytest.param(EOS, marks=pytest.mark.slow)])
def test_sigterm_with_batches_in_flight_drains_and_redoes_nothing(lab: Lab, mode: str) -> None:
    outcome = assert_kept(faults.sigterm_drain(lab, mode, faults.QUICK))
    assert outcome.notes["drain_rc"] == 0 and outcome.notes["drain_s"] < 30, outcome.notes


# -- freezes: the zombie, and partitions lost while a batch runs --------------------------------------------------
@pytest.mark.slow
def test_zombie_past_its_poll_interval_rejoins_without_loss(lab: Lab) -> None:
    assert_kept(faults.zombie(lab, ALO, faults.QUICK))


@pytest.mark.slow
def test_zombie_past_its_poll_interval_is_fenced_exactly_once(lab: Lab) -> None:
    assert_kept(faults.zombie(lab, EOS, faults.QUICK))


@pytest.mark.slow
def test_partitions_lost_mid_batch_loses_nothing_and_crashes_nothing(pausable_lab: Lab) -> None:
    assert_kept(faults.partitions_lost_mid_batch(pausable_lab, ALO, faults.QUICK))


@pytest.mark.slow
def test_exactly_once_output_of_lost_partitions_is_not_committed(pausable_lab: Lab) -> None:
    assert_kept(faults.partitions_lost_mid_batch(pausable_lab, EOS, faults.QUICK))


# -- consumer-group churn ----------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("static", [True, False], ids=["static members", "dynamic members"])
def test_three_workers_joining_and_leaving_every_few_seconds_lose_nothing(lab: Lab, mode: str, static: bool) -> None:
    outcome = assert_kept(faults.group_churn(lab, mode, faults.QUICK, static=static))
    assert outcome.faults_injected >= faults.MIN_CHURNS, outcome.notes
