"""What an operator relies on: /metrics agrees with the frames, /readyz waits for warm-up and assignment,
and several processes of one group share the partitions."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest

from worker.frames import Encoding, Priority
from worker.tools.local_broker import free_port
from worker.tools.publish_frames import publish, synthetic_frames
from worker.tools.read_results import read_results

from .helpers import http_get, ledger, make_topics, start_worker, uncommitted, wait_for

pytestmark = pytest.mark.integration


def metric_sum(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}(\{{[^}}]*\}})? ([0-9.e+-]+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def test_metrics_agree_with_frames_and_readyz_waits_for_warm_up(kafka_bootstrap, unique, tmp_path):
    topics = make_topics(kafka_bootstrap, unique)
    port = free_port()
    log = tmp_path / "worker.log"
    # A long warm-up makes the not-ready window wide enough to observe.
    worker = start_worker(kafka_bootstrap, topics, log_path=str(log),
                          extra_env={"WORKER_OBSERVABILITY_METRICS_PORT": str(port),
                                     "WORKER_RUNTIME_WARMUP_BATCHES": "30"})
    try:
        seen: list[int] = []

        def ready() -> bool:
            seen.append(http_get(port, "/readyz")[0])
            return seen[-1] == 200

        wait_for(ready, 120, "/readyz to turn 200", interval_s=0.05)
        assert 503 in seen, f"/readyz was never observed not-ready before warm-up: {sorted(set(seen))}"
        assert "warmed up" in log.read_text() and "partitions assigned" in log.read_text()
        assert http_get(port, "/healthz")[0] == 200

        frames = list(synthetic_frames(90, [(32, 32), (40, 32)], Encoding.RAW_RGB8, Priority.STANDARD, unique))
        publish(kafka_bootstrap, topics.standard, iter(frames))
        results = read_results(kafka_bootstrap, topics.results, until=lambda rs: len(rs) >= 90, timeout_s=120)
        assert len(ledger(results)) == 90

        def counters_caught_up() -> bool:
            text = http_get(port, "/metrics")[1]
            return metric_sum(text, "streamfer_results_produced_total", status="OK") == 90

        wait_for(counters_caught_up, 30, "results counter to reach 90")
        text = http_get(port, "/metrics")[1]
        assert metric_sum(text, "streamfer_frames_consumed_total", topic=topics.standard) == 90
        assert metric_sum(text, "streamfer_frames_dead_lettered_total") == 0
        assert metric_sum(text, "streamfer_batch_size_count") >= 1
        assert metric_sum(text, "streamfer_batch_size_sum") == 90
        assert metric_sum(text, "streamfer_end_to_end_seconds_count") == 90
        assert metric_sum(text, "streamfer_commits_total", outcome="ok") >= 1
        assert metric_sum(text, "streamfer_ready") == 1
        assert 'streamfer_model_info{' in text
    finally:
        worker.terminate()
        worker.wait(timeout=60)


@pytest.mark.parametrize("worker_id", ["host", None], ids=["explicit id", "default id"])
def test_three_processes_share_the_partitions_and_handle_each_frame_once(kafka_bootstrap, unique, tmp_path,
                                                                        worker_id):
    """Child i of `--processes 3` is `<worker_id>-p<i>` with an explicit id, else `<hostname>-<i>` (slot i)."""
    topics = make_topics(kafka_bootstrap, unique, partitions=3)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_OBSERVABILITY_WORKER")}
    env.update(topics.env())
    env.update({"WORKER_KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap, "WORKER_RUNTIME_TORCH_THREADS": "1",
                "WORKER_RUNTIME_WARMUP_BATCHES": "1", "WORKER_KAFKA_SESSION_TIMEOUT_MS": "6000",
                "WORKER_OBSERVABILITY_WORKER_SLOT_DIR": str(tmp_path / "slots")})
    if worker_id is not None:
        env["WORKER_OBSERVABILITY_WORKER_ID"] = worker_id
        expected = {f"{worker_id}-p{i}" for i in range(3)}
    else:
        expected = {f"{socket.gethostname()}-{i}" for i in range(3)}
    log_path = tmp_path / "workers.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "worker", "run", "--processes", "3", "--metrics-port", "0"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        def owners() -> set[str]:
            assigned = r"\[([^\]]+)\] worker\.loop\.pipeline: partitions assigned: \[\("
            return set(re.findall(assigned, log_path.read_text()))

        wait_for(lambda: owners() == expected, 120, "all three processes to own partitions")
        frames = []
        for priority, topic in zip(Priority, topics.inputs):
            batch = list(synthetic_frames(120, [(32, 32), (48, 32)], Encoding.RAW_RGB8, priority, unique,
                                          streams_per_shape=6))
            publish(kafka_bootstrap, topic, iter(batch))
            frames += batch
        results = read_results(kafka_bootstrap, topics.results, until=lambda rs: len(rs) >= len(frames),
                               timeout_s=180)
    finally:
        proc.terminate()  # forwarded to the children: each drains and commits
        code = proc.wait(timeout=90)
        log.close()
    assert code == 0, log_path.read_text()[-3000:]

    counts = ledger(results)
    assert set(counts) == {(f.stream_id, f.frame_index) for f in frames}
    assert max(counts.values()) == 1
    assert {r["worker_id"] for r in results} == expected
    assert uncommitted(kafka_bootstrap, topics.group, topics.inputs) == {}
