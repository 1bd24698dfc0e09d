"""Priority consumption and graceful shutdown against the real broker."""

from __future__ import annotations

import signal
import statistics

import pytest

from worker.frames import Encoding, Priority
from worker.tools.publish_frames import publish, synthetic_frames
from worker.tools.read_results import read_results

from .helpers import ledger, make_topics, start_worker, uncommitted

pytestmark = pytest.mark.integration


def produced_at(result: dict) -> float:
    return result["capture_ts_ms"] + result["end_to_end_ms"]


def test_realtime_backlog_is_served_before_an_older_bulk_backlog(kafka_bootstrap, unique, tmp_path):
    topics = make_topics(kafka_bootstrap, unique)
    # The bulk backlog is published first, so it is older: only priority can put realtime ahead of it.
    publish(kafka_bootstrap, topics.bulk, synthetic_frames(600, [(48, 48), (64, 48)], Encoding.RAW_RGB8,
                                                          Priority.BULK, unique))
    publish(kafka_bootstrap, topics.realtime, synthetic_frames(120, [(48, 48), (64, 48)], Encoding.RAW_RGB8,
                                                              Priority.REALTIME, unique))
    log = tmp_path / "worker.log"
    worker = start_worker(kafka_bootstrap, topics, exit_when_idle=2.0, log_path=str(log))
    assert worker.wait(timeout=180) == 0, log.read_text()[-3000:]

    results = read_results(kafka_bootstrap, topics.results, idle_timeout_s=1.0)
    assert len(ledger(results)) == 720
    realtime = sorted(produced_at(r) for r in results if r["source_topic"] == topics.realtime)
    bulk = sorted(produced_at(r) for r in results if r["source_topic"] == topics.bulk)
    assert realtime[-1] <= statistics.median(bulk), "realtime results should all precede most bulk results"


def test_sigterm_drains_commits_and_leaves_nothing_to_redo(kafka_bootstrap, unique, tmp_path):
    topics = make_topics(kafka_bootstrap, unique)
    frames = list(synthetic_frames(600, [(32, 32), (48, 32)], Encoding.RAW_RGB8, Priority.STANDARD, unique))
    publish(kafka_bootstrap, topics.standard, iter(frames))
    log = tmp_path / "worker.log"
    # Small batches and a small intake keep most frames unread when the signal comes.
    slow = {"WORKER_BATCHING_MAX_BATCH_SIZE": "2", "WORKER_BATCHING_FALLBACK_MAX_BATCH_SIZE": "2",
            "WORKER_BATCHING_MAX_PENDING_FRAMES": "8", "WORKER_DELIVERY_MAX_INFLIGHT_BATCHES": "1"}
    worker = start_worker(kafka_bootstrap, topics, extra_env=slow, log_path=str(log))
    read_results(kafka_bootstrap, topics.results, until=lambda rs: len(rs) >= 30, timeout_s=120)
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=60) == 0, log.read_text()[-3000:]
    assert "draining" in log.read_text()

    after_stop = ledger(read_results(kafka_bootstrap, topics.results, idle_timeout_s=1.0))
    assert len(after_stop) < len(frames), "the worker finished everything before the signal: nothing was tested"
    # Everything it produced is committed: a restart redoes nothing, so no frame gets a second result.
    restarted = start_worker(kafka_bootstrap, topics, exit_when_idle=2.0, log_path=str(log))
    assert restarted.wait(timeout=180) == 0, log.read_text()[-3000:]
    final = ledger(read_results(kafka_bootstrap, topics.results, idle_timeout_s=1.0))
    assert len(final) == len(frames)
    assert max(final.values()) == 1, "a frame drained before SIGTERM was processed again after the restart"
    assert uncommitted(kafka_bootstrap, topics.group, topics.inputs) == {}
