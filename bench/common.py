"""What the Kafka benchmarks share: the broker, the workload, load generators, worker processes, and how
results are turned into throughput and latency figures.

Every figure comes from the results themselves: a result carries `capture_ts_ms` (the *intended* send
time of its frame) and `end_to_end_ms` (capture -> result ready to produce), so the moment a result was
made is `capture_ts_ms + end_to_end_ms` on this machine's clock, whichever consumer made it.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import stats  # noqa: E402
from confluent_kafka import Consumer, Producer, TopicPartition  # noqa: E402
from workloads import WORKLOADS, Workload, model_env, model_settings  # noqa: E402

from tests.integration.helpers import TestTopics as Topics  # noqa: E402
from tests.integration.helpers import end_offsets  # noqa: E402 (after the sys.path set-up above)
from worker.schemas import FrameRecord  # noqa: E402
from worker.tools.publish_frames import frame_producer, send_frames, synthetic_frames  # noqa: E402
from worker.tools.read_results import read_results  # noqa: E402
from worker.topics import ensure_topics  # noqa: E402

RESULTS_DIR = REPO / "bench" / "results"
# librdkafka's client logs (start-up retries such as "Coordinator load in progress") stay out of the tables.
_KAFKA_LOG = logging.getLogger("bench.kafka")
_KAFKA_LOG.addHandler(logging.NullHandler())
_KAFKA_LOG.propagate = False
PARTITIONS = 3


# -- the workload (definitions in workloads.py) ------------------------------------------------------------
STREAMS_PER_SHAPE = 6  # keys per shape: spreads a topic's frames over its partitions


def describe_workload(workload: Workload | None = None) -> dict[str, Any]:
    return (workload or WORKLOADS["mixed"]).describe()


def workload_records(count: int, run_id: str, workload: Workload | None = None) -> list[FrameRecord]:
    """`count` frames of the workload, the classes interleaved evenly by share (deterministic)."""
    per_class: list[tuple[float, FrameRecord]] = []
    for priority, load in (workload or WORKLOADS["mixed"]).classes.items():
        n = max(1, round(count * load.share))
        records = synthetic_frames(n, list(load.shapes), load.encoding, priority, run_id,
                                   streams_per_shape=STREAMS_PER_SHAPE)
        per_class.extend(((i + 0.5) / n, rec) for i, rec in enumerate(records))
    per_class.sort(key=lambda pair: (pair[0], pair[1].priority))
    return [rec for _, rec in per_class[:count]]


def run_id_of(stream_id: str) -> str:
    return stream_id.split("-", 1)[0]


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"


# -- the broker and topics ---------------------------------------------------------------------------------
# Broker warm-up (Broker.warm_up): offered rate, measuring window, "quiet" JIT compiler, and the limit.
WARMUP_RATE_FPS = 200.0
WARMUP_WINDOW_S = 5.0
WARMUP_QUIET_CORES = 0.05
WARMUP_MAX_S = 150.0


class Broker:
    """KAFKA_BOOTSTRAP_SERVERS when set, else a fresh local broker in a temp dir, destroyed on exit."""

    def __init__(self) -> None:
        self.bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "")
        self.pid: int | None = None
        self.description = f"external broker {self.bootstrap}" if self.bootstrap else ""
        self._local = None

    def __enter__(self) -> Broker:
        if not self.bootstrap:
            from worker.tools.local_broker import LocalKafka

            t0 = time.monotonic()
            self._local = LocalKafka(tempfile.mkdtemp(prefix="streamfer-bench-kafka-"), heap_mb=512)
            state = self._local.start()
            self.bootstrap, self.pid = state.bootstrap_servers, state.pid
            self.description = f"local single-node Apache Kafka (KRaft), started in {time.monotonic() - t0:.0f}s"
            print(f"[bench] {self.description} at {self.bootstrap}", flush=True)
        return self

    def __exit__(self, *exc: object) -> None:
        close_producers()
        if self._local is not None:
            self._local.destroy()

    def cpu_seconds(self) -> float | None:
        return process_cpu_seconds(self.pid) if self.pid else None

    def warm_up(self, log_dir: Path, rate_fps: float = WARMUP_RATE_FPS, max_s: float = WARMUP_MAX_S) -> dict[str, Any]:
        """Run frames through a worker until the broker's JIT compiler is quiet, so no benchmark measures it.

        A fresh JVM compiles its hot code for the first minute or so of traffic: on the 2-core VM its C2 compiler
        threads took 0.3-0.5 cores for ~35 s under 200 frames/s, and the request threads 1.6x their warm CPU,
        on the cores the worker runs on; a production broker has long finished. Waits (in WARMUP_WINDOW_S steps)
        until the C2 threads use under WARMUP_QUIET_CORES, at most `max_s`. Nothing to do for an external
        broker (KAFKA_BOOTSTRAP_SERVERS), whose threads this process cannot see."""
        if not self.pid:
            return {"skipped": "external broker"}
        t0 = time.monotonic()
        topics = make_topics(self.bootstrap, "warm")
        proc = start_worker(self.bootstrap, topics, log_dir, 1, new_id("warm"), expiry=True)
        windows: list[float] = []
        try:
            before = compiler_cpu_seconds(self.pid)
            while time.monotonic() - t0 < max_s:
                publish_load(self.bootstrap, topics, workload_records(int(rate_fps * WARMUP_WINDOW_S),
                                                                      new_id("warm")), rate_fps=rate_fps)
                after = compiler_cpu_seconds(self.pid)
                windows.append((after - before) / WARMUP_WINDOW_S)
                before = after
                if not proc.alive():
                    raise RuntimeError(f"the warm-up worker exited\n{proc.tail()}")
                if windows[-1] < WARMUP_QUIET_CORES:
                    break
        finally:
            proc.stop()
        quiet = bool(windows) and windows[-1] < WARMUP_QUIET_CORES
        seconds = time.monotonic() - t0
        print(f"[bench] broker warm-up: {seconds:.0f}s at {rate_fps:.0f} frames/s, JIT compiler cores per "
              f"{WARMUP_WINDOW_S:.0f}s window {', '.join(f'{w:.2f}' for w in windows)}"
              f"{'' if quiet else ' (still compiling: figures may include it)'}", flush=True)
        return {"seconds": seconds, "rate_fps": rate_fps, "compiler_cores_per_window": windows, "quiet": quiet}


def compiler_cpu_seconds(pid: int) -> float:
    """CPU seconds of a JVM's C2 JIT compiler threads (thread names "C2 CompilerThreadN", "C2 CompilerThre" once
    the kernel's 15 bytes cut them)."""
    return sum(s for role, s in thread_cpu_seconds(pid).items() if role.startswith("C2 Compiler"))


def thread_role(os_name: str) -> str:
    """A thread's role from its OS name, the numbering dropped: "infer-cpu-0-0" -> "infer-cpu", "decode_1" ->
    "decode", "rdk:broker1" -> "rdk:broker" (librdkafka's). The worker names its threads (worker.threadnames);
    its main thread, the loop, keeps the process's name ("python")."""
    return re.sub(r"([-_]?\d+)+$", "", os_name) or os_name


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """user + system CPU seconds of a process's live threads, summed by role (thread_role), from Linux /proc.
    A thread that ended is not counted: compare two readings of long-lived threads only."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            role = thread_role((task / "comm").read_text().strip())
        except OSError:
            continue
        seconds = _stat_cpu_seconds(task / "stat")
        if seconds is not None:
            out[role] = out.get(role, 0.0) + seconds
    return out


def process_cpu_seconds(pid: int) -> float | None:
    """user + system CPU seconds of a process (Linux /proc), or None."""
    return _stat_cpu_seconds(Path(f"/proc/{pid}/stat"))


def _stat_cpu_seconds(stat: Path) -> float | None:
    """user + system CPU seconds from a /proc stat file (a process's or one thread's), or None."""
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def machine_cpu_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, all cores (Linux /proc/stat)."""
    try:
        with open("/proc/stat") as fh:
            values = [int(v) for v in fh.readline().split()[1:]]
    except OSError:
        return (float("nan"), float("nan"))
    tick = os.sysconf("SC_CLK_TCK")
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    total = sum(values[:8])  # guest time is already inside user
    return ((total - idle) / tick, total / tick)


class CpuWatch:
    """CPU used over a span by: this process, the given child processes, the broker, and everything else on
    the machine ("background": other people's work on a shared machine is what makes timings noisy)."""

    def __init__(self, broker: Broker | None = None, pids: Sequence[int] = ()) -> None:
        self.broker = broker
        self.pids = list(pids)
        self._start = self._stamp()

    def _stamp(self) -> dict[str, float]:
        busy, total = machine_cpu_seconds()
        children = sum(process_cpu_seconds(p) or 0.0 for p in self.pids)
        broker = (self.broker.cpu_seconds() or 0.0) if self.broker else 0.0
        return {"wall": time.monotonic(), "self": time.process_time(), "children": children, "broker": broker,
                "busy": busy, "total": total}

    def add_pid(self, pid: int) -> None:
        """Count a process started after the watch (its CPU so far counts from zero)."""
        self.pids.append(pid)

    def stop(self) -> dict[str, float]:
        end = self._stamp()
        d = {k: end[k] - self._start.get(k, 0.0) for k in end}
        wall = d["wall"] or float("nan")
        children = end["children"] - self._start["children"]
        ours = d["self"] + children
        return {"wall_s": d["wall"], "cores": d["total"] / wall, "ours_cores": ours / wall,
                "bench_process_cores": d["self"] / wall, "watched_processes_cores": children / wall,
                "broker_cores": d["broker"] / wall,
                "background_cores": max(0.0, d["busy"] - ours - d["broker"]) / wall}


def make_topics(bootstrap: str, tag: str) -> Topics:
    """Fresh input, results and dead-letter topics and a fresh group id."""
    u = new_id(tag)
    t = Topics(realtime=f"b{u}.realtime", standard=f"b{u}.standard", bulk=f"b{u}.bulk", results=f"b{u}.results",
               dead_letter=f"b{u}.dlq", group=f"g{u}")
    ensure_topics(bootstrap, [*t.inputs, t.results, t.dead_letter], PARTITIONS)
    return t


def fresh_consumer(bootstrap: str, topics: Topics, tag: str) -> Topics:
    """The same inputs (and their backlog) for a new consumer: a new group, results and dead-letter topic."""
    u = new_id(tag)
    t = Topics(topics.realtime, topics.standard, topics.bulk, results=f"b{u}.results", dead_letter=f"b{u}.dlq",
               group=f"g{u}")
    ensure_topics(bootstrap, [t.results, t.dead_letter], PARTITIONS)
    return t


# -- load ---------------------------------------------------------------------------------------------------
_PRODUCERS: dict[str, Producer] = {}


def cached_frame_producer(bootstrap: str) -> Producer:
    """The frame producer of worker.tools.publish_frames, one per broker, kept open: a new producer needs ~0.5 s to
    connect and get its idempotent producer id, and frames due meanwhile would count that against the consumer."""
    if bootstrap not in _PRODUCERS:
        _PRODUCERS[bootstrap] = frame_producer(bootstrap, logger=_KAFKA_LOG)
    return _PRODUCERS[bootstrap]


def close_producers() -> None:
    for producer in _PRODUCERS.values():
        producer.flush(10)
    _PRODUCERS.clear()


@dataclass
class LoadReport:
    sent: int
    seconds: float
    offered_fps: float | None
    achieved_fps: float
    # Actual minus intended send time (OpenMessaging's "send delay"); large values mean the generator itself
    # fell behind. Latencies stay honest anyway: capture_ts_ms is the intended time.
    send_delay_p99_ms: float = 0.0
    send_delay_max_ms: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in self.__dict__.items()}


def publish_load(bootstrap: str, topics: Topics, records: Sequence[FrameRecord], rate_fps: float | None = None,
                 stop: Callable[[], bool] = lambda: False) -> LoadReport:
    """Publish `records` to their class's topic: as fast as possible (a backlog), or open loop at `rate_fps`
    (worker.tools.publish_frames.send_frames: capture_ts_ms is each frame's intended send time)."""
    report = send_frames(cached_frame_producer(bootstrap), records, lambda rec: topics.for_priority(rec.priority),
                         rate_fps, stop)
    delays = report.send_delays_ms
    return LoadReport(sent=report.sent, seconds=report.seconds, offered_fps=rate_fps,
                      achieved_fps=report.sent / report.seconds if report.seconds else 0,
                      send_delay_p99_ms=percentile(delays, 0.99) if delays else 0.0,
                      send_delay_max_ms=delays[-1] if delays else 0.0)


# -- consumers: progress and results ----------------------------------------------------------------------------
def wait_committed(bootstrap: str, group: str, ends: dict[tuple[str, int], int], timeout_s: float,
                   alive: Callable[[], bool] = lambda: True) -> bool:
    """Wait until the group has committed every partition up to `ends` (what was published); False on timeout."""
    probe = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    tps = [TopicPartition(t, p) for (t, p), end in ends.items() if end > 0]
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            committed = {(tp.topic, tp.partition): tp.offset for tp in probe.committed(tps, timeout=10)}
            if all(committed.get(k, -1) >= ends[k] for k in ends if ends[k] > 0):
                return True
            if not alive():
                return False
            time.sleep(0.2)
        return False
    finally:
        probe.close()


def wait_started(bootstrap: str, group: str, ends: dict[tuple[str, int], int], timeout_s: float,
                 alive: Callable[[], bool] = lambda: True) -> bool:
    """Wait until the group has committed anything of `ends` (the consumer is past start-up and group join)."""
    probe = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    tps = [TopicPartition(t, p) for (t, p), end in ends.items() if end > 0]
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and alive():
            if any(tp.offset > 0 for tp in probe.committed(tps, timeout=10)):
                return True
            time.sleep(0.2)
        return False
    finally:
        probe.close()


def read_run_results(bootstrap: str, results_topic: str, expected: int | None = None,
                     timeout_s: float = 120.0) -> list[dict[str, Any]]:
    """Every result on a results topic (committed ones), stopping at `expected` when given."""
    return read_results(bootstrap, results_topic, count=expected, idle_timeout_s=1.0, timeout_s=timeout_s)


def produced_at_ms(r: dict[str, Any]) -> float:
    return r["capture_ts_ms"] + r["end_to_end_ms"]


def steady_throughput(results: Sequence[dict[str, Any]], trim: float = 0.1) -> dict[str, Any]:
    """Frames/s over the middle of a run: results made between the `trim` and `1 - trim` quantiles of their
    production times, divided by that span. Start-up (group join, warm caches) and the tail are left out."""
    times = sorted(produced_at_ms(r) for r in results)
    if len(times) < 20:
        return {"frames_per_s": float("nan"), "window_s": 0.0, "frames_in_window": len(times)}
    lo, hi = int(trim * (len(times) - 1)), int((1 - trim) * (len(times) - 1))
    span_s = (times[hi] - times[lo]) / 1000.0
    n = hi - lo
    return {"frames_per_s": n / span_s if span_s > 0 else float("nan"), "window_s": span_s, "frames_in_window": n,
            "window_start_ms": times[lo], "window_end_ms": times[hi]}


class CpuSampler:
    """Samples a process's cumulative CPU seconds against wall time (time.time(), the clock results are
    stamped with) in a thread, so CPU can be counted over the same window as the throughput."""

    def __init__(self, pid: int, interval_s: float = 0.1) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-cpu-sampler", daemon=True)
        self._thread.start()

    def _take(self) -> None:
        cpu = process_cpu_seconds(self.pid)
        if cpu is not None:
            self.samples.append((time.time(), cpu))

    def _loop(self) -> None:
        self._take()
        while not self._stop.wait(self.interval_s):
            self._take()

    def stop(self) -> list[tuple[float, float]]:
        """Stop sampling (one last sample first) and return the samples."""
        self._take()
        self._stop.set()
        self._thread.join()
        return self.samples


def window_cpu_ms_per_frame(samples: Sequence[tuple[float, float]], tp: dict[str, Any]) -> float:
    """CPU-ms per frame of a process over steady_throughput's window (NaN if the samples do not cover it)."""
    if "window_start_ms" not in tp:
        return float("nan")
    cpu = stats.cpu_between(samples, tp["window_start_ms"] / 1000.0, tp["window_end_ms"] / 1000.0)
    return stats.cpu_ms_per_frame(cpu, tp["frames_in_window"])


def all_active_throughput(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Frames/s while every worker of a group was producing: from the last worker's first result to the
    first worker's last result (so staggered start-ups and early finishers do not count)."""
    by_worker: dict[str, list[float]] = {}
    for r in results:
        by_worker.setdefault(r["worker_id"], []).append(produced_at_ms(r))
    start = max(min(v) for v in by_worker.values())
    end = min(max(v) for v in by_worker.values())
    n = sum(1 for r in results if start <= produced_at_ms(r) <= end)
    span_s = (end - start) / 1000.0
    return {"frames_per_s": n / span_s if span_s > 0.5 else float("nan"), "window_s": span_s,
            "frames_in_window": n, "workers_with_results": len(by_worker),
            "per_worker_results": {w: len(v) for w, v in sorted(by_worker.items())}}


def latency_summary(results: Sequence[dict[str, Any]], qs: Sequence[float] = (0.5, 0.95, 0.99)) -> dict[str, float]:
    values = sorted(r["end_to_end_ms"] for r in results)
    out = {f"p{_q_name(q)}_ms": percentile(values, q) for q in qs}
    out["max_ms"] = values[-1] if values else float("nan")
    out["n"] = len(values)
    return out


def _q_name(q: float) -> str:
    return f"{q * 100:g}".replace(".", "")


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted sequence."""
    if not sorted_values:
        return float("nan")
    k = max(0, min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1))
    return float(sorted_values[k])


def batch_size_distribution(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Share of frames that ran in a batch of each size range (frame-weighted), and the mean."""
    sizes = [r["batch_size"] for r in results if r.get("status", "OK") == "OK"]
    edges = [(1, 1), (2, 3), (4, 7), (8, 15), (16, 31), (32, 10**9)]
    dist = {(f"{a}" if a == b else (f"{a}-{b}" if b < 10**9 else f"{a}+")): 0.0 for a, b in edges}
    for s in sizes:
        for (a, b), key in zip(edges, dist, strict=True):
            if a <= s <= b:
                dist[key] += 1
    total = len(sizes) or 1
    return {"share_of_frames": {k: round(v / total, 3) for k, v in dist.items()},
            "mean_frame_weighted": (sum(sizes) / len(sizes)) if sizes else float("nan")}


# -- worker processes ---------------------------------------------------------------------------------------------
def worker_env(bootstrap: str, topics: Topics, torch_threads: int, worker_id: str,
               expiry: bool = False, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of a `python -m worker run` process; defaults unless named here."""
    env = dict(os.environ)
    env.update(topics.env())
    env.update({"WORKER_KAFKA_BOOTSTRAP_SERVERS": bootstrap, "WORKER_OBSERVABILITY_WORKER_ID": worker_id,
                "WORKER_OBSERVABILITY_METRICS_PORT": "0", "WORKER_RUNTIME_TORCH_THREADS": str(torch_threads),
                "PYTHONUNBUFFERED": "1"})
    if not expiry:
        # A pre-published backlog is older than realtime's 2 s max age: it must run, not expire.
        env.update({"WORKER_BATCHING_REALTIME_MAX_AGE_MS": "0", "WORKER_BATCHING_STANDARD_MAX_AGE_MS": "0"})
    env.update(extra or {})
    return env


class Proc:
    """A child process with its log in the bench's log folder."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.popen = subprocess.Popen(argv, env=env, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (the worker drains and commits), SIGKILL if it does not exit."""
        if self.alive():
            self.popen.terminate()
        try:
            code = self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            code = self.popen.wait()
        self._log.close()
        return code

    def wait(self, timeout_s: float) -> int:
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return self.stop()
        finally:
            if not self._log.closed:
                self._log.close()

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def start_worker(bootstrap: str, topics: Topics, log_dir: Path, torch_threads: int, worker_id: str,
                 exit_when_idle_s: float | None = None, expiry: bool = False,
                 extra_env: dict[str, str] | None = None) -> Proc:
    argv = [sys.executable, "-m", "worker", "run"]
    if exit_when_idle_s is not None:
        argv += ["--exit-when-idle", str(exit_when_idle_s)]
    env = worker_env(bootstrap, topics, torch_threads, worker_id, expiry, extra_env)
    return Proc(argv, env, log_dir / f"{worker_id}.log")


@dataclass
class BacklogRun:
    results: list[dict[str, Any]]
    procs: list[Proc]
    seconds: float  # consumer start to everything committed (start-up and group join included)
    proc_cpu_s: list[float | None]  # CPU seconds each consumer process used, start-up included
    broker_cpu_s: float | None  # CPU seconds the local broker used meanwhile (None for an external one)
    cpu_samples: list[list[tuple[float, float]]] = field(default_factory=list)  # per process, CpuSampler's

    def cpu_ms_per_frame(self, tp: dict[str, Any]) -> float:
        """CPU-ms per frame of all consumer processes together over steady_throughput's window."""
        if not self.cpu_samples or "window_start_ms" not in tp:
            return float("nan")
        t0, t1 = tp["window_start_ms"] / 1000.0, tp["window_end_ms"] / 1000.0
        return stats.cpu_ms_per_frame(sum(stats.cpu_between(s, t0, t1) for s in self.cpu_samples),
                                      tp["frames_in_window"])


def run_backlog(bootstrap: str, topics: Topics, expected: int, start: Callable[[Topics], Proc | list[Proc]],
                timeout_s: float, tag: str, broker: Broker | None = None) -> BacklogRun:
    """Start consumer process(es) on an already published backlog, wait until the group committed it all,
    stop them and read their results."""
    consumer_topics = fresh_consumer(bootstrap, topics, tag)
    ends = end_offsets(bootstrap, topics.inputs)
    broker_cpu0 = broker.cpu_seconds() if broker else None
    t0 = time.monotonic()
    started = start(consumer_topics)
    procs = started if isinstance(started, list) else [started]
    samplers = [CpuSampler(p.popen.pid) for p in procs]
    done = wait_committed(bootstrap, consumer_topics.group, ends, timeout_s,
                          alive=lambda: all(p.alive() for p in procs))
    elapsed = time.monotonic() - t0
    proc_cpu = [process_cpu_seconds(p.popen.pid) for p in procs]
    samples = [s.stop() for s in samplers]
    broker_cpu = broker.cpu_seconds() if broker else None
    for p in procs:
        p.stop()
    if not done:
        tails = "\n".join(f"--- {p.log_path}\n{p.tail()}" for p in procs)
        raise RuntimeError(f"{tag}: the backlog was not consumed within {timeout_s:.0f}s\n{tails}")
    results = read_run_results(bootstrap, consumer_topics.results, expected)
    return BacklogRun(results, procs, elapsed, proc_cpu,
                      None if broker_cpu is None or broker_cpu0 is None else broker_cpu - broker_cpu0, samples)


# -- output ----------------------------------------------------------------------------------------------------
def table(title: str, headers: Sequence[str], rows: Iterable[Sequence[Any]], note: str = "") -> str:
    """A fixed-width text table (also valid enough to read in a terminal log)."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = " | ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))
    out = [f"\n== {title} ==", line, "-" * len(line)]
    out += [" | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    if note:
        out.append(note)
    text = "\n".join(out)
    print(text, flush=True)
    return text


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        return f"{v:.0f}" if abs(v) >= 100 else (f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}")
    return str(v)


def machine() -> dict[str, Any]:
    import confluent_kafka
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "host_cpu": cpu,
        "cpu_cores": os.cpu_count(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "confluent_kafka": confluent_kafka.__version__,
        "librdkafka": confluent_kafka.libversion()[0],
    }


def write_json(name: str, data: dict[str, Any], out_dir: Path = RESULTS_DIR) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=_json_default))
    print(f"[bench] wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}", flush=True)
    return path


def _json_default(o: Any) -> Any:
    if isinstance(o, float) and math.isnan(o):
        return None
    if hasattr(o, "as_dict"):
        return o.as_dict()
    return str(o)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@dataclass
class Context:
    """What every benchmark gets from run_all (or builds for itself when run alone)."""

    bootstrap: str
    broker: Broker | None
    quick: bool
    torch_threads: int
    log_dir: Path
    out_dir: Path = RESULTS_DIR
    shared: dict[str, Any] = field(default_factory=dict)  # figures one benchmark hands to the next
    workload_name: str = "mixed"  # a key of workloads.WORKLOADS
    model: str = "toy"  # a key of workloads.MODELS
    rounds: int = 0  # interleaved rounds; 0: the benchmark's default (fewer with --quick)

    def scale(self, full: float, quick: float) -> float:
        return quick if self.quick else full

    @property
    def workload(self) -> Workload:
        return WORKLOADS[self.workload_name]

    def model_overrides(self) -> dict[str, Any]:
        """The [model] settings of this run's model and workload (load_settings overrides)."""
        return model_settings(self.model, self.workload)

    def worker_env(self) -> dict[str, str]:
        """Extra environment of a worker process: the model, then whatever run_all varies (CUDA graphs)."""
        return {**model_env(self.model_overrides()), **self.shared.get("worker_env", {})}

    def records(self, count: int, run_id: str) -> list[FrameRecord]:
        return workload_records(count, run_id, self.workload)

    def round_count(self, full: int, quick: int) -> int:
        return self.rounds or (quick if self.quick else full)


def standalone(run: Callable[[Context], dict[str, Any]], argv: list[str] | None, description: str,
               configure: Callable[[Any], None] | None = None) -> int:
    """`python bench/NAME.py [--quick] [--torch-threads N]`: one benchmark with its own broker. Extra flags
    added by `configure` reach the benchmark as ctx.shared["args"]."""
    import argparse

    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="short run (noisier figures)")
    p.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads per process (default 1)")
    add_workload_args(p)
    if configure:
        configure(p)
    args = p.parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="streamfer-bench-logs-"))
    with Broker() as broker:
        warm_up = broker.warm_up(log_dir)
        ctx = Context(bootstrap=broker.bootstrap, broker=broker, quick=args.quick,
                      torch_threads=args.torch_threads, log_dir=log_dir,
                      shared={"args": args, "broker_warm_up": warm_up},
                      workload_name=args.workload, model=args.model, rounds=args.rounds)
        run(ctx)
    return 0


def add_workload_args(p: Any) -> None:
    from workloads import MODELS, WORKLOADS

    p.add_argument("--workload", choices=list(WORKLOADS), default="mixed", help="frames fed (bench/workloads.py)")
    p.add_argument("--model", choices=list(MODELS), default="toy", help="toy (builtin CNN) or opennsfw (ResNet-50)")
    p.add_argument("--rounds", type=int, default=0, help="interleaved rounds (default: each benchmark's own)")


class Timer:
    """Accumulates wall and thread-CPU seconds of named code paths (thread-safe enough for counters)."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            w0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                dw, dc = time.perf_counter() - w0, time.thread_time() - c0
                with self._lock:
                    self.wall[name] = self.wall.get(name, 0.0) + dw
                    self.cpu[name] = self.cpu.get(name, 0.0) + dc
                    self.calls[name] = self.calls.get(name, 0) + 1

        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        return timed
