"""The worker's threads carry their Python names at the OS level (Linux), where top -H and /proc show them."""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from model_factories import jpeg_frame

from worker.config import ModelSettings, RuntimeSettings
from worker.metrics import Health, Metrics, MetricsServer
from worker.runtime.start import build_executor
from worker.threadnames import OS_NAME_MAX_BYTES, name_os_thread, os_thread_name

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OS thread names are read from /proc")


def os_names() -> set[str]:
    names = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            names.add((task / "comm").read_text().strip())
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return names


def await_os_name(name: str, timeout_s: float = 10.0) -> set[str]:
    """The OS thread names once one is `name` (a thread names itself when it starts), or the last seen."""
    deadline = time.monotonic() + timeout_s
    names = os_names()
    while name not in names and time.monotonic() < deadline:
        time.sleep(0.01)
        names = os_names()
    return names


def test_the_os_name_is_the_first_15_bytes_cut_at_a_character_boundary() -> None:
    assert os_thread_name("infer-cpu-0-0") == b"infer-cpu-0-0"
    assert os_thread_name("preprocess-worker-12") == b"preprocess-work"
    # "é" is two bytes: the 15th byte would be half of one, so the name stops before it.
    assert os_thread_name("decode-ééééééé") == "decode-éééé".encode()
    assert len(os_thread_name("x" * 40)) == OS_NAME_MAX_BYTES


@linux_only
def test_a_thread_that_names_itself_shows_its_python_name_in_proc() -> None:
    seen: dict[str, str] = {}

    def work() -> None:
        name_os_thread()
        seen["comm"] = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()

    t = threading.Thread(target=work, name="streamfer-test-thread")
    t.start()
    t.join()
    assert seen["comm"] == "streamfer-test-"


@linux_only
def test_the_executors_inference_preprocessing_and_decode_threads_are_named_in_proc() -> None:
    runtime = dataclasses.replace(RuntimeSettings(device="cpu", warmup_batches=1, graph_batch_sizes=(1, 4)),
                                  preprocess_threads=2)
    with build_executor(ModelSettings(), runtime) as ex:
        frames = [jpeg_frame(i) for i in range(4)]  # 4 frames on 2 decode threads: both decode a chunk
        outcome = ex.submit(frames, frames[0].shape).result(timeout=30)
        assert len(outcome.verdicts) == 4
        names = os_names()
    assert {"infer-cpu-0-0", "preprocess-0", "preprocess-1"} <= names
    assert any(n.startswith("decode_") for n in names), names


@linux_only
def test_the_metrics_servers_thread_is_named_in_proc() -> None:
    server = MetricsServer(Metrics(), Health(), "127.0.0.1", 0).start()
    try:
        assert "metrics-http" in await_os_name("metrics-http")
    finally:
        server.stop()
