"""The limit: the model's own best throughput on this device, and the worker's saturated throughput as a
fraction of it, in one run; then where the worker's time goes.

1. Executor only (no Kafka): the workload's frames (same shapes, encodings and shares as the Kafka runs)
   submitted to `InferenceExecutor` in batches of one shape, 2 batches in flight as in the worker
   (decode + preprocess of the next batch overlap the model), for each batch size and torch thread count,
   once (a sweep). Model only (prepared tensors, `runner.run`) is listed beside it.
2. Interleaved rounds (L c L c ...): (L) the executor at the sweep's best batch size and the worker's thread
   count = "the limit"; (c) the worker, a `python -m worker run` process with default settings, on a
   pre-published backlog of the same workload, frames/s and CPU-ms/frame over the middle 80% of its
   results. The worker's fraction of the limit is the median (min-max) of the per-round ratios.
3. The same worker in this process with timers around each stage of its loop (and the preprocessing and
   inference threads), counted while the backlog drains; with --profile also a cProfile of the loop thread.

    python bench/model_limit.py [--quick] [--torch-threads 1] [--rounds N] [--model M] [--workload W]
    python bench/model_limit.py --what-if [--rounds N]   # single settings changed, interleaved rounds
    python bench/model_limit.py --what-if --variants batch --workload jpeg224 --model opennsfw
        # no batch settings (adaptive sizes) against fixed max_batch_size 4/8/16/32
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import pstats
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import stats
from common import Context
from executor_load import executor_round, frame_cycle
from workloads import Workload

from worker.config import load_settings
from worker.frames import Frame, SourceRef
from worker.schemas import decode_frame, encode_frame

BATCH_SIZES = (1, 2, 4, 8, 16, 32)
# The worker's fraction of the runtime's best that its issues ask for: 0.85 on the default (mixed) workload,
# 0.9 with the near-zero model, where only the pipeline's own cost is left (issue 15).
GOAL = 0.85
GOAL_NEAR_ZERO_MODEL = 0.9


def goal_for(model: str) -> float:
    return GOAL_NEAR_ZERO_MODEL if model == "null" else GOAL


def runtime_overrides(ctx: Context) -> dict[str, Any]:
    """runtime.* settings run_all varies (cuda_graphs on/off on a GPU); empty on CPU."""
    return dict(ctx.shared.get("runtime_overrides", {}))


def seed_comparison(ctx: Context) -> dict[str, Any]:
    """The seed's own kind of figure: executor latency of one 512x512 frame and of a batch of 16."""
    from worker.frames import Encoding, Priority
    from worker.runtime import InferenceExecutor

    settings = load_settings(env={}, overrides={"model": ctx.model_overrides(), "runtime": {
        "torch_threads": ctx.torch_threads, **runtime_overrides(ctx)}})
    rec = next(common.synthetic_frames(1, [(512, 512)], Encoding.RAW_RGB8, Priority.STANDARD, "seed"))
    frame = decode_frame(encode_frame(rec), SourceRef("seed", 0, 0), Priority.STANDARD, time.time())
    with InferenceExecutor.from_settings(settings.model, settings.runtime) as executor:
        executor.warm_up([(512, 512, 3)])
        return {"single_512_ms": batch_latency_ms(executor, frame, frame.shape, 1, 30),
                "batch16_512_ms": batch_latency_ms(executor, frame, frame.shape, 16, 30),
                "device": executor.device_description}


def shape_schedule(run_id: str, workload: Workload | None = None) -> list[tuple[Frame, tuple[int, int, int]]]:
    """One frame per (class, shape) of the workload, repeated by share (executor_load.frame_cycle)."""
    return frame_cycle(workload or common.WORKLOADS["mixed"])


def executor_throughput(executor: Any, cycle: list, batch_size: int, seconds: float) -> float:
    """Frames/s of the executor fed batches of `batch_size` frames cycling through the shapes."""
    return float(executor_round(executor, cycle, batch_size, seconds)["frames_per_s"])


def model_only_throughput(executor: Any, cycle: list, batch_size: int, seconds: float) -> float:
    """Frames/s of runner.run on tensors prepared beforehand (no decode, no preprocessing, one at a time)."""
    from worker.runtime.preprocess import Preprocessor

    runner = executor.runners[0]
    prep = Preprocessor(executor.contract)  # the executor's preprocessing, to build the same tensors
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
        n += batch_size
        i += 1
    return n / (time.perf_counter() - t0)


def batch_latency_ms(executor: Any, frame: Frame, shape: tuple[int, int, int], batch_size: int, iters: int) -> float:
    """Median submit -> outcome time of one batch alone (the model time in the latency budget)."""
    executor.submit([frame] * batch_size, shape).result()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        executor.submit([frame] * batch_size, shape).result()
        times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times)


def measure_executor(ctx: Context, thread_counts: list[int], seconds: float) -> dict[str, Any]:
    import torch

    from worker.runtime import InferenceExecutor

    cycle = shape_schedule(common.new_id("lim"), ctx.workload)
    rows = []
    for threads in thread_counts:
        settings = load_settings(env={}, overrides={"model": ctx.model_overrides(),
                                                    "runtime": {"torch_threads": threads, **runtime_overrides(ctx)}})
        executor = InferenceExecutor.from_settings(settings.model, settings.runtime)
        try:
            executor.warm_up()
            for b in BATCH_SIZES:
                measured = executor_round(executor, cycle, b, seconds)
                rows.append({"torch_threads": threads, "batch_size": b, "executor_fps": measured["frames_per_s"],
                             "executor_cpu_ms_per_frame": measured["cpu_ms_per_frame"],
                             "model_only_fps": model_only_throughput(executor, cycle, b, seconds / 2)})
                print(f"[limit] threads={threads} batch={b:>2}: executor {rows[-1]['executor_fps']:.0f} frames/s, "
                      f"model only {rows[-1]['model_only_fps']:.0f} frames/s", flush=True)
        finally:
            executor.close()
    torch.set_num_threads(ctx.torch_threads)
    return {"rows": rows, "device": str(executor.device_description)}


def standard_batch_ms(ctx: Context) -> dict[str, Any]:
    """Model time of a full batch (max_batch_size) of the standard class's largest shape, at the worker's
    thread count: the "model time" of the latency budget."""
    from worker.frames import Priority
    from worker.runtime import InferenceExecutor

    settings = load_settings(env={}, overrides={"model": ctx.model_overrides(), "runtime": {
        "torch_threads": ctx.torch_threads,
                                                            **runtime_overrides(ctx)}})
    load = ctx.workload.classes.get(Priority.STANDARD) or next(iter(ctx.workload.classes.values()))
    w, h = max(load.shapes, key=lambda s: s[0] * s[1])
    rec = next(common.synthetic_frames(1, [(w, h)], load.encoding, Priority.STANDARD, "budget"))
    frame = decode_frame(encode_frame(rec), SourceRef("budget", 0, 0), Priority.STANDARD, time.time())
    with InferenceExecutor.from_settings(settings.model, settings.runtime) as executor:
        executor.warm_up()
        ms = batch_latency_ms(executor, frame, frame.shape, settings.batching.max_batch_size,
                              iters=5 if ctx.quick else 10)
    return {"batch_size": settings.batching.max_batch_size, "shape_wxh": f"{w}x{h}",
            "encoding": load.encoding.value, "median_ms": ms,
            "max_wait_ms": settings.batching.standard.max_wait_ms}


# -- the worker, as a process ------------------------------------------------------------------------------------
def worker_saturated(ctx: Context, topics: common.Topics, frames: int) -> dict[str, Any]:
    run = common.run_backlog(ctx.bootstrap, topics, frames,
                             lambda t: common.start_worker(ctx.bootstrap, t, ctx.log_dir, ctx.torch_threads,
                                                           common.new_id("limw"), extra_env=ctx.worker_env()),
                             timeout_s=300, tag="limw", broker=ctx.broker)
    tp = common.steady_throughput(run.results)
    return {**tp, "results": len(run.results), "seconds_total": run.seconds,
            "cpu_ms_per_frame": run.cpu_ms_per_frame(tp),
            "worker_cpu_s": run.proc_cpu_s[0], "broker_cpu_s": run.broker_cpu_s,
            "batch_sizes": common.batch_size_distribution(run.results)}


def limit_vs_worker(ctx: Context, topics: common.Topics, frames: int, limit: dict[str, Any]) -> dict[str, Any]:
    """The executor at its best batch size (at the worker's thread count) and the worker process on the
    backlog, in interleaved rounds (L c L c ...): the worker's fraction of the limit as the median of the
    per-round ratios, with min and max."""
    from worker.runtime import InferenceExecutor

    rounds = ctx.round_count(3, 2)
    settings = load_settings(env={}, overrides={"model": ctx.model_overrides(), "runtime": {
        "torch_threads": ctx.torch_threads, **runtime_overrides(ctx)}})
    cycle = shape_schedule(common.new_id("lim"), ctx.workload)
    trials: dict[str, dict[int, dict[str, Any]]] = {"L": {}, "c": {}}
    with InferenceExecutor.from_settings(settings.model, settings.runtime) as executor:
        executor.warm_up()
        for r, which in stats.interleaved(["L", "c"], rounds):
            if which == "L":
                trials["L"][r] = executor_round(executor, cycle, limit["batch_size"], ctx.scale(3, 1.5))
            else:
                trials["c"][r] = worker_saturated(ctx, topics, frames)
            print(f"[limit] round {r} ({which}) {trials[which][r]['frames_per_s']:.0f} frames/s, "
                  f"{trials[which][r]['cpu_ms_per_frame']:.2f} CPU-ms/frame", flush=True)
    fps = {w: {r: t["frames_per_s"] for r, t in by.items()} for w, by in trials.items()}
    return {"rounds": rounds, "trials": trials,
            "limit_fps": stats.Spread.of(list(fps["L"].values())),
            "worker_fps": stats.Spread.of(list(fps["c"].values())),
            "limit_cpu_ms_per_frame": stats.Spread.of([t["cpu_ms_per_frame"] for t in trials["L"].values()]),
            "worker_cpu_ms_per_frame": stats.Spread.of([t["cpu_ms_per_frame"] for t in trials["c"].values()]),
            "fraction": stats.ratio_spread(fps["c"], fps["L"])}


# -- the worker, in this process, with timers ----------------------------------------------------------------------
LOOP_TURN = "loop turn (all below)"
# The loop's own phase timers (worker.pipeline.PHASES), in the order they run.
LOOP_PHASES = [
    ("collect", "collect finished batches (build results)"),
    ("expire", "expire"),
    ("dispatch", "dispatch due batches (batcher.pop_batch + submit)"),
    ("emit", "produce results"),
    ("deliver", "producer.poll (delivery reports)"),
    ("commit", "commit if due"),
    ("backpressure", "pause/resume"),
    ("poll", "poll input (consume + decode + batcher.add)"),
    ("lag", "lag gauge refresh"),
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
    """Times the worker's stages in this process while a backlog is draining: from the first frame consumed
    until `expected` results are acknowledged. The loop's phases come from its own timers
    (`Pipeline.phase_times`); public functions inside them and on the runtime's threads are wrapped (restored
    on exit). A sampler thread watches the pipeline to open and close the window and to record how many
    batches were in flight. Also takes the CPU seconds of this process, the broker and the whole machine."""

    SAMPLE_S = 0.002

    def __init__(self, expected: int, broker: common.Broker | None) -> None:
        self.expected = expected
        self.broker = broker
        self.timer = common.Timer()
        self.active = False
        self.start: dict[str, float] = {}
        self.end: dict[str, float] = {}
        self.phases_start: Any = None
        self.phases_end: Any = None
        # Time-weighted: how many batches were in flight, and pending frames / 32.
        self.inflight: dict[int, float] = {}
        self.pending: dict[int, float] = {}
        self._pipeline: Any = None
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample_loop, name="bench-sampler", daemon=True)
        self._undo: list[tuple[Any, str, Any]] = []

    def attach(self, pipeline: Any) -> None:
        """Given the pipeline before it runs (worker.app.run_worker's on_pipeline)."""
        self._pipeline = pipeline
        self._sampler.start()

    def __enter__(self) -> Instrumented:
        import importlib

        for module_name, owner, attr, label in SUB_STAGES + THREAD_STAGES:
            module = importlib.import_module(module_name)
            target, name = (getattr(module, owner), attr) if attr else (module, owner)
            original = getattr(target, name)
            self._undo.append((target, name, original))
            setattr(target, name, self._gated(label, original))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for target, name, original in reversed(self._undo):
            setattr(target, name, original)

    def _stamp(self) -> dict[str, float]:
        busy, total = common.machine_cpu_seconds()
        return {"wall": time.perf_counter(), "process_cpu": time.process_time(), "machine_busy": busy,
                "machine_total": total,
                "broker_cpu": (self.broker.cpu_seconds() or float("nan")) if self.broker else float("nan")}

    def _gated(self, label: str, fn: Any) -> Any:
        timed = self.timer.wrap(label, fn)

        def call(*args: Any, **kwargs: Any) -> Any:
            return timed(*args, **kwargs) if self.active else fn(*args, **kwargs)

        return call

    def _sample_loop(self) -> None:
        last = time.perf_counter()
        while not self._stop.wait(self.SAMPLE_S):
            p = self._pipeline
            summary = p.summary
            was = self.active
            self.active = summary.consumed > 0 and summary.results < self.expected
            now = time.perf_counter()
            if self.active and not was and not self.start:
                self.start = self._stamp()
                self.phases_start = p.phase_times.copy()
            if was and not self.active and not self.end:
                self.end = self._stamp()
                self.phases_end = p.phase_times.copy()
            if self.active:
                inflight = p.inflight_batches
                self.inflight[inflight] = self.inflight.get(inflight, 0.0) + now - last
                pending = min(p.batcher.pending_frames // 32, 8)
                self.pending[pending] = self.pending.get(pending, 0.0) + now - last
            last = now

    def report(self) -> dict[str, Any]:
        if not self.end:
            self.end = self._stamp()
            self.phases_end = self._pipeline.phase_times.copy()
        window = self.end["wall"] - self.start["wall"]
        p0, p1 = self.phases_start, self.phases_end
        phase = {name: (p1.wall[name] - p0.wall[name], p1.cpu[name] - p0.cpu[name], p1.calls[name] - p0.calls[name])
                 for name, _label in LOOP_PHASES}
        timed = {LOOP_TURN: (sum(v[0] for v in phase.values()), sum(v[1] for v in phase.values()),
                             phase["poll"][2])}
        timed.update({label: phase[name] for name, label in LOOP_PHASES})
        timed.update({label: (self.timer.wall.get(label, 0.0), self.timer.cpu.get(label, 0.0),
                              self.timer.calls.get(label, 0)) for _m, _o, _a, label in SUB_STAGES + THREAD_STAGES})
        rows = []
        for label, (wall, cpu_s, calls) in timed.items():
            rows.append({"stage": label, "calls": calls, "wall_s": wall, "cpu_s": cpu_s,
                         "share_of_window": wall / window if window else float("nan"),
                         "mean_ms": wall * 1000.0 / max(1, calls)})
        d = {k: self.end[k] - self.start[k] for k in self.start}
        loop_cpu = timed[LOOP_TURN][1]
        prep_cpu = self.timer.cpu.get(THREAD_STAGES[0][3], 0.0)
        infer_cpu = self.timer.cpu.get(THREAD_STAGES[1][3], 0.0)
        cores = d["machine_total"] / window if window else float("nan")
        cpu = [
            ("inference thread (torch)", infer_cpu),
            ("preprocess thread (decode, normalise)", prep_cpu),
            ("loop thread (consume, batch, produce, commit)", loop_cpu),
            ("other threads of the worker (librdkafka, ...)", d["process_cpu"] - infer_cpu - prep_cpu - loop_cpu),
            ("Kafka broker (JVM)", d["broker_cpu"]),
            ("other processes on the machine",
             d["machine_busy"] - d["process_cpu"] - (0.0 if d["broker_cpu"] != d["broker_cpu"] else d["broker_cpu"])),
            ("idle", d["machine_total"] - d["machine_busy"]),
        ]
        total = sum(self.inflight.values()) or float("nan")
        occupancy = {"batches_in_flight": {k: v / total for k, v in sorted(self.inflight.items())},
                     "pending_frames_div_32": {k: v / total for k, v in sorted(self.pending.items())}}
        return {"window_s": window, "stages": rows, "cores_seen": cores, "occupancy": occupancy,
                "cpu_budget": [{"who": who, "cpu_s": s, "cores": s / window if window else float("nan")}
                               for who, s in cpu]}


def worker_in_process(ctx: Context, topics: common.Topics, frames: int, profile: bool) -> dict[str, Any]:
    """Run the worker on the backlog in a thread of this process, with stage timers, or (profile=True) under
    cProfile instead (the profiler's own overhead makes its timings relative only)."""
    from worker.app import StopFlag, run_worker
    from worker.metrics import Health

    t = common.fresh_consumer(ctx.bootstrap, topics, "limi")
    overrides = t.overrides()
    overrides["kafka"]["bootstrap_servers"] = ctx.bootstrap
    overrides.update({"model": ctx.model_overrides(),
                      "observability": {"metrics_enabled": False, "worker_id": common.new_id("limi")},
                      "runtime": {"torch_threads": ctx.torch_threads, **runtime_overrides(ctx)},
                      "batching": {"realtime": {"max_age_ms": 0}, "standard": {"max_age_ms": 0}}})
    settings = load_settings(env={}, overrides=overrides)
    outcome: dict[str, Any] = {}
    prof = cProfile.Profile() if profile else None
    inst = Instrumented(frames, ctx.broker)

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

    cpu0 = time.process_time()
    broker0 = ctx.broker.cpu_seconds() if ctx.broker else None
    with (contextlib.nullcontext() if profile else inst):
        thread = threading.Thread(target=work, name="bench-worker")
        thread.start()
        thread.join(300)
    if "error" in outcome:
        raise outcome["error"]
    process_cpu = time.process_time() - cpu0
    broker_cpu = (ctx.broker.cpu_seconds() - broker0) if ctx.broker and broker0 is not None else None
    results = common.read_run_results(ctx.bootstrap, t.results, frames)
    report = {} if profile else inst.report()
    report.update({"throughput": common.steady_throughput(results), "process_cpu_s_whole_run": process_cpu,
                   "broker_cpu_s_whole_run": broker_cpu})
    if prof:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
        report["cprofile_loop_thread_top25_tottime"] = out.getvalue()
    return report


# -- the benchmark -------------------------------------------------------------------------------------------------
def run(ctx: Context, profile: bool | None = None) -> dict[str, Any]:
    import os

    profile = (not ctx.quick) if profile is None else profile
    seconds = ctx.scale(1.0, 0.6)
    thread_counts = sorted({ctx.torch_threads, os.cpu_count() or 1}) if not ctx.quick else [ctx.torch_threads]
    print(f"\n[limit] executor only: batch sizes {list(BATCH_SIZES)}, torch threads {thread_counts}", flush=True)
    ex = measure_executor(ctx, thread_counts, seconds)
    rows = ex["rows"]
    best = max(rows, key=lambda r: r["executor_fps"])
    best_same = max((r for r in rows if r["torch_threads"] == ctx.torch_threads), key=lambda r: r["executor_fps"])
    best_model = max(rows, key=lambda r: r["model_only_fps"])
    budget = standard_batch_ms(ctx)

    frames = int(ctx.scale(6000, 2500))
    topics = common.make_topics(ctx.bootstrap, "lim")
    print(f"[limit] publishing a backlog of {frames} frames", flush=True)
    load = common.publish_load(ctx.bootstrap, topics, ctx.records(frames, common.new_id("r")))
    print(f"[limit] executor (batch {best_same['batch_size']}) and worker process ({ctx.torch_threads} torch "
          "thread(s)) in interleaved rounds", flush=True)
    lw = limit_vs_worker(ctx, topics, frames, best_same)
    worker = lw["trials"]["c"][max(lw["trials"]["c"])]  # the last round: for the CPU note below
    print("[limit] the same worker in this process, with stage timers", flush=True)
    inproc = worker_in_process(ctx, topics, frames, profile=False)
    prof_text = None
    if profile:
        print("[limit] once more under cProfile (loop thread only), on a smaller backlog", flush=True)
        small = common.make_topics(ctx.bootstrap, "limp")
        common.publish_load(ctx.bootstrap, small, ctx.records(2000, common.new_id("r")))
        prof_text = worker_in_process(ctx, small, 2000, profile=True).get("cprofile_loop_thread_top25_tottime")

    fraction: stats.Spread = lw["fraction"]
    text = [common.table(
        "model limit: executor only (decode + preprocess + model, 2 batches in flight), one sweep",
        ["torch threads", "batch", "executor fps", "CPU-ms/frame", "model-only fps"],
        [[r["torch_threads"], r["batch_size"], r["executor_fps"], r["executor_cpu_ms_per_frame"],
          r["model_only_fps"]] for r in rows])]
    summary_rows = [
        ["model only, best in the sweep (prepared tensors)", f"{best_model['model_only_fps']:.0f}", "",
         f"batch {best_model['batch_size']}, {best_model['torch_threads']} thr", ""],
        ["executor, best in the sweep (any thread count)", f"{best['executor_fps']:.0f}",
         f"{best['executor_cpu_ms_per_frame']:.2f}", f"batch {best['batch_size']}, {best['torch_threads']} thr", ""],
        [f"(L) executor at batch {best_same['batch_size']}, {ctx.torch_threads} thr = the limit",
         lw["limit_fps"].text(), lw["limit_cpu_ms_per_frame"].text(), f"{lw['rounds']} rounds", "1.00"],
        ["(c) worker process, saturated", lw["worker_fps"].text(), lw["worker_cpu_ms_per_frame"].text(),
         f"{lw['rounds']} rounds, {ctx.torch_threads} thr", fraction.text(2)],
        ["worker in-process + timers (1 run)", f"{inproc['throughput']['frames_per_s']:.0f}", "", "", ""],
    ]
    text.append(common.table("the limit and the worker (same run; median (min-max) of interleaved rounds)",
                             ["what", "frames/s", "CPU-ms/frame", "how", "of limit"], summary_rows,
                             note=f"worker / limit = {fraction.text(2)}: median (min-max) of per-round ratios "
                                  f"(goal >= {goal_for(ctx.model)}). Last worker round: process CPU "
                                  f"{worker['worker_cpu_s']:.1f}s, "
                                  f"broker CPU {worker['broker_cpu_s'] or float('nan'):.1f}s over "
                                  f"{worker['seconds_total']:.1f}s (incl. start-up)."))
    window = inproc["window_s"]
    text.append(common.table(
        f"where the worker's time goes (in-process, while the backlog drained: {window:.2f}s, "
        f"{inproc['throughput']['frames_per_s']:.0f} frames/s)",
        ["stage", "calls", "wall s", "cpu s", "% of window", "mean ms"],
        [[s["stage"], s["calls"], s["wall_s"], s["cpu_s"], f"{100 * s['share_of_window']:.0f}%", s["mean_ms"]]
         for s in inproc["stages"]],
        note="Loop stages are inclusive (indented = part of the line above); wall - cpu = waiting (I/O, GIL, "
             "CPU, timeouts). Thread rows: busy time of the preprocessing and inference threads.\n"
             "Batches in flight (share of the window): " + ", ".join(
                 f"{k}: {v:.0%}" for k, v in inproc["occupancy"]["batches_in_flight"].items())
             + "; frames pending in the batcher >= 256 for "
             + f"{inproc['occupancy']['pending_frames_div_32'].get(8, 0.0):.0%} of it."))
    text.append(common.table(
        f"CPU while the backlog drained ({window:.2f}s x {inproc['cores_seen']:.0f} cores)",
        ["who", "cpu s", "cores"], [[c["who"], c["cpu_s"], c["cores"]] for c in inproc["cpu_budget"]]))
    if prof_text:
        print(prof_text)
    result = {
        "benchmark": "model_limit", "machine": common.machine(), "model": ctx.model,
        "workload_name": ctx.workload_name, "workload": ctx.workload.describe(),
        "torch_threads_worker": ctx.torch_threads, "device": ex["device"],
        "executor_rows": rows, "limit": best, "limit_same_threads": best_same, "model_only_best": best_model,
        "rounds": lw["rounds"], "limit_vs_worker_trials": lw["trials"],
        "limit_fps": lw["limit_fps"].as_dict(), "worker_fps": lw["worker_fps"].as_dict(),
        "limit_cpu_ms_per_frame": lw["limit_cpu_ms_per_frame"].as_dict(),
        "worker_cpu_ms_per_frame": lw["worker_cpu_ms_per_frame"].as_dict(),
        "worker_in_process": inproc, "backlog_publish": load,
        "fraction_of_limit": fraction.as_dict(), "goal": goal_for(ctx.model),
        "standard_full_batch": budget, "cprofile": prof_text, "tables": text,
    }
    ctx.shared["capacity_fps"] = lw["worker_fps"].median
    ctx.shared["standard_full_batch_ms"] = budget["median_ms"]
    common.write_json("model_limit", result, ctx.out_dir)
    return result


# -- what-if: the worker with single settings changed, interleaved -------------------------------------------------
WHAT_IF = {
    "defaults": {},
    "commit_interval_ms=200": {"WORKER_DELIVERY_COMMIT_INTERVAL_MS": "200"},
    "max_inflight_batches=3": {"WORKER_DELIVERY_MAX_INFLIGHT_BATCHES": "3"},
    "preprocess_threads=2": {"WORKER_RUNTIME_PREPROCESS_THREADS": "2"},
    "all three": {"WORKER_DELIVERY_COMMIT_INTERVAL_MS": "200", "WORKER_DELIVERY_MAX_INFLIGHT_BATCHES": "3",
                  "WORKER_RUNTIME_PREPROCESS_THREADS": "2"},
}


# The scheduler's isolation: lower classes bounded by max_blocking_ms always (0) or only while realtime is present.
WHAT_IF_SCHEDULER = {
    "defaults": {},
    "realtime_quiet_ms=0 (always bounded)": {"WORKER_BATCHING_REALTIME_QUIET_MS": "0"},
}
# Batch sizing: no batch settings (the defaults: sizes from the learned cost model, seeded by the warm-up
# calibration) against a fixed max_batch_size with adaptive sizing off.
FIXED_BATCH_SIZES = (4, 8, 16, 32)
ADAPTIVE = "no batch settings (adaptive)"
WHAT_IF_BATCH = {ADAPTIVE: {}, **{f"fixed {n}": {"WORKER_BATCHING_MAX_BATCH_SIZE": str(n),
                                                 "WORKER_BATCHING_ADAPTIVE_BATCH_SIZE": "false"}
                              for n in FIXED_BATCH_SIZES}}
# Issue #16: adaptive reaches this share of the best fixed size, and this multiple of the default 32.
GOAL_OF_BEST_FIXED = 0.95
GOAL_OVER_FIXED_32 = 1.3
VARIANT_SETS = {"settings": WHAT_IF, "scheduler": WHAT_IF_SCHEDULER, "batch": WHAT_IF_BATCH}


def what_if_frames(ctx: Context) -> int:
    """Frames per worker run. open_nsfw runs ~13-40 frames/s on a 2-core CPU (fixed batches of 32 the slowest):
    800 frames keep >= 15 s in the middle 80% the figures come from up to 42 frames/s (quick: 500, up to 26),
    and the batch set's 15 runs (quick: 10) fit in ~14 minutes (quick: ~6), start-up and calibration included."""
    if ctx.model == "opennsfw":
        return int(ctx.scale(800, 500))
    return int(ctx.scale(4000, 2000))


def _what_if_run(ctx: Context, topics: common.Topics, frames: int,
                 env: dict[str, str]) -> tuple[common.BacklogRun, dict[str, Any]]:
    """One worker process with `env` added on the published backlog: the run and its steady throughput."""
    run = common.run_backlog(ctx.bootstrap, topics, frames,
                             lambda t: common.start_worker(ctx.bootstrap, t, ctx.log_dir, ctx.torch_threads,
                                                           common.new_id("wi"),
                                                           extra_env={**ctx.worker_env(), **env}),
                             timeout_s=300, tag="wi", broker=ctx.broker)
    return run, common.steady_throughput(run.results)


def what_if(ctx: Context, rounds: int, variant_set: str = "settings") -> dict[str, Any]:
    """Saturated throughput of the worker process with one setting changed at a time, in interleaved rounds
    (so background load hits every variant alike); median (min-max) per variant of frames/s, of the per-round
    ratio to the defaults and of the worker's CPU-ms per frame over the throughput window, and each class's
    mean batch size."""
    if variant_set == "batch":
        return what_if_batch(ctx, rounds)
    variants = VARIANT_SETS[variant_set]
    frames = what_if_frames(ctx)
    topics = common.make_topics(ctx.bootstrap, "wi")
    common.publish_load(ctx.bootstrap, topics, ctx.records(frames, common.new_id("wi")))
    fps: dict[str, list[float]] = {name: [] for name in variants}
    cpu_ms: dict[str, list[float]] = {name: [] for name in variants}
    sizes: dict[str, list[dict[str, float]]] = {name: [] for name in variants}  # mean batch size per class
    classes = (("realtime", topics.realtime), ("standard", topics.standard), ("bulk", topics.bulk))
    for r in range(rounds):
        for name, env in variants.items():
            run, tp = _what_if_run(ctx, topics, frames, env)
            fps[name].append(tp["frames_per_s"])
            cpu_ms[name].append(run.cpu_ms_per_frame(tp))
            sizes[name].append({label: common.batch_size_distribution(
                [x for x in run.results if x["source_topic"] == topic])["mean_frame_weighted"]
                for label, topic in classes})
            print(f"[what-if] round {r + 1} {name}: {fps[name][-1]:.0f} frames/s, {cpu_ms[name][-1]:.2f} "
                  "CPU-ms/frame, mean batch size " + " ".join(f"{k} {v:.1f}" for k, v in sizes[name][-1].items()),
                  flush=True)
    per_round = {name: dict(enumerate(v, 1)) for name, v in fps.items()}

    def mean_sizes(name: str) -> str:
        return " / ".join(f"{statistics.median(x[k] for x in sizes[name]):.1f}" for k, _ in classes)

    rows = [[name, stats.Spread.of(v).text(), stats.ratio_spread(per_round[name], per_round["defaults"]).text(2),
             stats.Spread.of(cpu_ms[name]).text(), mean_sizes(name), " ".join(f"{x:.0f}" for x in v)]
            for name, v in fps.items()]
    text = common.table("what-if: the worker with one setting changed (saturated frames/s, interleaved rounds)",
                        ["variant", "frames/s median (min-max)", "vs defaults (per-round ratios)",
                         "CPU-ms/frame median (min-max)", "batch size rt/std/bulk (median of means)", "rounds"], rows)
    result = {"benchmark": "model_limit_what_if", "machine": common.machine(), "frames": frames, "rounds": rounds,
              "variants": {n: {"env": variants[n], "frames_per_s": v, "cpu_ms_per_frame": cpu_ms[n],
                               "mean_batch_size_by_class": sizes[n]}
                           for n, v in fps.items()}, "tables": [text]}
    common.write_json("model_limit_what_if", result, ctx.out_dir)
    return result


def sizes_used(results: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Per batch size the worker ran: frames and batches (every frame of a batch of n reports n) and the
    share of frames."""
    frames: dict[int, int] = {}
    for x in results:
        if x.get("status", "OK") == "OK":
            frames[x["batch_size"]] = frames.get(x["batch_size"], 0) + 1
    total = sum(frames.values()) or 1
    return {n: {"frames": k, "batches": k / n, "share_of_frames": k / total} for n, k in sorted(frames.items())}


def seeded_line(log_path: Path) -> str:
    """The worker's "batch cost model seeded" log line (its warm-up calibration), or "" if absent."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return next((line for line in lines if "batch cost model seeded" in line), "")


def what_if_batch(ctx: Context, rounds: int) -> dict[str, Any]:
    """The worker with no batch settings (adaptive sizes from the learned cost model) against fixed
    max_batch_size 4/8/16/32 with adaptive sizing off, each once per round on the same backlog: frames/s and
    CPU-ms per frame per variant, per-round ratios adaptive / best fixed (highest median frames/s) and
    adaptive / fixed 32, and the batch sizes the adaptive worker ran."""
    frames = what_if_frames(ctx)
    topics = common.make_topics(ctx.bootstrap, "wib")
    common.publish_load(ctx.bootstrap, topics, ctx.records(frames, common.new_id("wib")))
    print(f"[what-if batch] {ctx.model} on {ctx.workload_name}: backlog of {frames} frames, {rounds} rounds of "
          f"{', '.join(WHAT_IF_BATCH)}; worker logs in {ctx.log_dir}", flush=True)
    runs: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in WHAT_IF_BATCH}
    failed: list[str] = []
    for r, name in stats.interleaved(list(WHAT_IF_BATCH), rounds):
        try:
            run, tp = _what_if_run(ctx, topics, frames, WHAT_IF_BATCH[name])
        except RuntimeError as exc:  # a stalled or crashed worker: a finding, left out of the medians
            failed.append(f"round {r} {name}: {str(exc)[-1500:]}")
            print(f"[what-if batch] FAILED {failed[-1]}", flush=True)
            continue
        used = sizes_used(run.results)
        runs[name][r] = {"frames_per_s": tp["frames_per_s"], "cpu_ms_per_frame": run.cpu_ms_per_frame(tp),
                         "window_s": tp["window_s"], "seconds_total": run.seconds,
                         "mean_batch_size": common.batch_size_distribution(run.results)["mean_frame_weighted"],
                         "sizes_used": used, "calibration_log": seeded_line(run.procs[0].log_path),
                         "log": str(run.procs[0].log_path)}
        t = runs[name][r]
        print(f"[what-if batch] round {r} {name}: {t['frames_per_s']:.1f} frames/s, {t['cpu_ms_per_frame']:.1f} "
              f"CPU-ms/frame, steady {t['window_s']:.0f}s of {t['seconds_total']:.0f}s, sizes "
              + " ".join(f"{n}x{u['batches']:.0f}" for n, u in used.items()), flush=True)
    fps = {name: {r: t["frames_per_s"] for r, t in by.items()} for name, by in runs.items()}
    fixed = [name for name in WHAT_IF_BATCH if name != ADAPTIVE]
    best = max(fixed, key=lambda name: stats.Spread.of(list(fps[name].values())).median)
    of_best = stats.ratio_spread(fps[ADAPTIVE], fps[best])
    over_32 = stats.ratio_spread(fps[ADAPTIVE], fps["fixed 32"])

    rows = [[name, stats.Spread.of(list(fps[name].values())).text(1),
             stats.Spread.of([t["cpu_ms_per_frame"] for t in by.values()]).text(1),
             stats.Spread.of([t["mean_batch_size"] for t in by.values()]).text(1),
             " ".join(f"{v:.1f}" for v in fps[name].values())]
            for name, by in runs.items()]
    text = [common.table(f"what-if batch: {ctx.model} on {ctx.workload_name}, no batch settings vs fixed "
                         f"max_batch_size (saturated, {frames}-frame backlog, {rounds} interleaved rounds)",
                         ["variant", "frames/s median (min-max)", "CPU-ms/frame median (min-max)",
                          "mean batch size", "frames/s per round"], rows,
                         note="".join(f"\nFAILED {f}" for f in failed))]
    text.append(common.table(
        "adaptive against fixed sizes (median (min-max) of per-round ratios of frames/s)",
        ["ratio", "per-round ratios", "goal", "met (median)"],
        [[f"adaptive / best fixed ({best})", of_best.text(2), f">= {GOAL_OF_BEST_FIXED}",
          "yes" if of_best.median >= GOAL_OF_BEST_FIXED else "no"],
         ["adaptive / fixed 32 (the default size)", over_32.text(2), f">= {GOAL_OVER_FIXED_32}",
          "yes" if over_32.median >= GOAL_OVER_FIXED_32 else "no"]]))
    adaptive = runs[ADAPTIVE]
    all_sizes = sorted({n for t in adaptive.values() for n in t["sizes_used"]})
    frames_all = sum(u["frames"] for t in adaptive.values() for u in t["sizes_used"].values()) or 1
    text.append(common.table(
        "batch sizes the adaptive worker ran (whole runs, start-up included)",
        ["batch size", "share of frames (all rounds)", "batches per round"],
        [[n, f"{sum(t['sizes_used'].get(n, {}).get('frames', 0) for t in adaptive.values()) / frames_all:.1%}",
          " ".join(f"{t['sizes_used'].get(n, {}).get('batches', 0):.0f}" for t in adaptive.values())]
         for n in all_sizes],
        note="Calibration (round 1's log): " + (adaptive[min(adaptive)]["calibration_log"] or "not found")))
    result = {"benchmark": "model_limit_what_if_batch", "machine": common.machine(), "model": ctx.model,
              "workload_name": ctx.workload_name, "workload": ctx.workload.describe(),
              "torch_threads_worker": ctx.torch_threads, "frames": frames, "rounds": rounds,
              "variants": {name: {"env": WHAT_IF_BATCH[name], "rounds": by,
                                  "frames_per_s": stats.Spread.of(list(fps[name].values())).as_dict(),
                                  "cpu_ms_per_frame": stats.Spread.of(
                                      [t["cpu_ms_per_frame"] for t in by.values()]).as_dict()}
                           for name, by in runs.items()},
              "failed": failed, "best_fixed": best, "adaptive_of_best_fixed": of_best.as_dict(),
              "adaptive_over_fixed_32": over_32.as_dict(),
              "goals": {"of_best_fixed": GOAL_OF_BEST_FIXED, "over_fixed_32": GOAL_OVER_FIXED_32},
              "tables": text}
    common.write_json("model_limit_what_if_batch", result, ctx.out_dir)
    return result


def _run_standalone(ctx: Context) -> dict[str, Any]:
    args = ctx.shared["args"]
    if args.what_if:
        # The batch set is long with a real model: --quick runs 2 rounds of it, like the other benchmarks.
        return what_if(ctx, ctx.round_count(3, 2) if args.variants == "batch" else args.rounds or 3, args.variants)
    return run(ctx)


def summary(result: dict[str, Any]) -> list[tuple[str, str]]:
    """Headline rows for bench/results/summary.md: medians (min-max) of interleaved rounds."""
    from batching_gain import _spread_text

    lim, model = result["limit_same_threads"], result["model_only_best"]
    return [
        ("model only, best in the sweep (prepared tensors, no decode)",
         f"{model['model_only_fps']:.0f} frames/s (batch {model['batch_size']}, {model['torch_threads']} torch thr)"),
        ("the limit: InferenceExecutor (decode + preprocess + model)",
         f"{_spread_text(result['limit_fps'])} frames/s, {_spread_text(result['limit_cpu_ms_per_frame'])} "
         f"CPU-ms/frame (batch {lim['batch_size']}, {result['torch_threads_worker']} torch thr)"),
        (f"worker saturated ({result['torch_threads_worker']} torch thr)",
         f"{_spread_text(result['worker_fps'])} frames/s, {_spread_text(result['worker_cpu_ms_per_frame'])} "
         f"CPU-ms/frame = **{_spread_text(result['fraction_of_limit'], 2)} of the limit** (goal >= {result['goal']})"),
        ("CPU while the worker drained a backlog (cores)",
         ", ".join(f"{c['who'].split(' (')[0]} {c['cores']:.2f}" for c in result["worker_in_process"]["cpu_budget"])),
    ]


def main(argv: list[str] | None = None) -> int:
    def configure(p: Any) -> None:
        p.add_argument("--what-if", action="store_true",
                       help="instead: the worker with single settings changed, in interleaved rounds")
        p.add_argument("--variants", choices=sorted(VARIANT_SETS), default="settings",
                       help="--what-if variant set: settings (commit interval, in-flight, preprocess threads), "
                            "scheduler (the blocking bound always vs only while realtime is present) or batch "
                            "(no batch settings vs fixed max_batch_size 4/8/16/32)")

    return common.standalone(_run_standalone, argv, __doc__.splitlines()[0], configure)


if __name__ == "__main__":
    raise SystemExit(main())
