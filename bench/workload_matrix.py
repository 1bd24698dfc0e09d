"""The workload matrix: for each model (null, toy, open_nsfw) and each JPEG workload (224x224, 640x360, 1280x720,
1920x1080, each into a 224x224 model input), batching_gain's throughput rounds: (L) the runtime's own best, (a) one
frame per inference, (b) consume(32), (c) the worker, interleaved (L a b c L a b c ...). Prints one table of medians
(min-max) with CPU-ms per frame and the per-round ratios; writes workload_matrix.json (and each cell's
batching_gain_<model>_<workload>.json).

    python bench/workload_matrix.py [--quick] [--rounds N] [--models toy,opennsfw] [--workloads jpeg224,...]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import batching_gain
import common
import stats
from common import Context
from stats import Spread
from workloads import JPEG_WORKLOADS, MODELS, WORKLOADS

PIPELINE_COST = ("null", "jpeg224")  # the near-zero model: what is left is the pipeline's own cost
CELL_KEYS = ("model", "workload_name", "rounds", "backlog_frames", "limit_batch_size", "throughput_spread",
             "cpu_ms_per_frame", "ratios", "failed_rounds")


def run(ctx: Context) -> dict[str, Any]:
    args = ctx.shared.get("args")
    models = names(getattr(args, "models", None), list(MODELS), MODELS)
    workloads = names(getattr(args, "workloads", None), list(JPEG_WORKLOADS), WORKLOADS)
    cells: list[dict[str, Any]] = []
    failed: list[str] = []
    t0 = time.monotonic()
    for model in models:
        for workload in workloads:
            cell_ctx = dataclasses.replace(ctx, model=model, workload_name=workload,
                                           shared={**ctx.shared, "throughput_only": True})
            try:
                cells.append(batching_gain.run(cell_ctx))
            except Exception as exc:  # noqa: BLE001 (one cell failing must not lose the others)
                print(f"[matrix] {model}/{workload} FAILED: {type(exc).__name__}: {str(exc)[:500]}", flush=True)
                failed.append(f"{model}/{workload}: {type(exc).__name__}: {str(exc)[:300]}")
    sp = Spread.from_dict
    failed_rounds = [f"{c['model']}/{c['workload_name']} {f}" for c in cells for f in c["failed_rounds"]]
    text = common.table(
        "workload matrix: saturated frames/s and CPU-ms/frame, median (min-max) of interleaved rounds",
        ["model", "workload", "rounds", "(L) fps", "(c) worker fps", "(b) fps", "(a) fps",
         "CPU-ms/frame L / c / b / a", "c/L", "c/b", "c/a"],
        [[c["model"], c["workload_name"], c["rounds"], *(sp(c["throughput_spread"][w]).text() for w in "Lcba"),
          " / ".join(sp(c["cpu_ms_per_frame"][w]).text() for w in "Lcba"),
          *(sp(c["ratios"][k]).text(2) for k in ("c/L", "c/b", "c/a"))] for c in cells],
        note="(L) the runtime's own best (InferenceExecutor alone, no Kafka, best batch size); (a) one frame per "
             "inference; (b) consume(num_messages=32) per-shape sub-batches; (c) the worker with defaults. Ratios: "
             "median (min-max) of per-round ratios. CPU-ms/frame: the process's CPU time / frames (all its threads), "
             "over the same window as frames/s." + "".join(f"\nFAILED round, {f}" for f in failed_rounds))
    result = {"benchmark": "workload_matrix", "quick": ctx.quick, "torch_threads": ctx.torch_threads,
              "models": models, "workloads": workloads, "elapsed_s": round(time.monotonic() - t0, 1),
              "failed": failed, "tables": [text], "cells": [{k: c[k] for k in CELL_KEYS} for c in cells]}
    common.write_json("workload_matrix", result)
    return result


def summary(result: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Rows for bench/results/summary.md: the worker vs (L) and (b) per cell; the near-zero model's cell, the
    pipeline's own cost, in bold (the headline)."""
    def cell(c: dict[str, Any]) -> str:
        sp, bold = Spread.from_dict, "**" if (c["model"], c["workload_name"]) == PIPELINE_COST else ""
        return (f"worker {sp(c['throughput_spread']['c']).text()} frames/s, "
                f"{bold}{sp(c['cpu_ms_per_frame']['c']).text()}{bold} CPU-ms/frame; vs (L) "
                f"{bold}{sp(c['ratios']['c/L']).text(2)}{bold}, vs (b) {sp(c['ratios']['c/b']).text(2)}")

    return [(f"{c['model']} / {c['workload_name']}", cell(c), stats.rounds(c["rounds"])) for c in result["cells"]]


def names(text: str | None, default: list[str], known: dict[str, Any]) -> list[str]:
    chosen = [n.strip() for n in text.split(",") if n.strip()] if text else default
    if unknown := [n for n in chosen if n not in known]:
        raise SystemExit(f"unknown: {', '.join(unknown)} (known: {', '.join(known)})")
    return chosen


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", help=f"comma-separated, of {', '.join(MODELS)} (default: all)")
    p.add_argument("--workloads", help=f"comma-separated, of {', '.join(WORKLOADS)} (default: the JPEG ones)")


if __name__ == "__main__":
    raise SystemExit(common.standalone(run, None, __doc__.splitlines()[0], configure))
