"""Settings A/B: the worker's saturated frames/s and CPU-ms per frame under two sets of settings, on one
published backlog, in interleaved rounds (A B, then B A, ...: a drifting machine favours neither). Reports the
median (min-max) of each and of the per-round ratios B/A. For tuning a setting on your own workload and host
before changing it; not part of run_all.

    python bench/settings_ab.py --b WORKER_RUNTIME_INSTANCES_PER_DEVICE=2 [--a KEY=VALUE ...] [--rounds 8]
        [--frames 8000] [--workload mixed] [--model toy] [--torch-threads 1]

Each KEY=VALUE is a worker environment variable (docs/configuration.md: WORKER_<SECTION>_<FIELD>), applied on
top of the benchmark's own worker settings (the model, one torch thread unless --torch-threads).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import stats
from common import Context

DEFAULT_ROUNDS = 8
DEFAULT_FRAMES = 8000


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


def configure(p: Any) -> None:
    p.add_argument("--a", action="append", default=[], metavar="KEY=VALUE", help="variant A's worker settings")
    p.add_argument("--b", action="append", default=[], metavar="KEY=VALUE", help="variant B's worker settings")
    p.add_argument("--frames", type=int, default=DEFAULT_FRAMES, help="backlog frames each round consumes")


def run(ctx: Context, variants: dict[str, dict[str, str]]) -> dict[str, Any]:
    """Rounds of the two variants (`variants_of`'s) on one backlog; the table, and the JSON with every round."""
    rounds = ctx.rounds or DEFAULT_ROUNDS
    frames = ctx.shared["args"].frames
    topics = common.make_topics(ctx.bootstrap, "ab")
    publish = common.publish_load(ctx.bootstrap, topics, ctx.records(frames, common.new_id("ab")))
    fps: dict[str, dict[int, float]] = {"A": {}, "B": {}}
    cpu: dict[str, dict[int, float]] = {"A": {}, "B": {}}
    for r, v in stats.rotating(list(variants), rounds):
        env = {**ctx.worker_env(), **variants[v]}
        backlog = common.run_backlog(
            ctx.bootstrap, topics, frames,
            lambda t, env=env, v=v: common.start_worker(ctx.bootstrap, t, ctx.log_dir, ctx.torch_threads,
                                                        common.new_id(f"ab{v}"), extra_env=env),
            timeout_s=600, tag=f"ab{v}", broker=ctx.broker)
        tp = common.steady_throughput(backlog.results)
        fps[v][r], cpu[v][r] = tp["frames_per_s"], backlog.cpu_ms_per_frame(tp)
        print(f"[ab] round {r} {v}: {fps[v][r]:.0f} frames/s, {cpu[v][r]:.3f} CPU-ms/frame", flush=True)
    spreads = {v: (stats.Spread.of(list(fps[v].values())), stats.Spread.of(list(cpu[v].values()))) for v in fps}
    ratio_fps, ratio_cpu = stats.ratio_spread(fps["B"], fps["A"]), stats.ratio_spread(cpu["B"], cpu["A"])
    rows = [[v, " ".join(f"{k}={val}" for k, val in variants[v].items()) or "(the benchmark's defaults)",
             spreads[v][0].text(), spreads[v][1].text(3)] for v in ("A", "B")]
    rows.append(["B/A", "per-round ratios", ratio_fps.text(3), ratio_cpu.text(3)])
    text = common.table(
        f"settings A/B, {ctx.model} model, {ctx.workload_name} workload, backlog of {frames} frames: median "
        f"(min-max) of {rounds} interleaved rounds", ["variant", "settings", "frames/s", "CPU-ms/frame"], rows,
        note="frames/s and the worker process's CPU-ms per frame over the middle 80% of each round's results")
    result = {"benchmark": "settings_ab", "machine": common.machine(), "model": ctx.model,
              "workload_name": ctx.workload_name, "workload": ctx.workload.describe(),
              "torch_threads": ctx.torch_threads, "rounds": rounds, "backlog_frames": frames,
              "backlog_publish": publish, "broker_warm_up": ctx.shared.get("broker_warm_up"), "settings": variants,
              "frames_per_s": {v: {str(r): x for r, x in fps[v].items()} for v in fps},
              "cpu_ms_per_frame": {v: {str(r): x for r, x in cpu[v].items()} for v in cpu},
              "spread": {v: {"frames_per_s": s[0].as_dict(), "cpu_ms_per_frame": s[1].as_dict()}
                         for v, s in spreads.items()},
              "ratio_b_over_a": {"frames_per_s": ratio_fps.as_dict(), "cpu_ms_per_frame": ratio_cpu.as_dict()},
              "table": text}
    common.write_json("settings_ab", result)
    return result


def variants_of(argv: list[str]) -> dict[str, dict[str, str]]:
    """The two variants' settings from the command line; SystemExit (status 2, the reason) on bad ones, so a
    mistake shows before the broker starts."""
    import argparse

    p = argparse.ArgumentParser(add_help=False)
    configure(p)
    args, _ = p.parse_known_args(argv)
    try:
        variants = {"A": parse_assignments(args.a), "B": parse_assignments(args.b)}
    except ValueError as exc:
        p.error(str(exc))
    if variants["A"] == variants["B"]:
        p.error("--a and --b give the same settings: nothing to compare")
    return variants


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Read (and refused when bad) before standalone starts the broker; --help reaches standalone's parser.
    variants = {} if "-h" in argv or "--help" in argv else variants_of(argv)
    return common.standalone(lambda ctx: run(ctx, variants), argv, __doc__.splitlines()[0], configure=configure)


if __name__ == "__main__":
    raise SystemExit(main())
