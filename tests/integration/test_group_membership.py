"""Static membership on the worker's defaults, against the real broker and with the default 45 s session (not the
tests' 6 s), so that nothing here can be a session expiring: a process restarted under its worker id takes the
killed one's place at once; a worker stopped gracefully leaves the group, so its partitions move on at once; and
two processes under one worker id fence each other until the older one stops with a message naming the setting."""

from __future__ import annotations

import signal
import socket
import time

import pytest
from confluent_kafka.admin import AdminClient

from tests.reliability.faults import DEFAULT_MEMBERSHIP_ENV
from worker.config import KafkaSettings
from worker.frames import Encoding, Priority
from worker.tools.publish_frames import publish, synthetic_frames
from worker.tools.read_results import read_results

from .helpers import ledger, make_topics, start_worker, uncommitted, wait_for

pytestmark = pytest.mark.integration

SESSION_S = KafkaSettings().session_timeout_ms / 1000
SMALL_BATCHES = {"WORKER_BATCHING_MAX_BATCH_SIZE": "2", "WORKER_BATCHING_FALLBACK_MAX_BATCH_SIZE": "2",
                 "WORKER_DELIVERY_MAX_INFLIGHT_BATCHES": "1"}
PARTITIONS = 3


def members(bootstrap: str, group: str) -> dict[str | None, set[tuple[str, int]]]:
    """The group's members by group.instance.id, with the partitions each is assigned."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    described = admin.describe_consumer_groups([group])[group].result(timeout=10)
    return {m.group_instance_id: {(tp.topic, tp.partition) for tp in m.assignment.topic_partitions}
            for m in described.members}


def publish_backlog(bootstrap: str, topics, per_topic: int, run_id: str) -> set[tuple[str, int]]:
    ids: set[tuple[str, int]] = set()
    for priority, topic in zip(Priority, topics.inputs):
        frames = list(synthetic_frames(per_topic, [(32, 32)], Encoding.RAW_RGB8, priority, run_id,
                                       streams_per_shape=4))
        publish(bootstrap, topic, iter(frames))
        ids |= {(f.stream_id, f.frame_index) for f in frames}
    return ids


def test_a_killed_worker_restarted_under_its_default_id_takes_its_place_without_waiting_out_the_session(
        kafka_bootstrap, unique, tmp_path):
    topics = make_topics(kafka_bootstrap, unique)
    every = {(t, p) for t in topics.inputs for p in range(PARTITIONS)}
    ids = publish_backlog(kafka_bootstrap, topics, 150, unique)
    log = str(tmp_path / "worker.log")
    env = {"WORKER_DELIVERY_MODE": "exactly_once", **DEFAULT_MEMBERSHIP_ENV, **SMALL_BATCHES}
    first = start_worker(kafka_bootstrap, topics, extra_env=env, worker_id=None, log_path=log)
    read_results(kafka_bootstrap, topics.results, until=lambda rs: len(rs) >= 40, timeout_s=120)
    (member_id,) = members(kafka_bootstrap, topics.group)  # the worker's own <hostname>-<slot>
    assert member_id is not None and member_id.startswith(f"{socket.gethostname()}-")
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    killed = time.monotonic()

    # The same command, as a supervisor restarts it: the same slot, hence the same id. A dynamic member would wait
    # for the dead one's session to expire before it got a partition.
    second = start_worker(kafka_bootstrap, topics, extra_env=env, worker_id=None, exit_when_idle=2.0, log_path=log)
    wait_for(lambda: members(kafka_bootstrap, topics.group) == {member_id: every}, SESSION_S * 0.75,
             "the restarted worker holding every partition under the dead one's id, within the session")
    assert time.monotonic() - killed < SESSION_S
    assert second.wait(timeout=240) == 0, open(log).read()[-3000:]
    counts = ledger(read_results(kafka_bootstrap, topics.results, idle_timeout_s=1.0))
    assert set(counts) == ids and max(counts.values()) == 1
    assert uncommitted(kafka_bootstrap, topics.group, topics.inputs) == {}


def test_a_static_member_stopped_gracefully_hands_its_partitions_over_at_once(kafka_bootstrap, unique, tmp_path):
    topics = make_topics(kafka_bootstrap, unique)
    every = {(t, p) for t in topics.inputs for p in range(PARTITIONS)}
    log = str(tmp_path / "workers.log")
    staying = start_worker(kafka_bootstrap, topics, extra_env=DEFAULT_MEMBERSHIP_ENV, worker_id="w0", log_path=log)
    leaving = start_worker(kafka_bootstrap, topics, extra_env=DEFAULT_MEMBERSHIP_ENV, worker_id="w1", log_path=log)
    try:
        wait_for(lambda: {k: bool(v) for k, v in members(kafka_bootstrap, topics.group).items()}
                 == {"w0": True, "w1": True}, 120, "both static members holding partitions")
        leaving.send_signal(signal.SIGTERM)
        assert leaving.wait(timeout=60) == 0, open(log).read()[-3000:]
        stopped = time.monotonic()
        # Without its LeaveGroup, w1 would stay a member holding its partitions for the whole session.
        wait_for(lambda: members(kafka_bootstrap, topics.group) == {"w0": every}, SESSION_S * 0.5,
                 "w0 holding every partition soon after w1's graceful stop")
        assert time.monotonic() - stopped < SESSION_S
    finally:
        staying.send_signal(signal.SIGTERM)
        assert staying.wait(timeout=60) == 0, open(log).read()[-3000:]


def test_two_processes_under_one_worker_id_fence_each_other_until_the_older_stops(kafka_bootstrap, unique, tmp_path):
    topics = make_topics(kafka_bootstrap, unique)
    older_log, newer_log = tmp_path / "older.log", tmp_path / "newer.log"
    older = start_worker(kafka_bootstrap, topics, worker_id="same", log_path=str(older_log))
    wait_for(lambda: "same" in members(kafka_bootstrap, topics.group), 120, "the first process in the group")
    newer = start_worker(kafka_bootstrap, topics, worker_id="same", log_path=str(newer_log))
    try:
        # Each fenced process first joins again under a new consumer (as a process frozen past its session must),
        # which fences the other; the older one, fenced a second time within a minute, stops.
        assert older.wait(timeout=120) == 2, older_log.read_text()[-3000:]
        assert "two processes share one observability.worker_id" in older_log.read_text()
        assert "rejoining under a new consumer" in older_log.read_text()
        assert "rejoining under a new consumer" in newer_log.read_text()
        wait_for(lambda: members(kafka_bootstrap, topics.group).get("same"), 120, "the newer process holding "
                 "the partitions")
    finally:
        newer.send_signal(signal.SIGTERM)
        assert newer.wait(timeout=60) == 0, newer_log.read_text()[-3000:]
