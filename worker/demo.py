"""`worker demo`: the whole job on an embedded default, for a first look.

Starts the local broker, creates the topics, publishes sample frames of several shapes to the three
priority topics, runs the worker until it is idle, then reads the results back and prints a summary.
"""

from __future__ import annotations

import json
import os
import threading
import time

from worker.config import load_settings
from worker.frames import Encoding, Priority
from worker.local_kafka import LocalKafka
from worker.producer import publish, random_run_id, synthetic_frames
from worker.results import read_results
from worker.topics import ensure_topics, worker_topics

DEMO_SHAPES = {Priority.REALTIME: [(64, 64), (96, 64)], Priority.STANDARD: [(128, 96), (64, 64), (80, 80)],
               Priority.BULK: [(160, 120), (128, 96)]}


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run_demo(frames_per_topic: int = 120, keep_broker: bool = False, rate_fps: float = 200.0) -> int:
    from worker.app import StopFlag, run_worker, setup_logging
    from worker.metrics import Health

    broker = LocalKafka()
    already_running = broker.running() is not None
    print("starting the local Apache Kafka broker (first run resolves its jars with Maven)...", flush=True)
    bootstrap = broker.start().bootstrap_servers
    try:
        settings = load_settings(env={k: v for k, v in os.environ.items() if k.startswith("WORKER_")},
                                 overrides={"kafka": {"bootstrap_servers": bootstrap, "group_id": "streamfer-demo"},
                                            "observability": {"metrics_port": 0, "log_level": "WARNING"}})
        setup_logging(settings)
        ensure_topics(bootstrap, worker_topics(settings.topics))
        run_id = random_run_id()
        # The worker starts first, as in production: frames then flow through a warm, assigned worker.
        health = Health()
        stop = StopFlag()
        outcome: dict[str, object] = {}

        def work() -> None:
            try:
                outcome["summary"] = run_worker(settings, exit_when_idle_s=3.0, stop=stop, health=health)
            except BaseException as exc:  # noqa: BLE001 (re-raised on the main thread)
                outcome["error"] = exc

        thread = threading.Thread(target=work, name="demo-worker")
        started = time.monotonic()
        thread.start()
        deadline = time.monotonic() + 120
        while not health.ready and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not health.ready:
            stop.set()
            thread.join()
            raise RuntimeError(f"the worker did not become ready: {outcome.get('error')}")
        produced = 0
        for priority, topic in ((Priority.REALTIME, settings.topics.realtime),
                                (Priority.STANDARD, settings.topics.standard), (Priority.BULK, settings.topics.bulk)):
            encoding = Encoding.JPEG if priority is Priority.STANDARD else Encoding.RAW_RGB8
            frames = synthetic_frames(frames_per_topic, DEMO_SHAPES[priority], encoding, priority, run_id)
            produced += publish(bootstrap, topic, frames, rate_fps=rate_fps).sent
        print(f"published {produced} frames (run {run_id}) to the three priority topics at {rate_fps:.0f} "
              "frames/s each; waiting for the worker to go idle...", flush=True)
        thread.join()
        if "error" in outcome:
            raise outcome["error"]  # type: ignore[misc]
        summary = outcome["summary"]
        elapsed = time.monotonic() - started
        results = [r for r in read_results(bootstrap, settings.topics.results, idle_timeout_s=1.0)
                   if r["stream_id"].startswith(run_id)]
        ids = {(r["stream_id"], r["frame_index"]) for r in results}
        latencies = [r["end_to_end_ms"] for r in results]
        by_topic: dict[str, int] = {}
        for r in results:
            by_topic[r["source_topic"]] = by_topic.get(r["source_topic"], 0) + 1
        print("\nsample results:")
        for r in results[:3]:
            print("  " + json.dumps({k: r[k] for k in ("stream_id", "frame_index", "status", "flagged",
                                                         "batch_size", "end_to_end_ms", "scores")}))
        print("\nsummary")
        print(f"  frames produced        {produced}")
        print(f"  results (distinct)     {len(ids)}  ({len(results)} messages)")
        print(f"  per input topic        {json.dumps(by_topic)}")
        print(f"  flagged                {sum(1 for r in results if r['flagged'])}")
        print(f"  batches run            {summary.batches} (mean size {summary.mean_batch_size:.1f})")
        print(f"  worker wall time       {elapsed:.2f} s (incl. model warm-up and the 3 s idle wait)")
        print(f"  end-to-end latency ms  p50 {_pct(latencies, 0.5):.1f}  p99 {_pct(latencies, 0.99):.1f}"
              "  (capture to result produced)")
        ok = len(ids) == produced
        print("\nevery frame has a result" if ok else f"\nMISSING results for {produced - len(ids)} frames")
        return 0 if ok else 1
    finally:
        if not keep_broker and not already_running:
            broker.stop()
