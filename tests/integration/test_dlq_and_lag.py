"""The operator's tools against the real broker and real workers: `worker dlq show` and `worker dlq replay` (a
round trip: frames dead-lettered because of a cause, the cause fixed, replayed, each scored; a frame that keeps
failing stops at the replay limit; frames refused by reference read back from their input topic while retained),
and `worker lag` while a worker is stopped and after it caught up, compared with Kafka's own
kafka-consumer-groups.sh --describe on the same group."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource

from tests.reliability.models import marked_pixels, unmarked_pixels
from worker.cli import main
from worker.codec.schemas import FrameRecord
from worker.config import load_settings
from worker.frames import Encoding, Priority
from worker.kafka.roles import transactional_producer
from worker.kafka.topics import ensure_topics
from worker.testing import FrameProducer, ResultsReader, TestTopics, end_offsets
from worker.tools.dlq.entries import DeadLetterToolError, Selection, ledger_topic, read_ledger
from worker.tools.dlq.replay import replay

from .helpers import ledger, make_topics, start_worker, wait_for

pytestmark = pytest.mark.integration

PROJECT_ROOT = Path(__file__).resolve().parents[2]
TOOLS_LIB = PROJECT_ROOT / "deploy" / "local-kafka" / "tools-lib"
POISON_MODEL = {"WORKER_MODEL_SOURCE": "tests.reliability.models:poison_model"}  # raises on marked frames
MODES = ["at_least_once", "exactly_once"]


# -- helpers -------------------------------------------------------------------------------------------------
class Cli:
    """`worker ...` in this process, with the test's topics and group in the environment (as an operator's
    shell or config file would have them); returns the exit code and what it printed."""

    def __init__(self, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, bootstrap: str,
                 topics: TestTopics, env: dict[str, str] | None = None) -> None:
        self.capsys = capsys
        for key, value in {**topics.env(), "WORKER_KAFKA_BOOTSTRAP_SERVERS": bootstrap, **(env or {})}.items():
            monkeypatch.setenv(key, value)

    def __call__(self, *argv: str) -> tuple[int, str]:
        self.capsys.readouterr()
        code = main(list(argv))
        return code, self.capsys.readouterr().out

    def json(self, *argv: str) -> Any:
        code, out = self(*argv, "--json")
        assert code == 0, out
        return json.loads(out)


def run_until_idle(bootstrap: str, topics: TestTopics, log: Path, env: dict[str, str]) -> None:
    """A worker that exits once idle and caught up (with a transaction marker after the last frame, too)."""
    worker = start_worker(bootstrap, topics, extra_env=env, exit_when_idle=2.0, log_path=str(log))
    assert worker.wait(timeout=240) == 0, log.read_text()[-3000:]


def frame(stream: str, index: int, pixels: bytes, tenant: str = "tenant-a", encoding: Encoding = Encoding.RAW_RGB8,
          capture_ts_ms: int | None = None, side: int = 32) -> FrameRecord:
    return FrameRecord(stream, index, capture_ts_ms or int(time.time() * 1000), tenant, Priority.STANDARD, side, side,
                       3, encoding, pixels)


def ids(frames: list[FrameRecord]) -> set[tuple[str, int]]:
    return {(f.stream_id, f.frame_index) for f in frames}


# -- dlq replay: the round trip ----------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_dead_letters_replayed_after_the_cause_is_fixed_are_scored_once_and_a_frame_that_keeps_failing_stops(
        kafka_bootstrap, unique, tmp_path, capsys, monkeypatch, mode):
    topics = make_topics(kafka_bootstrap, unique, partitions=2)
    env = {"WORKER_DELIVERY_MODE": mode, "WORKER_DLQ_MAX_REPLAYS": "2"}
    cli = Cli(capsys, monkeypatch, kafka_bootstrap, topics, env)
    # 18 good frames over 3 streams, every 4th marked (the poison model raises on those), and 2 frames whose JPEG
    # is broken (they fail whatever the model).
    good = [frame(f"cam{i % 3}-{unique}", i, (marked_pixels if i % 4 == 0 else unmarked_pixels)(32, 32, i).tobytes(),
                  tenant=f"tenant-{i % 2}") for i in range(18)]
    poisoned = ids([f for f in good if f.frame_index % 4 == 0])
    broken = [frame(f"broken-{unique}", j, b"\xff\xd8 not a JPEG", encoding=Encoding.JPEG) for j in range(2)]
    FrameProducer(kafka_bootstrap, topics).publish(good + broken, keep_capture_ts=True)

    # 1. The cause: a model that fails on the marked frames.
    run_until_idle(kafka_bootstrap, topics, tmp_path / "poisoned.log", {**env, **POISON_MODEL})
    reader = ResultsReader(kafka_bootstrap, topics)
    assert set(ledger(reader.read_all(idle_timeout_s=1.0))) == ids(good) - poisoned
    shown = cli.json("dlq", "show")
    assert shown["by_error_type"] == {"ModelError": len(poisoned), "FrameDecodeError": 2}
    assert shown["by_replay_count"] == {"0": 7} and shown["replayed"] == 0 and shown["at_replay_limit"] == 0
    assert {n["stream_id"] for n in shown["newest"]} <= {f.stream_id for f in good + broken}
    assert all("payload_base64" not in n for n in shown["newest"])

    # 2. The cause fixed (the builtin model). A dry run says what it would send and sends nothing.
    before = end_offsets(kafka_bootstrap, topics.inputs)
    dry = cli.json("dlq", "replay", "--dry-run")
    assert (dry["sent"], dry["skipped"], dry["failed"]) == (7, 0, 0)
    assert {i["outcome"] for i in dry["items"]} == {"would send"} and {i["replay_count"] for i in dry["items"]} == {1}
    assert end_offsets(kafka_bootstrap, topics.inputs) == before
    assert cli.json("dlq", "replay")["sent"] == 7
    assert cli.json("dlq", "replay")["skipped_by_reason"] == {"already replayed (in the ledger)": 7}  # never twice
    run_until_idle(kafka_bootstrap, topics, tmp_path / "fixed.log", env)
    results = ledger(reader.read_all(idle_timeout_s=1.0))
    assert set(results) == ids(good)  # every replayed frame scored
    if mode == "exactly_once":
        assert max(results.values()) == 1, {k: n for k, n in results.items() if n > 1}
    shown = cli.json("dlq", "show")
    assert shown["by_replay_count"] == {"0": 7, "1": 2} and shown["replayed"] == 7

    # 3. The broken frames fail again, each time dead-lettered with its replay count, until the limit (2).
    second = cli.json("dlq", "replay")
    assert second["sent"] == 2 and {i["replay_count"] for i in second["items"] if i["outcome"] == "sent"} == {2}
    run_until_idle(kafka_bootstrap, topics, tmp_path / "again.log", env)
    third = cli.json("dlq", "replay")
    assert third["sent"] == 0
    assert third["skipped_by_reason"] == {"already replayed (in the ledger)": 9,
                                          "at the replay limit: replayed 2 times (dlq.max_replays = 2)": 2}
    shown = cli.json("dlq", "show")
    assert shown["by_replay_count"] == {"0": 7, "1": 2, "2": 2} and shown["at_replay_limit"] == 2
    code, text = cli("dlq", "show", "--error-type", "FrameDecodeError")
    assert code == 0 and "at the replay limit (2, not replayed again): 2" in text
    assert set(ledger(reader.read_all(idle_timeout_s=1.0))) == ids(good)  # the broken frames never got a result


# -- dlq replay: the ledger read waits for a transaction still completing on it -----------------------------
def test_reading_the_ledger_waits_for_a_transaction_open_on_it_then_sees_its_records(kafka_bootstrap, unique, caplog):
    """Kafka acknowledges a commit before its markers reach the ledger: a replay that starts right after another
    would stop at the last stable offset, below the records just committed, and replay their dead letters again
    (seen once in the round trip above). Held open here, the transaction stands for one still completing."""
    topics = make_topics(kafka_bootstrap, unique, partitions=1)
    kafka = {"bootstrap_servers": kafka_bootstrap, "group_id": topics.group}
    settings = load_settings(env={}, overrides={**topics.overrides(), "kafka": kafka})
    name = ledger_topic(topics.dead_letter)
    ensure_topics(settings.kafka, [name], partitions=1)
    writer = transactional_producer(settings.kafka, f"t{unique}-ledger-writer", "ledger writer", 60_000)
    writer.init_transactions(30)

    def replayed(coordinates: str, timestamp_ms: int) -> None:
        writer.produce(name, key=coordinates.encode(), value=json.dumps({"dead_letter_timestamp_ms": timestamp_ms}))

    writer.begin_transaction()
    replayed("dlq/0@0", 10)
    writer.commit_transaction(30)
    writer.begin_transaction()
    replayed("dlq/0@1", 11)
    writer.flush(30)  # written, its transaction open
    caplog.set_level(logging.INFO, logger="worker.tools.dlq.entries")
    with ThreadPoolExecutor(1) as pool:
        read = pool.submit(read_ledger, settings)
        wait_for(lambda: read.done() or "waiting for a transaction" in caplog.text, 30, "the ledger read to wait")
        assert not read.done(), f"the ledger read stopped below the open transaction's record: {read.result()}"
        with pytest.raises(DeadLetterToolError, match=r"still open after 0.5s.*Stop that producer"):
            read_ledger(settings, settle_timeout_s=0.5)
        writer.commit_transaction(30)
        assert read.result(timeout=30) == {"dlq/0@0": 10, "dlq/0@1": 11}



def test_a_replay_fences_one_still_running_before_it_reads_the_ledger(kafka_bootstrap, unique):
    """Two replays of one dead-letter topic never interleave: the second fences the first (same transactional id)
    before it reads the ledger, so a chunk the first could still commit is either in that read or aborted. Read
    first, it would wait on the first's open chunk (or miss one committed after the read and replay it again)."""
    topics = make_topics(kafka_bootstrap, unique, partitions=1)
    kafka = {"bootstrap_servers": kafka_bootstrap, "group_id": topics.group}
    settings = load_settings(env={}, overrides={**topics.overrides(), "kafka": kafka})
    name = ledger_topic(topics.dead_letter)
    ensure_topics(settings.kafka, [name], partitions=1)
    running = transactional_producer(
        settings.kafka, f"{settings.delivery.transactional_id_prefix}-dlq-replay.{topics.dead_letter}",
        "a replay still running", 60_000)
    running.init_transactions(30)
    running.begin_transaction()
    running.produce(name, key=b"dlq/0@7", value=json.dumps({"dead_letter_timestamp_ms": 7}))
    running.flush(30)  # its chunk written, its transaction open
    with ThreadPoolExecutor(1) as pool:
        second = pool.submit(replay, settings, Selection())
        report = second.result(timeout=45)  # without the fence first: the ledger read waits up to 90 s
    assert not report.stopped and report.items == []
    with pytest.raises(KafkaException):
        running.commit_transaction(30)  # fenced: its chunk was aborted, never in the ledger
    assert read_ledger(settings) == {}

# -- dlq replay: frames refused by reference ---------------------------------------------------------------
def set_max_message_bytes(bootstrap: str, topic: str, limit: int) -> None:
    entry = ConfigEntry("max.message.bytes", str(limit), incremental_operation=AlterConfigOpType.SET)
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for fut in admin.incremental_alter_configs(
            [ConfigResource(ConfigResource.Type.TOPIC, topic, incremental_configs=[entry])]).values():
        fut.result(30)


@pytest.mark.parametrize("mode", MODES)
def test_frames_refused_by_reference_are_replayed_from_their_input_topic_while_it_retains_them(
        kafka_bootstrap, unique, tmp_path, capsys, monkeypatch, mode):
    topics = make_topics(kafka_bootstrap, unique, partitions=1)
    env = {"WORKER_DELIVERY_MODE": mode, "WORKER_MODEL_DEFAULT_THRESHOLD": "0"}
    cli = Cli(capsys, monkeypatch, kafka_bootstrap, topics, env)
    # Results of frames with the longest identifiers the limits allow do not fit a 1000-byte results topic.
    set_max_message_bytes(kafka_bootstrap, topics.results, 1000)
    pixels = unmarked_pixels(2, 2).tobytes()
    short = [frame(f"s{unique}", i, pixels, side=2) for i in range(3)]
    long = [frame(f"L{unique}-{i}".ljust(256, "x"), 0, pixels, tenant="t".ljust(256, "y"), side=2) for i in range(3)]
    interleaved = [f for pair in zip(short, long) for f in pair]  # offsets 0..5
    FrameProducer(kafka_bootstrap, topics).publish(interleaved, keep_capture_ts=True)
    run_until_idle(kafka_bootstrap, topics, tmp_path / "refused.log", env)
    reader = ResultsReader(kafka_bootstrap, topics)
    assert set(ledger(reader.read_all(idle_timeout_s=1.0))) == ids(short)
    shown = cli.json("dlq", "show")
    assert shown["by_error_type"] == {"OutputRejected": 3} and shown["reference_only"] == 3
    assert shown["reference_only_not_retained"] == 0

    # The cause fixed (the results topic takes them now); retention has meanwhile deleted the first one (offset 1).
    set_max_message_bytes(kafka_bootstrap, topics.results, 1_048_588)
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.delete_records([TopicPartition(topics.standard, 0, 2)])[TopicPartition(topics.standard, 0, 2)].result(30)
    assert cli.json("dlq", "show")["reference_only_not_retained"] == 1
    replayed = cli.json("dlq", "replay")
    assert replayed["sent"] == 2 and replayed["skipped"] == 1
    [gone] = [i for i in replayed["items"] if i["outcome"] == "skipped"]
    assert gone["source"] == f"{topics.standard}/0@1" and "no longer retained" in gone["reason"]
    run_until_idle(kafka_bootstrap, topics, tmp_path / "fixed.log", env)
    results = ledger(reader.read_all(idle_timeout_s=1.0))
    assert set(results) == ids(short) | ids(long[1:])
    if mode == "exactly_once":
        assert max(results.values()) == 1


# -- lag -----------------------------------------------------------------------------------------------------
def kafka_tools_classpath() -> str:
    """Kafka's own tools jars (deploy/local-kafka/tools-lib, resolved by ./dev setup; resolved here with Maven when
    missing, as the broker's jars are)."""
    if shutil.which("java") is None:
        pytest.skip("java is not installed: Kafka's kafka-consumer-groups tool cannot run (apt-get install "
                    "openjdk-17-jre-headless)")
    if not any(TOOLS_LIB.glob("kafka-tools-*.jar")):
        mvn = shutil.which("mvn")
        if mvn is None:
            pytest.skip(f"Kafka's tools jars are not in {TOOLS_LIB} and Maven is not installed to fetch them "
                        "(./dev setup does)")
        subprocess.run([mvn, "-q", "-B", "-f", "tools-pom.xml", "dependency:copy-dependencies",
                        "-DincludeScope=runtime", "-DoutputDirectory=tools-lib"], cwd=TOOLS_LIB.parent, check=True,
                       timeout=600)
    return f"{TOOLS_LIB}/*"


def kafka_describe(bootstrap: str, group: str) -> dict[tuple[str, int], dict[str, str]]:
    """kafka-consumer-groups.sh --describe --group: per (topic, partition) its columns."""
    out = subprocess.run(["java", "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn", "-cp", kafka_tools_classpath(),
                          "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand", "--bootstrap-server",
                          bootstrap, "--describe", "--group", group],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    rows: dict[tuple[str, int], dict[str, str]] = {}
    header: list[str] = []
    for line in out.splitlines():
        cols = line.split()
        if cols[:2] == ["GROUP", "TOPIC"]:
            header = cols
        elif header and len(cols) == len(header) and cols[0] == group:
            row = dict(zip(header, cols))
            rows[(row["TOPIC"], int(row["PARTITION"]))] = row
    assert rows, out
    return rows


def assert_agrees_with_kafka(ours: dict[str, Any], theirs: dict[tuple[str, int], dict[str, str]]) -> None:
    [group] = ours["groups"]
    mine = {(p["topic"], p["partition"]): p for p in group["partitions"]}
    for tp, row in theirs.items():
        p = mine[tp]
        # Kafka prints "-" for a partition with nothing committed (one a member owns but never read from).
        committed, lag = ("-", "-") if p["committed"] is None else (str(p["committed"]), str(p["lag"]))
        assert (committed, str(p["end"]), lag) == (row["CURRENT-OFFSET"], row["LOG-END-OFFSET"], row["LAG"]), \
            (tp, p, row)
        owner = p["owner"] or {"client_id": "-", "host": "-", "member_id": "-"}
        assert (owner["client_id"], owner["host"], owner["member_id"]) == \
            (row["CLIENT-ID"], row["HOST"], row["CONSUMER-ID"]), (tp, p, row)


def test_lag_while_the_worker_is_stopped_and_after_it_caught_up_agrees_with_kafka_consumer_groups(
        kafka_bootstrap, unique, tmp_path, capsys, monkeypatch, streamfer_topics, streamfer_worker):
    topics = streamfer_topics
    cli = Cli(capsys, monkeypatch, kafka_bootstrap, topics)
    pixels = unmarked_pixels(32, 32).tobytes()
    producer = FrameProducer(kafka_bootstrap, topics)
    producer.publish([frame(f"cam{i % 6}-{unique}", i, pixels) for i in range(30)], keep_capture_ts=True)
    run_until_idle(kafka_bootstrap, topics, tmp_path / "first.log", {})

    # Stopped, with 24 frames captured 10 minutes ago still to do (expiry is off in the test kit's settings).
    old_ms = int(time.time() * 1000) - 600_000
    sent_at = time.time()
    producer.publish([frame(f"cam{i % 6}-{unique}", 100 + i, pixels, capture_ts_ms=old_ms) for i in range(24)],
                     keep_capture_ts=True)
    stopped = cli.json("lag")
    [group] = stopped["groups"]
    assert group["group"] == topics.group and group["state"] == "Empty" and group["members"] == []
    assert stopped["totals"]["standard"]["lag"] == 24 and stopped["totals"]["realtime"]["lag"] == 0
    assert stopped["total_lag"] == 24
    lagging = [p for p in group["partitions"] if p["lag"]]
    assert lagging and all(p["owner"] is None for p in lagging)
    for p in lagging:  # the frame at the committed offset: one of the old ones
        assert 600 <= p["oldest_pending_age_s"] <= 600 + (time.time() - sent_at) + 5
    assert_agrees_with_kafka(stopped, kafka_describe(kafka_bootstrap, topics.group))
    # The exit code for probes and scripts.
    assert cli("lag", "--fail-above", "24")[0] == 0 and cli("lag", "--fail-above", "23")[0] == 3
    assert cli("lag", "--class", "realtime", "--fail-above", "0")[0] == 0
    assert cli("lag", "--fail-above-age", "300")[0] == 3 and cli("lag", "--fail-above-age", "3600")[0] == 0

    # A worker runs and catches up: no lag, and each partition owned by it.
    worker = streamfer_worker(worker_id="w-lag")
    wait_for(lambda: cli("lag", "--no-age", "--fail-above", "0")[0] == 0, 120, "the worker to catch up")
    running = cli.json("lag")
    [group] = running["groups"]
    assert group["state"] == "Stable" and [m["client_id"] for m in group["members"]] == ["w-lag"]
    assert running["total_lag"] == 0 and all(p["owner"]["client_id"] == "w-lag" for p in group["partitions"])
    assert_agrees_with_kafka(running, kafka_describe(kafka_bootstrap, topics.group))
    assert len(ledger(ResultsReader(kafka_bootstrap, topics).read(54))) == 54
    worker.stop()


def test_lag_of_a_group_that_never_ran_counts_from_the_first_offset(kafka_bootstrap, unique, capsys, monkeypatch):
    topics = make_topics(kafka_bootstrap, unique, partitions=1)
    cli = Cli(capsys, monkeypatch, kafka_bootstrap, topics)
    FrameProducer(kafka_bootstrap, topics).publish([frame(f"c{unique}", i, unmarked_pixels(2, 2).tobytes(), side=2)
                                                    for i in range(5)], keep_capture_ts=True)
    report = cli.json("lag")
    [group] = report["groups"]
    assert group["state"] == "Dead" and report["totals"]["standard"]["lag"] == 5
    [standard] = [p for p in group["partitions"] if p["topic"] == topics.standard]
    assert standard["committed"] is None and standard["oldest_pending_age_s"] is not None
    code, text = cli("lag")
    assert code == 0 and f"group {topics.group}: does not exist" in text
