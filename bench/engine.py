"""The engine per device (issue 61): the worker against onnxruntime alone, int8 against fp32, and low load.

Sections (`--sections`, all by default), each in interleaved rounds, medians with min-max:

- `e2e`: `worker run` with `model.source` = opennsfw, then nudenet, otherwise the worker's defaults (one one-thread
  onnxruntime runner per core), draining a backlog of 224x224 JPEG frames (the jpeg224 workload, whatever
  `--workload` says), against onnxruntime's model-alone frames/s on the same preset's ONNX file (batch 8,
  `--torch-threads` threads: give the machine's cores, every graph optimisation), measured in the same round just
  before, and against that many one-thread sessions side by side (the other layout); beside them one runner on
  `--torch-threads` threads, and `runtime.engine = "torch"` (WORKER_VARIANTS; `--variants` picks some), and with
  `--base` the other tree's worker on its defaults. The ratio worker / alone is per round, over the fastest layout
  alone and over each.
- `int8`: per preset, the int8 model's agreement with fp32 on the calibration images, the largest score difference
  (`worker.runtime.quantize.check_int8`), and both models' frames/s alone at batch 8.
- `layout`: per preset, onnxruntime alone at batch 8 on `--torch-threads` cores: one session of that many threads
  against that many one-thread sessions side by side (one Python thread each), frames/s and CPU-ms a frame, and a
  single frame's latency on one and on all threads: why `runtime.instances_per_device` auto gives a CPU one
  one-thread runner per core (worker.runtime.engine.runner_layout).
- `lowload`: the builtin CNN on the jpeg224 workload at 50 and 200 frames/s offered and on a backlog: the worker's
  CPU-ms per frame (by thread role), its results' `inference_ms` at batches of 1-2 and the start-up cost model's
  `n1_ms`, this tree against `--base` (a checkout of worker/ and schemas/, e.g. `git archive main worker schemas |
  tar -x -C /tmp/base`); the engine alone on a batch of one (the builtin CNN's forward, every 20 ms).

    python bench/engine.py --torch-threads 2 --base /tmp/base
    python bench/engine.py --sections int8 --rounds 3
    python bench/engine.py --torch-threads 2 --sections e2e --presets nudenet --rounds 3
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import statistics
import time
from pathlib import Path
from typing import Any

import common
import stats
from common import Context

from worker.config import usable_cores

SECTIONS = ("e2e", "int8", "lowload", "layout")
# The e2e section's workers, besides `model.source`: the defaults (runtime.torch_threads and instances_per_device
# auto: one one-thread onnxruntime runner per core), one runner on `--torch-threads` threads (the default before
# issue 61's runner layout), and the torch engine (onnx2torch, the engine before issue 61).
WORKER_VARIANTS: dict[str, dict[str, str]] = {
    "defaults": {"WORKER_RUNTIME_TORCH_THREADS": "0", "WORKER_RUNTIME_INSTANCES_PER_DEVICE": "0"},
    "one-runner": {"WORKER_RUNTIME_INSTANCES_PER_DEVICE": "1"},
    "torch": {"WORKER_RUNTIME_ENGINE": "torch"},
}
PRESETS = ("opennsfw", "nudenet")
ALONE_BATCH = 8
ALONE_SECONDS = 4.0
LOW_LOADS = (50.0, 200.0)
COST_MODEL_RE = re.compile(r"'n1_ms': ([0-9.]+)")
# e2e: frames a worker drains; its frames/s window is its steady middle (10 s and more at ~120 frames/s here).
E2E_BACKLOG = 1500
SMALL_THREADS_RE = re.compile(r"cpu intra-op threads for batches of <= \d+ frames: (\d+)")


def model_alone(path: Path, shape: tuple[int, ...], threads: int, seconds: float = ALONE_SECONDS,
                spinning: bool = False) -> dict[str, float]:
    """Frames/s and CPU-ms per frame (this process's) of one onnxruntime session (the worker's options; `spinning`:
    onnxruntime's default of spinning intra-op threads) on random batches of ALONE_BATCH, after one."""
    import numpy as np
    import onnxruntime

    from worker.runtime.engine import session_options

    options = session_options(threads)
    if spinning:  # onnxruntime's default
        options = onnxruntime.SessionOptions()
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = threads
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    x = (np.random.default_rng(0).random((ALONE_BATCH, *shape)) * 255).astype(np.float32)
    session.run(None, {name: x})
    frames, t0, cpu0 = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - t0 < seconds:
        session.run(None, {name: x})
        frames += ALONE_BATCH
    return {"frames_per_s": frames / (time.perf_counter() - t0),
            "cpu_ms_per_frame": (time.process_time() - cpu0) * 1000.0 / frames}


def preset_input(preset: str) -> tuple[Path, tuple[int, ...]]:
    """The preset's ONNX file and one sample's input shape in its layout."""
    from worker.config import load_settings
    from worker.runtime.contract import ModelContract
    from worker.runtime.models import preset_model_file

    contract = ModelContract.from_settings(load_settings(env={}, overrides={"model": {"source": preset}}).model)
    assert contract.input_size is not None
    return preset_model_file(preset), contract.input_shape(contract.input_size)


ALONE_LAYOUTS = ("alone", "alone-spinning", "alone-sessions")  # one N-thread session (sleeping, spinning); N x 1


def e2e(ctx: Context, rounds: int, presets: list[str], base: Path | None = None,
        variants: list[str] | None = None) -> dict[str, Any]:
    """Per preset: the worker variants (and with `base` the defaults of that tree, `defaults-base`) against
    onnxruntime alone in both layouts, one session of `--torch-threads` threads (its threads sleeping, as the
    worker's, and spinning, its default) and that many one-thread sessions side by side; the ratio per round over
    the fastest layout alone, and over each."""
    threads = ctx.torch_threads
    workers = {v: WORKER_VARIANTS[v] for v in (variants or list(WORKER_VARIANTS))}
    if base is not None:  # PYTHONSAFEPATH: `python -m worker` would put this tree's directory ahead of PYTHONPATH
        workers["defaults-base"] = {**WORKER_VARIANTS["defaults"], "PYTHONPATH": str(base), "PYTHONSAFEPATH": "1"}
    out: dict[str, Any] = {"usable_cores": usable_cores()}
    # jpeg224 frames into each preset's own input (the toy model's input size left out of the workers' settings).
    presets_ctx = dataclasses.replace(ctx, workload_name="jpeg224", model="opennsfw")
    for preset in presets:
        path, shape = preset_input(preset)
        inputs, load = common.backlog(presets_ctx, f"eng-{preset}", int(ctx.scale(E2E_BACKLOG, 240)))

        def measure(variant: str, preset: str = preset, path: Path = path, shape: tuple[int, ...] = shape,
                    inputs: common.Topics = inputs) -> dict[str, Any]:
            if variant == "alone-sessions":
                return sessions_side_by_side(path, shape, threads, 1)
            if variant.startswith("alone"):
                return model_alone(path, shape, threads, spinning=variant == "alone-spinning")
            env = {"WORKER_MODEL_SOURCE": preset, **workers[variant]}
            return common.worker_round(presets_ctx, inputs, env, tag=f"eng-{preset}-{variant}")

        runs = stats.run_rounds(stats.interleaved([*ALONE_LAYOUTS, *workers], rounds), measure)
        layouts = {a: stats.figure(runs[a], "frames_per_s") for a in ALONE_LAYOUTS}
        alone = {r: max(layouts[a][r] for a in ALONE_LAYOUTS) for r in layouts["alone"]}
        fps = {v: stats.spread(runs[v], "frames_per_s") for v in runs}
        ratios = {v: stats.ratio_spread(stats.figure(runs[v], "frames_per_s"), alone) for v in workers}
        by_layout = {v: {a: stats.ratio_spread(stats.figure(runs[v], "frames_per_s"), layouts[a])
                         for a in ALONE_LAYOUTS} for v in workers}
        cpu = {v: stats.spread(runs[v], "cpu_ms_per_frame") for v in runs}
        # On a machine shared with other work, frames per CPU-second is the steadier comparison: alone / worker.
        alone_cpu = stats.figure(runs["alone-sessions"], "cpu_ms_per_frame")
        efficiency = {v: stats.ratio_spread(alone_cpu, stats.figure(runs[v], "cpu_ms_per_frame")) for v in workers}
        out[preset] = {"backlog": load, "runs": runs, "frames_per_s": fps, "ratio_to_alone": ratios,
                       "ratio_to_each_layout": by_layout, "cpu_ms_per_frame": cpu,
                       "cpu_efficiency_to_alone": efficiency}
        names = {"alone": f"onnxruntime alone, 1 session x {threads} threads, threads sleep (the worker's)",
                 "alone-spinning": f"onnxruntime alone, 1 session x {threads} threads, threads spin (its default)",
                 "alone-sessions": f"onnxruntime alone, {threads} sessions x 1 thread side by side"}
        common.table(f"{preset}: worker draining a 224x224 JPEG backlog vs onnxruntime alone (batch {ALONE_BATCH}; "
                     f"the worker's defaults use the {usable_cores()} cores this process may; / alone: per round, "
                     f"over the fastest layout alone; / 1x{threads}, / {threads}x1: over each), {stats.rounds(rounds)}",
                     ["what", "frames/s", "/ alone", f"/ 1x{threads}", f"/ {threads}x1", "CPU-ms/frame",
                      f"{threads}x1's CPU / this"],
                     [*[[names[a], fps[a].text(1), "", "", "", cpu[a].text(2), ""] for a in ALONE_LAYOUTS],
                      *[[f"worker, {v} ({' '.join(f'{k}={x}' for k, x in workers[v].items() if k[:6] == 'WORKER')})",
                         fps[v].text(1), ratios[v].text(2), by_layout[v]["alone"].text(2),
                         by_layout[v]["alone-sessions"].text(2), cpu[v].text(2), efficiency[v].text(2)]
                        for v in workers]])
    return out


def int8(ctx: Context, rounds: int) -> dict[str, Any]:
    from worker.config import load_settings
    from worker.runtime.engine import load_engine_model
    from worker.runtime.quantize import check_int8, quantized_model

    out: dict[str, Any] = {}
    for preset in PRESETS:
        s = load_settings(env={}, overrides={"model": {"source": preset},
                                             "runtime": {"device": "cpu", "torch_threads": ctx.torch_threads}})
        fp32 = load_engine_model(s.model, s.runtime)
        t0 = time.perf_counter()
        path = quantized_model(fp32.module.path, fp32.module.input_name, s.model, fp32.contract)  # type: ignore[attr-defined]
        quantise_s = time.perf_counter() - t0
        int8_settings = load_settings(env={}, overrides={"model": {"source": preset, "int8_min_agreement": 0.0},
                                                         "runtime": {"device": "cpu", "precision": "int8",
                                                                     "torch_threads": ctx.torch_threads}})
        q = load_engine_model(int8_settings.model, int8_settings.runtime)
        check = check_int8(fp32.module, q.module, fp32.contract, 0.0)
        shape = fp32.contract.input_shape(fp32.contract.input_size or (224, 224))
        files = {"fp32": fp32.module.path, "int8": path}  # type: ignore[attr-defined]
        threads = ctx.torch_threads
        runs = stats.run_rounds(stats.interleaved(["fp32", "int8"], rounds),
                                lambda v, files=files, shape=shape, threads=threads: {  # type: ignore[misc]
                                    **model_alone(files[v], shape, threads)})
        fps = {v: stats.spread(runs[v], "frames_per_s") for v in runs}
        speedup = stats.ratio_spread(stats.figure(runs["int8"], "frames_per_s"), stats.figure(runs["fp32"],
                                                                                               "frames_per_s"))
        out[preset] = {"images": check.images, "agreement": check.agreement, "disagreeing": check.disagreeing,
                       "largest_score_difference": check.largest_difference, "quantise_or_cache_s": quantise_s,
                       "runs": runs, "frames_per_s": fps, "int8_over_fp32": speedup}
        common.table(f"{preset}: int8 (QDQ, per tensor) vs fp32, onnxruntime alone, batch {ALONE_BATCH}, "
                     f"{stats.rounds(rounds)}", ["agreement", "largest score diff", "fp32 frames/s", "int8 frames/s",
                                                 "int8 / fp32"],
                     [[f"{check.agreeing}/{check.images}", f"{check.largest_difference:.4f}", fps["fp32"].text(1),
                       fps["int8"].text(1), speedup.text(2)]])
    return out


def sessions_side_by_side(path: Path, shape: tuple[int, ...], sessions: int, threads: int,
                          seconds: float = ALONE_SECONDS) -> dict[str, float]:
    """Frames/s and CPU-ms per frame of `sessions` onnxruntime sessions of `threads` threads each, each called back to
    back on batches of ALONE_BATCH from its own thread (the worker's runners)."""
    import threading

    import numpy as np
    import onnxruntime

    from worker.runtime.engine import session_options

    x = (np.random.default_rng(0).random((ALONE_BATCH, *shape))).astype(np.float32)
    made = [onnxruntime.InferenceSession(str(path), session_options(threads), providers=["CPUExecutionProvider"])
            for _ in range(sessions)]
    for s in made:
        s.run(None, {s.get_inputs()[0].name: x})
    counts, stop = [0] * sessions, time.perf_counter() + seconds

    def loop(i: int) -> None:
        name = made[i].get_inputs()[0].name
        while time.perf_counter() < stop:
            made[i].run(None, {name: x})
            counts[i] += ALONE_BATCH

    t0, cpu0 = time.perf_counter(), time.process_time()
    workers = [threading.Thread(target=loop, args=(i,)) for i in range(sessions)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    frames = sum(counts)
    return {"frames_per_s": frames / (time.perf_counter() - t0),
            "cpu_ms_per_frame": (time.process_time() - cpu0) * 1000.0 / frames}


def single_frame_ms(path: Path, shape: tuple[int, ...], threads: int, calls: int = 30) -> float:
    """Median wall ms of one frame through a session of `threads` threads, back to back."""
    import numpy as np
    import onnxruntime

    from worker.runtime.engine import session_options

    s = onnxruntime.InferenceSession(str(path), session_options(threads), providers=["CPUExecutionProvider"])
    feed = {s.get_inputs()[0].name: np.random.default_rng(0).random((1, *shape)).astype(np.float32)}
    times = []
    for i in range(calls + 5):
        t0 = time.perf_counter()
        s.run(None, feed)
        if i >= 5:
            times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times)


def layout(ctx: Context, rounds: int) -> dict[str, Any]:
    cores = ctx.torch_threads
    out: dict[str, Any] = {"cores": cores}
    for preset in PRESETS:
        path, shape = preset_input(preset)
        variants = {f"1 session x {cores} threads": (1, cores), f"{cores} sessions x 1 thread": (cores, 1)}
        runs = stats.run_rounds(stats.interleaved(list(variants), rounds),
                                lambda v, path=path, shape=shape, variants=variants:  # type: ignore[misc]
                                sessions_side_by_side(path, shape, *variants[v]))
        one, many = list(variants)
        ratio = stats.ratio_spread(stats.figure(runs[many], "frames_per_s"), stats.figure(runs[one], "frames_per_s"))
        latency = {t: single_frame_ms(path, shape, t) for t in (1, cores)}
        out[preset] = {"runs": runs, "sessions_over_threads": ratio, "single_frame_ms": latency}
        common.table(f"{preset}: onnxruntime alone, batch {ALONE_BATCH}, {cores} cores, {stats.rounds(rounds)}; one "
                     f"frame back to back: {latency[1]:.1f} ms on 1 thread, {latency[cores]:.1f} ms on {cores}",
                     ["layout", "frames/s", "CPU-ms/frame", f"/ 1 session x {cores} threads"],
                     [[v, stats.spread(runs[v], "frames_per_s").text(1),
                       stats.spread(runs[v], "cpu_ms_per_frame").text(2), ratio.text(2) if v == many else ""]
                      for v in variants])
    return out


def lowload_round(ctx: Context, tree: str, rate: float | None) -> dict[str, Any]:
    """The builtin CNN on jpeg224 from `tree`: an offered `rate` (None: a backlog) -> CPU-ms per frame, by thread,
    inference_ms of batches of 1-2, the cost model's n1_ms."""
    # PYTHONSAFEPATH: `python -m worker` would put the current directory (this tree) ahead of PYTHONPATH.
    env = {"PYTHONPATH": tree, "PYTHONSAFEPATH": "1", "WORKER_MODEL_SOURCE": "builtin"}
    tag = f"ll-{'backlog' if rate is None else int(rate)}"
    if rate is None:
        inputs = ctx.shared["lowload_backlog"]
        r = common.consumer_round(ctx, inputs, lambda t: common.start_worker(ctx, t, tag, env), tag)
        figures = {"cpu_ms_per_frame": r["cpu_ms_per_frame"], "mean_batch": r["mean_batch"], "log": r["log"]}
        log = Path(r["log"]).read_text()
        results: list[dict[str, Any]] = []
    else:
        t = common.topics(ctx.bootstrap, tag)
        producer, proc = common.FrameProducer(ctx.bootstrap, t), common.start_worker(ctx, t, tag, env)
        try:
            common.warm(ctx, proc, producer, tag)
            level = common.open_loop_level(ctx, proc, producer, rate, ctx.scale(20, 10), ctx.scale(60, 30))
        finally:
            proc.stop()
        results = [x for x in common.ResultsReader(ctx.bootstrap, t).read_all(idle_timeout_s=1.0)
                   if common.run_id_of(x["stream_id"]) == level["run_id"] and x["status"] == "OK"]
        figures = {"cpu_ms_per_frame": level["consumer_cpu_ms_per_frame"],
                   "by_thread": level["consumer_thread_cpu_ms_per_frame"],
                   "mean_batch": common.batch_sizes(results)["mean_frame_weighted"], "log": str(proc.log_path)}
        log = proc.log()
    small = [x["inference_ms"] for x in results if x["batch_size"] <= 2]
    seeded, small_threads = COST_MODEL_RE.search(log), SMALL_THREADS_RE.search(log)
    return {**figures, "inference_ms_batch_1_2": statistics.median(small) if small else float("nan"),
            "n1_ms": float(seeded.group(1)) if seeded else float("nan"),
            "small_batch_threads": int(small_threads.group(1)) if small_threads else None}


def engine_alone_small(threads: int) -> dict[str, float]:
    """The builtin CNN's forward alone on a normalised batch of 1 and 2, on `threads` threads and on one (the
    worker's choice for batches of <= 2 here), back to back and one call every 20 ms (as at 50 frames/s): median
    wall ms and this thread's CPU-ms per call (a sleeping process's caches go cold: the call costs more)."""
    import torch

    from worker.config import load_settings
    from worker.runtime.models import load_model

    loaded = load_model(load_settings(env={}, overrides={"model": {"source": "builtin"}}).model)
    times: dict[str, list[float]] = {}
    with torch.inference_mode():
        inputs = {n: torch.rand((n, 3, 224, 224)).contiguous(memory_format=torch.channels_last) for n in (1, 2)}
        for t in sorted({1, threads}):
            torch.set_num_threads(t)
            for x in inputs.values():
                for _ in range(20):  # first-call costs (oneDNN primitives per shape) out of the way
                    loaded.module(x)
        for _ in range(3):  # interleaved, so a burst of other work on the machine lands on every figure
            for t in sorted({1, threads}):
                torch.set_num_threads(t)
                for n, x in inputs.items():
                    for gap in (0.0, 0.02):
                        key = f"n{n}_t{t}_{'hot' if gap == 0 else 'every_20ms'}"
                        for _ in range(20):
                            time.sleep(gap)
                            t0, cpu0 = time.perf_counter(), time.thread_time()
                            loaded.module(x)
                            times.setdefault(f"{key}_ms", []).append((time.perf_counter() - t0) * 1000.0)
                            times.setdefault(f"{key}_cpu_ms", []).append((time.thread_time() - cpu0) * 1000.0)
    torch.set_num_threads(threads)
    return {key: statistics.median(values) for key, values in times.items()}


def lowload(ctx: Context, rounds: int, base: Path | None) -> dict[str, Any]:
    trees = {"this": str(common.REPO), **({"base": str(base.resolve())} if base else {})}
    ctx.shared["lowload_backlog"], _ = common.backlog(ctx, "ll-backlog", int(ctx.scale(3000, 1200)))
    loads: list[float | None] = [*LOW_LOADS, None]
    variants = [f"{tree}@{'backlog' if rate is None else int(rate)}" for tree in trees for rate in loads]

    def measure(variant: str) -> dict[str, Any]:
        tree, _, load = variant.partition("@")
        return lowload_round(ctx, trees[tree], None if load == "backlog" else float(load))

    runs = stats.run_rounds(stats.interleaved(variants, rounds), measure)
    alone = engine_alone_small(ctx.torch_threads)
    rows, out = [], {"runs": runs, "engine_alone_ms": alone}
    for v in variants:
        cpu, inf, n1 = (stats.spread(runs[v], k) for k in ("cpu_ms_per_frame", "inference_ms_batch_1_2", "n1_ms"))
        threads = {role: statistics.median(r["by_thread"].get(role, 0.0) for r in runs[v].values() if "by_thread" in r)
                   for role in ("python", "preprocess", "decode", "infer-cpu")
                   if any("by_thread" in r for r in runs[v].values())}
        out[v] = {"cpu_ms_per_frame": cpu, "inference_ms_batch_1_2": inf, "n1_ms": n1, "by_thread_median": threads}
        rows.append([v, cpu.text(2), " ".join(f"{k} {x:.2f}" for k, x in threads.items()), inf.text(2), n1.text(2)])
    common.table(f"Low load: builtin CNN, 224x224 JPEG, {stats.rounds(rounds)}; engine alone (forward, one thread) "
                 f"at batch 1: {alone['n1_t1_hot_ms']:.2f} ms ({alone['n1_t1_hot_cpu_ms']:.2f} CPU-ms) back to back, "
                 f"{alone['n1_t1_every_20ms_ms']:.2f} ms ({alone['n1_t1_every_20ms_cpu_ms']:.2f} CPU-ms) every 20 ms; "
                 f"batch 2: {alone['n2_t1_hot_ms']:.2f} / {alone['n2_t1_every_20ms_ms']:.2f} ms "
                 f"({alone['n2_t1_hot_cpu_ms']:.2f} / {alone['n2_t1_every_20ms_cpu_ms']:.2f} CPU-ms)",
                 ["tree@load", "CPU-ms/frame", "by thread (median)", "inference_ms, batch 1-2", "n1_ms"], rows)
    return out


def run(ctx: Context) -> dict[str, Any]:
    args = ctx.shared["args"]
    wanted = args.sections.split(",")
    result: dict[str, Any] = {"torch_threads": ctx.torch_threads,
                              "note": "2-core machine shared with other sessions: figures from a loaded machine; "
                                      "compare ratios within one run"}
    if "e2e" in wanted:
        result["e2e"] = e2e(ctx, ctx.round_count(3, 2), args.presets.split(","), args.base,
                            args.variants.split(",") if args.variants else None)
    if "int8" in wanted:
        result["int8"] = int8(ctx, ctx.round_count(3, 2))
    if "layout" in wanted:
        result["layout"] = layout(ctx, ctx.round_count(3, 2))
    if "lowload" in wanted:
        # The builtin CNN on jpeg224 frames, whatever --workload and --model say.
        result["lowload"] = lowload(dataclasses.replace(ctx, workload_name="jpeg224", model="toy"),
                                    ctx.round_count(3, 2), args.base)
    name = "engine" if set(wanted) == set(SECTIONS) else "engine_" + "_".join(wanted)
    if "e2e" in wanted and set(args.presets.split(",")) != set(PRESETS):  # a partial run keeps the full one's file
        name += "_" + "_".join(args.presets.split(","))
    common.write_json(name, result)
    return result


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated: {', '.join(SECTIONS)}")
    p.add_argument("--base", type=Path, help="lowload, e2e: another source tree (worker/ and schemas/), run as 'base'")
    p.add_argument("--variants", help=f"e2e: the worker variants, comma-separated, of {', '.join(WORKER_VARIANTS)}")
    p.add_argument("--presets", default=",".join(PRESETS), help=f"e2e: comma-separated, of {', '.join(PRESETS)}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(common.standalone(run, None, __doc__.splitlines()[0], configure,
                                       needs_broker=lambda a: bool(set(a.sections.split(",")) & {"e2e", "lowload"})))
