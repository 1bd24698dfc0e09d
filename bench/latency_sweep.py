"""Latency under load: an offered-rate sweep from 10% to 120% of the worker's measured capacity, open loop with
intended-send timestamps (OpenMessaging style), against one warm worker process with its default settings (expiry
on, as in production). Per level: p50/p95/p99 end-to-end latency (capture -> result), per class, the batch-size
distribution, expired frames, and where the standard class's p99 leaves its budget (the knee).

Budget (standard class) = batching.standard.max_wait_ms + the executor's median time for a full batch
(max_batch_size frames of the standard class's largest shape, decode included), measured in the same run. Kafka
transit (producer linger, fetch) is not in it, so the knee is conservative. The worker gets the same budget as its
batching.standard.latency_budget_ms.

    python bench/latency_sweep.py [--quick] [--model toy|opennsfw]   # writes latency_sweep[_MODEL].json
    python bench/latency_sweep.py --capacity 1300 --levels 0.25,0.5   # fixed rates: compare settings or trees
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import stats
from common import Context
from executor_load import as_frame

from worker.frames import Priority
from worker.runtime.start import build_executor
from worker.testing import FrameProducer, synthetic_frames

LEVELS = (0.1, 0.25, 0.5, 0.7, 0.85, 1.0, 1.2)
QUICK_LEVELS = (0.1, 0.5, 0.85, 1.0, 1.2)
WARMUP_SHARE = 0.1  # of each level, by intended send time, discarded
# A level lasts until it has offered this many standard frames (the knee's class), within its time limit: a p99
# over ~100 frames is their maximum, and one hiccup of a shared machine then decides the knee.
STANDARD_SAMPLES = {"full": 1000, "quick": 400}
LEVEL_SECONDS = {"full": (6.0, 30.0), "quick": (4.0, 15.0)}  # (at least, at most)
COLUMNS = {  # the table's columns (the text table has all, summary.md's the first twelve): header -> cell of a level
    "load": lambda lv: f"{lv['share_of_capacity']:.0%}", "offered/s": lambda lv: lv["offered_fps"],
    "achieved/s": lambda lv: lv["achieved_fps"], "p50": lambda lv: lv["latency"]["p50_ms"],
    "p95": lambda lv: lv["latency"]["p95_ms"], "p99": lambda lv: lv["latency"]["p99_ms"],
    **{f"{p.label} p99": lambda lv, p=p: lv["latency_by_class"][p.label]["p99_ms"] for p in Priority},
    "expired": lambda lv: lv["expired"], "mean batch": lambda lv: lv["batch_sizes"]["mean_frame_weighted"],
    "std budget": lambda lv: "ok" if lv["standard_p99_within_budget"] else "OVER",
    "std n": lambda lv: lv["latency_by_class"]["standard"].get("n", 0),
    "std p99 in/queued/run": lambda lv: "/".join(f"{lv['standard_parts'][f'{k}_p99_ms']:.0f}"
                                                 for k in ("in", "queued", "run")),
    "% frames in batch 1|2-3|4-7|8-15|16-31|32": lambda lv: " ".join(
        f"{int(round(100 * v))}" for v in lv["batch_sizes"]["share_of_frames"].values()),
    "send delay p99": lambda lv: lv["load"]["send_delay_p99_ms"], "worker cores": lambda lv: lv["consumer_cores"],
    "worker CPU-ms/frame": lambda lv: lv["worker_cpu_ms_per_frame"],
    "generator cores": lambda lv: lv["generator_cores"], "broker cores": lambda lv: lv["broker_cores"],
    "bg cores": lambda lv: lv["background_cores"],
}


def level_seconds(rate: float, standard_share: float, quick: bool) -> float:
    """How long a level offers frames: enough standard frames for its p99, within LEVEL_SECONDS."""
    low, high = LEVEL_SECONDS["quick" if quick else "full"]
    wanted = STANDARD_SAMPLES["quick" if quick else "full"] / max(rate * standard_share, 1e-9)
    return max(low, min(high, wanted))


def standard_parts(ok: list[dict[str, Any]]) -> dict[str, float]:
    """p50/p99 of where a standard frame's latency went: in (capture -> the worker read it: producer, broker,
    fetch, the worker's own poll), queued (read -> its batch started) and run (preprocessing + model)."""
    parts = {"in": [r["end_to_end_ms"] - r["queued_ms"] - r["inference_ms"] for r in ok],
             "queued": [float(r["queued_ms"]) for r in ok], "run": [float(r["inference_ms"]) for r in ok]}
    return {f"{name}_{q}_ms": stats.percentile(sorted(values), quantile) for name, values in parts.items()
            for q, quantile in (("p50", 0.5), ("p99", 0.99))}


def standard_batch_ms(ctx: Context) -> float:
    """Median submit -> outcome time of a full batch (max_batch_size frames) of the standard class's largest shape
    alone, at the worker's thread count: the "model time" of the budget."""
    settings = ctx.settings()
    load = ctx.workload.classes.get(Priority.STANDARD) or next(iter(ctx.workload.classes.values()))
    w, h = max(load.shapes, key=lambda s: s[0] * s[1])
    frame = as_frame(synthetic_frames(1, [(w, h)], load.encoding, Priority.STANDARD, "budget")[0])
    batch = [frame] * settings.batching.max_batch_size
    with build_executor(settings.model, settings.runtime) as executor:
        executor.warm_up()
        executor.submit(batch, frame.shape).result()  # untimed: first-call costs
        times = []
        for _ in range(5 if ctx.quick else 10):
            t0 = time.perf_counter()
            executor.submit(batch, frame.shape).result()
            times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times)


def budget_ms(ctx: Context) -> dict[str, Any]:
    max_wait, model = ctx.settings().batching.standard.max_wait_ms, standard_batch_ms(ctx)
    return {"max_wait_ms": max_wait, "model_ms": model, "budget_ms": max_wait + model,
            "definition": "standard max_wait_ms + executor median for a full batch of the standard class's "
                          "largest shape (Kafka transit not included)"}


def knee_of(levels: list[dict[str, Any]], budget: float, top: float) -> tuple[str, dict | None, dict | None]:
    """The first level whose standard p99 left the budget, the last one below it within it, and that in words."""
    knee = next((lv for lv in levels if not lv["standard_p99_within_budget"]), None)
    last_ok = max((lv for lv in levels if lv["standard_p99_within_budget"] and
                   (knee is None or lv["share_of_capacity"] < knee["share_of_capacity"])),
                  key=lambda lv: lv["share_of_capacity"], default=None)
    if knee is None:
        return f"standard p99 stayed within {budget:.1f} ms at every level up to {top:.0%}", None, last_ok
    if last_ok is None:
        return (f"knee: standard p99 was over the {budget:.1f} ms budget already at the lowest level "
                f"({knee['share_of_capacity']:.0%} of capacity, {knee['offered_fps']:.0f} frames/s)", knee, None)
    return (f"knee: standard p99 leaves the {budget:.1f} ms budget between {last_ok['share_of_capacity']:.0%} and "
            f"{knee['share_of_capacity']:.0%} of capacity ({last_ok['offered_fps']:.0f}-{knee['offered_fps']:.0f} "
            "frames/s)", knee, last_ok)


def run(ctx: Context) -> dict[str, Any]:
    # The worker's saturated frames/s: given (--capacity), batching_gain's (c) in the same run, else measured here.
    given, chosen = getattr(ctx.shared.get("args"), "capacity", None), getattr(ctx.shared.get("args"), "levels", None)
    if given:
        ctx.shared["capacity_fps"] = given
    capacity_source = ("given (--capacity)" if given else
                       "batching gain's (c), median" if "capacity_fps" in ctx.shared else "1 run")
    if "capacity_fps" not in ctx.shared:
        ctx.shared["capacity_fps"] = common.worker_round(ctx, common.backlog(ctx, "swc", int(ctx.scale(4000, 2000)))[0],
                                                         tag="swc")["frames_per_s"]
    cap, budget = float(ctx.shared["capacity_fps"]), budget_ms(ctx)
    levels = tuple(chosen) if chosen else QUICK_LEVELS if ctx.quick else LEVELS
    standard_share = ctx.workload.classes[Priority.STANDARD].share
    print(f"\n[sweep] capacity {cap:.0f} frames/s, budget {budget['budget_ms']:.1f} ms, levels {levels}", flush=True)
    topics = common.topics(ctx.bootstrap, "sw")
    producer = FrameProducer(ctx.bootstrap, topics)
    # The scheduler is told the standard budget the sweep judges it by (it sizes and releases batches for it).
    proc = common.start_worker(ctx, topics, "sw", expiry=True,
                               env={"WORKER_BATCHING_STANDARD_LATENCY_BUDGET_MS": f"{budget['budget_ms']:.0f}"})
    runs: list[dict[str, Any]] = []
    try:
        common.warm(ctx, proc, producer, "the worker")
        for share in levels:
            seconds = level_seconds(share * cap, standard_share, ctx.quick)
            lv = common.open_loop_level(ctx, proc, producer, share * cap, seconds, seconds * 3 + 30)
            runs.append({"share_of_capacity": share, **lv})
            print(f"[sweep] {share:>4.0%} = {share * cap:.0f} frames/s for {seconds:.0f}s: sent {lv['load']['sent']}, "
                  f"send delay p99 {lv['load']['send_delay_p99_ms']:.1f} ms, drained {lv['drain_after_load_s']:.1f}s "
                  "after the load", flush=True)
            if not lv["drained"]:
                break
            time.sleep(0.5)
    finally:
        proc.stop()
    by_run: dict[str, list[dict[str, Any]]] = {}
    for r in common.ResultsReader(ctx.bootstrap, topics).read_all(idle_timeout_s=1.0):
        by_run.setdefault(common.run_id_of(r["stream_id"]), []).append(r)
    standard_topic = topics.for_priority(Priority.STANDARD)
    for lv in runs:
        results = by_run.get(lv["run_id"], [])
        lv.update(common.level_figures(results, topics, lv["seconds"], WARMUP_SHARE))
        lv["achieved_fps"] = common.steady_throughput(results, trim=0.05)["frames_per_s"]
        # Worker process CPU over the level (its drain included) per frame it finished.
        lv["worker_cpu_ms_per_frame"] = stats.cpu_ms_per_frame(lv["consumer_cores"] * lv["wall_s"], len(results))
        first = min((r["capture_ts_ms"] for r in results), default=0)
        lv["standard_parts"] = standard_parts([r for r in results if r["status"] == "OK" and r["source_topic"] ==
                                               standard_topic and r["capture_ts_ms"] >= first + WARMUP_SHARE *
                                               lv["seconds"] * 1000.0])
        lv["standard_p99_within_budget"] = bool(lv["latency_by_class"]["standard"]["p99_ms"] <= budget["budget_ms"])
    knee_text, knee, last_ok = knee_of(runs, budget["budget_ms"], levels[-1])
    seconds = [lv["seconds"] for lv in runs] or [0]
    text = common.table(
        f"latency under load (open loop, {min(seconds):.0f}-{max(seconds):.0f}s per level for >= "
        f"{STANDARD_SAMPLES['quick' if ctx.quick else 'full']} standard frames, first {WARMUP_SHARE:.0%} discarded; "
        f"capacity {cap:.0f} frames/s; budget {budget['budget_ms']:.1f} ms = {budget['max_wait_ms']:.0f} ms wait + "
        f"{budget['model_ms']:.1f} ms model), ms", list(COLUMNS), [[c(lv) for c in COLUMNS.values()] for lv in runs],
        note=knee_text + ". Latency over OK results; expired = frames past their class's max_age_ms.\n"
             "std p99 in/queued/run: each part's own p99 for standard frames (in: capture -> read by the worker; "
             "queued: read -> batch start; run: preprocessing + model).\nCapacity was measured on a backlog with no "
             "load generator running; here the generator (this process: Avro encode + lz4) shares the same CPUs, so "
             "the worker saturates below 100%.")
    result = {"benchmark": "latency_sweep", "model": ctx.model, "workload_name": ctx.workload_name,
              "workload": ctx.workload.describe(), "capacity_fps": cap, "capacity_source": capacity_source,
              "budget": budget, "standard_samples_per_level": STANDARD_SAMPLES, "level_seconds": LEVEL_SECONDS,
              "broker_warm_up": ctx.shared.get("broker_warm_up"), "levels": runs, "knee": knee_text,
              "knee_share": knee["share_of_capacity"] if knee else None,
              "last_within_budget_share": last_ok["share_of_capacity"] if last_ok else None, "tables": [text]}
    common.write_json("latency_sweep" if ctx.model == "toy" else f"latency_sweep_{ctx.model}", result)
    return result


def summary(result: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Rows for bench/results/summary.md: (figure, value, rounds): one sweep, each level once."""
    b = result["budget"]
    cells = "; ".join(f"{lv['share_of_capacity']:.0%}: {lv['latency']['p50_ms']:.0f}/{lv['latency']['p99_ms']:.0f}"
                      for lv in result["levels"])
    return [("capacity (worker saturated) and standard budget",
             f"{result['capacity_fps']:.0f} frames/s; {b['budget_ms']:.0f} ms = {b['max_wait_ms']:.0f} ms wait + "
             f"{b['model_ms']:.0f} ms full-batch model time", result["capacity_source"]),
            ("knee", f"**{result['knee'].removeprefix('knee: ')}**", "1 sweep"),
            ("p50/p99 ms by offered load (share of capacity)", cells, "1 sweep")]


def markdown_levels(result: dict[str, Any]) -> str:
    """The sweep's levels as a markdown table for summary.md (the text table's first twelve columns)."""
    cells = list(COLUMNS.values())[:12]
    return "\n".join(common.markdown_table(list(COLUMNS)[:12], [[c(lv) for c in cells] for lv in result["levels"]]))


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--capacity", type=float, help="frames/s the levels are shares of (default: measured here)")
    p.add_argument("--levels", type=lambda v: [float(x) for x in v.split(",")],
                   help="comma-separated shares of capacity (default: the full or quick set)")


if __name__ == "__main__":
    raise SystemExit(common.standalone(run, None, __doc__.splitlines()[0], configure))
