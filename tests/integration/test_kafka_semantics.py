"""Delivery under what a consumer group does in production: crashes and churn in both delivery modes,
a model slower than the poll interval, and bad input, against the real broker."""

from __future__ import annotations

import contextlib
import io
import random
import signal
import threading
import time
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from worker.codec.schemas import FrameRecord, encode_frame
from worker.frames import Encoding, Priority
from worker.tools.publish_frames import publish, synthetic_frames
from worker.tools.read_results import read_dead_letters, read_results

from .helpers import ledger, make_topics, start_worker, uncommitted
from .models import SLOW_HEIGHT

pytestmark = pytest.mark.integration

EOS = {"WORKER_DELIVERY_MODE": "exactly_once"}
SMALL_BATCHES = {"WORKER_BATCHING_MAX_BATCH_SIZE": "2", "WORKER_BATCHING_FALLBACK_MAX_BATCH_SIZE": "2",
                 "WORKER_DELIVERY_MAX_INFLIGHT_BATCHES": "1"}


def publish_all(bootstrap, topics, per_topic, run_id, rate_fps=None):
    ids = set()
    for priority, topic in zip(Priority, topics.inputs):
        frames = list(synthetic_frames(per_topic, [(32, 32), (48, 32)], Encoding.RAW_RGB8, priority, run_id,
                                       streams_per_shape=4))
        publish(bootstrap, topic, iter(frames), rate_fps=rate_fps)
        ids |= {(f.stream_id, f.frame_index) for f in frames}
    return ids


def test_exactly_once_sigkill_mid_batch_leaves_no_duplicate_and_no_gap(kafka_bootstrap, unique, tmp_path):
    topics = make_topics(kafka_bootstrap, unique)
    ids = publish_all(kafka_bootstrap, topics, 150, unique)
    log = str(tmp_path / "worker.log")
    for kill_after in (40, 160):  # two crashes at different points of the stream
        worker = start_worker(kafka_bootstrap, topics, extra_env={**EOS, **SMALL_BATCHES}, log_path=log)
        read_results(kafka_bootstrap, topics.results, until=lambda rs, n=kill_after: len(rs) >= n, timeout_s=120)
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=30)
    last = start_worker(kafka_bootstrap, topics, extra_env=EOS, exit_when_idle=2.0, log_path=log)
    assert last.wait(timeout=240) == 0, open(log).read()[-3000:]

    counts = ledger(read_results(kafka_bootstrap, topics.results, idle_timeout_s=1.0))  # read_committed
    assert set(counts) == ids, f"{len(ids - set(counts))} frames without a committed result"
    assert max(counts.values()) == 1, "a read_committed reader saw a frame's result twice"
    assert uncommitted(kafka_bootstrap, topics.group, topics.inputs) == {}


@pytest.mark.parametrize("mode", ["at_least_once", "exactly_once"])
def test_three_workers_joining_and_leaving_while_frames_flow(kafka_bootstrap, unique, tmp_path, mode):
    topics = make_topics(kafka_bootstrap, unique)
    env = {"WORKER_DELIVERY_MODE": mode, **SMALL_BATCHES}
    log = str(tmp_path / "workers.log")
    ids: set = set()
    producer = threading.Thread(target=lambda: ids.update(publish_all(kafka_bootstrap, topics, 200, unique,
                                                                      rate_fps=60)))
    workers = [start_worker(kafka_bootstrap, topics, extra_env=env, worker_id="w0", log_path=log)]
    producer.start()
    rng = random.Random(unique)
    # Churn: workers join, one leaves cleanly, one crashes, while the producer keeps publishing.
    for step, action in enumerate(["join", "join", "leave", "join", "crash"]):
        time.sleep(rng.uniform(1.5, 3.0))  # churn pacing, not synchronisation: the ledger is checked below
        if action == "join":
            workers.append(start_worker(kafka_bootstrap, topics, extra_env=env, worker_id=f"w{step + 1}",
                                        log_path=log))
        else:
            victim = workers.pop(0)
            victim.send_signal(signal.SIGTERM if action == "leave" else signal.SIGKILL)
            victim.wait(timeout=60)
    producer.join(timeout=120)
    for w in workers:
        w.send_signal(signal.SIGTERM)
    for w in workers:
        assert w.wait(timeout=90) == 0, open(log).read()[-3000:]
    final = start_worker(kafka_bootstrap, topics, extra_env={"WORKER_DELIVERY_MODE": mode}, exit_when_idle=2.0,
                         log_path=log)
    assert final.wait(timeout=240) == 0, open(log).read()[-3000:]

    # The crashed worker's id is never used again, so a transaction it had open (results produced, offsets not
    # yet sent) hides the results after it from read_committed readers until the broker aborts it
    # (transaction.timeout.ms, 30 s): wait for every frame's result first, then read them all.
    with contextlib.suppress(TimeoutError):  # a missing result is reported by the assertion below
        read_results(kafka_bootstrap, topics.results, until=lambda rs: ids <= set(ledger(rs)), timeout_s=90)
    counts = ledger(read_results(kafka_bootstrap, topics.results, idle_timeout_s=1.0))
    assert set(counts) == ids, f"{len(ids - set(counts))} frames without a result"
    if mode == "exactly_once":
        assert max(counts.values()) == 1, "exactly-once: a frame has two committed results"
    assert uncommitted(kafka_bootstrap, topics.group, topics.inputs) == {}


def test_a_model_slower_than_the_poll_interval_causes_no_rebalance(kafka_bootstrap, unique, tmp_path):
    topics = make_topics(kafka_bootstrap, unique)
    slow = list(synthetic_frames(2, [(SLOW_HEIGHT, SLOW_HEIGHT)], Encoding.RAW_RGB8, Priority.STANDARD, unique))
    fast = list(synthetic_frames(60, [(32, 32)], Encoding.RAW_RGB8, Priority.STANDARD, unique + "f"))
    publish(kafka_bootstrap, topics.standard, iter(slow + fast))
    log = tmp_path / "worker.log"
    worker = start_worker(kafka_bootstrap, topics, log_path=str(log), exit_when_idle=2.0, extra_env={
        "WORKER_MODEL_SOURCE": "tests.integration.models:slow_on_40px_frames",
        # The model stalls 9 s on a batch; the group's poll interval is 6 s.
        "WORKER_KAFKA_SESSION_TIMEOUT_MS": "6000", "WORKER_KAFKA_MAX_POLL_INTERVAL_MS": "6000"})
    assert worker.wait(timeout=180) == 0, log.read_text()[-3000:]

    text = log.read_text()
    assert text.count("partitions assigned: [(") == 1, "the group rebalanced while the model was slow"
    assert "partitions lost" not in text
    counts = ledger(read_results(kafka_bootstrap, topics.results, idle_timeout_s=1.0))
    assert set(counts) == {(f.stream_id, f.frame_index) for f in slow + fast}
    assert uncommitted(kafka_bootstrap, topics.group, topics.inputs) == {}


def _frame(stream: str, index: int, **kw) -> FrameRecord:
    base = dict(stream_id=stream, frame_index=index, capture_ts_ms=int(time.time() * 1000), tenant="t",
                priority=Priority.STANDARD, width=16, height=16, channels=3, encoding=Encoding.RAW_RGB8,
                data=bytes(16 * 16 * 3))
    base.update(kw)
    return FrameRecord(**base)


def _bad_jpeg() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (10, 20, 30)).save(buf, format="JPEG")
    data = bytearray(buf.getvalue())
    data[len(data) // 2: len(data) // 2 + 40] = b"\x00" * 40
    return bytes(data[: len(data) * 2 // 3])


BAD_MESSAGES = st.one_of(
    st.binary(min_size=1, max_size=300).map(lambda b: ("random bytes", b)),
    st.integers(1, 200).map(lambda cut: ("truncated Avro", encode_frame(_frame("x", 0))[:-cut])),
    st.sampled_from([(0, 16), (16, 0), (-3, 16)]).map(
        lambda wh: ("zero dimensions", encode_frame(_frame("x", 0, width=wh[0], height=wh[1], data=b"")))),
    st.just(("huge dimensions", encode_frame(_frame("x", 0, width=100_000, height=100_000, data=b"\x00")))),
    st.integers(1, 700).map(lambda n: ("mismatched byte count", encode_frame(_frame("x", 0, data=bytes(n))))),
    st.just(("corrupt JPEG", encode_frame(_frame("x", 0, encoding=Encoding.JPEG, data=_bad_jpeg())))),
)


@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(bad=st.lists(BAD_MESSAGES, min_size=10, max_size=25))
def test_fuzzed_bad_frames_are_dead_lettered_and_never_stop_the_worker(kafka_bootstrap, tmp_path_factory, bad):
    from confluent_kafka import Producer

    from .helpers import make_topics as mk

    run = uuid.uuid4().hex[:8]  # not `random`: hypothesis seeds it, so every example would share topics
    topics = mk(kafka_bootstrap, run, partitions=1)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    good = []
    for i, (_kind, payload) in enumerate(bad):  # good and bad frames interleaved on one partition
        good_frame = _frame(f"{run}-good", i)
        producer.produce(topics.standard, value=encode_frame(good_frame))
        producer.produce(topics.standard, value=payload, key=f"bad-{i}".encode())
        good.append((good_frame.stream_id, good_frame.frame_index))
    assert producer.flush(30) == 0
    del producer
    log = tmp_path_factory.mktemp("fuzz") / "worker.log"
    worker = start_worker(kafka_bootstrap, topics, exit_when_idle=2.0, log_path=str(log))
    assert worker.wait(timeout=180) == 0, log.read_text()[-3000:]

    results = read_results(kafka_bootstrap, topics.results, idle_timeout_s=1.0)
    dead = read_dead_letters(kafka_bootstrap, topics.dead_letter, idle_timeout_s=1.0)
    ok_ids = {(r["stream_id"], r["frame_index"]) for r in results if r["stream_id"].startswith(run)}
    assert ok_ids == set(good), "a good frame next to a bad one lost its result"
    # Random bytes can, rarely, be a valid tiny frame; every other bad message must be dead-lettered.
    assert len(dead) + (len(results) - len(good)) == len(bad)
    for d in dead:
        assert d.headers["streamfer.error"] and d.headers["streamfer.error_type"]
        assert d.headers["streamfer.source_topic"] == topics.standard
        assert int(d.headers["streamfer.source_offset"]) >= 0
    assert uncommitted(kafka_bootstrap, topics.group, topics.inputs) == {}
