"""A model slower than the poll interval, and a model that raises on some inputs."""

from __future__ import annotations

import pytest

from . import faults
from .conftest import assert_kept
from .harness import MODES, Lab

pytestmark = pytest.mark.integration

ALO, EOS = MODES


@pytest.mark.parametrize("mode", [ALO, pytest.param(EOS, marks=pytest.mark.slow)])
def test_a_model_stalling_past_the_poll_interval_causes_no_rebalance_and_the_lag_drains(lab: Lab, mode: str) -> None:
    outcome = assert_kept(faults.slow_model(lab, mode, faults.QUICK))
    events = outcome.notes["events"]
    assert events.get("assigned") == 1 and not events.get("revoked") and not events.get("lost"), events


@pytest.mark.parametrize("mode", [ALO, pytest.param(EOS, marks=pytest.mark.slow)])
def test_a_model_raising_on_some_frames_dead_letters_only_those(lab: Lab, mode: str) -> None:
    outcome = assert_kept(faults.poison_model(lab, mode, faults.QUICK))
    assert outcome.audit.dead_letters == outcome.faults_injected
    assert set(outcome.audit.error_types) == {"ModelError"}
