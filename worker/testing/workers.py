"""`worker run` processes for a test or a benchmark: started on a test's topics with the worker's own env syntax,
ready once /readyz answers, stopped with a drain; and the small waits around them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker.errors import StreamferError

if TYPE_CHECKING:
    from worker.testing.kafka import TestTopics


class WorkerStartError(StreamferError):
    """A worker started by the test kit exited or did not become ready; the message ends with its log."""


# -- worker processes ------------------------------------------------------------------------------------
# Small batching waits and one torch thread keep tests quick; expiry is off because tests publish backlogs
# before a worker starts (pass max_age_ms settings to test expiry).
TEST_ENV = {"WORKER_RUNTIME_TORCH_THREADS": "1", "WORKER_RUNTIME_WARMUP_BATCHES": "1",
            "WORKER_KAFKA_SESSION_TIMEOUT_MS": "6000", "WORKER_KAFKA_MAX_POLL_INTERVAL_MS": "60000",
            "WORKER_BATCHING_REALTIME_MAX_AGE_MS": "0", "WORKER_BATCHING_STANDARD_MAX_AGE_MS": "0"}


def settings_env(settings: Mapping[str, Any], prefix: str = "WORKER") -> dict[str, str]:
    """{"batching": {"realtime": {"max_wait_ms": 5}}} -> {"WORKER_BATCHING_REALTIME_MAX_WAIT_MS": "5"}: the
    worker's own env syntax (lists comma-separated, table settings such as tenant_weights key=value)."""
    out: dict[str, str] = {}
    for key, value in settings.items():
        name = f"{prefix}_{key}".upper()
        if isinstance(value, Mapping) and key not in _table_settings():
            out.update(settings_env(value, name))
        elif isinstance(value, Mapping):
            out[name] = ",".join(f"{k}={v}" for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            out[name] = ",".join(str(v) for v in value)
        elif isinstance(value, bool):
            out[name] = "true" if value else "false"
        else:
            out[name] = str(value)
    return out


def _table_settings() -> set[str]:
    """Names of settings whose value is a table (consumer_overrides, tenant_weights, ...), not a section."""
    import dataclasses

    from worker.config import Settings

    names: set[str] = set()
    pending: list[Any] = [Settings]
    while pending:
        for f in dataclasses.fields(pending.pop()):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if dataclasses.is_dataclass(default):
                pending.append(type(default))
            elif isinstance(default, dict):
                names.add(f.name)
    return names


def start_worker(bootstrap: str, topics: TestTopics, extra_env: dict[str, str] | None = None,
                 exit_when_idle: float | None = None, worker_id: str | None = "w0",
                 log_path: str | None = None, test_env: bool = True) -> subprocess.Popen:
    """A `worker run` process with the test's topics (not waited for: see `streamfer_worker` for that).

    `worker_id` None leaves the worker its default id (`<hostname>-<slot>`, the lowest slot free on this host for the
    test's transactional id prefix: a process started after another of the same prefix exited gets its id again).
    `test_env` False leaves out TEST_ENV: the worker's own defaults, as a benchmark measures them."""
    env = dict(os.environ)
    env.update(topics.env())
    env.pop("WORKER_OBSERVABILITY_WORKER_ID", None)
    if worker_id is not None:
        env["WORKER_OBSERVABILITY_WORKER_ID"] = worker_id
    env.update({"WORKER_KAFKA_BOOTSTRAP_SERVERS": bootstrap, "WORKER_OBSERVABILITY_METRICS_PORT": "0",
                "PYTHONUNBUFFERED": "1"})
    env.update(TEST_ENV if test_env else {})
    env.update(extra_env or {})
    argv = [sys.executable, "-m", "worker", "run"]
    if exit_when_idle is not None:
        argv += ["--exit-when-idle", str(exit_when_idle)]
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT if log_path else subprocess.DEVNULL)


@dataclass
class RunningWorker:
    """A `worker run` process (that answered /readyz, unless started with ready=False); `stop()` sends SIGTERM (a
    drain) and returns its exit code."""

    process: subprocess.Popen
    port: int
    log_path: Path
    worker_id: str

    def get(self, path: str) -> tuple[int, str]:
        return http_get(self.port, path)

    def metrics(self) -> str:
        """The /metrics text exposition."""
        status, body = self.get("/metrics")
        assert status == 200, f"/metrics answered {status}"
        return body

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
            raise


def run_worker(bootstrap: str, topics: TestTopics, log_dir: Path, settings: Mapping[str, Any] | None = None,
               env: Mapping[str, str] | None = None, worker_id: str = "w0", ready_timeout_s: float = 120.0,
               ready: bool = True, test_env: bool = True) -> RunningWorker:
    """Start `worker run` with the test's topics and `settings` (nested like the TOML file) and wait until
    /readyz answers 200: warmed up and partitions assigned. `ready` False returns at once (a benchmark timing a
    backlog from the worker's start); `test_env` False: the worker's defaults instead of TEST_ENV's."""
    from worker.tools.local_broker import free_port

    port = free_port()
    log_path = log_dir / f"worker-{worker_id}.log"
    extra = {**settings_env(settings or {}), **dict(env or {}), "WORKER_OBSERVABILITY_METRICS_PORT": str(port)}
    proc = start_worker(bootstrap, topics, extra_env=extra, worker_id=worker_id, log_path=str(log_path),
                        test_env=test_env)
    worker = RunningWorker(proc, port, log_path, worker_id)
    if not ready:
        return worker
    deadline = time.monotonic() + ready_timeout_s
    while worker.get("/readyz")[0] != 200:
        if proc.poll() is not None:
            raise WorkerStartError(f"worker {worker_id} exited with {proc.returncode} before it was ready:\n"
                                   f"{worker.log()[-3000:]}")
        if time.monotonic() > deadline:
            worker.stop(timeout_s=10)
            raise WorkerStartError(f"worker {worker_id} was not ready after {ready_timeout_s}s:\n"
                                   f"{worker.log()[-3000:]}")
        time.sleep(0.1)
    return worker


def http_get(port: int, path: str, host: str = "127.0.0.1") -> tuple[int, str]:
    """Status and body of a GET on the worker's metrics port; (0, "") while nothing listens."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=2) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.2) -> None:
    """Poll a condition until it holds; fail with `what` after the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
