"""All the Kafka benchmarks on one broker, in one run: the limit, batching gain, latency under load, scaling,
and (where CUDA is available) the first three again with CUDA graphs on and off. Prints every table and
writes bench/results/<name>.json, bench/results/latency_sweep.png, summary.json and summary.md.

    python bench/run_all.py              # everything (bench/README.md gives the time on a 2-core machine)
    python bench/run_all.py --quick      # fewer rounds, shorter runs, noisier
    python bench/run_all.py --only gain  # limit | gain | sweep | scaling | matrix | gpu
    python bench/run_all.py --skip matrix --rounds 5

The broker is KAFKA_BOOTSTRAP_SERVERS when set, else a local single-node Kafka started for the run.
Figures are compared only within a run (ratios); on a shared machine absolute numbers drift between runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import batching_gain
import common
import latency_sweep
import model_limit
import scaling
import workload_matrix
from common import Context

# The seed's claims, printed beside ours for comparison; this bench did not measure them.
SEED_FIGURES = {
    "single 512x512 image": "23 ms",
    "batch of 16 (512x512)": "58 ms",
    "p99 end-to-end at 800 frames/s": "< 200 ms",
    "CUDA graphs vs eager": "17% lower latency",
}

BENCHES: dict[str, tuple[str, Callable[[Context], dict[str, Any]], Callable[[dict[str, Any]], list]]] = {
    # Order matters: the sweep takes the worker's capacity and the budget's model time from the limit.
    "limit": ("The limit: model vs worker", model_limit.run, model_limit.summary),
    "gain": ("Batching gain", batching_gain.run, batching_gain.summary),
    "sweep": ("Latency under load", latency_sweep.run, latency_sweep.summary),
    "scaling": ("Scaling (processes)", scaling.run, scaling.summary),
    "matrix": ("Workloads x models (JPEG 224x224-1080p into a 224x224 model)", workload_matrix.run,
               workload_matrix.summary),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="short runs (about half the time, noisier)")
    p.add_argument("--only", choices=[*BENCHES, "gpu"], help="run one benchmark")
    p.add_argument("--skip", action="append", default=[], choices=[*BENCHES, "gpu"], help="leave one out")
    p.add_argument("--rounds", type=int, default=0,
                   help="interleaved rounds of every benchmark (default: each one's own, fewer with --quick)")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch intra-op threads per worker process (default 1: the broker needs the other core)")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    machine = common.machine()
    log_dir = Path(tempfile.mkdtemp(prefix="streamfer-bench-logs-"))
    print(f"[bench] {machine['date']} on {machine['host_cpu']} x{machine['cpu_cores']}, torch {machine['torch']}, "
          f"librdkafka {machine['librdkafka']}; logs in {log_dir}", flush=True)
    sections: list[dict[str, Any]] = []
    failed: list[str] = []
    with common.Broker() as broker:
        warm_up = broker.warm_up(log_dir)
        ctx = Context(bootstrap=broker.bootstrap, broker=broker, quick=args.quick, torch_threads=args.torch_threads,
                      log_dir=log_dir, rounds=args.rounds)
        for name, (title, run, summarize) in BENCHES.items():
            if (args.only and args.only != name) or name in args.skip:
                continue
            sections.append(_section(name, title, lambda run=run: run(ctx), summarize, failed))
        if args.only in (None, "gpu") and "gpu" not in args.skip:
            sections.append(gpu_section(broker, args, log_dir, failed))
        broker_text = broker.description
    elapsed = time.monotonic() - t0
    summary = {"machine": machine, "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
               "broker": broker_text, "broker_warm_up": warm_up, "quick": args.quick,
               "torch_threads": args.torch_threads,
               "workload": common.describe_workload(), "elapsed_s": round(elapsed, 1), "sections": sections,
               "seed_figures": SEED_FIGURES, "failed": failed,
               "skipped": args.skip, "rounds": args.rounds}
    if not args.only:
        common.write_json("summary", summary)
        md = markdown(summary)
        (common.RESULTS_DIR / "summary.md").write_text(md)
        print(f"[bench] wrote bench/results/summary.md\n\n{md}", flush=True)
    print(f"[bench] done in {elapsed / 60:.1f} min" + (f"; FAILED: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


def _section(name: str, title: str, run: Callable[[], dict[str, Any]],
             summarize: Callable[[dict[str, Any]], list], failed: list[str]) -> dict[str, Any]:
    started = time.monotonic()
    try:
        result = run()
        rows = summarize(result)
        section = {"name": name, "title": title, "rows": rows, "seconds": round(time.monotonic() - started, 1)}
        if name == "sweep":
            section["markdown_table"] = latency_sweep.markdown_levels(result)
        return section
    except Exception as exc:  # noqa: BLE001 (one benchmark failing must not lose the others)
        traceback.print_exc()
        failed.append(name)
        return {"name": name, "title": title, "rows": [("FAILED", f"{type(exc).__name__}: {str(exc)[:300]}")],
                "seconds": round(time.monotonic() - started, 1)}


def gpu_section(broker: common.Broker, args: argparse.Namespace, log_dir: Path, failed: list[str]) -> dict[str, Any]:
    """With CUDA: limit, batching gain and sweep with CUDA graphs on and off, and the seed's kind of figure."""
    seed = [(f"seed: {k}", f"{v} (the seed's figure, not measured here)") for k, v in SEED_FIGURES.items()]
    if not common.cuda_available():
        print("\n== GPU ==\nskipped: torch sees no CUDA device on this machine (CUDA graphs on/off not measured)",
              flush=True)
        return {"name": "gpu", "title": "GPU: CUDA graphs on / off",
                "rows": [("CUDA graphs on/off", "skipped: no CUDA device on this machine")] + seed}
    rows: list[tuple[str, str]] = []
    per_mode: dict[str, dict[str, Any]] = {}
    for graphs in (True, False):
        mode = "on" if graphs else "off"
        ctx = Context(bootstrap=broker.bootstrap, broker=broker, quick=args.quick, torch_threads=args.torch_threads,
                      log_dir=log_dir, out_dir=common.RESULTS_DIR / f"cuda_graphs_{mode}", rounds=args.rounds,
                      shared={"worker_env": {"WORKER_RUNTIME_CUDA_GRAPHS": str(graphs).lower()},
                              "runtime_overrides": {"cuda_graphs": graphs}})
        results: dict[str, Any] = {}
        for name in ("limit", "gain", "sweep"):
            title, run, summarize = BENCHES[name]
            section = _section(f"{name} (graphs {mode})", title,
                               lambda run=run, name=name, results=results, ctx=ctx: results.setdefault(name, run(ctx)),
                               summarize, failed)
            rows += [(f"graphs {mode}: {k}", v) for k, v in section["rows"]]
        try:
            results["seed"] = model_limit.seed_comparison(ctx)
            rows.append((f"graphs {mode}: executor, one 512x512 frame / batch of 16",
                         f"{results['seed']['single_512_ms']:.1f} ms / {results['seed']['batch16_512_ms']:.1f} ms"))
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            failed.append(f"gpu seed comparison ({mode})")
            rows.append((f"graphs {mode}: seed comparison", f"FAILED: {exc}"))
        per_mode[mode] = results
    try:
        on, off = per_mode["on"], per_mode["off"]
        rows.append(("graphs on vs off: single 512x512 latency",
                     f"{1 - on['seed']['single_512_ms'] / off['seed']['single_512_ms']:.0%} lower with graphs"))
        fps_on, fps_off = (m["limit"]["worker_fps"]["median"] for m in (on, off))
        rows.append(("graphs on vs off: worker saturated frames/s", f"{fps_on / fps_off:.2f}x"))
    except (KeyError, ZeroDivisionError, TypeError):
        pass
    common.table("GPU: CUDA graphs on / off (same run)", ["figure", "value"], rows + seed)
    return {"name": "gpu", "title": "GPU: CUDA graphs on / off", "rows": rows + seed}


def markdown(summary: dict[str, Any]) -> str:
    m = summary["machine"]
    lines = [
        "# streamfer benchmark summary",
        "",
        f"Run {m['date']} on {m['host_cpu']} ({m['cpu_cores']} cores"
        + (f", GPU {m['cuda']}" if m["cuda"] else ", no GPU") + f"), Python {m['python']}, torch {m['torch']}, "
        f"confluent-kafka {m['confluent_kafka']} / librdkafka {m['librdkafka']}; {summary['broker']} on the same "
        f"machine. Load average {m['load_average_at_start']} at start, {summary['load_average_at_end']} at the end "
        f"(other work shares this machine; compare figures within one run). "
        f"{'Quick run. ' if summary['quick'] else ''}{summary['torch_threads']} torch thread(s) per process. "
        f"Took {summary['elapsed_s'] / 60:.1f} min.",
        "",
        "Workload: " + "; ".join(f"{cls} {v['share']:.0%} {v['encoding']} {'/'.join(v['shapes_wxh'])}"
                                 for cls, v in summary["workload"].items())
        + ". Model: the builtin CNN (the matrix: also open_nsfw). Every figure is the median (min-max) of "
        "interleaved rounds, every ratio the median of per-round ratios. Details and method: bench/README.md; "
        "raw figures: bench/results/*.json.",
        "",
        "| benchmark | figure | value |",
        "|---|---|---|",
    ]
    for section in summary["sections"]:
        for i, (figure, value) in enumerate(section["rows"]):
            lines.append(f"| {section['title'] if i == 0 else ''} | {figure} | {value} |")
    for section in summary["sections"]:
        if section.get("markdown_table"):
            lines += ["", "Latency under load (ms; open loop, intended-send timestamps; latency over OK results):", "",
                      section["markdown_table"]]
    if summary["failed"]:
        lines += ["", f"FAILED: {', '.join(summary['failed'])}"]
    if summary.get("skipped"):
        lines += ["", f"Not run (--skip): {', '.join(summary['skipped'])}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
