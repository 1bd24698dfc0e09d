"""The test kit's pure parts: settings become the worker's env vars, and the plugin is registered once
whether it comes from the installed entry point or from this checkout's conftest."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from worker.config import load_settings
from worker.testing import settings_env

ROOT = Path(__file__).resolve().parents[2]


def test_nested_settings_become_worker_env_vars() -> None:
    env = settings_env({"batching": {"max_batch_size": 8, "realtime": {"max_wait_ms": 5},
                                     "preferred_batch_sizes": [4, 8], "tenant_weights": {"a": 2, "b": 1}},
                        "delivery": {"mode": "exactly_once"}, "observability": {"metrics_enabled": False}})
    assert env == {"WORKER_BATCHING_MAX_BATCH_SIZE": "8", "WORKER_BATCHING_REALTIME_MAX_WAIT_MS": "5",
                   "WORKER_BATCHING_PREFERRED_BATCH_SIZES": "4,8", "WORKER_BATCHING_TENANT_WEIGHTS": "a=2,b=1",
                   "WORKER_DELIVERY_MODE": "exactly_once", "WORKER_OBSERVABILITY_METRICS_ENABLED": "false"}


def test_the_worker_reads_those_env_vars_back_as_the_same_settings() -> None:
    settings = load_settings(None, env=settings_env({"batching": {"max_batch_size": 8, "realtime": {"max_wait_ms": 5},
                                                                  "tenant_weights": {"a": 2}},
                                                     "observability": {"metrics_enabled": False}}))
    assert settings.batching.max_batch_size == 8
    assert settings.batching.realtime.max_wait_ms == 5
    assert settings.batching.tenant_weights == {"a": 2}
    assert settings.observability.metrics_enabled is False


def test_the_entry_point_and_the_conftest_name_the_plugin_alike() -> None:
    # pytest skips a pytest_plugins entry already registered under that name: the same name means once.
    entry_points = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["pytest11"]
    assert entry_points == {"worker.testing": "worker.testing"}
    conftest = ast.parse((ROOT / "tests" / "conftest.py").read_text())
    (assign,) = [n for n in conftest.body if isinstance(n, ast.Assign) and n.targets[0].id == "pytest_plugins"]
    assert ast.literal_eval(assign.value) == ["worker.testing"]
