"""Settings given the way operators give them, through `WORKER_*` environment variables, start a real worker."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from worker.testing import RunningWorker

pytestmark = pytest.mark.integration


def test_a_worker_starts_with_a_lower_case_log_level_and_logs_at_it(
        streamfer_worker: Callable[..., RunningWorker]) -> None:
    worker = streamfer_worker(env={"WORKER_OBSERVABILITY_LOG_LEVEL": "debug"})  # returns once /readyz answers 200
    assert worker.alive()
    # The executor's warm-up line is logged at DEBUG before the worker turns ready: the level took effect.
    assert re.search(r" DEBUG \[w0\] worker\.runtime\.executor: runtime warm-up done", worker.log()), worker.log()
