"""Fixtures shared by the integration tests that run workers' pipelines in this process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.test_rebalance_transactions import InProcessWorker


@pytest.fixture
def workers() -> Iterator[list[InProcessWorker]]:
    """The in-process workers a test starts (it appends them), halted after it unless it stopped them."""
    started: list[InProcessWorker] = []
    yield started
    for w in started:
        if not w.stop.is_set():
            w.halt()
