"""Fixtures of the fault suite: a Lab on the session's broker, and one on a broker of its own for the faults
that stop the broker (so no other test sees them)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from worker.tools.local_broker import LocalKafka

from .harness import Lab, RunOutcome


@pytest.fixture(scope="session")
def lab(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Lab:
    """Runs on the session's broker. It may be frozen for a moment (SIGSTOP/SIGCONT keeps its address) when
    the session started it (STREAMFER_TEST_BROKER_DIR), never restarted."""
    broker_dir = os.environ.get("STREAMFER_TEST_BROKER_DIR")
    return Lab(tmp_path_factory.mktemp("reliability"), fixed_bootstrap=kafka_bootstrap,
               pausable=LocalKafka(broker_dir) if broker_dir else None)


@pytest.fixture(scope="module")
def restartable_lab(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """A broker of its own that the tests stop, kill and restart; needs the project's local broker."""
    if not os.environ.get("STREAMFER_TEST_BROKER_DIR"):
        pytest.skip("restarting a broker needs the project's local Kafka (the session uses an external one)")
    lab = Lab.with_own_broker(tmp_path_factory.mktemp("restartable"))
    yield lab
    lab.close()


@pytest.fixture
def pausable_lab(lab: Lab) -> Lab:
    if lab.pausable is None or lab.pausable.running() is None:
        pytest.skip("freezing the broker needs the project's local Kafka (the session uses an external one)")
    return lab


def assert_kept(outcome: RunOutcome | None) -> RunOutcome:
    """The run kept its mode's promise: nothing lost, nothing misrouted, no crash, and (exactly-once or a
    clean stop) nothing duplicated; at-least-once duplicates within the in-flight bound per fault."""
    assert outcome is not None, "the fault could not be injected here"
    assert not outcome.problems(), outcome.describe()
    return outcome
