"""Every benchmark in one run, and bench/results/summary.md: the one home of the project's measured figures.

The Kafka benchmarks share one broker (the test kit's, warmed up): batching gain (with the runtime's own best, the
limit), latency under load, scaling, the workload matrix and the batch-size A/B; the others run as their own
processes: preprocessing cost, the host's CPU per frame (host_cost), the batcher, and a reliability smoke (one
fault, both modes). The GPU's figures come from `./dev gpu-check` (bench/gpu_check.py), which needs no broker. Each
writes its JSON to bench/results/; summary.md is generated from them: date, commit, machine, every figure as median
(min-max) with its rounds, and the headline table the README copies.

    python bench/run_all.py              # everything (bench/README.md gives the time on a 2-core machine)
    python bench/run_all.py --quick      # fewer rounds, shorter runs, noisier: every benchmark end to end
    python bench/run_all.py --only gain  # one section (names below); --skip NAME (repeatable) leaves one out
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import batcher
import batching_gain
import common
import host_cost
import latency_sweep
import preprocess_cost
import scaling
import settings_ab
import workload_matrix
from common import Context

Summary = Callable[[dict[str, Any]], list[tuple[str, str, str]]]
HERE = Path(__file__).resolve().parent


def batch_ab(ctx: Context) -> dict[str, Any]:
    """settings_ab's batch set through Kafka: no batch settings vs fixed sizes, open_nsfw on 224x224 JPEG."""
    args = argparse.Namespace(frames=0, in_step=None, variants="batch")
    cell = dataclasses.replace(ctx, model="opennsfw", workload_name="jpeg224", shared={**ctx.shared, "args": args})
    return settings_ab.run(cell, settings_ab.VARIANT_SETS["batch"])


def reliability_summary(report: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Rows for summary.md from tests/reliability/run.py's JSON: per fault and mode, what the verifier counted."""
    def duplicated(r: dict[str, Any]) -> str:  # at-least-once may answer a frame twice; exactly-once may not
        return f"**{r.get('duplicated')}**" if r["mode"] == "exactly_once" else f"{r.get('duplicated')} (allowed)"

    return [(f"{r['fault']} [{r['mode']}]", f"{r.get('produced', 0)} frames: lost **{r.get('lost')}**, duplicated "
             f"{duplicated(r)}; {r['verdict']}", f"{r['runs']} run(s)") for r in report["rows"]]


# Order matters: the sweep takes the worker's capacity from the gain.
KAFKA: dict[str, tuple[str, Callable[[Context], dict[str, Any]], Summary]] = {
    "gain": ("Batching gain", batching_gain.run, batching_gain.summary),
    "sweep": ("Latency under load", latency_sweep.run, latency_sweep.summary),
    "scaling": ("Scaling (processes)", scaling.run, scaling.summary),
    "matrix": ("Workloads x models (JPEG into a 224x224 model)", workload_matrix.run, workload_matrix.summary),
    "batch": ("Batch sizes, open_nsfw, 224x224 JPEG", batch_ab, settings_ab.summary),
}
# (title, argv for full and quick runs, the JSON it writes, its summary)
PROCESSES: dict[str, tuple[str, tuple[list[str], list[str]], str, Summary]] = {
    "preprocess": ("Preprocessing cost (near-zero model, no Kafka)",
                   (["preprocess_cost.py", "--rounds", "3"], ["preprocess_cost.py", "--rounds", "2", "--seconds", "1",
                                                               "--threads", "1", "--cases",
                                                               "jpeg224_to_224,jpeg720p_to_224,jpeg720p_photo_to_224"]),
                   "preprocess_cost", preprocess_cost.summary),
    "host": ("The host's CPU per frame (device stood in; CPU path), real loop and broker",
             (["host_cost.py", "--rounds", "3"], ["host_cost.py", "--rounds", "2", "--frames", "3000"]), "host_cost",
             host_cost.summary),
    "batcher": ("The micro-batcher alone", (["batcher.py"], ["batcher.py", "--frames", "20000"]), "batcher",
                batcher.summary),
    "reliability": ("Reliability smoke (the suite: tests/reliability/run.py)",
                    (["../tests/reliability/run.py", "--quick", "--faults", "sigkill", "--runs", "1", "--no-config",
                      "--worker-ids", "fixed"],) * 2, "reliability", reliability_summary),
}
SECTIONS = [*KAFKA, *PROCESSES]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="short runs (about half the time, noisier)")
    p.add_argument("--only", choices=SECTIONS, help="run one section")
    p.add_argument("--skip", action="append", default=[], choices=SECTIONS, help="leave one out")
    p.add_argument("--rounds", type=int, default=0,
                   help="interleaved rounds of every Kafka benchmark (default: each one's own, fewer with --quick)")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch intra-op threads per worker process (default 1: the broker needs the other core)")
    args = p.parse_args(argv)
    chosen = [s for s in SECTIONS if (not args.only or s == args.only) and s not in args.skip]
    t0, machine, log_dir = time.monotonic(), common.machine(), Path(tempfile.mkdtemp(prefix="streamfer-bench-logs-"))
    print(f"[bench] {machine['date']} at {machine['commit']} on {machine['host_cpu']} x{machine['cpu_cores']}, "
          f"torch {machine['torch']}, librdkafka {machine['librdkafka']}; logs in {log_dir}", flush=True)
    sections: list[dict[str, Any]] = []
    with common.broker() as broker:
        warm_up = common.warm_up(broker, log_dir)
        ctx = Context(bootstrap=broker.bootstrap, broker=broker, quick=args.quick, torch_threads=args.torch_threads,
                      log_dir=log_dir, rounds=args.rounds, shared={"broker_warm_up": warm_up})
        for name in (n for n in chosen if n in KAFKA):
            title, run, summarize = KAFKA[name]
            sections.append(section(name, title, lambda run=run: run(ctx), summarize))
        env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": broker.bootstrap, "PYTHONUNBUFFERED": "1"}
        for name in (n for n in chosen if n in PROCESSES):
            title, argvs, result, summarize = PROCESSES[name]
            sections.append(section(name, title, lambda a=argvs[args.quick], r=result: subprocess_run(a, r, env),
                                    summarize))
    summary = {"machine": machine, "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
               "broker": broker.description, "broker_warm_up": warm_up, "quick": args.quick,
               "torch_threads": args.torch_threads, "rounds": args.rounds, "elapsed_s": round(time.monotonic() - t0, 1),
               "workload": common.WORKLOADS["mixed"].label(), "sections": sections,
               "failed": [s["name"] for s in sections if s.get("failed")],
               "not_run": [s for s in SECTIONS if s not in chosen]}
    if not args.only:
        common.write_json("summary", summary)
        md = markdown(summary)
        (common.RESULTS_DIR / "summary.md").write_text(md)
        print(f"[bench] wrote bench/results/summary.md\n\n{md}", flush=True)
    print(f"[bench] done in {summary['elapsed_s'] / 60:.1f} min"
          + (f"; FAILED: {', '.join(summary['failed'])}" if summary["failed"] else ""), flush=True)
    return 1 if summary["failed"] else 0


def section(name: str, title: str, run: Callable[[], dict[str, Any]], summarize: Summary) -> dict[str, Any]:
    """One benchmark run and its summary rows; a failure is a row too (one benchmark failing loses no other)."""
    started = time.monotonic()
    try:
        result = run()
        out = {"name": name, "title": title, "rows": summarize(result)}
        if name == "sweep":
            out["markdown_table"] = latency_sweep.markdown_levels(result)
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        out = {"name": name, "title": title, "failed": True,
               "rows": [("FAILED", f"{type(exc).__name__}: {str(exc)[-300:]}", "")]}
    return {**out, "seconds": round(time.monotonic() - started, 1)}


def subprocess_run(argv: list[str], result: str, env: dict[str, str]) -> dict[str, Any]:
    """A benchmark in its own process (its own flags, its own broker use); its JSON result."""
    path = common.RESULTS_DIR / f"{result}.json"
    path.unlink(missing_ok=True)
    print(f"\n[bench] {' '.join(argv)}", flush=True)
    done = subprocess.run([sys.executable, str(HERE / argv[0]), *argv[1:]], env=env, cwd=common.REPO, timeout=3600)
    if not path.is_file():
        raise RuntimeError(f"{argv[0]} exited {done.returncode} without writing {path.name}")
    return dict(json.loads(path.read_text()))


def markdown(summary: dict[str, Any]) -> str:
    m = summary["machine"]
    rounds = f"{summary['rounds']} rounds each" if summary["rounds"] else "each benchmark's own rounds"
    lines = [
        "# streamfer benchmark summary", "",
        "Generated by `./dev bench` (bench/run_all.py); do not edit. Method: bench/README.md; every round: "
        "bench/results/*.json. Figures: median (min-max) of interleaved rounds; ratios: median (min-max) of "
        "per-round ratios.", "",
        f"- Run: {m['date']}, commit {m['commit']}, {'quick run' if summary['quick'] else 'full run'} ({rounds}), "
        f"took {summary['elapsed_s'] / 60:.1f} min",
        f"- Machine: {m['host_cpu']}, {m['cpu_cores']} cores, " + (f"GPU {m['cuda']}" if m["cuda"] else "no GPU")
        + f"; load average {m['load_average_at_start']} at start, {summary['load_average_at_end']} at the end "
        "(other work shares this machine: compare figures within one run)",
        f"- Software: Python {m['python']}, torch {m['torch']}, confluent-kafka {m['confluent_kafka']} / librdkafka "
        f"{m['librdkafka']}; {summary['broker']}; {summary['torch_threads']} torch thread(s) per worker process",
        f"- Workload unless a row says otherwise: {summary['workload']}; the builtin CNN", "",
        "## Headline (the README's table)", "", "| figure | value | rounds |", "|---|---|---|",
        *(f"| {s['title']}: {figure} | {value} | {rounds} |" for s in summary["sections"]
          for figure, value, rounds in s["rows"] if "**" in value),
        "", "## Every figure", "", "| benchmark | figure | value | rounds |", "|---|---|---|---|",
        *(f"| {s['title'] if i == 0 else ''} | {figure} | {value} | {rounds} |" for s in summary["sections"]
          for i, (figure, value, rounds) in enumerate(s["rows"])),
    ]
    lines += [line for s in summary["sections"] if s.get("markdown_table") for line in (
        "", "Latency under load (ms; open loop, intended-send timestamps; latency over OK results):", "",
        s["markdown_table"])]
    lines += ["", f"FAILED: {', '.join(summary['failed'])}"] if summary["failed"] else []
    lines += ["", f"Not run: {', '.join(summary['not_run'])}"] if summary["not_run"] else []
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
