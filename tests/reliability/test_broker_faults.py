"""The broker goes away while frames flow (restart, kill -9, a 10 s outage with a full producer queue) and comes
back on the same address: the worker reconnects within RECONNECT_BOUND_S, without operator action, and loses
nothing. These stop a broker of their own (restartable_lab), so no other test sees the outage."""

from __future__ import annotations

import pytest

from . import faults
from .conftest import assert_kept
from .harness import MODES, Lab

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.parametrize("mode", MODES)
def test_a_clean_broker_restart_mid_stream_loses_nothing(restartable_lab: Lab, mode: str) -> None:
    outcome = assert_kept(faults.broker_restart(restartable_lab, mode, faults.QUICK))
    assert outcome.notes["resumed_after_s"] <= faults.RECONNECT_BOUND_S


@pytest.mark.parametrize("mode", MODES)
def test_a_broker_killed_mid_transaction_loses_nothing(restartable_lab: Lab, mode: str) -> None:
    outcome = assert_kept(faults.broker_kill9(restartable_lab, mode, faults.QUICK))
    assert outcome.notes["resumed_after_s"] <= faults.RECONNECT_BOUND_S


@pytest.mark.parametrize("mode", MODES)
def test_an_unreachable_output_path_with_a_full_queue_backpressures_and_loses_nothing(
        restartable_lab: Lab, mode: str) -> None:
    assert_kept(faults.output_path_down(restartable_lab, mode, faults.QUICK))
