"""The GPU check's end-to-end section: the worker's real loop (FrameSource, MicroBatcher, InferenceExecutor,
delivery, ResultSink, OffsetTracker, as worker.loop.pipeline.build_pipeline wires them) over the in-memory Kafka
fakes of the kit (worker.testing.fakes), since the GPU machine has no broker (no Java).

The feed is open_nsfw's workload: JPEGs of scikit-image's bundled photos at 224x224 and 1280x720, spread over the
three priority topics (20% realtime, 40% standard, 40% bulk, as the mixed workload). Each frame's capture time is
its *intended* send time and a message becomes readable only then, so a loop that falls behind shows in the
latencies (no coordinated omission); latency is capture to result, as the worker reports it in `end_to_end_ms`.

Per data path (CPU decode, and device decode on a GPU) and frame size: sustained frames/s at
saturation (a backlog), p50/p99 latency per class at OFFERED_FPS offered, mean batch size, CPU-ms per frame by
thread role, peak GPU memory; every run checks its ledger (each frame read is answered once, nothing lost).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import common
import stats
from workloads import WORKLOADS, model_settings

from worker.app import freeze_startup_heap
from worker.codec.schemas import FrameRecord, decode_result, encode_frame
from worker.config import ConfigError, Settings, load_settings
from worker.frames import Encoding, Priority, SourceRef
from worker.kafka.wiring import KafkaClients
from worker.loop.pipeline import RunSummary, build_pipeline
from worker.metrics import Health, Metrics
from worker.photos import PHOTOS, photo
from worker.runtime.start import start_runtime
from worker.testing import FakeConsumer, FakeProducer, FrameLedger
from worker.tools.publish_frames import encode_pixels

if TYPE_CHECKING:  # a name only: host_cost.py runs this module against older trees, which lack it
    from worker.frames import TP

# Warm-up timings of (frame shape, batch size, seconds) that seed the batcher's cost model (Pipeline.seed_costs).
Costs = list[tuple[tuple[int, int, int], int, float]]
OFFERED_FPS = 800.0
P99_GOAL_MS = 50.0  # issue 34's goal for the device data path at OFFERED_FPS: every frame answered, p99 under this
SIZES: dict[str, tuple[int, int]] = {"224x224": (224, 224), "720p": (1280, 720)}  # (width, height)
# A cycle of five frames: the mixed workload's shares (realtime 20%, standard 40%, bulk 40%), interleaved.
CLASS_CYCLE = (Priority.STANDARD, Priority.BULK, Priority.REALTIME, Priority.STANDARD, Priority.BULK)
PARTITIONS = 2  # per topic
STREAMS_PER_CLASS = 6
CROPS_PER_PHOTO = 4  # distinct JPEGs per photo: a pan across it, as a camera's consecutive frames differ
WARMUP_SHARE = 0.1  # frames due in the first tenth of a timed run are left out of its latencies
MIB = 1 << 20


@dataclass(frozen=True)
class Plan:
    """How much one run feeds: on a GPU sized to fit the check's budget; with --cpu a code-path check."""

    backlog_frames: dict[str, int]  # per size: the saturation run's backlog
    offered_fps: float
    offered_s: float
    deadline_s: float  # a run still unanswered this long after its last frame was due is stopped (and drained)

    @classmethod
    def for_check(cls, cuda: bool, quick: bool) -> Plan:
        if cuda:
            # About 5 s a run at the CPU decode path's executor rates (GPU-NOTES: ~600 and ~435 frames/s).
            return cls({"224x224": 1500 if quick else 3000, "720p": 1000 if quick else 2000},
                       OFFERED_FPS, 2.0 if quick else 5.0, 10.0)
        # A CPU runs open_nsfw at a few frames/s here: enough frames to pass every stage and class, no figures.
        return cls({"224x224": 24, "720p": 12}, 8.0, 2.0, 60.0)


# -- the feed -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Message:
    due: float  # wall seconds (time.time(), the worker's clock) when it becomes readable
    tp: TP
    value: bytes
    priority: Priority


def photo_jpegs(size: tuple[int, int], crops: int = CROPS_PER_PHOTO) -> list[bytes]:
    """JPEGs (worker.tools.publish_frames' quality) of scikit-image's bundled photos, each scaled to cover `size`
    and cut at `crops` places across it: real camera-like content, not synthetic blocks."""
    import numpy as np
    from PIL import Image

    w, h = size
    out: list[bytes] = []
    for name in PHOTOS:
        img = Image.fromarray(photo(name))
        scale = max(w * 1.25 / img.width, h * 1.25 / img.height)
        big = np.asarray(img.resize((round(img.width * scale), round(img.height * scale)),
                                    Image.Resampling.BILINEAR))
        top, span = (big.shape[0] - h) // 2, big.shape[1] - w
        for i in range(crops):
            left = round(span * i / max(1, crops - 1))
            out.append(encode_pixels(np.ascontiguousarray(big[top:top + h, left:left + w]), Encoding.JPEG))
    return out


def topic_of(settings: Settings, priority: Priority) -> str:
    return next(t for t, p in settings.topics.input_topics().items() if p is priority)


def schedule(settings: Settings, jpegs: Sequence[bytes], size: tuple[int, int], count: int, rate_fps: float,
             t0: float) -> list[Message]:
    """`count` frames, frame i due at t0 + i / rate_fps (rate 0: all at t0, a backlog), its class from CLASS_CYCLE,
    on one of STREAMS_PER_CLASS streams per class (a stream keeps its partition, its frame indices count up)."""
    w, h = size
    next_index: Counter[str] = Counter()
    out: list[Message] = []
    for i in range(count):
        priority = CLASS_CYCLE[i % len(CLASS_CYCLE)]
        stream_no = (i // len(CLASS_CYCLE)) % STREAMS_PER_CLASS
        stream = f"e2e-{priority.label}-{w}x{h}-{stream_no}"
        due = t0 + (i / rate_fps if rate_fps > 0 else 0.0)
        record = FrameRecord(stream_id=stream, frame_index=next_index[stream], capture_ts_ms=round(due * 1000.0),
                             tenant=f"tenant-{stream_no % 3}", priority=priority, width=w, height=h, channels=3,
                             encoding=Encoding.JPEG, data=jpegs[i % len(jpegs)])
        next_index[stream] += 1
        out.append(Message(due, (topic_of(settings, priority), stream_no % PARTITIONS), encode_frame(record),
                           priority))
    return out


class TimedConsumer(FakeConsumer):
    """The fake consumer fed on a schedule: a message is readable from its due time on, and a consume() with a
    timeout blocks until one is (as librdkafka's does) instead of spinning the loop."""

    def __init__(self, conf: dict[str, Any], messages: Sequence[Message]) -> None:
        super().__init__(conf)
        self._messages = messages
        self._released = 0

    def _release(self, now: float) -> None:
        while self._released < len(self._messages) and self._messages[self._released].due <= now:
            m = self._messages[self._released]
            self.append(m.tp, m.value)
            self._released += 1

    def _readable(self) -> bool:
        return any(pos < len(self.log.get(tp, ())) for tp, pos in self.position_of.items() if tp not in self.paused)

    def consume(self, num_messages: int, timeout: float) -> list[Any]:
        now = time.time()
        self._release(now)
        if timeout > 0 and not self.queued_events and not self._readable():
            deadline = now + timeout
            while True:
                # After a release the next message is due later than now: this sleeps, never spins.
                due = self._messages[self._released].due if self._released < len(self._messages) else math.inf
                time.sleep(max(0.0, min(deadline, due) - time.time()))
                self._release(time.time())
                if self._readable() or time.time() >= deadline:
                    break
        return super().consume(num_messages, 0)


# -- one run --------------------------------------------------------------------------------------------------------
@dataclass
class Run:
    """What one run of the loop left behind: every result and dead letter produced, the group's commits."""

    messages: list[Message]
    results: list[dict[str, Any]]
    dead_letters: int
    committed: dict[TP, int]
    summary: RunSummary
    stopped_at_deadline: bool
    wall_s: float
    thread_cpu_s: dict[str, float]  # by thread role (bench/common.thread_role), over the run
    gpu_peak_bytes: int | None


def run_loop(settings: Settings, executor: Any, messages: list[Message],
             costs: Costs | None = None, deadline_s: float = 60.0,
             cuda_device: Any = None, tracing: Any = None) -> Run:
    """Build the real pipeline over the fakes (a fresh group: nothing committed), feed it `messages` on their
    schedule, and run its loop (common.run_pipeline_thread) until every message is answered, or until `deadline_s`
    after the last one was due (then it stops and drains, as on SIGTERM: what it never read stays uncommitted).
    Wall time and thread CPU end when it is told to stop.
    `tracing`: worker.tracing's, for the pipeline (bench/tracing_cost.py); None builds it as a tree without it."""
    consumers: list[TimedConsumer] = []
    producers: list[FakeProducer] = []

    def consumer(conf: dict[str, Any], logger: Any = None) -> TimedConsumer:
        consumers.append(TimedConsumer(conf, messages))
        return consumers[-1]

    def producer(conf: dict[str, Any], logger: Any = None) -> FakeProducer:
        producers.append(FakeProducer(conf))
        return producers[-1]

    clients = KafkaClients(consumer=consumer, producer=producer, output_message_limit=lambda _settings: None)
    pipeline = build_pipeline(settings, executor, Metrics(settings=settings), Health(), clients=clients,
                              **({"tracing": tracing} if tracing is not None else {}))
    pipeline.seed_costs(costs or [])
    consumers[0].rebalance("assign", sorted({m.tp for m in messages}))
    total = len(messages)
    stop_at = (messages[-1].due if messages else time.time()) + deadline_s
    stopped = threading.Event()

    def should_stop() -> bool:
        if pipeline.delivery.results + pipeline.delivery.dead_lettered >= total:
            return True
        if time.time() >= stop_at:
            stopped.set()
            return True
        return False

    def reset_peak() -> None:
        import torch

        torch.cuda.synchronize(cuda_device)
        torch.cuda.reset_peak_memory_stats(cuda_device)

    run = common.run_pipeline_thread(pipeline, should_stop, before_go=reset_peak if cuda_device is not None else None)
    peak = None
    if cuda_device is not None:
        import torch

        peak = int(torch.cuda.max_memory_allocated(cuda_device))
    results = [decode_result(m.value) for p in producers for m in p.visible if m.topic == settings.topics.results]
    dead = sum(1 for p in producers for m in p.visible if m.topic == settings.topics.dead_letter)
    return Run(messages=messages, results=results, dead_letters=dead, committed=dict(consumers[0].group_committed),
               summary=run.summary, stopped_at_deadline=stopped.is_set(), wall_s=run.wall_s,
               thread_cpu_s=run.thread_cpu_s, gpu_peak_bytes=peak)


# -- what a run shows -----------------------------------------------------------------------------------------------
def ledger(run: Run, settings: Settings) -> dict[str, Any]:
    """Per class: frames sent, answered (OK, EXPIRED), dead-lettered, never read; and the faults: a frame
    answered twice, a frame below its partition's committed offset without an answer (lost), an answer above it."""
    sent: Counter[TP] = Counter()
    book = FrameLedger()
    for m in run.messages:  # each partition's frames at offsets 0, 1, ... (TimedConsumer appends them in this order)
        book.sent(SourceRef(*m.tp, sent[m.tp]))
        sent[m.tp] += 1
    book.add_results(run.results)
    answered = sum(len(got) for got in book.answers.values())
    classes: dict[str, dict[str, int]] = {}
    for p in Priority:
        topic = topic_of(settings, p)
        mine = [r for r in run.results if r["source_topic"] == topic]
        n_sent = sum(n for tp, n in sent.items() if tp[0] == topic)
        classes[p.label] = {"sent": n_sent, "ok": sum(r["status"] == "OK" for r in mine),
                            "expired": sum(r["status"] == "EXPIRED" for r in mine),
                            "unread": sum(n - min(n, run.committed.get(tp, 0)) for tp, n in sent.items()
                                          if tp[0] == topic)}
    return {"classes": classes, "duplicates": book.duplicates, "lost": len(book.lost(run.committed)),
            "answered_above_commit": book.answered_at_or_above(run.committed), "dead_letters": run.dead_letters,
            "sent": len(run.messages), "answered": answered,
            "complete": not run.stopped_at_deadline and answered == len(run.messages)}


def ledger_faults(book: dict[str, Any]) -> list[str]:
    """What breaks the worker's promise (each frame read answered exactly once, nothing lost), in words."""
    faults = [f"{book[k]} {k.replace('_', ' ')}" for k in ("duplicates", "lost", "answered_above_commit",
                                                             "dead_letters") if book[k]]
    for label, c in book["classes"].items():
        if c["ok"] + c["expired"] + c["unread"] != c["sent"]:
            faults.append(f"{label}: {c['sent']} sent but {c['ok']} OK + {c['expired']} expired + {c['unread']} "
                          "unread")
    return faults


# The worker's thread roles (worker.threadnames names them): the loop, preprocessing (a batch's staging), decode (its
# frames' decoding), inference (infer-<device>); the rest (torch's and CUDA's own) is "other".
ROLES = {"loop": "loop", "preprocess": "preprocess", "decode": "decode", "infer": "inference"}


def figures(run: Run, settings: Settings, timed: bool) -> dict[str, Any]:
    """Throughput over the middle of the run, per-class latency (OK results of frames due after the first tenth of a
    timed run), mean batch size, CPU-ms per frame by role, peak GPU memory, and the ledger."""
    book, answered = ledger(run, settings), len(run.results)
    cpu: Counter[str] = Counter()
    for role, seconds in run.thread_cpu_s.items():
        cpu[next((v for k, v in ROLES.items() if role.startswith(k)), "other")] += seconds
    out: dict[str, Any] = {
        "frames": len(run.messages), "answered": answered, "wall_s": run.wall_s,
        "throughput": common.steady_throughput(run.results),
        "mean_batch": run.summary.mean_batch_size, "batches": run.summary.batches,
        "cpu_ms_per_frame": {role: stats.cpu_ms_per_frame(s, answered) for role, s in sorted(cpu.items())},
        "thread_cpu_ms_per_frame": {role: stats.cpu_ms_per_frame(s, answered)
                                    for role, s in sorted(run.thread_cpu_s.items(), key=lambda kv: -kv[1]) if s > 0},
        "gpu_peak_mib": None if run.gpu_peak_bytes is None else run.gpu_peak_bytes / MIB,
        "ledger": book, "ledger_faults": ledger_faults(book), "stopped_at_deadline": run.stopped_at_deadline,
    }
    if timed and run.messages:
        ok, start, last_due = [r for r in run.results if r["status"] == "OK"], run.messages[0].due, run.messages[-1].due
        warm_until_ms = (start + WARMUP_SHARE * (last_due - start)) * 1000.0
        kept = [r for r in ok if r["capture_ts_ms"] >= warm_until_ms]
        out["latency"] = common.latency_summary(kept)
        out["latency_by_class"] = {p.label: common.latency_summary([r for r in kept if r["source_topic"] ==
                                                                    topic_of(settings, p)]) for p in Priority}
        out["drain_after_load_s"] = max((common.produced_at_ms(r) for r in run.results), default=math.nan) / 1000.0 \
            - last_due
    return out


def row(kind: str, rate: float, f: dict[str, Any]) -> str:
    """One run's figures in a line of the summary table."""
    tp, cpu, book = f["throughput"]["frames_per_s"], f["cpu_ms_per_frame"], f["ledger"]
    parts = [("n/a (under 20 results)" if math.isnan(tp) else f"{tp:.0f}") + " frames/s"
             + (" sustained" if kind == "saturation" else f" at {rate:.0f} offered")]
    if kind == "offered":
        parts += ["p50/p99 ms " + ", ".join(f"{c} {v['p50_ms']:.0f}/{v['p99_ms']:.0f}"
                                            for c, v in f["latency_by_class"].items()),
                  f"last result {f['drain_after_load_s']:.2f}s after the last frame was due"]
    parts += [f"mean batch {f['mean_batch']:.1f}", "CPU-ms/frame " + ", ".join(
        f"{role} {cpu.get(role, 0.0):.2f}" for role in (*ROLES.values(), "other"))]
    if f["gpu_peak_mib"] is not None:
        parts.append(f"GPU peak {f['gpu_peak_mib']:.0f} MiB")
    expired, unread = (sum(c[k] for c in book["classes"].values()) for k in ("expired", "unread"))
    parts.append(f"ledger {book['answered']}/{book['sent']} answered once" + (f", {expired} expired" if expired else "")
                 + (f", {unread} unread at the deadline" if unread else ""))
    return "; ".join(parts)


def goal_verdict(f: dict[str, Any]) -> str:
    """Issue 34's goal for a timed run on the device data path: every frame answered, p99 over all classes under
    P99_GOAL_MS."""
    p99, complete = f["latency"]["p99_ms"], f["ledger"]["complete"]
    return (f"goal (all answered, p99 < {P99_GOAL_MS:.0f} ms): {stats.met(complete and p99 < P99_GOAL_MS)} "
            f"(p99 {p99:.0f} ms{'' if complete else ', not all answered'})")


# -- the section ----------------------------------------------------------------------------------------------------
def e2e_settings(cuda: bool, torch_threads: int, decode: str, model: str = "opennsfw",
                 max_batch_size: int | None = None) -> Settings:
    """The worker's defaults for the model, on the check's device, warming up both frame sizes."""
    runtime: dict[str, Any] = {"device": "cuda:0" if cuda else "cpu", "torch_threads": torch_threads,
                               "warmup_shapes": [f"{w}x{h}" for w, h in SIZES.values()], "decode": decode}
    return load_settings(env={}, overrides={
        "model": model_settings(model, WORKLOADS["jpeg224"]), "runtime": runtime,
        "observability": {"worker_id": "gpu-check-e2e", "metrics_enabled": False},
        **({} if max_batch_size is None else {"batching": {"max_batch_size": max_batch_size}})})


def start_executor(settings: Settings, freeze_heap: bool = True) -> tuple[Any, Costs]:
    """The runtime as the worker starts it (worker.runtime.start_runtime: warm-up, the cost model's calibration to
    batching.largest_batch_size), then the start-up heap frozen as worker.app does (not in a test process). Returns
    the executor and the calibration timings that seed each run."""
    runtime = start_runtime(settings)
    if freeze_heap:
        freeze_startup_heap()
    return runtime.executor, runtime.calibration


def feed(settings: Settings, jpegs: Sequence[bytes], size: tuple[int, int], count: int,
         rate_fps: float) -> list[Message]:
    """The schedule, starting once its messages are encoded (capture times are the intended send times, so the start
    is planned ahead: from the cost of encoding a sample of them)."""
    t = time.perf_counter()
    sample = schedule(settings, jpegs, size, min(count, 32), rate_fps, time.time())
    lead = 0.3 + 3.0 * (time.perf_counter() - t) / max(1, len(sample)) * count
    t0 = time.time() + lead
    messages = schedule(settings, jpegs, size, count, rate_fps, t0)
    if time.time() > t0:
        raise RuntimeError(f"encoding {count} frames took longer than the {lead:.2f}s planned for it: their capture "
                           "times are already past")
    return messages


def section_e2e_device(check: Any, section: Any) -> None:
    """The gpu_check section of the device data path (runtime.decode = device): run first, it needs a GPU."""
    section_e2e(check, section, "device")


def section_e2e_cpu(check: Any, section: Any) -> None:
    """The gpu_check section of the CPU data path (runtime.decode = cpu; measured on a GPU before: run late)."""
    section_e2e(check, section, "cpu")


def section_e2e(check: Any, section: Any, path: str) -> None:
    """One data path's runs (check: gpu_check.Check, section: gpu_check.Section): per frame size, saturation and
    OFFERED_FPS offered."""
    cuda, plan = check.cuda, Plan.for_check(check.cuda, check.quick)
    label = "" if cuda else " (code-path check on the CPU: not a GPU figure)"
    section.data = {"plan": dataclasses.asdict(plan), "path": path, "runs": {}}
    jpegs = {name: photo_jpegs(size) for name, size in SIZES.items()}
    section.data["jpeg_kib"] = {name: sum(map(len, js)) / len(js) / 1024 for name, js in jpegs.items()}
    name = f"decode {path}"
    try:
        settings = e2e_settings(cuda, check.torch_threads, path, max_batch_size=None if cuda else 8)
    except ConfigError as exc:
        section.add(name, f"skipped: the settings are refused here ({exc})")
        return
    t = time.monotonic()
    # Warm-up and calibration (model load, graph capture; ~15 s on the H200), then two runs per frame size of about
    # 5 s each, plus the drain of what the path could not keep up with (~10 s at 720p).
    executor, costs = start_executor(settings)
    started_s, device = time.monotonic() - t, executor.device_description
    section.add(f"{name}: start-up", f"{device} warmed up and calibrated in {started_s:.1f}s")
    try:
        for size_name, size in SIZES.items():
            for kind, count, rate in (("saturation", plan.backlog_frames[size_name], 0.0),
                                      ("offered", round(plan.offered_fps * plan.offered_s), plan.offered_fps)):
                run = run_loop(settings, executor, feed(settings, jpegs[size_name], size, count, rate), costs,
                               plan.deadline_s, "cuda:0" if cuda else None)
                f, key = figures(run, settings, timed=rate > 0), f"{name} / {size_name} / {kind}"
                section.data["runs"][key] = {"offered_fps": rate, "startup_s": started_s, "device": device, **f}
                goal = f"; {goal_verdict(f)}" if cuda and path == "device" and rate > 0 else ""
                section.add(f"{key}{label}", row(kind, rate, f) + goal)
                if f["ledger_faults"]:
                    section.fail(f"{key}: ledger: {'; '.join(f['ledger_faults'])}")
    finally:
        executor.close()
        gc.unfreeze()  # start_executor froze the heap as the worker does; the rest of the process collects it
