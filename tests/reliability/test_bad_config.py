"""Bad configuration: every invalid setting stops `python -m worker run` at start-up with exit code 2 and an
error naming the setting (the cases: tests/reliability/configcases.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .configcases import CASES, CONFIG_ERROR_EXIT, TIMEOUT_S, Case, Outcome, env_for, problems, run_cases
from .harness import PROJECT_ROOT


@pytest.fixture(scope="module")
def outcomes(kafka_bootstrap: str) -> dict[str, Outcome]:
    return run_cases(kafka_bootstrap)


def _params():
    for name, case in CASES.items():
        marks = [pytest.mark.integration] if case.needs_broker else []
        yield pytest.param(name, id=name, marks=marks)


@pytest.mark.parametrize("name", list(_params()))
def test_invalid_setting_stops_start_up_with_exit_2_naming_it(name: str, outcomes: dict[str, Outcome]) -> None:
    got = outcomes[name]
    assert not problems(CASES[name], got), f"{problems(CASES[name], got)}; stderr:\n{got.stderr[-1500:]}"


def test_every_problem_is_reported_at_once() -> None:
    """Three bad settings: one start-up error naming all three (an operator fixes them in one go)."""
    env = env_for(Case({"WORKER_BATCHING_MAX_BATCH_SIZE": "0", "WORKER_DELIVERY_MODE": "maybe",
                        "WORKER_OBSERVABILITY_LOG_LEVEL": "loud"}, ""), "127.0.0.1:9")
    proc = subprocess.run([sys.executable, "-m", "worker", "run"], env=env, cwd=PROJECT_ROOT,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == CONFIG_ERROR_EXIT
    for name in ("batching.max_batch_size", "delivery.mode", "observability.log_level"):
        assert name in proc.stderr
