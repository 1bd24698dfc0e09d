"""The foundation's promise against a real broker: every frame gets exactly one result, offsets reach the
end, and a SIGKILL mid-stream loses nothing."""

from __future__ import annotations

import signal

import pytest

from worker.frames import Encoding, Priority
from worker.tools.publish_frames import publish, synthetic_frames
from worker.tools.read_results import read_results

from .helpers import ledger, make_topics, start_worker, uncommitted

pytestmark = pytest.mark.integration

SHAPES = {Priority.REALTIME: [(32, 32), (48, 32)], Priority.STANDARD: [(64, 48), (32, 32)],
          Priority.BULK: [(40, 40), (64, 48), (24, 24)]}


def produce_mixed(bootstrap, topics, per_topic, run_id):
    sent = {}
    for priority, topic in zip(Priority, topics.inputs):
        encoding = Encoding.JPEG if priority is Priority.STANDARD else Encoding.RAW_RGB8
        frames = list(synthetic_frames(per_topic, SHAPES[priority], encoding, priority, run_id))
        publish(bootstrap, topic, iter(frames))
        for f in frames:
            sent[(f.stream_id, f.frame_index)] = topic
    return sent


def test_every_frame_of_every_shape_and_priority_gets_exactly_one_result(kafka_bootstrap, unique, tmp_path):
    topics = make_topics(kafka_bootstrap, unique)
    sent = produce_mixed(kafka_bootstrap, topics, per_topic=40, run_id=unique)

    worker = start_worker(kafka_bootstrap, topics, exit_when_idle=2.0, log_path=str(tmp_path / "worker.log"))
    assert worker.wait(timeout=180) == 0, (tmp_path / "worker.log").read_text()[-3000:]
    assert "start-up heap frozen" in (tmp_path / "worker.log").read_text()  # before the loop: worker.app

    results = read_results(kafka_bootstrap, topics.results, idle_timeout_s=1.0)
    counts = ledger(results)
    assert set(counts) == set(sent)
    assert max(counts.values()) == 1
    for r in results:
        key = (r["stream_id"], r["frame_index"])
        assert r["source_topic"] == sent[key]
        assert r["status"] == "OK"
        assert set(r["scores"]) == {"nudity", "violence", "weapons", "drugs", "hate_symbols"}
        assert all(0.0 <= v <= 1.0 for v in r["scores"].values())
        assert r["flagged"] == bool(r["flagged_labels"])
        assert r["batch_size"] >= 1
    assert uncommitted(kafka_bootstrap, topics.group, topics.inputs) == {}


def test_sigkill_mid_stream_then_restart_leaves_no_frame_without_a_result(kafka_bootstrap, unique, tmp_path):
    topics = make_topics(kafka_bootstrap, unique)
    sent = produce_mixed(kafka_bootstrap, topics, per_topic=150, run_id=unique)
    log = str(tmp_path / "worker.log")
    small_batches = {"WORKER_BATCHING_MAX_BATCH_SIZE": "2", "WORKER_BATCHING_FALLBACK_MAX_BATCH_SIZE": "2",
                     "WORKER_DELIVERY_MAX_INFLIGHT_BATCHES": "1"}

    first = start_worker(kafka_bootstrap, topics, extra_env=small_batches, log_path=log)
    # Wait until the worker is visibly mid-stream: some results out, most frames still to do.
    partial = read_results(kafka_bootstrap, topics.results, until=lambda rs: len(rs) >= 40, timeout_s=120)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    assert len(ledger(partial)) < len(sent), "the worker finished before it was killed: the test proves nothing"

    second = start_worker(kafka_bootstrap, topics, exit_when_idle=2.0, log_path=log)
    assert second.wait(timeout=240) == 0, open(log).read()[-3000:]

    counts = ledger(read_results(kafka_bootstrap, topics.results, idle_timeout_s=1.0))
    missing = set(sent) - set(counts)
    assert not missing, f"{len(missing)} frames without a result"
    assert uncommitted(kafka_bootstrap, topics.group, topics.inputs) == {}
