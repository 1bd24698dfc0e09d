"""An output too large for its topic never stops its partition: a real results topic whose max.message.bytes
takes the result of a frame with short identifiers but not one with long ones. The worker reads the limit at
start-up and bounds its producer's messages and batches by it, so the large results are refused alone and
dead-lettered by reference (their source coordinates, no payload), the rest are scored, and the offsets reach
the end, in both delivery modes."""

from __future__ import annotations

import pytest
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource

from worker.codec.schemas import ResultContext, build_result
from worker.frames import OUTPUT_REJECTED, Encoding, Frame, Priority, SourceRef, Verdict
from worker.tools.publish_frames import publish, synthetic_frames
from worker.tools.read_results import read_dead_letters, read_results

from .helpers import ledger, make_topics, start_worker, uncommitted

pytestmark = pytest.mark.integration

SHORT, LONG = "t", "x" * 242  # limits.max_identifier_bytes is 256: with the stream suffix, 256 bytes
SUFFIX = "-bulk-32x32-s0"  # what synthetic_frames appends to a run id
LABELS = ("nudity", "violence", "weapons", "drugs", "hate_symbols")
TOPIC_LIMIT = 1_000  # the smallest max.message.bytes librdkafka's producer takes
BATCH_OVERHEAD = 61 + 20  # a record batch header, and one record's framing and headers count


def identifiers(name: str) -> tuple[str, str]:
    """(stream id, tenant) of the frames run with `name`: both as long as the limits allow for LONG."""
    return name + SUFFIX, (name + SUFFIX)[:256]


def result_size(name: str) -> int:
    """Bytes of a flagged result and its key for a frame run with `name`."""
    stream_id, tenant = identifiers(name)
    frame = Frame(stream_id=stream_id, frame_index=10**6, tenant=tenant, priority=Priority.BULK,
                  capture_ts_ms=1_800_000_000_000, width=32, height=32, channels=3, encoding=Encoding.RAW_RGB8,
                  data=b"", source=SourceRef("t" * 30, 2, 10**6))
    verdict = Verdict(dict.fromkeys(LABELS, 0.5), LABELS)  # default_threshold 0 below: every label flags
    value = build_result(frame, verdict, "OK", ResultContext("streamfer-moderation-cnn", "1", "w0"), 1.0, 8, 1.0,
                         1_800_000_000.0)
    return len(value) + len(frame.stream_id)


def limit_results_topic(bootstrap: str, topic: str, max_message_bytes: int) -> None:
    entry = ConfigEntry("max.message.bytes", str(max_message_bytes), incremental_operation=AlterConfigOpType.SET)
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for fut in admin.incremental_alter_configs(
            [ConfigResource(ConfigResource.Type.TOPIC, topic, incremental_configs=[entry])]).values():
        fut.result(30)


@pytest.mark.parametrize("mode", ["at_least_once", "exactly_once"])
def test_results_the_broker_refuses_are_dead_lettered_by_reference_and_the_partition_moves_on(
        kafka_bootstrap, unique, tmp_path, mode):
    short, long = result_size(SHORT + unique), result_size(LONG)
    assert short + BATCH_OVERHEAD < TOPIC_LIMIT < long + BATCH_OVERHEAD, (short, long)
    topics = make_topics(kafka_bootstrap, unique, partitions=1)
    limit_results_topic(kafka_bootstrap, topics.results, TOPIC_LIMIT)
    # Interleaved on one partition: frames with short identifiers (results fit) and long ones (they do not).
    small = synthetic_frames(12, [(32, 32)], Encoding.RAW_RGB8, Priority.BULK, SHORT + unique,
                             tenants=[identifiers(SHORT + unique)[1]], streams_per_shape=1)
    large = synthetic_frames(12, [(32, 32)], Encoding.RAW_RGB8, Priority.BULK, LONG, tenants=[identifiers(LONG)[1]],
                             streams_per_shape=1)
    frames = [f for pair in zip(small, large) for f in pair]
    publish(kafka_bootstrap, topics.bulk, iter(frames))

    log = tmp_path / "worker.log"
    worker = start_worker(kafka_bootstrap, topics, exit_when_idle=2.0, log_path=str(log),
                          extra_env={"WORKER_DELIVERY_MODE": mode, "WORKER_MODEL_DEFAULT_THRESHOLD": "0"})
    assert worker.wait(timeout=240) == 0, log.read_text()[-3000:]

    results = ledger(read_results(kafka_bootstrap, topics.results, idle_timeout_s=1.0))
    assert set(results) == {(f.stream_id, f.frame_index) for f in frames if len(f.tenant) < 100}
    assert max(results.values()) == 1
    dead = read_dead_letters(kafka_bootstrap, topics.dead_letter, idle_timeout_s=1.0)
    refused = sorted(int(d.headers["streamfer.source_offset"]) for d in dead)
    assert refused == [i for i, f in enumerate(frames) if len(f.tenant) >= 100]  # once each, in a 1-partition topic
    assert all(d.headers["streamfer.error_type"] == OUTPUT_REJECTED and d.value == b"" for d in dead)
    assert uncommitted(kafka_bootstrap, topics.group, topics.inputs) == {}
