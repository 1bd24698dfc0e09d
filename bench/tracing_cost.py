"""What tracing costs the worker (issue 60): CPU-ms per frame on a backlog, [tracing] off against on at a 1% and a
100% sampling ratio, and against the tree without tracing (`--base`).

A backlog of 224x224 JPEG frames (the jpeg224 workload, no traceparent headers: the worker's own sampler decides)
through the worker's real loop over the kit's in-memory fakes (no broker: its CPU and noise are not the worker's),
on the CPU data path with the near-zero model (`null`): the host's own work per frame, which is what tracing adds
to. Spans are exported over OTLP/HTTP to a sink in the parent process that reads each request and answers 200, so
the protobuf encoding and the HTTP requests are paid as with a real collector. A round runs every variant in a
fresh process, interleaved (the order rotates); CPU is the process's (every thread: the loop, preprocessing, the
export thread) from the loop's start to the last span exported.

    python bench/tracing_cost.py                       # off, 1%, 100%: 5 rounds of 4000 frames
    python bench/tracing_cost.py --base /tmp/base      # and the tree without tracing, as 'base'
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# variant -> sample_ratio (None: [tracing] off)
VARIANTS: dict[str, float | None] = {"off": None, "1%": 0.01, "100%": 1.0}


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One round of one variant, in a fresh process on the round's tree."""
    sys.path.insert(0, spec["tree"])
    import worker  # noqa: F401 (the round's tree, whatever is inserted later)

    sys.path.insert(1, str(HERE))
    import common
    import gpu_e2e
    import host_cost
    from workloads import WORKLOADS, model_settings

    from worker.config import load_settings

    ratio = spec["ratio"]
    overrides: dict[str, Any] = {
        "model": {**model_settings("null", WORKLOADS["jpeg224"]), "source": "nullmodel:null_model"},
        "runtime": {"device": "cpu", "warmup_shapes": ["224x224"], "decode": "cpu"},
        "observability": {"worker_id": "tracing-cost"}}
    if ratio is not None:
        overrides["tracing"] = {"endpoint": spec["sink"], "sample_ratio": ratio}
    settings = load_settings(env={**common.NO_EXPIRY, "WORKER_RUNTIME_TORCH_THREADS": "1"}, overrides=overrides)
    tracing = metrics = None
    if spec["tree_has_tracing"]:
        from worker.metrics import Metrics
        from worker.tracing import setup_tracing

        metrics = Metrics(settings=settings)
        tracing = setup_tracing(settings, metrics)
    executor, costs = gpu_e2e.start_executor(settings, freeze_heap=True)
    try:
        records = common.workload_records(spec["frames"], common.new_id("tc"), WORKLOADS["jpeg224"])
        messages = host_cost.fake_backlog(settings, records, gpu_e2e)
        before = resource.getrusage(resource.RUSAGE_SELF)
        run = gpu_e2e.run_loop(settings, executor, messages, costs, deadline_s=600.0, tracing=tracing)
        if tracing is not None:
            tracing.shutdown(30.0)  # the spans still queued are exported: their cost counts
        after = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        executor.close()
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    answered = len(run.results)
    dropped = 0.0
    if metrics is not None:
        dropped = sum(s.value for m in metrics.registry.collect() for s in m.samples
                      if s.name == "streamfer_trace_spans_dropped_total")
    faults = gpu_e2e.ledger_faults(gpu_e2e.ledger(run, settings))
    per_frame = 1000.0 / max(1, answered)
    return {"answered": answered, "wall_s": run.wall_s, "cpu_s": cpu_s, "cpu_ms_per_frame": cpu_s * per_frame,
            # The loop thread (where the spans are made) and the export thread (encoding, HTTP), from the loop's
            # start to its end: less noisy than the whole process, where preprocessing dominates.
            "loop_ms_per_frame": run.thread_cpu_s.get("loop", 0.0) * per_frame,
            "export_ms_per_frame": run.thread_cpu_s.get("trace-export", 0.0) * per_frame,
            "threads_cpu_s": run.thread_cpu_s, "mean_batch": run.summary.mean_batch_size,
            "spans_dropped": dropped, "faults": faults}


class Sink:
    """An OTLP/HTTP collector that keeps nothing: reads each request's body and answers 200 (an empty
    ExportTraceServiceResponse); counts requests and bytes."""

    def __init__(self) -> None:
        from worker.testing.otlp import OtlpReceiver

        self.requests = 0
        self.bytes = 0
        self._receiver = OtlpReceiver(self._take)
        self.endpoint = self._receiver.endpoint

    def _take(self, body: bytes) -> None:
        self.requests += 1
        self.bytes += len(body)

    def stop(self) -> None:
        self._receiver.stop()


def run_child(spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
                          capture_output=True, text=True, timeout=timeout_s, cwd=spec["tree"],
                          env={**os.environ, "PYTHONPATH": spec["tree"]})
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-1500:]}"}
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--frames", type=int, default=4000, help="the backlog, per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--base", type=Path, help="a tree without tracing (holding worker/ and schemas/): 'base/off'")
    parser.add_argument("--out", default="tracing_cost", help="the JSON's name under bench/results/")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child)), default=str))
        return {}

    sys.path.insert(0, str(HERE))
    import common
    import stats

    sink = Sink()
    keys = [*(f"this/{v}" for v in VARIANTS), *(["base/off"] if args.base else [])]
    trees = {"this": str(common.REPO), **({"base": str(args.base.resolve())} if args.base else {})}
    runs: dict[str, dict[int, dict[str, Any]]] = {k: {} for k in keys}
    try:
        for rnd, key in stats.rotating(keys, args.rounds):
            tree, variant = key.split("/")
            requests0 = sink.requests
            spec = {"tree": trees[tree], "tree_has_tracing": tree == "this", "ratio": VARIANTS[variant],
                    "frames": args.frames, "sink": sink.endpoint}
            result = run_child(spec, timeout_s=900)
            result["export_requests"] = sink.requests - requests0
            runs[key][rnd] = result
            print(f"[tracing_cost] round {rnd} {key}: " + (result["error"] if "error" in result else
                  f"{result['cpu_ms_per_frame']:.3f} CPU-ms/frame, {result['answered']} answered, "
                  f"{result['export_requests']} exports, {result['spans_dropped']:.0f} spans dropped, "
                  f"faults {result['faults'] or 'none'}"), flush=True)
    finally:
        sink.stop()

    def spread(key: str, pick: Any) -> stats.Spread:
        return stats.Spread.of([pick(r) for r in runs[key].values() if "error" not in r])

    reference = "this/off"

    def ratio_to_off(key: str, figure: str = "cpu_ms_per_frame") -> stats.Spread:
        """Per round: this variant's figure over the same round's tracing-off run's."""
        return stats.Spread.of([r[figure] / runs[reference][rnd][figure]
                                for rnd, r in runs[key].items()
                                if "error" not in r and "error" not in runs[reference].get(rnd, {"error": 1})])

    rows = [[key, spread(key, lambda r: r["cpu_ms_per_frame"]).text(3), ratio_to_off(key).text(3),
             spread(key, lambda r: r["loop_ms_per_frame"]).text(3), ratio_to_off(key, "loop_ms_per_frame").text(3),
             spread(key, lambda r: r["export_ms_per_frame"]).text(4),
             spread(key, lambda r: r["export_requests"]).text(0), spread(key, lambda r: r["spans_dropped"]).text(0),
             spread(key, lambda r: r["mean_batch"]).text(1)] for key in keys]
    text = common.table(
        f"Worker CPU per frame with tracing, 224x224 JPEG backlog of {args.frames}, null model, in-memory Kafka "
        f"(median (min-max) over {args.rounds} interleaved rounds)",
        ["tree/tracing", "CPU-ms/frame", "x off", "loop ms/frame", "loop x off", "export ms/frame",
         "OTLP requests", "spans dropped", "mean batch"], rows,
        note="CPU-ms/frame: the worker process's, every thread, from the loop's start to the last span exported; "
             "loop: the loop thread alone (where spans are made); export: the export thread (encoding, HTTP); "
             "x off: over the same round's tracing-off run. OTLP to a local sink that answers 200. base/off: the "
             "tree without tracing.")
    summary_keys = ("cpu_ms_per_frame", "loop_ms_per_frame", "export_ms_per_frame")
    summary = {key: {**{k: vars(spread(key, lambda r, k=k: r[k])) for k in summary_keys},
                     "ratio_to_off": vars(ratio_to_off(key)),
                     "loop_ratio_to_off": vars(ratio_to_off(key, "loop_ms_per_frame"))} for key in keys}
    common.write_json(args.out, {"frames": args.frames, "rounds": args.rounds, "summary": summary, "runs": runs,
                                 "table": text})
    return summary


if __name__ == "__main__":
    main()
