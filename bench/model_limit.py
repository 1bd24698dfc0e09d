"""The limit: the model's own best throughput on this device, and where the worker's time goes.

1. Executor only (no Kafka): the workload's frames submitted to `InferenceExecutor` in batches of one shape, 2 in
   flight as in the worker, for each batch size and torch thread count, once (a sweep); model only (prepared
   tensors, `runner.run`) beside it.
2. The worker in this process on a backlog, with timers around each stage of its loop (and the preprocessing and
   inference threads), counted while the backlog drains; a full run adds a cProfile of the loop thread.
3. The model time of a full standard batch: the latency sweep's budget.

The worker's frames/s as a fraction of the runtime's best, in interleaved rounds: bench/batching_gain.py.

    python bench/model_limit.py [--quick] [--torch-threads 1] [--model M] [--workload W]
"""

from __future__ import annotations

import contextlib
import cProfile
import importlib
import io
import os
import pstats
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
from common import Context, Topics
from executor_load import as_frame, executor_sweep, frame_cycle

from worker.app import StopFlag, run_worker
from worker.config import load_settings
from worker.frames import Encoding, Frame, Priority
from worker.metrics import Health
from worker.runtime import InferenceExecutor
from worker.runtime.preprocess import Preprocessor
from worker.testing import synthetic_frames

BATCH_SIZES = (1, 2, 4, 8, 16, 32)


def one_frame(w: int, h: int, encoding: Encoding, tag: str) -> Frame:
    return as_frame(synthetic_frames(1, [(w, h)], encoding, Priority.STANDARD, tag)[0])


def batch_latency_ms(executor: Any, frame: Frame, batch_size: int, iters: int) -> float:
    """Median submit -> outcome time of one batch alone (the model time in the latency budget)."""
    executor.submit([frame] * batch_size, frame.shape).result()  # untimed: first-call costs
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        executor.submit([frame] * batch_size, frame.shape).result()
        times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times)


def model_only_throughput(executor: Any, cycle: list, batch_size: int, seconds: float) -> float:
    """Frames/s of runner.run on tensors prepared beforehand (no decode, no preprocessing, one at a time)."""
    runner, prep = executor.runners[0], Preprocessor(executor.contract)  # the executor's own preprocessing
    tensors = []
    for frame, shape in cycle:
        hb = prep.prepare([frame] * batch_size, shape)
        tensors.append(hb.pixels.to(runner.device))  # the runner's input: uint8 pixels it normalises itself
        hb.release()
    for x in tensors:
        runner.run(x)
    n, t0, i = 0, time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds or i % len(tensors):
        runner.run(tensors[i % len(tensors)])
        n, i = n + batch_size, i + 1
    return n / (time.perf_counter() - t0)


def measure_executor(ctx: Context, thread_counts: list[int], seconds: float) -> dict[str, Any]:
    import torch

    cycle, rows = frame_cycle(ctx.workload), []
    for threads in thread_counts:
        settings = ctx.settings(threads)
        with InferenceExecutor.from_settings(settings.model, settings.runtime) as executor:
            executor.warm_up()
            for b, measured in executor_sweep(executor, cycle, BATCH_SIZES, seconds)[0].items():
                rows.append({"torch_threads": threads, "batch_size": b, "executor_fps": measured["frames_per_s"],
                             "executor_cpu_ms_per_frame": measured["cpu_ms_per_frame"],
                             "model_only_fps": model_only_throughput(executor, cycle, b, seconds / 2)})
                print(f"[limit] threads={threads} batch={b:>2}: executor {rows[-1]['executor_fps']:.0f} frames/s, "
                      f"model only {rows[-1]['model_only_fps']:.0f} frames/s", flush=True)
            device = str(executor.device_description)
    torch.set_num_threads(ctx.torch_threads)
    return {"rows": rows, "device": device}


def standard_batch_ms(ctx: Context) -> dict[str, Any]:
    """Model time of a full batch (max_batch_size) of the standard class's largest shape, at the worker's thread
    count: the "model time" of the latency budget."""
    settings = ctx.settings()
    load = ctx.workload.classes.get(Priority.STANDARD) or next(iter(ctx.workload.classes.values()))
    w, h = max(load.shapes, key=lambda s: s[0] * s[1])
    with InferenceExecutor.from_settings(settings.model, settings.runtime) as executor:
        executor.warm_up()
        ms = batch_latency_ms(executor, one_frame(w, h, load.encoding, "budget"), settings.batching.max_batch_size,
                              iters=5 if ctx.quick else 10)
    return {"batch_size": settings.batching.max_batch_size, "shape_wxh": f"{w}x{h}", "encoding": load.encoding.value,
            "median_ms": ms, "max_wait_ms": settings.batching.standard.max_wait_ms}


# -- the worker, in this process, with timers ----------------------------------------------------------------------
LOOP_TURN = "loop turn (all below)"
# The loop's own phase timers (worker.pipeline.PHASES), in the order they run.
LOOP_PHASES = [
    ("collect", "collect finished batches (build results)"), ("expire", "expire"),
    ("dispatch", "dispatch due batches (batcher.pop_batch + submit)"), ("emit", "produce results"),
    ("deliver", "producer.poll (delivery reports)"), ("commit", "commit if due"), ("backpressure", "pause/resume"),
    ("poll", "poll input (consume + decode + batcher.add)"), ("lag", "lag gauge refresh"),
]
# Public functions inside those phases and on the runtime's threads, timed by wrapping them.
SUB_STAGES = [
    ("worker.source", "FrameSource", "poll", "  consumer.consume + decode"),
    ("worker.source", "decode_frame", None, "    Avro decode of frames"),
    ("worker.batching", "MicroBatcher", "add", "  batcher.add"),
    ("worker.schemas", "encode_result", None, "  Avro encode of results"),
    ("worker.source", "FrameSource", "commit", "  consumer.commit"),
]
THREAD_STAGES = [
    ("worker.runtime.preprocess", "Preprocessor", "prepare", "preprocess thread: decode + normalise"),
    ("worker.runtime.runners", "EagerRunner", "run", "inference thread: model"),
]


class Instrumented:
    """Times the worker's stages in this process while a backlog drains: from the first frame consumed until
    `expected` results are acknowledged. The loop's phases come from its own timers (`Pipeline.phase_times`); public
    functions inside them and on the runtime's threads are wrapped (restored on exit), counting wall and thread-CPU
    seconds while the window is open. A sampler thread opens and closes the window and records how many batches
    were in flight. Also takes the CPU seconds of this process, the broker and the whole machine."""

    SAMPLE_S = 0.002

    def __init__(self, expected: int, broker: common.Broker | None) -> None:
        self.expected, self.broker = expected, broker
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.start: dict[str, float] = {}
        self.end: dict[str, float] = {}
        self.phases_start: Any = None
        self.phases_end: Any = None
        # Time-weighted: how many batches were in flight, and pending frames / 32.
        self.inflight: dict[int, float] = {}
        self.pending: dict[int, float] = {}
        self.active, self._pipeline, self._lock, self._stop = False, None, threading.Lock(), threading.Event()
        self._sampler = threading.Thread(target=self._sample_loop, name="bench-sampler", daemon=True)
        self._undo: list[tuple[Any, str, Any]] = []

    def attach(self, pipeline: Any) -> None:
        """Given the pipeline before it runs (worker.app.run_worker's on_pipeline)."""
        self._pipeline = pipeline
        self._sampler.start()

    def __enter__(self) -> Instrumented:
        for module_name, owner, attr, label in SUB_STAGES + THREAD_STAGES:
            module = importlib.import_module(module_name)
            target, name = (getattr(module, owner), attr) if attr else (module, owner)
            self._undo.append((target, name, getattr(target, name)))
            setattr(target, name, self._timed(label, getattr(target, name)))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for target, name, original in reversed(self._undo):
            setattr(target, name, original)

    def _timed(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return fn(*args, **kwargs)
            w0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                dw, dc = time.perf_counter() - w0, time.thread_time() - c0
                with self._lock:
                    self.wall[label] = self.wall.get(label, 0.0) + dw
                    self.cpu[label] = self.cpu.get(label, 0.0) + dc
                    self.calls[label] = self.calls.get(label, 0) + 1

        return call

    def _stamp(self) -> dict[str, float]:
        busy, total = common.machine_cpu_seconds()
        broker = (self.broker.cpu_seconds() or float("nan")) if self.broker else float("nan")
        return {"wall": time.perf_counter(), "process_cpu": time.process_time(), "machine_busy": busy,
                "machine_total": total, "broker_cpu": broker}

    def _sample_loop(self) -> None:
        last = time.perf_counter()
        while not self._stop.wait(self.SAMPLE_S):
            p, was = self._pipeline, self.active
            self.active = p.summary.consumed > 0 and p.summary.results < self.expected
            now = time.perf_counter()
            if self.active and not was and not self.start:
                self.start, self.phases_start = self._stamp(), p.phase_times.copy()
            if was and not self.active and not self.end:
                self.end, self.phases_end = self._stamp(), p.phase_times.copy()
            if self.active:
                self.inflight[p.inflight_batches] = self.inflight.get(p.inflight_batches, 0.0) + now - last
                pending = min(p.batcher.pending_frames // 32, 8)
                self.pending[pending] = self.pending.get(pending, 0.0) + now - last
            last = now

    def report(self) -> dict[str, Any]:
        if not self.end:
            self.end, self.phases_end = self._stamp(), self._pipeline.phase_times.copy()
        window, p0, p1 = self.end["wall"] - self.start["wall"], self.phases_start, self.phases_end
        phase = {name: (p1.wall[name] - p0.wall[name], p1.cpu[name] - p0.cpu[name], p1.calls[name] - p0.calls[name])
                 for name, _label in LOOP_PHASES}
        timed = {LOOP_TURN: (sum(v[0] for v in phase.values()), sum(v[1] for v in phase.values()),
                             phase["poll"][2]), **{label: phase[name] for name, label in LOOP_PHASES}}
        timed.update({label: (self.wall.get(label, 0.0), self.cpu.get(label, 0.0), self.calls.get(label, 0))
                      for _m, _o, _a, label in SUB_STAGES + THREAD_STAGES})
        rows = [{"stage": label, "calls": calls, "wall_s": wall, "cpu_s": cpu_s,
                 "share_of_window": wall / window if window else float("nan"), "mean_ms": wall * 1000.0 / max(1, calls)}
                for label, (wall, cpu_s, calls) in timed.items()]
        d = {k: self.end[k] - self.start[k] for k in self.start}
        loop_cpu, (prep_cpu, infer_cpu) = timed[LOOP_TURN][1], (self.cpu.get(s[3], 0.0) for s in THREAD_STAGES)
        broker_cpu = 0.0 if d["broker_cpu"] != d["broker_cpu"] else d["broker_cpu"]
        cpu = [("inference thread (torch)", infer_cpu), ("preprocess thread (decode, normalise)", prep_cpu),
               ("loop thread (consume, batch, produce, commit)", loop_cpu),
               ("other threads of the worker (librdkafka, ...)", d["process_cpu"] - infer_cpu - prep_cpu - loop_cpu),
               ("Kafka broker (JVM)", d["broker_cpu"]),
               ("other processes on the machine", d["machine_busy"] - d["process_cpu"] - broker_cpu),
               ("idle", d["machine_total"] - d["machine_busy"])]
        total = sum(self.inflight.values()) or float("nan")
        return {"window_s": window, "stages": rows,
                "occupancy": {"batches_in_flight": {k: v / total for k, v in sorted(self.inflight.items())},
                              "pending_frames_div_32": {k: v / total for k, v in sorted(self.pending.items())}},
                "cores_seen": d["machine_total"] / window if window else float("nan"),
                "cpu_budget": [{"who": who, "cpu_s": s, "cores": s / window if window else float("nan")}
                               for who, s in cpu]}


def worker_in_process(ctx: Context, inputs: Topics, frames: int, profile: bool) -> dict[str, Any]:
    """The worker on the backlog in a thread of this process, with stage timers, or (profile=True) under cProfile
    instead (the profiler's own overhead makes its timings relative only)."""
    t = common.topics(ctx.bootstrap, "limi", inputs_of=inputs)
    overrides = t.overrides()
    overrides["kafka"]["bootstrap_servers"] = ctx.bootstrap
    overrides.update({"model": ctx.model_overrides(),
                      "observability": {"metrics_enabled": False, "worker_id": common.new_id("limi")},
                      "runtime": {"torch_threads": ctx.torch_threads},
                      "batching": {"realtime": {"max_age_ms": 0}, "standard": {"max_age_ms": 0}}})
    settings, outcome = load_settings(env={}, overrides=overrides), {}
    prof, inst = cProfile.Profile() if profile else None, Instrumented(frames, ctx.broker)

    def work() -> None:
        try:
            if prof:
                prof.enable()
            outcome["summary"] = run_worker(settings, exit_when_idle_s=1.0, stop=StopFlag(), health=Health(),
                                            time_phases=True, on_pipeline=None if profile else inst.attach)
        except BaseException as exc:  # noqa: BLE001 (re-raised below)
            outcome["error"] = exc
        finally:
            if prof:
                prof.disable()

    cpu0, broker0 = time.process_time(), ctx.broker.cpu_seconds() if ctx.broker else None
    with contextlib.nullcontext() if profile else inst:
        thread = threading.Thread(target=work, name="bench-worker")
        thread.start()
        thread.join(300)
    if "error" in outcome:
        raise outcome["error"]
    process_cpu, broker1 = time.process_time() - cpu0, ctx.broker.cpu_seconds() if ctx.broker else None
    results = common.ResultsReader(ctx.bootstrap, t).read_all(idle_timeout_s=1.0)
    report = {} if profile else inst.report()
    report.update({"throughput": common.steady_throughput(results), "process_cpu_s_whole_run": process_cpu,
                   "broker_cpu_s_whole_run": None if broker0 is None or broker1 is None else broker1 - broker0})
    if prof:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
        report["cprofile_loop_thread_top25_tottime"] = out.getvalue()
    return report


# -- the benchmark -------------------------------------------------------------------------------------------------
def run(ctx: Context) -> dict[str, Any]:
    profile = not ctx.quick
    thread_counts = [ctx.torch_threads] if ctx.quick else sorted({ctx.torch_threads, os.cpu_count() or 1})
    print(f"\n[limit] executor only: batch sizes {list(BATCH_SIZES)}, torch threads {thread_counts}", flush=True)
    ex = measure_executor(ctx, thread_counts, ctx.scale(1.0, 0.6))
    rows, budget, frames = ex["rows"], standard_batch_ms(ctx), int(ctx.scale(6000, 2500))
    best, best_model = (max(rows, key=lambda r: r[k]) for k in ("executor_fps", "model_only_fps"))
    print(f"[limit] the worker in this process, with stage timers, on a backlog of {frames} frames", flush=True)
    topics, load = common.backlog(ctx, "lim", frames)
    inproc, prof_text = worker_in_process(ctx, topics, frames, profile=False), None
    if profile:
        print("[limit] once more under cProfile (loop thread only), on a smaller backlog", flush=True)
        small, _ = common.backlog(ctx, "limp", 2000)
        prof_text = worker_in_process(ctx, small, 2000, profile=True).get("cprofile_loop_thread_top25_tottime")
        print(prof_text)
    window, occupancy = inproc["window_s"], inproc["occupancy"]
    text = [common.table(
        "model limit: executor only (decode + preprocess + model, 2 batches in flight), one sweep",
        ["torch threads", "batch", "executor fps", "CPU-ms/frame", "model-only fps"],
        [[r["torch_threads"], r["batch_size"], r["executor_fps"], r["executor_cpu_ms_per_frame"],
          r["model_only_fps"]] for r in rows],
        note=f"best: executor {best['executor_fps']:.0f} frames/s (batch {best['batch_size']}, "
             f"{best['torch_threads']} thr), model only {best_model['model_only_fps']:.0f} (batch "
             f"{best_model['batch_size']}, {best_model['torch_threads']} thr). A full {budget['batch_size']}-frame "
             f"batch of {budget['shape_wxh']} {budget['encoding']}: {budget['median_ms']:.1f} ms (median)."),
        common.table(
            f"where the worker's time goes (in-process, while the backlog drained: {window:.2f}s, "
            f"{inproc['throughput']['frames_per_s']:.0f} frames/s)",
            ["stage", "calls", "wall s", "cpu s", "% of window", "mean ms"],
            [[s["stage"], s["calls"], s["wall_s"], s["cpu_s"], f"{100 * s['share_of_window']:.0f}%", s["mean_ms"]]
             for s in inproc["stages"]],
            note="Loop stages are inclusive (indented = part of the line above); wall - cpu = waiting (I/O, GIL, "
                 "CPU, timeouts). Thread rows: busy time of the preprocessing and inference threads.\nBatches in "
                 "flight (share of the window): " + ", ".join(f"{k}: {v:.0%}" for k, v in
                                                              occupancy["batches_in_flight"].items())
                 + f"; frames pending in the batcher >= 256 for {occupancy['pending_frames_div_32'].get(8, 0.0):.0%}"
                 " of it."),
        common.table(f"CPU while the backlog drained ({window:.2f}s x {inproc['cores_seen']:.0f} cores)",
                     ["who", "cpu s", "cores"], [[c["who"], c["cpu_s"], c["cores"]] for c in inproc["cpu_budget"]])]
    ctx.shared["standard_full_batch_ms"] = budget["median_ms"]
    result = {"benchmark": "model_limit", "model": ctx.model, "workload_name": ctx.workload_name,
              "workload": ctx.workload.describe(), "torch_threads_worker": ctx.torch_threads, "device": ex["device"],
              "executor_rows": rows, "limit": best, "model_only_best": best_model, "worker_in_process": inproc,
              "backlog_publish": load, "standard_full_batch": budget, "cprofile": prof_text, "tables": text}
    common.write_json("model_limit", result)
    return result


def summary(result: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Rows for bench/results/summary.md: (figure, value, rounds)."""
    best, model, inproc = result["limit"], result["model_only_best"], result["worker_in_process"]
    return [
        ("model only, best in the sweep (prepared tensors, no decode)",
         f"{model['model_only_fps']:.0f} frames/s (batch {model['batch_size']}, {model['torch_threads']} torch thr)",
         "1 sweep"),
        ("InferenceExecutor (decode + preprocess + model), best in the sweep",
         f"{best['executor_fps']:.0f} frames/s, {best['executor_cpu_ms_per_frame']:.2f} CPU-ms/frame (batch "
         f"{best['batch_size']}, {best['torch_threads']} torch thr)", "1 sweep"),
        ("the worker in process with stage timers", f"{inproc['throughput']['frames_per_s']:.0f} frames/s", "1 run"),
        ("CPU while the worker drained a backlog (cores)",
         ", ".join(f"{c['who'].split(' (')[0]} {c['cores']:.2f}" for c in inproc["cpu_budget"]), "1 run"),
    ]


if __name__ == "__main__":
    raise SystemExit(common.standalone(run, None, __doc__.splitlines()[0]))
