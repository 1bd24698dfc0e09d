"""Latency under load: an offered-rate sweep from 10% to 120% of the worker's measured capacity, open loop
with intended-send timestamps (OpenMessaging style), against one warm worker process with its default
settings (expiry on, as in production). Per level: p50/p95/p99 end-to-end latency (capture -> result),
per class, the batch-size distribution, expired frames, and where the standard class's p99 leaves its
budget (the knee). Prints a table, writes JSON and a PNG plot.

Budget (standard class) = batching.standard.max_wait_ms + the executor's median time for a full batch
(max_batch_size frames of the standard class's largest shape, decode included), measured in the same run.
Kafka transit (producer linger, fetch) is not in it, so the knee is conservative. The worker gets the same
budget as its batching.standard.latency_budget_ms.

    python bench/latency_sweep.py [--quick]
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import stats
from common import Context
from model_limit import standard_batch_ms

from worker.frames import Priority
from worker.testing import FrameProducer, end_offsets, wait_committed

LEVELS = (0.1, 0.25, 0.5, 0.7, 0.85, 1.0, 1.2)
QUICK_LEVELS = (0.1, 0.5, 0.85, 1.0, 1.2)
WARMUP_SHARE = 0.1  # of each level, by intended send time, discarded
# A level lasts until it has offered this many standard frames (the knee's class), within its time limit: a p99
# over ~100 frames is their maximum, and one hiccup of a shared machine then decides the knee.
STANDARD_SAMPLES = {"full": 1000, "quick": 400}
LEVEL_SECONDS = {"full": (6.0, 30.0), "quick": (4.0, 15.0)}  # (at least, at most)


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


def capacity(ctx: Context) -> float:
    """The worker's saturated frames/s: batching_gain's (c) in the same run, else measured here."""
    if "capacity_fps" in ctx.shared:
        return float(ctx.shared["capacity_fps"])
    topics, _ = common.backlog(ctx, "swc", int(ctx.scale(4000, 2000)))
    return float(common.worker_round(ctx, topics, tag="swc")["frames_per_s"])


def budget_ms(ctx: Context) -> dict[str, Any]:
    if "standard_full_batch_ms" not in ctx.shared:
        ctx.shared["standard_full_batch_ms"] = standard_batch_ms(ctx)["median_ms"]
    max_wait = ctx.settings().batching.standard.max_wait_ms
    model = ctx.shared["standard_full_batch_ms"]
    return {"max_wait_ms": max_wait, "model_ms": model, "budget_ms": max_wait + model,
            "definition": "standard max_wait_ms + executor median for a full batch of the standard class's "
                          "largest shape (Kafka transit not included)"}


def run(ctx: Context) -> dict[str, Any]:
    capacity_source = "batching gain's (c), median" if "capacity_fps" in ctx.shared else "1 run"
    cap = capacity(ctx)
    budget = budget_ms(ctx)
    levels = QUICK_LEVELS if ctx.quick else LEVELS
    standard_share = ctx.workload.classes[Priority.STANDARD].share
    print(f"\n[sweep] capacity {cap:.0f} frames/s, budget {budget['budget_ms']:.1f} ms, levels {levels}", flush=True)
    topics = common.topics(ctx.bootstrap, "sw")
    producer = FrameProducer(ctx.bootstrap, topics)
    # The scheduler is told the standard budget the sweep judges it by (it sizes and releases batches for it).
    proc = common.start_worker(ctx, topics, "sw", expiry=True,
                               env={"WORKER_BATCHING_STANDARD_LATENCY_BUDGET_MS": f"{budget['budget_ms']:.0f}"})
    runs: list[dict[str, Any]] = []
    try:
        producer.publish(ctx.records(30, common.new_id("warm")))
        if not wait_committed(ctx.bootstrap, topics.group, end_offsets(ctx.bootstrap, topics.inputs), 120,
                              alive=proc.alive):
            raise RuntimeError(f"the worker did not get warm\n{proc.log()[-3000:]}")
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
    knee = None
    for lv in runs:
        results = by_run.get(lv["run_id"], [])
        lv.update(common.level_figures(results, topics, lv["seconds"], WARMUP_SHARE))
        lv["achieved_fps"] = common.steady_throughput(results, trim=0.05)["frames_per_s"]
        # Worker process CPU over the level (its drain included) per frame it finished.
        lv["worker_cpu_ms_per_frame"] = (lv["consumer_cores"] * lv["wall_s"] * 1000.0 / len(results)
                                         if results else float("nan"))
        first = min((r["capture_ts_ms"] for r in results), default=0)
        standard_ok = [r for r in results if r["status"] == "OK" and r["source_topic"] == standard_topic
                       and r["capture_ts_ms"] >= first + WARMUP_SHARE * lv["seconds"] * 1000.0]
        lv["standard_parts"] = standard_parts(standard_ok)
        lv["standard_p99_within_budget"] = bool(lv["latency_by_class"]["standard"]["p99_ms"] <= budget["budget_ms"])
        if knee is None and not lv["standard_p99_within_budget"]:
            knee = lv
    last_ok = max((lv for lv in runs if lv["standard_p99_within_budget"] and (knee is None or
                   lv["share_of_capacity"] < knee["share_of_capacity"])),
                  key=lambda lv: lv["share_of_capacity"], default=None)
    if knee is None:
        knee_text = f"standard p99 stayed within {budget['budget_ms']:.1f} ms at every level up to {levels[-1]:.0%}"
    elif last_ok is None:
        knee_text = (f"knee: standard p99 was over the {budget['budget_ms']:.1f} ms budget already at the lowest level "
                     f"({knee['share_of_capacity']:.0%} of capacity, {knee['offered_fps']:.0f} frames/s)")
    else:
        knee_text = (f"knee: standard p99 leaves the {budget['budget_ms']:.1f} ms budget between "
                     f"{(last_ok['share_of_capacity'] if last_ok else 0):.0%} and {knee['share_of_capacity']:.0%} "
                     f"of capacity ({(last_ok['offered_fps'] if last_ok else 0):.0f}-{knee['offered_fps']:.0f} "
                     "frames/s)")
    rows = []
    for lv in runs:
        lat, cls = lv["latency"], lv["latency_by_class"]
        bs = lv["batch_sizes"]["share_of_frames"]
        rows.append([f"{lv['share_of_capacity']:.0%}", lv["offered_fps"], lv["achieved_fps"], lat["p50_ms"],
                     lat["p95_ms"], lat["p99_ms"], cls["realtime"]["p99_ms"], cls["standard"]["p99_ms"],
                     cls["bulk"]["p99_ms"], "ok" if lv["standard_p99_within_budget"] else "OVER",
                     cls["standard"].get("n", 0),
                     "/".join(f"{lv['standard_parts'][f'{k}_p99_ms']:.0f}" for k in ("in", "queued", "run")),
                     lv["expired"],
                     lv["batch_sizes"]["mean_frame_weighted"],
                     " ".join(f"{int(round(100 * v))}" for v in bs.values()),
                     lv["load"]["send_delay_p99_ms"], lv["consumer_cores"], lv["worker_cpu_ms_per_frame"],
                     lv["generator_cores"], lv["broker_cores"],
                     lv["background_cores"]])
    text = common.table(
        f"latency under load (open loop, {min((lv['seconds'] for lv in runs), default=0):.0f}-"
        f"{max((lv['seconds'] for lv in runs), default=0):.0f}s per level for >= "
        f"{STANDARD_SAMPLES['quick' if ctx.quick else 'full']} standard frames, first {WARMUP_SHARE:.0%} "
        f"discarded; capacity "
        f"{cap:.0f} frames/s; budget {budget['budget_ms']:.1f} ms = {budget['max_wait_ms']:.0f} ms wait + "
        f"{budget['model_ms']:.1f} ms model), ms",
        ["load", "offered", "achieved", "p50", "p95", "p99", "rt p99", "std p99", "bulk p99", "std budget",
         "std n", "std p99 in/queued/run", "expired", "mean batch", "% frames in batch 1|2-3|4-7|8-15|16-31|32",
         "send delay p99", "worker cores", "worker CPU-ms/frame", "generator cores", "broker cores", "bg cores"],
        rows, note=knee_text + ". Latency over OK results; expired = frames past their class's max_age_ms.\n"
                   "std p99 in/queued/run: each part's own p99 for standard frames (in: capture -> read by the "
                   "worker; queued: read -> batch start; run: preprocessing + model).\n"
                   "Capacity was measured on a backlog with no load generator running; here the generator (this "
                   "process: Avro encode + lz4) shares the same CPUs, so the worker saturates below 100%.")
    plot: Path | None = ctx.out_dir / "latency_sweep.png"
    try:
        plot_sweep(runs, cap, budget["budget_ms"], plot)
        print(f"[bench] wrote {plot}", flush=True)
    except Exception as exc:  # noqa: BLE001 (a plot must never lose the numbers)
        print(f"[sweep] plot failed: {exc}", flush=True)
        plot = None
    result = {"benchmark": "latency_sweep", "machine": common.machine(), "model": ctx.model,
              "workload_name": ctx.workload_name, "workload": ctx.workload.describe(),
              "capacity_fps": cap, "capacity_source": capacity_source, "budget": budget,
              "standard_samples_per_level": STANDARD_SAMPLES, "level_seconds": LEVEL_SECONDS,
              "broker_warm_up": ctx.shared.get("broker_warm_up"), "levels": runs,
              "knee": knee_text, "knee_share": knee["share_of_capacity"] if knee else None,
              "last_within_budget_share": last_ok["share_of_capacity"] if last_ok else None,
              "plot": str(plot) if plot else None, "tables": [text]}
    common.write_json("latency_sweep", result, ctx.out_dir)
    return result


# -- the plot (Pillow; no plotting library needed) ------------------------------------------------------------------
def plot_sweep(runs: list[dict[str, Any]], cap: float, budget: float, path: Path) -> None:
    from PIL import Image, ImageDraw, ImageFont

    series = {
        "p50": ([(lv["offered_fps"], lv["latency"]["p50_ms"]) for lv in runs], (31, 119, 180)),
        "p95": ([(lv["offered_fps"], lv["latency"]["p95_ms"]) for lv in runs], (255, 127, 14)),
        "p99": ([(lv["offered_fps"], lv["latency"]["p99_ms"]) for lv in runs], (214, 39, 40)),
        "standard p99": ([(lv["offered_fps"], lv["latency_by_class"]["standard"]["p99_ms"]) for lv in runs],
                         (148, 103, 189)),
    }
    W, H, L, R, T, B = 900, 560, 80, 190, 50, 60
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    font = ImageFont.load_default()
    ys = [y for pts, _ in series.values() for _, y in pts if y == y and y > 0] + [budget]
    y_lo = 10 ** math.floor(math.log10(max(0.1, min(ys))))
    y_hi = 10 ** math.ceil(math.log10(max(ys)))
    x_hi = max(max(lv["offered_fps"] for lv in runs), cap) * 1.05

    def px(x: float, y: float) -> tuple[float, float]:
        fy = (math.log10(max(y, y_lo)) - math.log10(y_lo)) / (math.log10(y_hi) - math.log10(y_lo))
        return L + x / x_hi * (W - L - R), H - B - fy * (H - T - B)

    d.rectangle([L, T, W - R, H - B], outline="black")
    decade = y_lo
    while decade <= y_hi * 1.0001:
        _, y = px(0, decade)
        d.line([L, y, W - R, y], fill=(225, 225, 225))
        d.text((L - 8, y), f"{decade:g}", fill="black", anchor="rm", font=font)
        decade *= 10
    step = 10 ** math.floor(math.log10(x_hi / 2))
    x = 0.0
    while x <= x_hi:
        px_x, _ = px(x, y_lo)
        d.line([px_x, H - B, px_x, H - B + 4], fill="black")
        d.text((px_x, H - B + 8), f"{x:g}", fill="black", anchor="mt", font=font)
        x += step
    _, by = px(0, budget)
    d.line([L, by, W - R, by], fill=(44, 160, 44), width=2)
    d.text((W - R + 6, by), f"std budget {budget:.0f} ms", fill=(44, 160, 44), anchor="lm", font=font)
    cx, _ = px(cap, y_lo)
    d.line([cx, T, cx, H - B], fill=(127, 127, 127), width=1)
    d.text((cx, T - 4), f"capacity {cap:.0f}/s", fill=(90, 90, 90), anchor="mb", font=font)
    for i, (name, (pts, color)) in enumerate(series.items()):
        coords = [px(x, y) for x, y in pts if y == y]
        if len(coords) > 1:
            d.line(coords, fill=color, width=2)
        for cx_, cy_ in coords:
            d.ellipse([cx_ - 3, cy_ - 3, cx_ + 3, cy_ + 3], fill=color)
        d.line([W - R + 10, T + 20 + 18 * i, W - R + 30, T + 20 + 18 * i], fill=color, width=2)
        d.text((W - R + 36, T + 20 + 18 * i), name, fill="black", anchor="lm", font=font)
    d.text((W / 2, 20), "streamfer end-to-end latency vs offered load (log scale)", fill="black", anchor="mm",
           font=font)
    d.text(((L + W - R) / 2, H - 18), "offered frames/s (open loop)", fill="black", anchor="mm", font=font)
    d.text((12, T - 20), "ms", fill="black", font=font)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)


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
    lines = ["| load | offered/s | achieved/s | p50 | p95 | p99 | realtime p99 | standard p99 | bulk p99 | "
             "expired | mean batch |", "|" + "---|" * 11]
    for lv in result["levels"]:
        lat, cls = lv["latency"], lv["latency_by_class"]
        lines.append(f"| {lv['share_of_capacity']:.0%} | {lv['offered_fps']:.0f} | {lv['achieved_fps']:.0f} | "
                     f"{lat['p50_ms']:.0f} | {lat['p95_ms']:.0f} | {lat['p99_ms']:.0f} | "
                     f"{cls['realtime']['p99_ms']:.0f} | "
                     f"{cls['standard']['p99_ms']:.0f}{'' if lv['standard_p99_within_budget'] else ' (over)'} | "
                     f"{cls['bulk']['p99_ms']:.0f} | {lv['expired']} | "
                     f"{lv['batch_sizes']['mean_frame_weighted']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return common.standalone(run, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    raise SystemExit(main())
