"""A test kit for code around the worker: a pytest plugin (entry point `pytest11`, on whenever streamfer is
installed) so a team tests its camera ingest or its consumer of results against the real worker and a real
Kafka broker in its own CI. The project's own tests use the same fixtures. docs/testing.md has an example.

Fixtures: `kafka_bootstrap` (a broker for the session: worker.testing.broker), `streamfer_topics` (fresh topics
and a group per test), `streamfer_worker` (starts `worker run` processes with given settings, ready when returned),
`frame_producer` and `results_reader` (read_committed). Kafka and the worker are imported only when a
fixture runs, so the plugin costs nothing in test sessions that do not use it. The benchmarks (bench/) start
their broker, topics, worker processes and load through the same functions.

The in-memory kit (docs/testing.md), loaded on first use: `InMemoryKafka`, `FakeConsumer`, `FakeProducer` and
`FakeExecutor` (worker.testing.fakes) run the real loop without a broker or a model; `FakeClock`
(worker.testing.clock) for every part that takes a clock; `FrameLedger` and `ledger` (worker.testing.frameledger)
check what became of each frame.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from worker.errors import StreamferError
from worker.testing.broker import kafka_broker, local_broker_pid  # noqa: F401 (the kit's public names)

if TYPE_CHECKING:
    from worker.frames import Encoding, Priority
    from worker.schemas import FrameRecord

log = logging.getLogger(__name__)
# librdkafka's own log lines of the frame producer (start-up retries such as "Coordinator load in progress"):
# delivery errors reach the caller anyway, so they stay out of test and benchmark output.
_CLIENT_LOG = logging.getLogger("worker.testing.kafka")
_CLIENT_LOG.addHandler(logging.NullHandler())
_CLIENT_LOG.propagate = False


class WorkerStartError(StreamferError):
    """A worker started by the test kit exited or did not become ready; the message ends with its log."""


# -- topics ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TestTopics:
    """One test's input, results and dead-letter topics and consumer group, named apart from every other's."""

    __test__ = False  # not a test class, whatever its name

    realtime: str
    standard: str
    bulk: str
    results: str
    dead_letter: str
    group: str

    @property
    def inputs(self) -> list[str]:
        return [self.realtime, self.standard, self.bulk]

    def for_priority(self, priority: Priority) -> str:
        from worker.frames import Priority

        return {Priority.REALTIME: self.realtime, Priority.STANDARD: self.standard, Priority.BULK: self.bulk}[priority]

    def priority_of(self) -> dict[str, Priority]:
        from worker.frames import Priority

        return {self.realtime: Priority.REALTIME, self.standard: Priority.STANDARD, self.bulk: Priority.BULK}

    def env(self) -> dict[str, str]:
        return {
            "WORKER_TOPICS_REALTIME": self.realtime, "WORKER_TOPICS_STANDARD": self.standard,
            "WORKER_TOPICS_BULK": self.bulk, "WORKER_TOPICS_RESULTS": self.results,
            "WORKER_TOPICS_DEAD_LETTER": self.dead_letter, "WORKER_KAFKA_GROUP_ID": self.group,
        }

    def overrides(self) -> dict[str, dict[str, Any]]:
        return {"topics": {"realtime": self.realtime, "standard": self.standard, "bulk": self.bulk,
                           "results": self.results, "dead_letter": self.dead_letter},
                "kafka": {"group_id": self.group}}


def make_topics(bootstrap: str, unique: str, partitions: int = 3, replication: int = 1,
                inputs_of: TestTopics | None = None) -> TestTopics:
    """Create the five topics of one test (`t<unique>.realtime`, ...) and name its group `g<unique>`.

    `inputs_of`: keep those input topics (and what was published to them), new results and dead-letter topics
    and a new group: another consumer of the same frames, from the beginning (a benchmark's next round)."""
    from worker.kafka.topics import ensure_topics

    t = TestTopics(realtime=f"t{unique}.realtime", standard=f"t{unique}.standard", bulk=f"t{unique}.bulk",
                   results=f"t{unique}.results", dead_letter=f"t{unique}.dlq", group=f"g{unique}")
    if inputs_of is not None:
        t = dataclasses.replace(t, realtime=inputs_of.realtime, standard=inputs_of.standard, bulk=inputs_of.bulk)
    ensure_topics(bootstrap, [*([] if inputs_of else t.inputs), t.results, t.dead_letter], partitions, replication)
    return t


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


# -- producing frames, reading results -------------------------------------------------------------------
def synthetic_frames(count: int, shapes: Sequence[tuple[int, int]], encoding: Encoding, priority: Priority, run_id: str,
                     streams_per_shape: int = 2) -> list[FrameRecord]:
    """`count` deterministic frames (smooth random pixels, JPEG-compressible like video) of the given (width,
    height) shapes, cycled over shapes, streams (`<run_id>-<class>-<w>x<h>-s<n>`) and three tenants."""
    from worker.tools.publish_frames import synthetic_frames as make

    return list(make(count, list(shapes), encoding, priority, run_id, streams_per_shape=streams_per_shape))


@dataclass
class FrameProducer:
    """Publishes frames (Avro, as cameras do) to the test's input topics."""

    bootstrap: str
    topics: TestTopics
    sent: list[FrameRecord] = field(default_factory=list)
    _producer: Any = field(default=None, init=False, repr=False)
    # How a frame becomes a message on a topic: None, a plain Avro body; `registry_frame_producer`'s, registry-framed.
    encode: Callable[[FrameRecord, str], bytes] | None = None

    def publish(self, frames: Iterable[FrameRecord], rate_fps: float | None = None) -> Any:
        """Publish frames to their priority's topic as a camera would: as fast as possible (a backlog) or open
        loop at `rate_fps`, each frame's capture time its *intended* send time (a late send counts against the
        consumer, not hidden); returns worker.tools.publish_frames' PublishReport once all are acknowledged. One
        producer is kept for the FrameProducer's life: a new one takes ~0.5 s to connect and get its idempotent id."""
        from worker.tools.publish_frames import frame_producer, send_frames

        if self._producer is None:
            self._producer = frame_producer(self.bootstrap, logger=_CLIENT_LOG)
            self._producer.list_topics(self.topics.realtime, timeout=30)
        return send_frames(self._producer, frames, lambda rec: self.topics.for_priority(rec.priority), rate_fps,
                           encode=self.encode)

    def send(self, frames: Iterable[FrameRecord], topic: str | None = None) -> list[FrameRecord]:
        """Publish frames as given (capture_ts_ms included), keyed by stream, each to its priority's topic
        unless `topic` is given; returns them once the broker acknowledged all."""
        from confluent_kafka import Producer

        from worker.schemas import encode_frame

        frames = list(frames)
        errors: list[str] = []

        def delivered(err: Any, _msg: Any) -> None:
            if err is not None:
                errors.append(err.str())

        producer = Producer({"bootstrap.servers": self.bootstrap, "enable.idempotence": True})
        for frame in frames:
            to = topic or self.topics.for_priority(frame.priority)
            producer.produce(to, key=frame.stream_id.encode(), on_delivery=delivered,
                             value=self.encode(frame, to) if self.encode else encode_frame(frame))
            producer.poll(0)
        remaining = producer.flush(60)
        assert remaining == 0 and not errors, f"{remaining} frames unacknowledged, errors: {errors[:3]}"
        self.sent += frames
        return frames

    def send_synthetic(self, count: int, priority: Priority | str = "standard",
                       shapes: Sequence[tuple[int, int]] = ((32, 32),), run_id: str | None = None
                       ) -> list[FrameRecord]:
        """`count` synthetic raw RGB frames of the given (width, height) shapes, captured now."""
        from worker.frames import Encoding, Priority

        prio = priority if isinstance(priority, Priority) else Priority[priority.upper()]
        run = run_id or f"test{uuid.uuid4().hex[:6]}"
        now_ms = int(time.time() * 1000)
        return self.send(dataclasses.replace(f, capture_ts_ms=now_ms)
                         for f in synthetic_frames(count, shapes, Encoding.RAW_RGB8, prio, run))

    def send_raw(self, topic: str, value: bytes, key: bytes | None = None) -> None:
        """A message that need not be a frame at all (to test dead-lettering)."""
        from confluent_kafka import Producer

        producer = Producer({"bootstrap.servers": self.bootstrap, "enable.idempotence": True})
        producer.produce(topic, value=value, key=key)
        assert producer.flush(30) == 0, f"message to {topic} not acknowledged"


@dataclass
class ResultsReader:
    """Reads the results topic (and dead letters) as a downstream consumer would: read_committed, from the start."""

    bootstrap: str
    topics: TestTopics

    def read(self, count: int, timeout_s: float = 120.0) -> list[dict[str, Any]]:
        """At least `count` decoded results (all committed so far once `count` are there); TimeoutError if not."""
        from worker.tools.read_results import read_results

        return read_results(self.bootstrap, self.topics.results, until=lambda rs: len(rs) >= count,
                            timeout_s=timeout_s)

    def read_all(self, idle_timeout_s: float = 3.0) -> list[dict[str, Any]]:
        """Every committed result, once nothing new came for `idle_timeout_s`."""
        from worker.tools.read_results import read_results

        return read_results(self.bootstrap, self.topics.results, idle_timeout_s=idle_timeout_s)

    def dead_letters(self, idle_timeout_s: float = 3.0) -> list[Any]:
        from worker.tools.read_results import read_dead_letters

        return read_dead_letters(self.bootstrap, self.topics.dead_letter, idle_timeout_s)


# -- Kafka state and small waits -------------------------------------------------------------------------
def committed_offsets(bootstrap: str, group: str, topics: list[str]) -> dict[tuple[str, int], int]:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        md = consumer.list_topics(timeout=10)
        tps = [TopicPartition(t, p) for t in topics for p in md.topics[t].partitions]
        return {(tp.topic, tp.partition): tp.offset for tp in consumer.committed(tps, timeout=10)}
    finally:
        consumer.close()


def end_offsets(bootstrap: str, topics: list[str]) -> dict[tuple[str, int], int]:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "offsets-probe"})
    try:
        md = consumer.list_topics(timeout=10)
        out = {}
        for t in topics:
            for p in md.topics[t].partitions:
                out[(t, p)] = consumer.get_watermark_offsets(TopicPartition(t, p), timeout=10)[1]
        return out
    finally:
        consumer.close()


def wait_committed(bootstrap: str, group: str, ends: Mapping[tuple[str, int], int], timeout_s: float,
                   alive: Callable[[], bool] = lambda: True, first: bool = False) -> bool:
    """Wait until `group` has committed every partition up to `ends` (end_offsets taken after publishing), or
    with `first` anything of them (its consumer is past start-up and group join). False after `timeout_s` or
    once `alive()` is false; one probe consumer, polled every 0.2 s."""
    from confluent_kafka import Consumer, TopicPartition

    probe = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    tps = [TopicPartition(t, p) for (t, p), end in ends.items() if end > 0]
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            committed = {(tp.topic, tp.partition): tp.offset for tp in probe.committed(tps, timeout=10)}
            done = [committed.get((tp.topic, tp.partition), -1) >= ends[(tp.topic, tp.partition)] for tp in tps]
            if (any(offset > 0 for offset in committed.values()) if first else all(done)):
                return True
            if not alive():
                return False
            time.sleep(0.2)
        return False
    finally:
        probe.close()


def uncommitted(bootstrap: str, group: str, topics: list[str]) -> dict[tuple[str, int], tuple[int, int]]:
    """Partitions whose committed offset is not their end offset: {tp: (committed, end)}.

    An empty partition has nothing to commit, so "no committed offset" counts as at its end (0)."""
    committed = committed_offsets(bootstrap, group, topics)
    ends = end_offsets(bootstrap, topics)
    return {tp: (committed.get(tp, -1), end) for tp, end in ends.items()
            if not (committed.get(tp, -1) == end or (end == 0 and committed.get(tp, -1) < 0))}


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


# -- the fixtures ----------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Apache Kafka broker for the whole session (see `kafka_broker` for which)."""
    with kafka_broker(tmp_path_factory.mktemp("local-kafka")) as bootstrap:
        yield bootstrap


@pytest.fixture
def streamfer_topics(kafka_bootstrap: str) -> TestTopics:
    """Fresh input, results and dead-letter topics (3 partitions) and a consumer group, for this test only."""
    return make_topics(kafka_bootstrap, uuid.uuid4().hex[:8])


@pytest.fixture
def streamfer_worker(kafka_bootstrap: str, streamfer_topics: TestTopics, tmp_path: Path
                     ) -> Iterator[Callable[..., RunningWorker]]:
    """Starts ready workers on the test's topics: `streamfer_worker(settings={...}, env={...})`; each is
    stopped (SIGTERM, a drain) at the end of the test if the test did not stop it."""
    started: list[RunningWorker] = []

    def start(settings: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
              worker_id: str | None = None, ready_timeout_s: float = 120.0) -> RunningWorker:
        worker = run_worker(kafka_bootstrap, streamfer_topics, tmp_path, settings, env,
                            worker_id or f"w{len(started)}", ready_timeout_s)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


@pytest.fixture
def frame_producer(kafka_bootstrap: str, streamfer_topics: TestTopics) -> FrameProducer:
    return FrameProducer(kafka_bootstrap, streamfer_topics)


@pytest.fixture
def results_reader(kafka_bootstrap: str, streamfer_topics: TestTopics) -> ResultsReader:
    return ResultsReader(kafka_bootstrap, streamfer_topics)


# -- a Schema Registry (Confluent API) -------------------------------------------------------------------
@pytest.fixture(scope="session")
def schema_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The base URL of a real Schema Registry for the session (schema_registry.url): STREAMFER_SCHEMA_REGISTRY_URL,
    else Apicurio Registry from Maven Central on loopback (worker.tools.schema_registry), stopped after. Skips
    only where no Java 17+ exists."""
    from worker.tools.schema_registry import SchemaRegistryUnavailable
    from worker.tools.schema_registry import schema_registry as running_registry

    try:
        with running_registry(tmp_path_factory.mktemp("schema-registry")) as url:
            yield url
    except SchemaRegistryUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture
def registry_frame_producer(kafka_bootstrap: str, streamfer_topics: TestTopics, schema_registry: str) -> FrameProducer:
    """A frame_producer writing the Confluent wire format: frame.avsc registered under `<topic>-value`."""
    from worker.config import SchemaRegistrySettings
    from worker.kafka.registry import frame_serializer

    serializer = frame_serializer(SchemaRegistrySettings(url=schema_registry))
    return FrameProducer(kafka_bootstrap, streamfer_topics, encode=serializer)


# -- the in-memory kit, re-exported (imported on first use: the plugin stays free of Kafka and Avro) -------------
_KIT = {
    "worker.testing.clock": ("START", "FakeClock"),
    "worker.testing.fakes": ("CAPTURE_TS_MS", "FakeConsumer", "FakeExecutor", "FakeMessage", "FakeProducer",
                             "InMemoryKafka", "Produced", "abortable", "frame_value", "outcome"),
    "worker.testing.frameledger": ("DEAD_LETTER", "EITHER", "RESULT", "FrameLedger", "dead_letter_source", "ledger",
                              "result_source"),
}
_KIT_MODULE = {name: module for module, names in _KIT.items() for name in names}

if TYPE_CHECKING:  # the names mypy sees; __getattr__ loads them at run time
    from worker.testing.clock import START, FakeClock  # noqa: F401
    from worker.testing.fakes import (  # noqa: F401
        CAPTURE_TS_MS,
        FakeConsumer,
        FakeExecutor,
        FakeMessage,
        FakeProducer,
        InMemoryKafka,
        Produced,
        abortable,
        frame_value,
        outcome,
    )
    from worker.testing.frameledger import (  # noqa: F401
        DEAD_LETTER,
        EITHER,
        RESULT,
        FrameLedger,
        dead_letter_source,
        ledger,
        result_source,
    )


def __getattr__(name: str) -> Any:
    module = _KIT_MODULE.get(name)
    if module is None:
        raise AttributeError(f"module 'worker.testing' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
