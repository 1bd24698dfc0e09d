"""The fault suite's machinery: publish a known set of input messages, run worker processes, inject faults,
and audit the outputs with a read_committed verifier.

The ledger keys on source coordinates (topic, partition, offset), which every output carries (a result in
its `source_*` fields, a dead letter in its `streamfer.source_*` headers), so good frames and garbage are
accounted for alike. A run's audit answers: was every input message answered (lost), answered more than
once (duplicated), answered the wrong way (misrouted: a good frame dead-lettered or garbage scored), or
answered for a message nobody sent (phantom)?

Used by the pytest suite (tests/reliability/test_*.py) and by the runner that prints the table
(tests/reliability/run.py). Nothing here sleeps for a fixed time where a condition can be awaited, except the
fault itself (an outage lasts N seconds).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import hashlib
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    IsolationLevel,
    KafkaError,
    KafkaException,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, OffsetSpec

from tests.integration.helpers import (
    TestTopics,
    group_commit_history,
    make_topics,
    offsets_moved_backwards,
    start_worker,
)
from tests.reliability.models import marked_pixels, unmarked_pixels
from tests.reliability.recovery import FaultMoment, Recovery, recoveries
from worker.codec.schemas import FrameRecord, decode_result, encode_frame
from worker.config import load_settings
from worker.frames import Encoding, Priority, SourceRef
from worker.testing import DEAD_LETTER, RESULT, FrameLedger, dead_letter_source
from worker.tools.local_broker import LocalKafka
from worker.tools.read_results import DeadLetterRecord, iter_messages

PROJECT_ROOT = Path(__file__).resolve().parents[2]
PARTITIONS = 3
DLQ_HEADERS = ("streamfer.error", "streamfer.error_type", "streamfer.source_topic",
               "streamfer.source_partition", "streamfer.source_offset")
MODES = ("at_least_once", "exactly_once")
# How a restarted worker is named: "fixed" sets its role's worker id (so the same transactional id: the new process
# fences the dead one's open transaction); "default" sets none, as a user gets it: the worker's own
# `<hostname>-<slot>`, the lowest slot free on this host, which a process restarted on the same host takes again;
# "fresh" sets a new id for every process, as a replacement pod of a Kubernetes Deployment gets (the dead process's
# transaction stays open until the broker aborts it).
WORKER_IDS = ("fixed", "default", "fresh")
# librdkafka's default message.max.bytes: the largest value (plus key and headers) a client may produce.
CLIENT_MAX_MESSAGE_BYTES = 1_000_000

# What a result or dead letter is expected for one input message.
# A run whose group commits nothing for this long (while work is left) is stuck: the worker hangs.
NO_PROGRESS_S = 60.0
# A dead producer's open transaction on an output partition hides every later output there from read_committed
# readers until the broker aborts it: transaction.timeout.ms (30 s) plus its abort check (10 s), with a margin.
OPEN_TRANSACTION_WAIT_S = 60.0
# After a kill with the broker frozen, the killed process's requests still on the wire are appended within this long
# of the broker's resume; no successor answers that soon (starting one takes seconds).
WIRE_LANDING_S = 2.0


# -- the inputs ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sent:
    """One input message as the verifier knows it."""

    kind: str  # "frame", "marked", or the label of a bad input
    expect: str  # RESULT, DEAD_LETTER or EITHER
    frame_id: tuple[str, int] | None = None  # (stream_id, frame_index) of a good frame
    digest: str = ""  # of the value, to check that a dead letter carries the original bytes


@dataclass(frozen=True)
class Outgoing:
    """A message to publish: a frame record (stamped with its intended send time) or raw bytes."""

    topic: str
    key: bytes | None
    sent: Sent
    record: FrameRecord | None = None
    raw: bytes = b""
    partition: int | None = None  # None: by key

    def value(self, intended_s: float) -> bytes:
        if self.record is None:
            return self.raw
        return encode_frame(dataclasses.replace(self.record, capture_ts_ms=int(intended_s * 1000)))


def digest(value: bytes | None) -> str:
    return hashlib.blake2b(value or b"", digest_size=8).hexdigest()


SHAPES = ((32, 32), (48, 32))  # (width, height): two shapes, so the batcher runs two shape buckets
STREAMS = 12


class FrameFactory:
    """Good frames with unique ids (`<run>-s<k>`, index), spread over the three priority topics."""

    def __init__(self, topics: TestTopics, run_id: str):
        self.topics = topics
        self.run_id = run_id
        self.next = 0
        self._payloads: dict[tuple[int, int, Encoding, bool], bytes] = {}

    def frames(self, count: int, marked: Iterable[int] = (), jpeg_every: int = 5,
               shape: tuple[int, int] | None = None, priority: Priority | None = None,
               partition: int | None = None) -> list[Outgoing]:
        """`count` frames; positions in `marked` (0-based within this call) carry the model-fault marker.
        By default shapes, classes and streams rotate; `shape`, `priority` and `partition` pin them."""
        marked = set(marked)
        out = []
        for i in range(count):
            n = self.next
            self.next += 1
            is_marked = i in marked
            w, h = shape or SHAPES[n % len(SHAPES)]
            # The marker must survive encoding, so marked frames are always RAW.
            enc = Encoding.JPEG if (jpeg_every and n % jpeg_every == jpeg_every - 1 and not is_marked) \
                else Encoding.RAW_RGB8
            prio = Priority(n % 3) if priority is None else priority
            stream = f"{self.run_id}-s{n % STREAMS}"
            record = FrameRecord(stream_id=stream, frame_index=n // STREAMS, capture_ts_ms=0, tenant=f"t{n % 3}",
                                 priority=prio, width=w, height=h, channels=3, encoding=enc,
                                 data=self._payload(w, h, enc, is_marked))
            out.append(Outgoing(topic=self.topics.inputs[prio], key=stream.encode(), record=record,
                                sent=Sent("marked" if is_marked else "frame", RESULT, (stream, n // STREAMS)),
                                partition=partition))
        return out

    def _payload(self, w: int, h: int, enc: Encoding, marked: bool) -> bytes:
        key = (w, h, enc, marked)
        if key not in self._payloads:
            pixels = marked_pixels(h, w) if marked else unmarked_pixels(h, w, seed=w * 1000 + h)
            if enc is Encoding.RAW_RGB8:
                self._payloads[key] = pixels.tobytes()
            else:
                from PIL import Image

                buf = io.BytesIO()
                Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
                self._payloads[key] = buf.getvalue()
        return self._payloads[key]


class Feeder(threading.Thread):
    """Publishes messages in order, open loop at `rate_fps` (or as fast as possible), and records the
    coordinates each landed at. A frame's capture_ts_ms is its *intended* send time, so latency measured from
    it includes any delay of the feeder itself (no coordinated omission)."""

    def __init__(self, bootstrap: str, items: Sequence[Outgoing], rate_fps: float | None = None):
        super().__init__(daemon=True, name="feeder")
        self.items = list(items)
        self.rate_fps = rate_fps
        self.sent: dict[SourceRef, Sent] = {}
        self.intended: dict[SourceRef, float] = {}
        # Delivered, but reported without an offset (a retried batch the broker already had, during a leader
        # change): (topic, partition, key, sent, intended), placed by `place_unplaced` once the run is over.
        self.unplaced: list[tuple[str, int, bytes | None, Sent, float]] = []
        self.errors: list[str] = []
        self.max_send_lag_s = 0.0
        self.published = 0  # items handed to the producer (all of them unless end() cut the list short)
        self._halt = threading.Event()
        self._end = threading.Event()
        self._producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 5,
                                   # Keep retrying through broker outages; the suite's outages are short.
                                   "message.timeout.ms": 300_000})

    def run(self) -> None:
        start = time.time()
        for i, item in enumerate(self.items):
            if self._halt.is_set() or self._end.is_set():
                break
            intended = start + i / self.rate_fps if self.rate_fps else time.time()
            if self.rate_fps:
                delay = intended - time.time()
                if delay > 0 and self._end.wait(delay):
                    break
                self.max_send_lag_s = max(self.max_send_lag_s, time.time() - intended)
            value = item.value(intended)
            sent = dataclasses.replace(item.sent, digest=digest(value))
            self._produce(item, value, sent, intended)
            self.published += 1
            self._producer.poll(0)
        deadline = time.monotonic() + 240
        while len(self._producer) and not self._halt.is_set() and time.monotonic() < deadline:
            self._producer.flush(0.5)
        if self._halt.is_set():
            self._producer.purge()
            self._producer.flush(5)
        elif len(self._producer):
            self.errors.append(f"{len(self._producer)} messages unacknowledged after 240 s")

    def place_unplaced(self, bootstrap: str) -> None:
        """Find the offsets of the messages delivered without one: in their partition, the message with the same key
        and value digest at an offset no other message of the run was reported at."""
        for topic, partition, key, sent, intended in self.unplaced:
            taken = {ref.offset for ref in self.sent if (ref.topic, ref.partition) == (topic, partition)}
            for msg in iter_partition(bootstrap, topic, partition):
                if msg.offset() not in taken and msg.key() == key and digest(msg.value()) == sent.digest:
                    ref = SourceRef(topic, partition, msg.offset())
                    self.sent[ref] = sent
                    self.intended[ref] = intended
                    break
            else:
                self.errors.append(f"a message to {topic} [{partition}] was delivered without an offset and is not "
                                   "in its partition")
        self.unplaced.clear()

    def stop(self) -> None:
        """Stop publishing and drop what is queued (the run is being abandoned)."""
        self._halt.set()

    def end(self) -> None:
        """Stop publishing the rest of the items, but deliver what was handed to the producer (an open-loop load
        that lasts as long as the scenario needs: `Run.end_feeds`)."""
        self._end.set()

    def _produce(self, item: Outgoing, value: bytes, sent: Sent, intended: float) -> None:
        def delivered(err: Any, msg: Any) -> None:
            if err is not None:
                if not self._halt.is_set():  # purged on purpose otherwise
                    self.errors.append(err.str())
                return
            if msg.offset() is None or msg.offset() < 0:
                self.unplaced.append((msg.topic(), msg.partition(), msg.key(), sent, intended))
                return
            ref = SourceRef(msg.topic(), msg.partition(), msg.offset())
            self.sent[ref] = sent
            self.intended[ref] = intended

        while True:
            try:
                if item.partition is None:
                    self._producer.produce(item.topic, value=value, key=item.key, on_delivery=delivered)
                else:
                    self._producer.produce(item.topic, value=value, key=item.key, partition=item.partition,
                                           on_delivery=delivered)
                return
            except BufferError:
                self._producer.poll(0.05)


# -- the workers ----------------------------------------------------------------------------------------------
def suite_env(mode: str, unique: str, model: str = "steady_model", batch_sleep_ms: float = 20) -> dict[str, str]:
    """Worker settings of the suite: small batches and caps, so every fault catches work in flight."""
    return {
        "PYTHONPATH": os.pathsep.join(p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")) if p),
        "WORKER_MODEL_SOURCE": f"tests.reliability.models:{model}",
        "WORKER_DELIVERY_MODE": mode,
        # One transactional id space per run: runs never fence each other.
        "WORKER_DELIVERY_TRANSACTIONAL_ID_PREFIX": f"rel-{unique}",
        "WORKER_BATCHING_MAX_BATCH_SIZE": "8",
        "WORKER_BATCHING_FALLBACK_MAX_BATCH_SIZE": "4",
        "WORKER_BATCHING_MAX_PENDING_FRAMES": "64",
        "WORKER_DELIVERY_MAX_INFLIGHT_BATCHES": "2",
        "WORKER_RUNTIME_WARMUP_BATCHES": "0",
        "WORKER_OBSERVABILITY_METRICS_ENABLED": "false",
        "STREAMFER_REL_BATCH_SLEEP_MS": str(batch_sleep_ms),
    }


def defaults_env(mode: str, unique: str) -> dict[str, str]:
    """The worker on its own defaults (builtin model, its batching, expiry and group settings): only the delivery
    mode and a transactional id space of the run's own, as a benchmark of a deployment measures it."""
    return {
        "PYTHONPATH": os.pathsep.join(p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")) if p),
        "WORKER_DELIVERY_MODE": mode,
        "WORKER_DELIVERY_TRANSACTIONAL_ID_PREFIX": f"rel-{unique}",
    }


def duplicate_bound_per_fault(env: dict[str, str]) -> int:
    """At-least-once: the most frames one fault may answer twice: what one worker holds read but not committed,
    which is what it reads at most past its last confirmed commit (`delivery.max_uncommitted_frames`; by default a
    full batcher plus every batch in flight, realtime's reserved slot included), as the worker itself derives it
    from the run's settings. The suite's producer queue is far below it."""
    return load_settings(env={k: v for k, v in env.items() if k.startswith("WORKER_")}).max_uncommitted_frames


@dataclass
class Crash:
    worker_id: str
    returncode: int
    log_tail: str


class Fleet:
    """The worker processes of one consumer group. A process that exits without being told to is a crash:
    it is recorded and restarted (as an orchestrator would), at most `max_restarts` times per worker."""

    def __init__(self, bootstrap: str, topics: TestTopics, env: dict[str, str], logdir: Path, max_restarts: int = 3,
                 worker_ids: str = "fixed", test_env: bool = True):
        self.bootstrap = bootstrap
        self.test_env = test_env  # False: the worker's own defaults, without the kit's TEST_ENV
        self.topics = topics
        self.env = env
        self.logdir = logdir
        self.max_restarts = max_restarts
        self.worker_ids = worker_ids
        self.procs: dict[str, subprocess.Popen] = {}
        self.crashes: list[Crash] = []
        self.unclean_stops: dict[str, int] = {}
        self._restarts: Counter = Counter()
        self._starts: Counter = Counter()
        self._log_offsets: dict[str, int] = {}

    def log_path(self, worker_id: str) -> Path:
        return self.logdir / f"{worker_id}.log"

    def start(self, worker_id: str, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start a process in the role `worker_id` (its log's name), the same command each time, as a supervisor
        restarts one; the process's worker id is the role's ("fixed"), the worker's own default ("default"), or
        new for each process ("fresh")."""
        env = dict(self.env)
        env.update(extra_env or {})
        path = self.log_path(worker_id)
        self._log_offsets[worker_id] = path.stat().st_size if path.exists() else 0
        self._starts[worker_id] += 1
        explicit = {"fixed": worker_id, "default": None,
                    "fresh": f"{worker_id}-{self._starts[worker_id]}"}[self.worker_ids]
        proc = start_worker(self.bootstrap, self.topics, extra_env=env, worker_id=explicit,
                            log_path=str(self.log_path(worker_id)), test_env=self.test_env)
        self.procs[worker_id] = proc
        return proc

    def is_up(self, worker_id: str) -> bool:
        """Whether the worker's current process has started its loop (model loaded, subscribed)."""
        path = self.log_path(worker_id)
        if worker_id not in self.procs or not path.exists():
            return False
        with open(path, "rb") as fh:
            fh.seek(self._log_offsets.get(worker_id, 0))
            return b"worker started:" in fh.read()

    def partitions(self, worker_id: str) -> set[tuple[str, int]]:
        """The partitions the worker's current process holds, by its log's assignment lines (cooperative
        increments: assigned adds, revoked and lost remove)."""
        path = self.log_path(worker_id)
        held: set[tuple[str, int]] = set()
        if worker_id not in self.procs or not path.exists():
            return held
        with open(path, "rb") as fh:
            fh.seek(self._log_offsets.get(worker_id, 0))
            text = fh.read().decode(errors="replace")
        for kind, listed in re.findall(r"partitions (assigned|revoked|lost): (\[[^\]]*\])", text):
            try:
                tps = {(t, int(p)) for t, p in ast.literal_eval(listed)}
            except (ValueError, SyntaxError):
                continue
            held = held | tps if kind == "assigned" else held - tps
        return held

    def pid(self, worker_id: str) -> int:
        return self.procs[worker_id].pid

    def signal(self, worker_id: str, sig: int) -> None:
        self.procs[worker_id].send_signal(sig)

    def kill(self, worker_id: str) -> None:
        """SIGKILL and reap: the worker gets no chance to flush, commit or leave the group."""
        proc = self.procs.pop(worker_id)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)

    def terminate(self, worker_id: str, timeout_s: float = 60.0) -> int:
        """SIGTERM (drain, commit, leave the group) and wait; returns the exit code (SIGKILL after the timeout)."""
        proc = self.procs.pop(worker_id)
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
            rc = -9
        if rc != 0:
            self.unclean_stops[worker_id] = rc
        return rc

    def supervise(self) -> None:
        for worker_id, proc in list(self.procs.items()):
            rc = proc.poll()
            if rc is None:
                continue
            self.crashes.append(Crash(worker_id, rc, self.log_tail(worker_id)))
            del self.procs[worker_id]
            if self._restarts[worker_id] < self.max_restarts:
                self._restarts[worker_id] += 1
                self.start(worker_id)

    def stop_all(self, timeout_s: float = 30.0) -> None:
        for worker_id in list(self.procs):
            self.terminate(worker_id, timeout_s)

    def log_tail(self, worker_id: str, chars: int = 3000) -> str:
        path = self.log_path(worker_id)
        if not path.exists():
            return ""
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if not ln.startswith("%")]
        return "\n".join(lines)[-chars:]

    def log_events(self) -> Counter:
        """Rebalance and failure events over all workers' logs."""
        events: Counter = Counter()
        for path in self.logdir.glob("*.log"):
            text = path.read_text(errors="replace")
            for name, needle in (("assigned", "partitions assigned"), ("revoked", "partitions revoked"),
                                 ("lost", "partitions lost"), ("traceback", "Traceback"),
                                 ("delivery_retried", "producing again")):
                events[name] += text.count(needle)
        return events


@contextlib.contextmanager
def cpu_load(processes: int) -> Iterator[None]:
    """Busy processes competing for the CPU while the block runs: timing windows (a transaction still open, a
    rebalance inside a poll) open wider under load, and several defects showed only then."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait(10)


def rss_bytes(pid: int) -> int | None:
    """Resident set size of a process from /proc (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# -- watching the group ----------------------------------------------------------------------------------------
class GroupWatch:
    """The worker group's committed offsets against the inputs' end offsets, without joining the group."""

    def __init__(self, bootstrap: str, group: str, topics: Sequence[str], partitions: int = PARTITIONS):
        # read_uncommitted: asks for committed offsets without requiring them stable, so the broker answers with
        # the last committed ones at once while a dead member's transaction holds pending offsets (a
        # read_committed client's look-up would wait, up to transaction.timeout.ms).
        self._consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False,
                                   "isolation.level": "read_uncommitted", "log_level": 0})
        self._tps = [TopicPartition(t, p) for t in topics for p in range(partitions)]

    def committed(self) -> int | None:
        """Messages the group has committed over all input partitions (None while the broker does not answer)."""
        try:
            answer = self._consumer.committed(self._tps, timeout=5)
        except KafkaException:
            return None
        if any(tp.error is not None for tp in answer):
            return None
        return sum(max(0, tp.offset) for tp in answer)

    def ends(self) -> int | None:
        try:
            return sum(self._consumer.get_watermark_offsets(tp, timeout=5)[1] for tp in self._tps)
        except KafkaException:
            return None

    def lag(self) -> int | None:
        committed, ends = self.committed(), self.ends()
        return None if committed is None or ends is None else ends - committed

    def close(self) -> None:
        self._consumer.close()


def end_offsets_of(admin: AdminClient, *topics: str, isolation: IsolationLevel) -> dict[tuple[str, int], int]:
    """Per partition of `topics`: the end a reader at `isolation` sees (read_committed: the last stable offset, which
    stops at the first transaction still open; read_uncommitted: the high watermark)."""
    md = admin.list_topics(timeout=10)
    request = {TopicPartition(t, p): OffsetSpec.latest() for t in topics for p in md.topics[t].partitions}
    futures = admin.list_offsets(request, isolation_level=isolation, request_timeout=10)
    return {(tp.topic, tp.partition): fut.result().offset for tp, fut in futures.items()}


def stamp_on_append(bootstrap: str, topics: list[str], properties: dict[str, str], timeout_s: float = 30.0) -> None:
    """Make the broker stamp each output with the time it appended it (LogAppendTime), not the time the worker
    produced it: an output produced while its partition's leader is away lands (and counts as an answer) later."""
    admin = AdminClient({"bootstrap.servers": bootstrap, **properties})
    entry = ConfigEntry("message.timestamp.type", "LogAppendTime", incremental_operation=AlterConfigOpType.SET)
    futures = admin.incremental_alter_configs(
        [ConfigResource(ConfigResource.Type.TOPIC, t, incremental_configs=[entry]) for t in topics])
    for fut in futures.values():
        fut.result(timeout_s)


def iter_partition(bootstrap: str, topic: str, partition: int) -> Iterator[Any]:
    """Every message of one partition, from its beginning to its end as it is now."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"place-{uuid.uuid4().hex[:8]}",
                         "enable.auto.commit": False, "enable.partition.eof": True, "log_level": 0})
    try:
        consumer.assign([TopicPartition(topic, partition, OFFSET_BEGINNING)])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            if msg.error() is not None:
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    return
                continue
            yield msg
    finally:
        consumer.close()


def read_results_with_times(bootstrap: str, topic: str) -> list[dict[str, Any]]:
    """Every committed result, each with `_produced_at` (its Kafka timestamp, seconds: when the broker appended it,
    see stamp_on_append): which worker process wrote a duplicate shows from the time, against the process start
    times in the worker's log."""
    out = []
    for msg in iter_messages(bootstrap, topic, idle_timeout_s=1.0, timeout_s=180):
        record = decode_result(msg.value())
        record["_produced_at"] = msg.timestamp()[1] / 1000.0
        out.append(record)
    return out


def read_dead_letters_with_times(bootstrap: str, topic: str) -> list[tuple[DeadLetterRecord, float]]:
    """Every committed dead letter with its Kafka timestamp (seconds; see stamp_on_append)."""
    return [(DeadLetterRecord(key=m.key(), value=m.value() or b"",
                              headers={k: (v or b"").decode(errors="replace") for k, v in (m.headers() or [])}),
             m.timestamp()[1] / 1000.0)
            for m in iter_messages(bootstrap, topic, idle_timeout_s=1.0, timeout_s=180)]


def answer_times(results: list[dict[str, Any]],
                 dead_letters: list[tuple[DeadLetterRecord, float]]) -> dict[SourceRef, list[float]]:
    """When each input message's answers landed (their append timestamps), by its source coordinates."""
    out: dict[SourceRef, list[float]] = {}
    for r in results:
        out.setdefault(SourceRef(r["source_topic"], r["source_partition"], r["source_offset"]), []).append(
            r["_produced_at"])
    for dl, at in dead_letters:
        ref = dead_letter_source(dl.headers)
        if ref is not None:
            out.setdefault(ref, []).append(at)
    return out


def ledger_of_repeats(sent: dict[SourceRef, Sent],
                      found: Iterable[tuple[SourceRef, str]]) -> dict[SourceRef, tuple[Sent, SourceRef]]:
    """`found`: one partition's messages (coordinates, value digest). A message no delivery report named whose value
    is a reported one's is a second copy: of the copies, the first in the partition expects the original's answer, the
    others a dead letter (a repeated frame). Returns the ledger entries to set, each with its original's coordinates."""
    found = list(found)
    if not found:
        return {}
    tp = found[0][0].topic_partition
    originals = {s.digest: ref for ref, s in sent.items() if ref.topic_partition == tp}
    copies: dict[SourceRef, list[SourceRef]] = {}
    for ref, value_digest in found:
        original = originals.get(value_digest)
        if ref not in sent and original is not None:
            copies.setdefault(original, [original]).append(ref)
    out: dict[SourceRef, tuple[Sent, SourceRef]] = {}
    for original, refs in copies.items():
        first, *later = sorted(refs, key=lambda r: r.offset)
        s = sent[original]
        again = Sent(f"{s.kind} (written twice by the feeder)", DEAD_LETTER if s.expect == RESULT else s.expect,
                     s.frame_id, s.digest)
        out[first] = (s, original)
        out.update({r: (again, original) for r in later})
    return out


# -- the audit ------------------------------------------------------------------------------------------------
@dataclass
class Audit:
    """The verifier's ledger over one run: every count is over input messages (source coordinates)."""

    produced: int = 0
    results: int = 0
    dead_letters: int = 0
    lost: int = 0
    duplicated: int = 0  # outputs beyond the first, summed over input messages
    misrouted: int = 0  # a good frame dead-lettered, or garbage answered with a result
    phantom: int = 0  # outputs for coordinates nobody produced
    mismatched: int = 0  # a result whose frame id is not the one produced at its coordinates
    bad_headers: int = 0  # dead letters without a reason or without their source coordinates
    dead_letters_without_original: int = 0  # dead letters whose value is not the input's bytes
    lost_sample: list[str] = field(default_factory=list)
    duplicated_sample: list[str] = field(default_factory=list)
    misrouted_sample: list[str] = field(default_factory=list)
    error_types: Counter = field(default_factory=Counter)

    def add(self, other: Audit) -> None:
        for f in dataclasses.fields(self):
            mine = getattr(self, f.name)
            if isinstance(mine, int):
                setattr(self, f.name, mine + getattr(other, f.name))
            elif isinstance(mine, list):
                mine.extend(getattr(other, f.name)[: max(0, 5 - len(mine))])
            elif isinstance(mine, Counter):
                mine.update(getattr(other, f.name))


def audit(sent: dict[SourceRef, Sent], results: list[dict[str, Any]], dead_letters: list[DeadLetterRecord]) -> Audit:
    """The run's ledger (worker.testing.FrameLedger) in figures, with a few of each fault named."""
    a = Audit(produced=len(sent), results=len(results), dead_letters=len(dead_letters))
    book = FrameLedger()
    for ref, s in sent.items():
        book.sent(ref, s.expect)
    produced_at: dict[SourceRef, list[str]] = {}
    for r in results:
        ref = SourceRef(r["source_topic"], r["source_partition"], r["source_offset"])
        book.answered(ref, RESULT)
        if "_produced_at" in r:
            produced_at.setdefault(ref, []).append(time.strftime("%H:%M:%S", time.localtime(r["_produced_at"]))
                                                   + f".{int(r['_produced_at'] * 1000) % 1000:03d}")
        s = sent.get(ref)
        if s is not None and s.frame_id is not None and (r["stream_id"], r["frame_index"]) != s.frame_id:
            a.mismatched += 1
    for dl in dead_letters:
        a.error_types[dl.headers.get("streamfer.error_type", "?")] += 1
        ref = dead_letter_source(dl.headers)
        if ref is None or not all(dl.headers.get(h) for h in DLQ_HEADERS):
            a.bad_headers += 1
        book.answered(ref, DEAD_LETTER)
        s = sent.get(ref) if ref is not None else None
        if s is not None and digest(dl.value) != s.digest:
            a.dead_letters_without_original += 1
    a.phantom = book.phantoms
    lost = book.lost()
    a.lost = len(lost)
    a.lost_sample = [f"{ref} {sent[ref].kind} {sent[ref].frame_id}" for ref in lost[:5]]
    duplicated = {ref: got for ref, got in book.duplicated().items() if ref in sent}
    a.duplicated = sum(len(got) - 1 for got in duplicated.values())
    a.duplicated_sample = [f"{ref} {sent[ref].kind} {got} at {produced_at.get(ref, '?')}"
                           for ref, got in list(duplicated.items())[:5]]
    misrouted = book.misrouted()
    a.misrouted = len(misrouted)
    a.misrouted_sample = [f"{ref} {sent[ref].kind}: expected {sent[ref].expect}, got {book.answers[ref]}"
                          for ref in misrouted[:5]]
    return a


# -- one run ------------------------------------------------------------------------------------------------------
@dataclass
class Lab:
    """Where runs happen: a broker and a scratch folder. With `broker` (a LocalKafka the suite may restart)
    the bootstrap address is read from the broker's state, so clients made after a restart find it."""

    workdir: Path
    fixed_bootstrap: str = ""
    broker: LocalKafka | None = None
    owns_broker: bool = False
    # A broker the suite may freeze for a moment (SIGSTOP/SIGCONT keeps its address): the restartable one,
    # or the shared test broker.
    pausable: LocalKafka | None = None
    # Replicas of each run's topics (3 on a three-node cluster).
    replication: int = 1

    def __post_init__(self) -> None:
        if self.pausable is None:
            self.pausable = self.broker

    @property
    def bootstrap(self) -> str:
        state = self.broker.state() if self.broker is not None else None
        return state.bootstrap_servers if state is not None else self.fixed_bootstrap

    # Worker ids of restarted workers (WORKER_IDS): "fixed", "default" (the worker's own) or "fresh" (new each time).
    worker_ids: str = "fixed"

    def with_worker_ids(self, worker_ids: str) -> Lab:
        """The same lab, its runs naming workers as `worker_ids` says (it does not own the broker a second time)."""
        if worker_ids not in WORKER_IDS:
            raise ValueError(f"worker_ids must be one of {WORKER_IDS}, not {worker_ids!r}")
        return dataclasses.replace(self, worker_ids=worker_ids, owns_broker=False)

    @classmethod
    def with_own_broker(cls, workdir: Path) -> Lab:
        """A lab on a broker of its own (for faults that stop the broker, so nothing else sees them)."""
        broker = LocalKafka(workdir / f"broker-{uuid.uuid4().hex[:6]}")
        broker.start()
        return cls(workdir, broker=broker, owns_broker=True)

    @classmethod
    def with_own_cluster(cls, workdir: Path, heap_mb: int = 320) -> Lab:
        """A lab on a three-node KRaft cluster of its own (replication factor 3, min ISR 2), for node faults."""
        broker = LocalKafka(workdir / f"cluster-{uuid.uuid4().hex[:6]}", heap_mb=heap_mb, nodes=3)
        broker.start(timeout_s=180)
        return cls(workdir, broker=broker, owns_broker=True, replication=3)

    def close(self) -> None:
        if self.owns_broker and self.broker is not None:
            self.broker.destroy()


@dataclass
class RunOutcome:
    fault: str
    mode: str
    audit: Audit
    crashes: list[Crash]
    unclean_stops: dict[str, int]
    seconds: float
    faults_injected: int
    duplicate_bound: int
    zero_duplicates_expected: bool = False
    notes: dict[str, Any] = field(default_factory=dict)
    logdir: str = ""
    # Per fault and affected partition: seconds from the fault to the partition's first answer after it.
    recovery: list[Recovery] = field(default_factory=list)

    def problems(self) -> list[str]:
        """Everything that breaks the delivery promise of the run's mode, or the worker's keeping going."""
        a, p = self.audit, []
        if self.notes.get("offsets_backwards"):
            p.append(f"the group's committed offset moved backwards (a duplicate in waiting): "
                     f"{self.notes['offsets_backwards'][:5]}")
        if self.notes.get("commit_history_error"):
            p.append(f"could not read the group's commit history: {self.notes['commit_history_error']}")
        if a.lost:
            p.append(f"{a.lost} lost, e.g. {a.lost_sample}")
        if (self.mode == "exactly_once" or self.zero_duplicates_expected) and a.duplicated:
            p.append(f"{a.duplicated} duplicated ({self.mode}, {self.fault}), e.g. {a.duplicated_sample}")
        if self.mode == "at_least_once" and a.duplicated > self.faults_injected * self.duplicate_bound:
            p.append(f"{a.duplicated} duplicated, above {self.faults_injected} faults x "
                     f"{self.duplicate_bound} in flight")
        for name in ("misrouted", "phantom", "mismatched", "bad_headers"):
            if getattr(a, name):
                p.append(f"{getattr(a, name)} {name}" + (f", e.g. {a.misrouted_sample}" if name == "misrouted" else ""))
        for c in self.crashes:
            p.append(f"worker {c.worker_id} exited on its own with {c.returncode}:\n{c.log_tail[-1500:]}")
        for worker_id, rc in self.unclean_stops.items():
            p.append(f"worker {worker_id} exited with {rc} after SIGTERM (expected a clean drain, 0)")
        if self.notes.get("stuck"):
            p.append(f"the group never caught up: {self.notes['stuck']}")
        if self.notes.get("feeder_errors"):
            p.append(f"the feeder could not publish: {self.notes['feeder_errors'][:3]}")
        return p

    def describe(self) -> str:
        return f"{self.fault} [{self.mode}] in {self.logdir}:\n  - " + "\n  - ".join(self.problems())


class Run:
    """One fault run: fresh topics and group, a fleet of workers, feeders, and at the end the audit."""

    def __init__(self, lab: Lab, fault: str, mode: str, *, model: str = "steady_model", batch_sleep_ms: float = 20,
                 env: dict[str, str] | None = None, partitions: int = PARTITIONS, worker_defaults: bool = False,
                 results_replication: int | None = None, results_partitions: int | None = None):
        """`worker_defaults`: the workers run on their own defaults (defaults_env; `model` and `batch_sleep_ms` are
        then unused) instead of the suite's small batches and test model."""
        self.lab = lab
        self.fault = fault + ("" if lab.worker_ids == "fixed" else f" ({lab.worker_ids} worker ids)")
        self.mode = mode
        self.unique = uuid.uuid4().hex[:8]
        self.partitions = partitions
        self.topics = make_topics(lab.bootstrap, self.unique, partitions, lab.replication,
                                  results_replication=results_replication, results_partitions=results_partitions)
        stamp_on_append(lab.bootstrap, [self.topics.results, self.topics.dead_letter],
                        lab.broker.client_properties() if lab.broker else {})
        slug = re.sub(r"[^a-z0-9]+", "-", self.fault.lower()).strip("-")
        self.dir = lab.workdir / f"{slug}-{mode}-{self.unique}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.env = defaults_env(mode, self.unique) if worker_defaults else suite_env(mode, self.unique, model,
                                                                                      batch_sleep_ms)
        self.env["STREAMFER_REL_PROBE_DIR"] = str(self.probe_dir)
        self.env.update(env or {})
        self.probe_dir.mkdir(exist_ok=True)
        self.fleet = Fleet(lab.bootstrap, self.topics, self.env, self.dir, worker_ids=lab.worker_ids,
                           test_env=not worker_defaults)
        self.watch = GroupWatch(lab.bootstrap, self.topics.group, self.topics.inputs, partitions)
        self.factory = FrameFactory(self.topics, self.unique)
        self.feeders: list[Feeder] = []
        # Messages the feeder wrote twice (see account_for_repeats), by their coordinates.
        self.repeats: dict[SourceRef, Sent] = {}
        self.repeat_intended: dict[SourceRef, float] = {}
        self.expected = 0
        self.faults_injected = 0
        self.fault_moments: list[FaultMoment] = []
        # A clean stop (SIGTERM drain) must not redo anything, even in at-least-once mode.
        self.zero_duplicates_expected = False
        self.aborted = False
        self.notes: dict[str, Any] = {}
        self.started = time.monotonic()

    @property
    def probe_dir(self) -> Path:
        return self.dir / "probe"

    # -- input ----------------------------------------------------------------------------------------------
    def feed(self, items: Sequence[Outgoing], rate_fps: float | None = None, wait: bool = False) -> Feeder:
        feeder = Feeder(self.lab.bootstrap, items, rate_fps)
        self.expected += len(items)
        self.feeders.append(feeder)
        feeder.start()
        if wait:
            feeder.join()
        return feeder

    def end_feeds(self, timeout_s: float = 240.0) -> None:
        """End an open-ended load: every feeder stops publishing, delivers what it handed over, and the run expects
        answers for what was published (not for the rest of the items)."""
        for f in self.feeders:
            f.end()
        for f in self.feeders:
            f.join(timeout_s)
            self.expected -= len(f.items) - f.published
            f.items = f.items[:f.published]

    @property
    def sent(self) -> dict[SourceRef, Sent]:
        out: dict[SourceRef, Sent] = {}
        for f in self.feeders:
            out.update(f.sent)
        out.update(self.repeats)
        return out

    def account_for_repeats(self) -> None:
        """The feeder's idempotent producer can still write a message twice when a leader change meets its retries
        (seen once with two of three nodes down). The worker answers the first copy and dead-letters the next as a
        repeated frame (worker/partitions/dedup.py); the ledger takes in every copy, the first expecting the
        original's answer and the others a dead letter, so neither counts as phantom or misrouted. Only read when the
        input partitions hold more messages than were reported delivered."""
        sent = self.sent
        ends = self.watch.ends()
        if ends is None or ends <= len(sent):
            return
        intended = self.intended
        for topic in self.topics.inputs:
            for partition in range(self.partitions):
                found = [(SourceRef(topic, partition, msg.offset()), digest(msg.value()))
                         for msg in iter_partition(self.lab.bootstrap, topic, partition)]
                for ref, (s, original) in ledger_of_repeats(sent, found).items():
                    self.repeats[ref] = s
                    self.repeat_intended[ref] = intended[original]
        if self.repeats:
            self.notes["feeder_wrote_twice"] = sorted(str(r) for r, s in self.repeats.items() if "twice" in s.kind)

    # -- waiting --------------------------------------------------------------------------------------------
    def wait(self, condition: Callable[[], bool], timeout_s: float, interval_s: float = 0.1) -> bool:
        """Poll `condition` while supervising the workers; False after the timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.fleet.supervise()
            if condition():
                return True
            time.sleep(interval_s)
        return False

    def progress(self) -> float:
        committed = self.watch.committed()
        return 0.0 if committed is None or not self.expected else committed / self.expected

    def wait_progress(self, fraction: float, timeout_s: float = 120.0) -> bool:
        """Wait until the group has committed `fraction` of all the input the run will produce."""
        ok = self.wait(lambda: self.progress() >= fraction, timeout_s)
        if not ok:
            self.notes.setdefault("progress_timeouts", []).append(fraction)
        return ok

    def _done_or_stalled(self) -> Callable[[], bool]:
        """A condition: caught up, or no worker left, or no offset committed for NO_PROGRESS_S."""
        last = {"committed": -1, "at": time.monotonic()}

        def check() -> bool:
            if self.caught_up() or not self.fleet.procs:
                return True
            committed = self.watch.committed()
            if committed != last["committed"]:
                last.update(committed=committed, at=time.monotonic())
            return time.monotonic() - last["at"] > NO_PROGRESS_S

        return check

    def caught_up(self) -> bool:
        committed = self.watch.committed()
        return committed is not None and committed >= self.expected and all(not f.is_alive() for f in self.feeders)

    # -- faults ---------------------------------------------------------------------------------------------
    def mark_fault(self, partitions: Iterable[tuple[str, int]] | None = None, began: float | None = None,
                   down: float | None = None) -> None:
        """A fault set off at `began` (time.time(); None: now) left these input partitions (None: every partition)
        without a server from `down` on (None: now): counted, and its recovery time measured from the answers after
        the run (see tests/reliability/recovery.py)."""
        self.faults_injected += 1
        self.fault_moments.append(FaultMoment(time.time() if down is None else down,
                                              None if partitions is None else frozenset(partitions), began))

    def kill_mid_batch(self, worker_id: str, timeout_s: float = 15.0) -> str:
        """SIGKILL the worker while a batch is inside its model; at a random moment if none is seen in time."""
        probe = self.probe_dir / f"forward.{self.fleet.pid(worker_id)}"
        phase = "mid-batch" if self.wait(probe.exists, timeout_s, interval_s=0.002) else "random"
        held = self.fleet.partitions(worker_id)
        self.fleet.kill(worker_id)
        self.mark_fault(held)
        probe.unlink(missing_ok=True)
        return phase

    def kill_after_produce(self, worker_id: str, freeze_s: float = 0.5) -> str:
        """SIGKILL the worker while its output is on the wire but unacknowledged: the broker is frozen
        (SIGSTOP) for `freeze_s` while the worker keeps producing, the worker is killed, then the broker
        resumes and appends what was sent. Without a broker to freeze, a kill at a random moment."""
        broker = self.lab.pausable.running() if self.lab.pausable else None
        held = self.fleet.partitions(worker_id)
        if broker is None:
            self.fleet.kill(worker_id)
            self.mark_fault(held)
            return "random"
        os.kill(broker.pid, signal.SIGSTOP)
        killed = None
        try:
            time.sleep(freeze_s)
            self.fleet.kill(worker_id)
            killed = time.time()
        finally:
            os.kill(broker.pid, signal.SIGCONT)
        if killed is not None:
            # What the dead process had on the wire lands as the broker resumes: its answers, not a successor's.
            self.mark_fault(held, began=killed, down=time.time() + WIRE_LANDING_S)
        return "after-produce"

    def kill_now(self, worker_id: str) -> str:
        held = self.fleet.partitions(worker_id)
        self.fleet.kill(worker_id)
        self.mark_fault(held)
        return "random"

    # -- the end --------------------------------------------------------------------------------------------
    def finish(self, timeout_s: float = 180.0, stop_workers: bool = True) -> RunOutcome:
        """Wait for the group to commit everything, stop the workers (SIGTERM), read and audit the outputs."""
        for f in self.feeders:
            f.join(timeout=timeout_s)
        for f in self.feeders:
            f.place_unplaced(self.lab.bootstrap)
        self.account_for_repeats()
        errors = [e for f in self.feeders for e in f.errors]
        if errors:
            self.notes["feeder_errors"] = errors
        if not self.aborted and not self.wait(self._done_or_stalled(), timeout_s, interval_s=0.2):
            self.notes["stuck"] = f"committed {self.watch.committed()} of {self.expected} after {timeout_s:.0f} s"
        elif not self.aborted and not self.caught_up():
            self.notes["stuck"] = (f"committed {self.watch.committed()} of {self.expected}: no progress for "
                                   f"{NO_PROGRESS_S:.0f} s" if self.fleet.procs else "every worker is gone")
        self.notes["events"] = dict(self.fleet.log_events())
        if stop_workers:
            self.fleet.stop_all()
        self.wait_for_open_transactions()
        self.check_commit_history()
        results = read_results_with_times(self.lab.bootstrap, self.topics.results)
        timed_dead_letters = read_dead_letters_with_times(self.lab.bootstrap, self.topics.dead_letter)
        dead_letters = [dl for dl, _at in timed_dead_letters]
        self.watch.close()
        self.results, self.dead_letters = results, dead_letters
        recovery = recoveries(self.fault_moments, self.intended, answer_times(results, timed_dead_letters))
        # Per fault, in order: each interrupted partition's seconds to its first answer (None: never answered).
        self.notes["recovery_s"] = [{f"{r.partition[0].rsplit('.', 1)[-1]}-{r.partition[1]}":
                                     None if r.seconds is None else round(r.seconds, 1)
                                     for r in recovery if r.fault_at == m.at} for m in self.fault_moments]
        return RunOutcome(fault=self.fault, mode=self.mode, audit=audit(self.sent, results, dead_letters),
                          crashes=list(self.fleet.crashes), unclean_stops=dict(self.fleet.unclean_stops),
                          seconds=time.monotonic() - self.started, faults_injected=self.faults_injected,
                          duplicate_bound=duplicate_bound_per_fault(self.env),
                          zero_duplicates_expected=self.zero_duplicates_expected, notes=self.notes,
                          logdir=str(self.dir), recovery=recovery)

    @property
    def intended(self) -> dict[SourceRef, float]:
        """When each input message was sent (its intended send time, see Feeder)."""
        out: dict[SourceRef, float] = {}
        for f in self.feeders:
            out.update(f.intended)
        out.update(self.repeat_intended)
        return out

    def wait_for_open_transactions(self, timeout_s: float = OPEN_TRANSACTION_WAIT_S) -> None:
        """Before the outputs are read: wait until no transaction is open on them. A process killed with a
        transaction open and not restarted under its transactional id (fresh worker ids) leaves it to the broker,
        and a read_committed reader sees no output of that partition past it until the broker aborts it: answered
        late, not lost. Past the timeout the audit reads what it can see."""
        admin = AdminClient({"bootstrap.servers": self.lab.bootstrap,
                             **(self.lab.broker.client_properties() if self.lab.broker else {})})
        started = time.monotonic()

        def settled() -> bool:
            try:
                outputs = (self.topics.results, self.topics.dead_letter)
                stable = end_offsets_of(admin, *outputs, isolation=IsolationLevel.READ_COMMITTED)
                ends = end_offsets_of(admin, *outputs, isolation=IsolationLevel.READ_UNCOMMITTED)
            except KafkaException:
                return False
            return stable == ends

        if not settled():
            done = self.wait(settled, timeout_s, interval_s=1.0)
            self.notes["open_transaction_wait_s" if done else "open_transaction_left"] = round(
                time.monotonic() - started, 1)

    def check_commit_history(self) -> None:
        """Every commit of the group, in order, from __consumer_offsets: no partition's committed offset may move
        backwards (the next owner would answer again what was committed). Read after the run rather than sampled
        during it, because a sample every so often can miss a step back that a later commit covers again."""
        try:
            history = group_commit_history(self.lab.bootstrap, self.topics.group)
        except Exception as exc:  # noqa: BLE001 (a broker that does not answer: reported, not raised)
            self.notes["commit_history_error"] = f"{type(exc).__name__}: {exc}"
            return
        self.notes["commits_read"] = sum(len(v) for v in history.values())
        backwards = offsets_moved_backwards(history)
        if backwards:
            self.notes["offsets_backwards"] = backwards

    def abort(self, reason: str) -> None:
        """Give up on the run (the fault left nothing to recover): stop feeding, kill the workers; finish()
        then audits what there is without waiting for the group to catch up."""
        self.notes["stuck"] = reason
        self.aborted = True
        for f in self.feeders:
            f.stop()
        self.abandon()

    def abandon(self) -> None:
        """Kill whatever still runs (after a failure inside a scenario)."""
        for worker_id in list(self.fleet.procs):
            self.fleet.kill(worker_id)
