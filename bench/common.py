"""What the Kafka benchmarks share, on the test kit (`worker.testing`: the broker, topics, worker processes,
publishing frames, reading results): the workload's frames, the broker's warm-up, CPU readings, consumer rounds on a
backlog or an offered load, figures from results, tables, JSON and the run's context.

Every figure comes from the results themselves: a result carries `capture_ts_ms` (the *intended* send time of its
frame) and `end_to_end_ms` (capture -> result ready to produce), so the moment a result was made is their sum on
this machine's clock, whichever consumer made it.
"""

from __future__ import annotations

import argparse
import datetime
import json
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
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import stats  # noqa: E402
from workloads import MODELS, WORKLOADS, Workload, model_env, model_settings  # noqa: E402

from worker.codec.schemas import FrameRecord  # noqa: E402
from worker.config import Settings, load_settings  # noqa: E402 (after the sys.path set-up above)
from worker.frames import Priority  # noqa: E402
from worker.testing import (  # noqa: E402
    FrameProducer,
    ResultsReader,
    RunningWorker,
    end_offsets,
    kafka_broker,
    local_broker_pid,
    make_topics,
    run_worker,
    synthetic_frames,
    wait_committed,
)
from worker.testing import TestTopics as Topics  # noqa: E402
from worker.threadnames import name_os_thread  # noqa: E402

if TYPE_CHECKING:
    from worker.loop.pipeline import Pipeline, RunSummary

RESULTS_DIR = REPO / "bench" / "results"
STREAMS_PER_SHAPE = 6  # keys per shape: spreads a topic's frames over its partitions
# A pre-published backlog is older than realtime's and standard's max age: it must run, not expire.
NO_EXPIRY = {"WORKER_BATCHING_REALTIME_MAX_AGE_MS": "0", "WORKER_BATCHING_STANDARD_MAX_AGE_MS": "0"}
KEPT_UP_DRAIN_S = 1.5  # a consumer that needs longer after an offered load ends was falling behind during it


# -- the workload (definitions in workloads.py) ------------------------------------------------------------
def workload_records(count: int, run_id: str, workload: Workload | None = None) -> list[FrameRecord]:
    """`count` frames of the workload, the classes interleaved evenly by share (deterministic); within a class,
    consecutive frames cycle over its shapes and then its streams."""
    per_class: list[tuple[float, FrameRecord]] = []
    for priority, load in (workload or WORKLOADS["mixed"]).classes.items():
        n = max(1, round(count * load.share))
        records = synthetic_frames(n, load.shapes, load.encoding, priority, run_id, STREAMS_PER_SHAPE)
        per_class.extend(((i + 0.5) / n, rec) for i, rec in enumerate(records))
    per_class.sort(key=lambda pair: (pair[0], pair[1].priority))
    return [rec for _, rec in per_class[:count]]


def run_id_of(stream_id: str) -> str:
    return stream_id.split("-", 1)[0]


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"


def topics(bootstrap: str, tag: str, inputs_of: Topics | None = None) -> Topics:
    """Fresh topics and group (worker.testing.make_topics); with `inputs_of`, the same inputs (and backlog)."""
    return make_topics(bootstrap, new_id(tag), inputs_of=inputs_of)


def publish(producer: FrameProducer, records: Sequence[FrameRecord], rate_fps: float | None = None,
            in_step: int = 1) -> dict[str, Any]:
    """Publish as a backlog, or open loop at `rate_fps` (capture_ts_ms = intended send time), or, with `in_step`
    > 1, in bursts of that many frames sent together (cameras sampled in step), rate_fps / in_step bursts a
    second; the load's figures. Send delay = actual minus intended send time (OpenMessaging's)."""
    if in_step > 1:
        t0 = time.monotonic()
        for i in range(0, len(records), in_step):
            time.sleep(max(0.0, t0 + i / (rate_fps or math.inf) - time.monotonic()))
            producer.publish(records[i:i + in_step])
        sent, seconds, delays = len(records), time.monotonic() - t0, []
    else:
        report = producer.publish(records, rate_fps)
        sent, seconds, delays = report.sent, report.seconds, report.send_delays_ms
    return {"sent": sent, "seconds": seconds, "offered_fps": rate_fps, "in_step": in_step,
            "achieved_fps": sent / seconds if seconds else 0.0,
            "send_delay_p99_ms": stats.percentile(delays, 0.99) if delays else 0.0,
            "send_delay_max_ms": delays[-1] if delays else 0.0}


def backlog(ctx: Context, tag: str, frames: int) -> tuple[Topics, dict[str, Any]]:
    """Fresh topics with `frames` of the run's workload published on them (a backlog) and the load's figures."""
    t = topics(ctx.bootstrap, tag)
    return t, publish(FrameProducer(ctx.bootstrap, t), ctx.records(frames, new_id(tag)))


# -- the broker ------------------------------------------------------------------------------------------------
# Broker warm-up: offered rate, measuring window, "quiet" JIT compiler, and the limit.
WARMUP_RATE_FPS, WARMUP_WINDOW_S, WARMUP_QUIET_CORES, WARMUP_MAX_S = 200.0, 5.0, 0.05, 150.0


@dataclass(frozen=True)
class Broker:
    bootstrap: str
    pid: int | None  # the local broker's JVM (worker.testing.local_broker_pid); None: its CPU is not visible
    description: str

    def cpu_seconds(self) -> float | None:
        return process_cpu_seconds(self.pid) if self.pid else None


def listening_pid(bootstrap: str) -> int | None:
    """The process listening on the first bootstrap address's port on this machine (Linux /proc), so an external
    broker on the loopback address has its CPU measured too; None when none can be seen."""
    try:
        port = int(bootstrap.split(",")[0].rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return None
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                return int(proc.name)
        except OSError:
            continue
    return None


@contextmanager
def broker() -> Iterator[Broker]:
    """The test kit's broker (worker.testing.kafka_broker: KAFKA_BOOTSTRAP_SERVERS, else a container or the
    project's local Kafka in a temp dir, removed after)."""
    t0 = time.monotonic()
    with kafka_broker() as bootstrap:
        pid = local_broker_pid() or listening_pid(bootstrap)
        if os.environ.get("KAFKA_BOOTSTRAP_SERVERS"):
            description = f"external broker {bootstrap}"
        elif pid:
            description = f"local single-node Apache Kafka (KRaft), started in {time.monotonic() - t0:.0f}s"
        else:
            description = f"testcontainers' Kafka at {bootstrap}"
        print(f"[bench] {description} at {bootstrap}", flush=True)
        yield Broker(bootstrap, pid, description)


def warm_up(b: Broker, log_dir: Path, rate_fps: float = WARMUP_RATE_FPS, max_s: float = WARMUP_MAX_S) -> dict[str, Any]:
    """Run frames through a worker until the broker's JIT compiler is quiet, so no benchmark measures it.

    A fresh JVM compiles its hot code for the first minute or so of traffic: on the 2-core VM its C2 compiler
    threads took 0.3-0.5 cores for ~35 s under 200 frames/s, and the request threads 1.6x their warm CPU, on the
    cores the worker runs on; a production broker has long finished. Waits (in WARMUP_WINDOW_S steps) until the C2
    threads use under WARMUP_QUIET_CORES, at most `max_s`. Nothing to do for a broker whose threads are not visible."""
    if not b.pid:
        return {"skipped": "the broker's process is not visible here"}
    t0 = time.monotonic()
    t = topics(b.bootstrap, "warm")
    proc = run_worker(b.bootstrap, t, log_dir, env={"WORKER_RUNTIME_TORCH_THREADS": "1"}, worker_id=new_id("warm"),
                      ready=False, test_env=False)
    producer, windows = FrameProducer(b.bootstrap, t), []
    try:
        before = compiler_cpu_seconds(b.pid)
        while time.monotonic() - t0 < max_s:
            producer.publish(workload_records(int(rate_fps * WARMUP_WINDOW_S), new_id("warm")), rate_fps)
            after = compiler_cpu_seconds(b.pid)
            windows.append((after - before) / WARMUP_WINDOW_S)
            before = after
            if not proc.alive():
                raise RuntimeError(f"the warm-up worker exited\n{proc.log()[-3000:]}")
            if windows[-1] < WARMUP_QUIET_CORES:
                break
    finally:
        proc.stop()
    quiet, seconds = bool(windows) and windows[-1] < WARMUP_QUIET_CORES, time.monotonic() - t0
    print(f"[bench] broker warm-up: {seconds:.0f}s at {rate_fps:.0f} frames/s, JIT compiler cores per "
          f"{WARMUP_WINDOW_S:.0f}s window {', '.join(f'{w:.2f}' for w in windows)}"
          f"{'' if quiet else ' (still compiling: figures may include it)'}", flush=True)
    return {"seconds": seconds, "rate_fps": rate_fps, "compiler_cores_per_window": windows, "quiet": quiet}


# -- CPU -----------------------------------------------------------------------------------------------------------
def compiler_cpu_seconds(pid: int) -> float:
    """CPU seconds of a JVM's C2 JIT compiler threads ("C2 CompilerThreadN", "C2 CompilerThre" once the kernel's
    15 bytes cut them)."""
    return sum(s for role, s in thread_cpu_seconds(pid).items() if role.startswith("C2 Compiler"))


def thread_role(os_name: str) -> str:
    """A thread's role from its OS name, the numbering dropped: "infer-cpu-0-0" -> "infer-cpu", "decode_1" ->
    "decode", "rdk:broker1" -> "rdk:broker" (librdkafka's). The worker names its threads (worker.threadnames); its
    main thread, the loop, keeps the process's name ("python")."""
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
        if (seconds := _stat_cpu_seconds(task / "stat")) is not None:
            out[role] = out.get(role, 0.0) + seconds
    return out


def thread_cpu_ms_per_frame(start: dict[str, float], end: dict[str, float], frames: int) -> dict[str, float]:
    """CPU-ms per frame of each thread role between two thread_cpu_seconds readings, largest first ("python" is
    the worker's loop, and all of a baseline loop's Python work)."""
    per = {role: stats.cpu_ms_per_frame(end[role] - start.get(role, 0.0), frames) for role in end}
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


def process_cpu_seconds(pid: int) -> float | None:
    """user + system CPU seconds of a process (Linux /proc), or None."""
    return _stat_cpu_seconds(Path(f"/proc/{pid}/stat"))


def _stat_cpu_seconds(stat: Path) -> float | None:
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
    tick, idle = os.sysconf("SC_CLK_TCK"), values[3] + (values[4] if len(values) > 4 else 0)
    total = sum(values[:8])  # guest time is already inside user
    return ((total - idle) / tick, total / tick)


class CpuWatch:
    """CPU used over a span by: this process, the given child processes, the broker, and everything else on the
    machine ("background": other people's work on a shared machine is what makes timings noisy)."""

    def __init__(self, b: Broker | None = None, pids: Sequence[int] = ()) -> None:
        self.broker, self.pids = b, list(pids)
        self._start = self._stamp()

    def _stamp(self) -> dict[str, float]:
        busy, total = machine_cpu_seconds()
        return {"wall": time.monotonic(), "self": time.process_time(), "busy": busy, "total": total,
                "children": sum(process_cpu_seconds(p) or 0.0 for p in self.pids),
                "broker": (self.broker.cpu_seconds() or 0.0) if self.broker else 0.0}

    def stop(self) -> dict[str, float]:
        end = self._stamp()
        d = {k: end[k] - self._start[k] for k in end}
        wall, ours = d["wall"] or float("nan"), d["self"] + d["children"]
        return {"wall_s": d["wall"], "cores": d["total"] / wall, "ours_cores": ours / wall,
                "bench_process_cores": d["self"] / wall, "watched_processes_cores": d["children"] / wall,
                "broker_cores": d["broker"] / wall, "background_cores": max(0.0, d["busy"] - ours - d["broker"]) / wall}


class CpuSampler:
    """Samples a process's cumulative CPU seconds against wall time (time.time(), the clock results are stamped
    with) every 100 ms in a thread, so CPU can be counted over the same window as the throughput."""

    def __init__(self, pid: int, interval_s: float = 0.1) -> None:
        self.pid, self.interval_s, self.samples = pid, interval_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-cpu-sampler", daemon=True)
        self._thread.start()

    def _take(self) -> None:
        if (cpu := process_cpu_seconds(self.pid)) is not None:
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


def window_cpu_ms_per_frame(samples: Sequence[Sequence[tuple[float, float]]], tp: dict[str, Any]) -> float:
    """CPU-ms per frame of the sampled processes together over steady_throughput's window (NaN if not covered)."""
    if not samples or "window_start_ms" not in tp:
        return float("nan")
    t0, t1 = tp["window_start_ms"] / 1000.0, tp["window_end_ms"] / 1000.0
    return stats.cpu_ms_per_frame(sum(stats.cpu_between(s, t0, t1) for s in samples), tp["frames_in_window"])


# -- figures from results ------------------------------------------------------------------------------------
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
    return {"frames_per_s": (hi - lo) / span_s if span_s > 0 else float("nan"), "window_s": span_s,
            "frames_in_window": hi - lo, "window_start_ms": times[lo], "window_end_ms": times[hi]}


def all_active_throughput(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Frames/s while every worker of a group was producing: from the last worker's first result to the first
    worker's last result (so staggered start-ups and early finishers do not count)."""
    by_worker: dict[str, list[float]] = {}
    for r in results:
        by_worker.setdefault(r["worker_id"], []).append(produced_at_ms(r))
    start, end = max(min(v) for v in by_worker.values()), min(max(v) for v in by_worker.values())
    n, span_s = sum(1 for r in results if start <= produced_at_ms(r) <= end), (end - start) / 1000.0
    return {"frames_per_s": n / span_s if span_s > 0.5 else float("nan"), "window_s": span_s,
            "frames_in_window": n, "workers_with_results": len(by_worker),
            "per_worker_results": {w: len(v) for w, v in sorted(by_worker.items())}}


def latency_summary(results: Sequence[dict[str, Any]], qs: Sequence[float] = (0.5, 0.95, 0.99)) -> dict[str, float]:
    values = sorted(r["end_to_end_ms"] for r in results)
    out = {f"p{q * 100:g}_ms".replace(".", ""): stats.percentile(values, q) for q in qs}
    return {**out, "max_ms": values[-1] if values else float("nan"), "n": len(values)}


def batch_sizes(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The batches OK frames ran in (every frame of a batch of n reports n): the share of frames in each size
    range, the frame-weighted mean, the number of batches, and per size run its frames, batches, share."""
    frames: dict[int, int] = {}
    for r in results:
        if r.get("status", "OK") == "OK":
            frames[r["batch_size"]] = frames.get(r["batch_size"], 0) + 1
    total, edges = sum(frames.values()), [(1, 1), (2, 3), (4, 7), (8, 15), (16, 31), (32, 10**9)]
    share = {(f"{a}" if a == b else f"{a}-{b}" if b < 10**9 else f"{a}+"):
             round(sum(k for n, k in frames.items() if a <= n <= b) / (total or 1), 3) for a, b in edges}
    return {"share_of_frames": share, "batches": sum(k / n for n, k in frames.items()),
            "mean_frame_weighted": sum(n * k for n, k in frames.items()) / total if total else float("nan"),
            "sizes_used": {n: {"frames": k, "batches": k / n, "share_of_frames": k / total}
                           for n, k in sorted(frames.items())}}


def level_figures(results: Sequence[dict[str, Any]], t: Topics, seconds: float, warm_share: float = 0.1
                  ) -> dict[str, Any]:
    """One level's latency (OK results; frames intended in its first `warm_share` left out, OpenMessaging's
    warm-up): all, per class, and the batch sizes they ran in; expired frames."""
    first = min((r["capture_ts_ms"] for r in results), default=0)
    kept = [r for r in results if r["capture_ts_ms"] >= first + warm_share * seconds * 1000.0]
    ok = [r for r in kept if r["status"] == "OK"]
    return {"results": len(results), "expired": sum(1 for r in kept if r["status"] == "EXPIRED"),
            "latency": latency_summary(ok), "batch_sizes": batch_sizes(ok),
            "latency_by_class": {p.label: latency_summary([r for r in ok if r["source_topic"] == t.for_priority(p)])
                                 for p in Priority}}


# -- consumer processes: a backlog, an offered load --------------------------------------------------------------
Start = Callable[[Topics], "RunningWorker | list[RunningWorker]"]


def start_worker(ctx: Context, t: Topics, tag: str, env: dict[str, str] | None = None, expiry: bool = False,
                 threads: int | None = None) -> RunningWorker:
    """A `worker run` process (worker.testing.run_worker) with the worker's defaults (not the tests'), the run's
    model and torch threads, and `env`; not waited for. Expiry is off unless asked (backlogs are old)."""
    extra = {"WORKER_RUNTIME_TORCH_THREADS": str(threads or ctx.torch_threads), **({} if expiry else NO_EXPIRY),
             **ctx.worker_env(), **(env or {})}
    return run_worker(ctx.bootstrap, t, ctx.log_dir, env=extra, worker_id=new_id(tag), ready=False, test_env=False)


def consumer_round(ctx: Context, inputs: Topics, start: Start, tag: str, timeout_s: float = 300,
                   cap_s: float | None = None) -> dict[str, Any]:
    """Consumer process(es) started on the published backlog (a new group of the same inputs), stopped once the
    group committed it all, or `cap_s` after its first commit (start-up is not consuming time). Frames/s and the
    processes' CPU-ms per frame over the middle 80% of their results, batch sizes (all, per class), the broker's
    and the machine's CPU meanwhile. RuntimeError when a process died or the backlog was not done."""
    t = topics(ctx.bootstrap, tag, inputs_of=inputs)
    ends, t0 = end_offsets(ctx.bootstrap, inputs.inputs), time.monotonic()
    started = start(t)
    procs = started if isinstance(started, list) else [started]
    samplers = [CpuSampler(p.process.pid) for p in procs]
    watch = CpuWatch(ctx.broker, [p.process.pid for p in procs])

    def alive() -> bool:
        return all(p.alive() for p in procs)

    if cap_s is not None:
        wait_committed(ctx.bootstrap, t.group, ends, 120, alive=alive, first=True)
    done = wait_committed(ctx.bootstrap, t.group, ends, cap_s or timeout_s, alive=alive)
    elapsed, cpu, still_alive = time.monotonic() - t0, watch.stop(), alive()
    proc_cpu, samples = process_cpu_seconds(procs[0].process.pid), [s.stop() for s in samplers]
    for p in procs:
        p.stop()
    tails = "\n".join(f"--- {p.log_path}\n{p.log()[-3000:]}" for p in procs)
    if not done and (cap_s is None or not still_alive):
        raise RuntimeError(f"{tag}: the backlog was not consumed within {cap_s or timeout_s:.0f}s\n{tails}")
    results = ResultsReader(ctx.bootstrap, t).read_all(idle_timeout_s=1.0)
    if len(results) < 40:
        raise RuntimeError(f"{tag}: {len(results)} results\n{tails}")
    tp, sizes = steady_throughput(results), batch_sizes(results)
    by_class = {label: [r for r in results if r["source_topic"] == topic]
                for label, topic in zip(("realtime", "standard", "bulk"), inputs.inputs, strict=True)}
    return {**tp, "results": len(results), "finished_backlog": done, "seconds_total": elapsed,
            "cpu_ms_per_frame": window_cpu_ms_per_frame(samples, tp), "worker_cpu_s": proc_cpu,
            "broker_cpu_s": cpu["broker_cores"] * cpu["wall_s"] if ctx.broker and ctx.broker.pid else None,
            "background_cores": cpu["background_cores"], "batch_sizes": sizes, "batches": sizes["batches"],
            "mean_batch": sizes["mean_frame_weighted"], "sizes_used": sizes["sizes_used"],
            "mean_batch_by_class": {k: batch_sizes(v)["mean_frame_weighted"] for k, v in by_class.items()},
            "log": str(procs[0].log_path)}


def worker_round(ctx: Context, inputs: Topics, env: dict[str, str] | None = None, tag: str = "w",
                 timeout_s: float = 300) -> dict[str, Any]:
    """The worker process (its defaults, the run's model, `env` added) on the published backlog (consumer_round)."""
    return consumer_round(ctx, inputs, lambda t: start_worker(ctx, t, tag, env), tag, timeout_s)


def open_loop_level(ctx: Context, proc: RunningWorker, producer: FrameProducer, rate: float, seconds: float,
                    drain_timeout_s: float, in_step: int = 1) -> dict[str, Any]:
    """Offer `rate` frames/s of the workload for `seconds` (publish: open loop, or in step) to a warm consumer, and
    wait until it has committed them: the frames' run id, the load, whether and how soon after the load it drained,
    the CPU meanwhile (the consumer's per frame sent, also by thread role; the broker's, the generator's, the
    machine's others')."""
    run_id, pid = new_id("lv"), proc.process.pid
    watch, threads_before = CpuWatch(ctx.broker, [pid]), thread_cpu_seconds(pid)
    load = publish(producer, ctx.records(max(20, int(rate * seconds)), run_id), rate, in_step)
    t_load_end, t = time.monotonic(), producer.topics
    drained = wait_committed(ctx.bootstrap, t.group, end_offsets(ctx.bootstrap, t.inputs), drain_timeout_s,
                             alive=proc.alive)
    drain_s, cpu = time.monotonic() - t_load_end, watch.stop()
    return {"run_id": run_id, "offered_fps": rate, "seconds": seconds, "load": load, "drained": drained,
            "drain_after_load_s": drain_s, "wall_s": cpu["wall_s"], "background_cores": cpu["background_cores"],
            "generator_cores": cpu["bench_process_cores"], "consumer_cores": cpu["watched_processes_cores"],
            "broker_cores": cpu["broker_cores"],
            "consumer_cpu_ms_per_frame": stats.cpu_ms_per_frame(cpu["watched_processes_cores"] * cpu["wall_s"],
                                                                load["sent"]),
            "consumer_thread_cpu_ms_per_frame": thread_cpu_ms_per_frame(threads_before, thread_cpu_seconds(pid),
                                                                        load["sent"])}


def warm(ctx: Context, proc: RunningWorker, producer: FrameProducer, what: str) -> None:
    """30 frames through a freshly started consumer, committed: model loaded, group joined, caches warm."""
    producer.publish(ctx.records(30, new_id("warm")))
    t = producer.topics
    if not wait_committed(ctx.bootstrap, t.group, end_offsets(ctx.bootstrap, t.inputs), 120, alive=proc.alive):
        raise RuntimeError(f"{what} did not get warm\n{proc.log()[-3000:]}")


def offered_round(ctx: Context, start: Callable[[Topics], RunningWorker], tag: str, rate: float, seconds: float,
                  in_step: int = 1) -> dict[str, Any]:
    """One consumer, warm, on fresh topics, under an offered load of `rate` frames/s for `seconds`: the level's
    figures (open_loop_level, level_figures) and whether it kept up (drained within KEPT_UP_DRAIN_S)."""
    t = topics(ctx.bootstrap, tag)
    producer, proc = FrameProducer(ctx.bootstrap, t), start(t)
    try:
        warm(ctx, proc, producer, tag)
        level = open_loop_level(ctx, proc, producer, rate, seconds, ctx.scale(60, 30), in_step)
    finally:
        proc.stop()
    results = [r for r in ResultsReader(ctx.bootstrap, t).read_all(idle_timeout_s=1.0)
               if run_id_of(r["stream_id"]) == level["run_id"]]
    figures = level_figures(results, t, seconds)
    return {**level, **figures, "mean_batch": figures["batch_sizes"]["mean_frame_weighted"],
            "batches": figures["batch_sizes"]["batches"], "sizes_used": figures["batch_sizes"]["sizes_used"],
            "frames_per_s": steady_throughput(results)["frames_per_s"],
            "cpu_ms_per_frame": level["consumer_cpu_ms_per_frame"], "log": str(proc.log_path),
            "kept_up": level["drained"] and len(results) >= level["load"]["sent"]
            and level["drain_after_load_s"] <= KEPT_UP_DRAIN_S}


# -- the worker's loop in this process, a benchmark's child process -------------------------------------------------
@dataclass
class LoopRun:
    """What `run_pipeline_thread` measured, from the go to the moment `should_stop` first said yes (the drain and
    the clients' close after it left out): the loop's summary, the wall time and this process's thread CPU by role
    (thread_role)."""

    summary: RunSummary
    wall_s: float
    thread_cpu_s: dict[str, float]


def run_pipeline_thread(pipeline: Pipeline, should_stop: Callable[[], bool],
                        before_go: Callable[[], None] | None = None) -> LoopRun:
    """Run `pipeline` in a thread named "loop", as the worker's (worker.threadnames: /proc and py-spy name it),
    until `should_stop`. Its CPU is read in the loop thread when `should_stop` first says yes, since closing the
    clients ends librdkafka's threads and /proc forgets an ended thread. `before_go` runs once the thread is named,
    just before the clock starts (a GPU's peak memory reset). An error of the loop is raised here."""
    named, go = threading.Event(), threading.Event()
    box: dict[str, Any] = {}

    def stop() -> bool:
        if not should_stop():
            return False
        if "cpu1" not in box:
            box["cpu1"], box["t1"] = thread_cpu_seconds(os.getpid()), time.time()
        return True

    def loop() -> None:
        name_os_thread()
        named.set()
        go.wait()
        try:
            box["summary"] = pipeline.run(stop)
        except BaseException as exc:  # noqa: BLE001 (re-raised below, in the caller's thread)
            box["error"] = exc

    thread = threading.Thread(target=loop, name="loop", daemon=True)
    thread.start()
    named.wait()
    if before_go is not None:
        before_go()
    cpu0, t0 = thread_cpu_seconds(os.getpid()), time.time()
    go.set()
    thread.join()
    if "error" in box:
        raise box["error"]
    if "cpu1" not in box:
        raise RuntimeError("the loop ended before should_stop said so")
    cpu1 = box["cpu1"]
    return LoopRun(box["summary"], box["t1"] - t0, {role: cpu1[role] - cpu0.get(role, 0.0) for role in cpu1})


def child_command(script: str | Path, spec: Any, flag: str = "--child") -> list[str]:
    """The command that runs `script` again in a fresh interpreter as a child: `python SCRIPT --child SPEC_JSON`."""
    return [sys.executable, str(Path(script).resolve()), flag, json.dumps(spec, default=json_default)]


def run_child(script: str | Path, spec: Any, tree: Path = REPO, timeout_s: float = 900.0) -> Any:
    """Run `script --child SPEC_JSON` (child_command) against `tree`'s `worker` (PYTHONPATH and working directory
    `tree`; the script's own folder comes first on sys.path, as Python puts it there), and return the JSON value on
    the last line it printed; RuntimeError with its exit code and the end of its stderr when it fails. The child
    reads --child before it imports this module, which would put this repository's worker first on sys.path."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(child_command(script, spec), capture_output=True, text=True, timeout=timeout_s, env=env,
                          cwd=tree)
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        raise RuntimeError(f"{Path(script).name} --child {json.dumps(spec, default=json_default)[:200]}: exit "
                           f"{done.returncode}\n{done.stderr.strip()[-3000:]}")
    return json.loads(lines[-1])


# -- output ----------------------------------------------------------------------------------------------------
def table(title: str, headers: Sequence[str], rows: Iterable[Sequence[Any]], note: str = "") -> str:
    """A fixed-width text table, printed and returned."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = " | ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))
    out = [f"\n== {title} ==", line, "-" * len(line)]
    out += [" | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    text = "\n".join(out + ([note] if note else []))
    print(text, flush=True)
    return text


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A markdown table, its columns padded to line up in plain text too."""
    cells = [list(headers), *([_fmt(c) for c in r] for r in rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells]
    return [lines[0], "|" + "|".join("-" * (w + 2) for w in widths) + "|", *lines[1:]]


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "n/a"
        return f"{v:.0f}" if abs(v) >= 100 else (f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}")
    return str(v)


def machine() -> dict[str, Any]:
    """Where and when: date, commit, CPU model, cores and int8 instruction sets, load, versions."""
    import confluent_kafka
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    from worker.runtime.quantize import CpuInfo

    return {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "commit": commit,
            "host_cpu": cpu, "cpu_cores": os.cpu_count(),
            "cpu_int8_flags": list(CpuInfo.read().flags),  # what int8's speed depends on (VNNI, AMX)
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()], "python": platform.python_version(),
            "torch": torch.__version__, "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "confluent_kafka": confluent_kafka.__version__, "librdkafka": confluent_kafka.libversion()[0]}


def write_json(name: str, data: dict[str, Any], out_dir: Path = RESULTS_DIR) -> Path:
    """`out_dir/name.json`: the benchmark's result with every round, and the machine it ran on."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **data}, indent=2, default=json_default))
    print(f"[bench] wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}", flush=True)
    return path


def json_default(o: Any) -> Any:
    if isinstance(o, float) and math.isnan(o):
        return None
    return o.as_dict() if hasattr(o, "as_dict") else str(o)


@dataclass
class Context:
    """What every benchmark gets from run_all (or builds for itself when run alone)."""

    bootstrap: str
    broker: Broker | None
    quick: bool
    torch_threads: int
    log_dir: Path
    shared: dict[str, Any] = field(default_factory=dict)  # figures one benchmark hands to the next
    workload_name: str = "mixed"  # a key of workloads.WORKLOADS
    model: str = "toy"  # a key of workloads.MODELS
    rounds: int = 0  # interleaved rounds; 0: the benchmark's default (fewer with --quick)

    def scale(self, full: float, quick: float) -> float:
        return quick if self.quick else full

    def round_count(self, full: int, quick: int) -> int:
        return self.rounds or (quick if self.quick else full)

    @property
    def workload(self) -> Workload:
        return WORKLOADS[self.workload_name]

    def model_overrides(self) -> dict[str, Any]:
        """The [model] settings of this run's model and workload (load_settings overrides)."""
        return model_settings(self.model, self.workload)

    def settings(self, threads: int | None = None) -> Settings:
        """Settings for an executor in this process: the run's model and torch threads."""
        runtime = {"torch_threads": threads or self.torch_threads}
        return load_settings(env={}, overrides={"model": self.model_overrides(), "runtime": runtime})

    def worker_env(self) -> dict[str, str]:
        """Extra environment of a worker process: the run's model."""
        return model_env(self.model_overrides())

    def records(self, count: int, run_id: str) -> list[FrameRecord]:
        return workload_records(count, run_id, self.workload)


def standalone(run: Callable[[Context], dict[str, Any]], argv: list[str] | None, description: str,
               configure: Callable[[argparse.ArgumentParser], None] | None = None,
               needs_broker: Callable[[argparse.Namespace], bool] = lambda _args: True) -> int:
    """`python bench/NAME.py [--quick] [--torch-threads N] [--workload W] [--model M] [--rounds N]`: one benchmark
    with its own broker (unless `needs_broker` says not). Extra flags added by `configure` reach the benchmark as
    ctx.shared["args"]."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="short run (noisier figures)")
    p.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads per process (default 1)")
    p.add_argument("--workload", choices=list(WORKLOADS), default="mixed", help="frames fed (bench/workloads.py)")
    p.add_argument("--model", choices=list(MODELS), default="toy", help="null, toy (builtin CNN) or opennsfw")
    p.add_argument("--rounds", type=int, default=0, help="interleaved rounds (default: each benchmark's own)")
    if configure:
        configure(p)
    args = p.parse_args(argv)
    ctx = Context(bootstrap="", broker=None, quick=args.quick, torch_threads=args.torch_threads,
                  log_dir=Path(tempfile.mkdtemp(prefix="streamfer-bench-logs-")), shared={"args": args},
                  workload_name=args.workload, model=args.model, rounds=args.rounds)
    if not needs_broker(args):
        run(ctx)
        return 0
    with broker() as b:
        ctx.bootstrap, ctx.broker, ctx.shared["broker_warm_up"] = b.bootstrap, b, warm_up(b, ctx.log_dir)
        run(ctx)
    return 0
