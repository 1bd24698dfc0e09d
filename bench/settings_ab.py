"""Settings A/B, the one harness for comparing settings (or source trees): named sets of worker settings on the same
work, in interleaved rounds (which set goes first rotates, so a drifting machine favours none); per set the median
(min-max) of frames/s, CPU-ms per frame, mean batch size and batches, and of the per-round ratios to the first set.

A set runs as the worker process (`python -m worker run`, the set's WORKER_* variables added) on one published
backlog; with --in-step FPS instead on an offered load below capacity, a fresh worker per round, every stream of
the workload sending a frame at the same instants (cameras sampled in step: what one batch can hold is then what
batching decides; on a backlog every group fills anyway); with --base TREE, set B is the worker of another source
tree.

    python bench/settings_ab.py --b WORKER_RUNTIME_INSTANCES_PER_DEVICE=2 [--a KEY=VALUE ...] [--rounds 8]
    python bench/settings_ab.py --variants settings   # commit interval, in-flight batches, preprocess threads
    python bench/settings_ab.py --variants scheduler  # the blocking bound always vs while realtime is present
    python bench/settings_ab.py --variants batch --workload jpeg224 --model opennsfw   # no batch settings vs
                                                      # fixed max_batch_size 4/8/16/32 (~14 min)
    git archive main worker schemas | tar -x -C /tmp/main-tree   # this tree against main, batch sizes on mixed
    python bench/settings_ab.py --base /tmp/main-tree --workload jpeg720+1080 --in-step 40 --rounds 3  # sizes

Each KEY=VALUE is a worker environment variable (docs/configuration.md: WORKER_<SECTION>_<FIELD>), applied on top of
the benchmark's own worker settings (the model, one torch thread unless --torch-threads). For tuning a setting on
your own workload and host before changing it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import stats
from common import Context
from stats import Spread

ADAPTIVE = "no batch settings (adaptive)"
FIXED_BATCH_SIZES = (4, 8, 16, 32)
VARIANT_SETS: dict[str, dict[str, dict[str, str]]] = {
    "settings": {
        "defaults": {},
        "commit_interval_ms=200": {"WORKER_DELIVERY_COMMIT_INTERVAL_MS": "200"},
        "max_inflight_batches=3": {"WORKER_DELIVERY_MAX_INFLIGHT_BATCHES": "3"},
        "preprocess_threads=2": {"WORKER_RUNTIME_PREPROCESS_THREADS": "2"},
        "all three": {"WORKER_DELIVERY_COMMIT_INTERVAL_MS": "200", "WORKER_DELIVERY_MAX_INFLIGHT_BATCHES": "3",
                      "WORKER_RUNTIME_PREPROCESS_THREADS": "2"}},
    # The scheduler's isolation: lower classes bounded by max_blocking_ms always (0) or only while realtime is present.
    "scheduler": {"defaults": {}, "realtime_quiet_ms=0 (always bounded)": {"WORKER_BATCHING_REALTIME_QUIET_MS": "0"}},
    # Batch sizing: no batch settings (sizes from the learned cost model, seeded by the warm-up calibration) against
    # a fixed max_batch_size with adaptive sizing off.
    "batch": {ADAPTIVE: {}, **{f"fixed {n}": {"WORKER_BATCHING_MAX_BATCH_SIZE": str(n),
                                              "WORKER_BATCHING_ADAPTIVE_BATCH_SIZE": "false"}
                               for n in FIXED_BATCH_SIZES}},
}
# Issue #16: adaptive reaches this share of the best fixed size, and this multiple of the default 32.
GOAL_OF_BEST_FIXED, GOAL_OVER_FIXED_32 = 0.95, 1.3
PAIR_ROUNDS, PAIR_FRAMES = 8, 8000  # --a/--b: tuning one setting on your own host wants more rounds
FIGURES = ("frames_per_s", "cpu_ms_per_frame", "mean_batch", "batches")


def parse_assignments(items: list[str]) -> dict[str, str]:
    """["WORKER_X=1", ...] -> {"WORKER_X": "1"}; ValueError on anything that is not a WORKER_ variable."""
    env: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("WORKER_") or not key.replace("_", "").isalnum() or not key.isupper():
            raise ValueError(f"{item!r}: expected WORKER_<SECTION>_<FIELD>=VALUE (docs/configuration.md)")
        if key in env:
            raise ValueError(f"{key} is given twice")
        env[key] = value
    return env


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--a", action="append", default=[], metavar="KEY=VALUE", help="variant A's worker settings")
    p.add_argument("--b", action="append", default=[], metavar="KEY=VALUE", help="variant B's worker settings")
    p.add_argument("--base", type=Path, help="variant B runs the worker of this source tree (holding worker/)")
    p.add_argument("--variants", choices=sorted(VARIANT_SETS), help="one of the project's sets instead of --a/--b")
    p.add_argument("--frames", type=int, default=0, help="frames each round consumes (or is offered)")
    p.add_argument("--in-step", type=float, metavar="FPS", help="offer FPS frames/s in step, no backlog")


def variants_of(argv: list[str]) -> dict[str, dict[str, str]]:
    """The sets to compare from the command line; SystemExit (status 2, the reason) on bad ones, so a mistake shows
    before the broker starts."""
    p = argparse.ArgumentParser(add_help=False)
    configure(p)
    args, _ = p.parse_known_args(argv)
    if args.variants:
        return VARIANT_SETS[args.variants]
    try:
        variants = {"A": parse_assignments(args.a), "B": parse_assignments(args.b)}
    except ValueError as exc:
        p.error(str(exc))
    if args.base:  # `python -m worker` imports the tree's package: PYTHONSAFEPATH keeps the working directory out
        variants["B"].update(PYTHONPATH=str(args.base.resolve()), PYTHONSAFEPATH="1")
    if variants["A"] == variants["B"]:
        p.error("--a and --b give the same settings: nothing to compare")
    return variants


def run(ctx: Context, variants: dict[str, dict[str, str]]) -> dict[str, Any]:
    """Every set once a round, rounds rotating, on one backlog (or offered load); the tables, and every round."""
    args, pair = ctx.shared["args"], list(variants) == ["A", "B"]
    rounds = ctx.rounds or (PAIR_ROUNDS if pair and not args.in_step else ctx.round_count(3, 2))
    # open_nsfw runs ~13-40 frames/s on a 2-core CPU (fixed batches of 32 the slowest): 800 frames keep >= 15 s in the
    # middle 80% up to 42 frames/s (quick: 500), and the batch set's 15 runs (quick: 10) fit in ~14 minutes (~6).
    frames = args.frames or (int(ctx.scale(800, 320)) if args.in_step else PAIR_FRAMES if pair else
                             int(ctx.scale(800, 500)) if ctx.model == "opennsfw" else int(ctx.scale(4000, 2000)))
    if args.in_step:
        streams = sum(len(load.shapes) for load in ctx.workload.classes.values()) * common.STREAMS_PER_SHAPE
        where = (f"{ctx.model} model, {ctx.workload_name} workload, {frames} frames offered at {args.in_step:g} "
                 f"frames/s by {streams} streams in step, a fresh worker process a round")

        def measure(name: str) -> dict[str, Any]:
            return common.offered_round(ctx, lambda t: common.start_worker(ctx, t, "ab", variants[name], expiry=True),
                                        "ab", args.in_step, frames / args.in_step, in_step=streams)
    else:
        topics, _ = common.backlog(ctx, "ab", frames)
        where = f"{ctx.model} model, {ctx.workload_name} workload, the worker process on a {frames}-frame backlog"

        def measure(name: str) -> dict[str, Any]:
            return common.worker_round(ctx, topics, variants[name], tag="ab", timeout_s=600)
    print(f"[ab] {where}: {rounds} rounds of {', '.join(variants)}"
          f"; worker logs in {ctx.log_dir}", flush=True)

    def one(name: str) -> dict[str, Any]:
        t = measure(name)
        print(f"[ab] {name}: {t['frames_per_s']:.1f} frames/s, {t['cpu_ms_per_frame']:.2f} CPU-ms/frame, sizes "
              + " ".join(f"{n}x{u['batches']:.0f}" for n, u in t["sizes_used"].items()), flush=True)
        return t

    runs = stats.run_rounds(stats.rotating(list(variants), rounds), one, lambda m: print("[ab]", m))
    first = next(iter(variants))
    by = {k: {name: stats.figure(runs.get(name, {}), k) for name in variants} for k in FIGURES}
    spreads = {name: {**{k: Spread.of(list(by[k][name].values())) for k in FIGURES},
                      **{f"{k}_over_first": stats.ratio_spread(by[k][name], by[k][first]) for k in FIGURES}}
               for name in variants}
    text = [common.table(
        f"settings A/B: {where}, median (min-max) of {rounds} interleaved rounds",
        ["variant", "settings", "frames/s", "CPU-ms/frame", "mean batch", "batches", f"frames/s / {first}",
         f"CPU-ms / {first}", f"batches / {first}", "frames/s per round"],
        [[name, " ".join(f"{k}={v}" for k, v in variants[name].items()) or "(the benchmark's defaults)",
          s["frames_per_s"].text(1), s["cpu_ms_per_frame"].text(), s["mean_batch"].text(1), s["batches"].text(),
          s["frames_per_s_over_first"].text(2), s["cpu_ms_per_frame_over_first"].text(2),
          s["batches_over_first"].text(2), " ".join(f"{v:.1f}" for v in by["frames_per_s"][name].values())]
         for name, s in spreads.items()],
        note="frames/s and CPU-ms per frame over the middle 80% of each round's results (--in-step: CPU from the "
             "load's start to the last commit, per frame sent); mean batch frame-weighted; ratios are medians "
             "(min-max) of per-round ratios"
             + "".join(f"\nFAILED {f}" for f in stats.failures(runs)))]
    result = {"benchmark": "settings_ab", "model": ctx.model, "workload_name": ctx.workload_name, "where": where,
              "torch_threads": ctx.torch_threads, "rounds": rounds, "backlog_frames": frames,
              "broker_warm_up": ctx.shared.get("broker_warm_up"),
              "variants": {name: {"env": variants[name], "rounds": runs.get(name, {}),
                                  **{k: s.as_dict() for k, s in spreads[name].items()}} for name in variants},
              "failed": stats.failures(runs), "tables": text}
    if ADAPTIVE in variants:
        result.update(adaptive_against_fixed(by["frames_per_s"], runs, text))
    common.write_json("settings_ab" + (f"_{args.variants}" if args.variants else ""), result)
    return result


def adaptive_against_fixed(fps: dict[str, dict[int, float]], runs: dict[str, dict[int, dict[str, Any]]],
                           text: list[str]) -> dict[str, Any]:
    """The batch set's verdicts: adaptive / the best fixed size (highest median frames/s) and adaptive / fixed 32, per
    round, against their goals; the batch sizes adaptive ran."""
    best = max((name for name in fps if name != ADAPTIVE), key=lambda name: Spread.of(list(fps[name].values())).median)
    of_best, over_32 = stats.ratio_spread(fps[ADAPTIVE], fps[best]), stats.ratio_spread(fps[ADAPTIVE], fps["fixed 32"])
    text.append(common.table(
        "adaptive against fixed sizes (median (min-max) of per-round ratios of frames/s)",
        ["ratio", "per-round ratios", "goal", "met (median)"],
        [[f"adaptive / best fixed ({best})", of_best.text(2), f">= {GOAL_OF_BEST_FIXED}",
          "yes" if of_best.median >= GOAL_OF_BEST_FIXED else "no"],
         ["adaptive / fixed 32 (the default size)", over_32.text(2), f">= {GOAL_OVER_FIXED_32}",
          "yes" if over_32.median >= GOAL_OVER_FIXED_32 else "no"]]))
    adaptive = [t for t in runs.get(ADAPTIVE, {}).values() if "sizes_used" in t]
    sizes = sorted({n for t in adaptive for n in t["sizes_used"]})
    total = sum(u["frames"] for t in adaptive for u in t["sizes_used"].values()) or 1
    log = Path(adaptive[0]["log"]).read_text(errors="replace") if adaptive and "log" in adaptive[0] else ""
    calibration = next((line for line in log.splitlines() if "batch cost model seeded" in line), "")
    text.append(common.table(
        "batch sizes the adaptive worker ran (whole runs, start-up included)",
        ["batch size", "share of frames (all rounds)", "batches per round"],
        [[n, f"{sum(t['sizes_used'].get(n, {}).get('frames', 0) for t in adaptive) / total:.1%}",
          " ".join(f"{t['sizes_used'].get(n, {}).get('batches', 0):.0f}" for t in adaptive)] for n in sizes],
        note=f"Calibration (the first round's log): {calibration}" if calibration else ""))
    return {"best_fixed": best, "adaptive_of_best_fixed": of_best.as_dict(),
            "adaptive_over_fixed_32": over_32.as_dict(),
            "goals": {"of_best_fixed": GOAL_OF_BEST_FIXED, "over_fixed_32": GOAL_OVER_FIXED_32}}


def summary(result: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Rows for bench/results/summary.md: each set's frames/s and CPU-ms/frame; the batch set's verdicts."""
    sp, rounds = Spread.from_dict, stats.rounds(result["rounds"])
    rows = [(name, f"{sp(v['frames_per_s']).text(1)} frames/s, {sp(v['cpu_ms_per_frame']).text()} CPU-ms/frame, "
             f"mean batch {sp(v['mean_batch']).text(1)}", rounds) for name, v in result["variants"].items()]
    if "best_fixed" in result:
        rows.append(("adaptive / best fixed size, adaptive / fixed 32 (per-round ratios)",
                     f"**{sp(result['adaptive_of_best_fixed']).text(2)}** (best: {result['best_fixed']}; goal >= "
                     f"{GOAL_OF_BEST_FIXED}), **{sp(result['adaptive_over_fixed_32']).text(2)}** (goal >= "
                     f"{GOAL_OVER_FIXED_32})", rounds))
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Read (and refused when bad) before standalone starts the broker; --help reaches standalone's parser.
    variants = {} if "-h" in argv or "--help" in argv else variants_of(argv)
    return common.standalone(lambda ctx: run(ctx, variants), argv, __doc__.splitlines()[0], configure=configure)


if __name__ == "__main__":
    raise SystemExit(main())
