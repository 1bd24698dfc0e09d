"""The workload matrix: for each model (toy, open_nsfw) and each JPEG workload (224x224, 640x360, 1280x720,
1920x1080, each into a 224x224 model input), batching_gain's throughput rounds: (L) the runtime's own best,
(a) one frame per inference, (b) consume(32), (c) the worker, interleaved (L a b c L a b c ...). Prints one
table of medians (min-max) with CPU-ms per frame and the per-round ratios; writes workload_matrix.json and
workload_matrix.md, and one batching_gain_<model>_<workload>.json per cell.

    python bench/workload_matrix.py [--quick] [--rounds N] [--models toy,opennsfw] [--workloads jpeg224,...]
    python bench/workload_matrix.py render   # the table again from the per-cell files (cells of several runs)
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import batching_gain
import common
from batching_gain import _spread_text
from common import Context
from workloads import JPEG_WORKLOADS, MODELS, WORKLOADS


def run(ctx: Context) -> dict[str, Any]:
    args = ctx.shared.get("args")
    models = _names(getattr(args, "models", None), list(MODELS), MODELS)
    workloads = _names(getattr(args, "workloads", None), list(JPEG_WORKLOADS), WORKLOADS)
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
    rows = [row(c) for c in cells]
    text = common.table(
        "workload matrix: saturated frames/s and CPU-ms/frame, median (min-max) of interleaved rounds",
        HEADERS, rows,
        note="(L) the runtime's own best (InferenceExecutor alone, no Kafka, best batch size); (a) one frame per "
             "inference; (b) consume(num_messages=32) per-shape sub-batches; (c) the worker with defaults. "
             "Ratios: median (min-max) of per-round ratios. CPU-ms/frame: the process's CPU time / frames "
             "(all its threads), over the same window as frames/s."
             + "".join(f"\nFAILED round, {c['model']}/{c['workload_name']}: {f}" for c in cells
                       for f in c["failed_rounds"]))
    result = {"benchmark": "workload_matrix", "machine": common.machine(), "quick": ctx.quick,
              "torch_threads": ctx.torch_threads, "models": models, "workloads": workloads,
              "elapsed_s": round(time.monotonic() - t0, 1), "cells": [_cell_summary(c) for c in cells],
              "failed": failed, "tables": [text]}
    common.write_json("workload_matrix", result, ctx.out_dir)
    (ctx.out_dir / "workload_matrix.md").write_text(markdown(result, rows))
    return result


HEADERS = ["model", "workload", "rounds", "(L) fps", "(c) worker fps", "(b) fps", "(a) fps",
           "CPU-ms/frame L / c / b / a", "c/L", "c/b", "c/a"]


def row(cell: dict[str, Any]) -> list[str]:
    fps, cpu, r = cell["throughput_spread"], cell["cpu_ms_per_frame"], cell["ratios"]
    return [cell["model"], cell["workload_name"], str(cell["rounds"]),
            *(_spread_text(fps[w]) for w in ("L", "c", "b", "a")),
            " / ".join(_spread_text(cpu[w]) for w in ("L", "c", "b", "a")),
            _spread_text(r["c/L"], 2), _spread_text(r["c/b"], 2), _spread_text(r["c/a"], 2)]


def _cell_summary(cell: dict[str, Any]) -> dict[str, Any]:
    keys = ("model", "workload_name", "rounds", "backlog_frames", "limit_batch_size", "throughput_spread",
            "cpu_ms_per_frame", "ratios", "failed_rounds")
    return {k: cell[k] for k in keys}


def markdown(result: dict[str, Any], rows: list[list[str]]) -> str:
    m = result["machine"]
    lines = [f"Workload matrix, {m['date']} on {m['host_cpu']} ({m['cpu_cores']} cores"
             + (f", GPU {m['cuda']}" if m["cuda"] else ", no GPU") + f"), torch {m['torch']}, "
             f"{result['torch_threads']} torch thread(s) per process{', quick run' if result['quick'] else ''}. "
             "Median (min-max) of interleaved rounds; method in bench/README.md.", "",
             "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    failed_rounds = [f"{c['model']}/{c['workload_name']} {f}" for c in result["cells"] for f in c["failed_rounds"]]
    if failed_rounds:
        lines += ["", "Failed rounds (left out of the medians): " + "; ".join(failed_rounds)]
    if result["failed"]:
        lines += ["", "FAILED: " + "; ".join(result["failed"])]
    return "\n".join(lines) + "\n"


def summary(result: dict[str, Any]) -> list[tuple[str, str]]:
    """Headline rows for bench/results/summary.md: the worker vs (L) and (b) per cell."""
    return [(f"{c['model']} / {c['workload_name']}",
             f"worker {_spread_text(c['throughput_spread']['c'])} frames/s, "
             f"{_spread_text(c['cpu_ms_per_frame']['c'])} CPU-ms/frame; vs (L) {_spread_text(c['ratios']['c/L'], 2)}, "
             f"vs (b) {_spread_text(c['ratios']['c/b'], 2)}") for c in result["cells"]]


def _names(text: str | None, default: list[str], known: dict[str, Any]) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()] if text else default
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown: {', '.join(unknown)} (known: {', '.join(known)})")
    return names


def render(out_dir: Path = common.RESULTS_DIR) -> dict[str, Any]:
    """Rebuild the matrix table from the per-cell JSON files already in out_dir (no run): for cells measured
    in separate runs (say toy, then open_nsfw). Each cell's own date and machine are in its file."""
    cells = []
    for model in MODELS:
        for workload in WORKLOADS:
            path = out_dir / f"batching_gain_{model}_{workload}.json"
            if path.is_file():
                cells.append(json.loads(path.read_text()))
    rows = [row(c) for c in cells]
    text = common.table("workload matrix (from the per-cell files): median (min-max) of interleaved rounds",
                        HEADERS, rows, note="; ".join(f"{c['model']}/{c['workload_name']}: {c['machine']['date']}"
                                                      for c in cells))
    result = {"benchmark": "workload_matrix", "machine": common.machine(), "quick": any(c.get("rounds", 3) < 3
                                                                                        for c in cells),
              "torch_threads": cells[0]["torch_threads"] if cells else 0, "rendered_from_files": True,
              "cells": [_cell_summary({"failed_rounds": [], **c}) for c in cells], "failed": [], "tables": [text]}
    common.write_json("workload_matrix", result, out_dir)
    (out_dir / "workload_matrix.md").write_text(markdown(result, rows))
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["render"]:
        render()
        return 0

    def configure(p: Any) -> None:
        p.add_argument("--models", help=f"comma-separated, of {', '.join(MODELS)} (default: all)")
        p.add_argument("--workloads", help=f"comma-separated, of {', '.join(WORKLOADS)} (default: the JPEG ones)")

    return common.standalone(run, argv, __doc__.splitlines()[0], configure)


if __name__ == "__main__":
    raise SystemExit(main())
