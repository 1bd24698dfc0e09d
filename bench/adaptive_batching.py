"""Batch sizes from the learned cost model against fixed sizes, on a backlog: the worker's batcher and
executor in-process (no Kafka), a heavy model (torchvision ResNet-50, random weights: the open_nsfw model
is not in this repository; its cost profile is ResNet-50's), frames of one size waiting (throughput mode).

Configurations: "auto" (no batch settings given: adaptive_batch_size with max_batch_size 32, the cost model
seeded by the executor's warm-up calibration, as the worker does) and fixed max_batch_size 4/8/16/32 with
adaptive sizing off. Rounds interleave the configurations in a shuffled order; per configuration the median
(min-max) of frames/s and of process CPU-ms per frame are reported. standard/bulk's blocking bound
(max_blocking_ms) is lifted here: this measures throughput sizing alone.

    python bench/adaptive_batching.py [--quick] [--model resnet50|resnet18|builtin] [--size 224] [--rounds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from worker.batching import MicroBatcher
from worker.config import BatchingSettings, ModelSettings
from worker.costmodel import CostModel
from worker.frames import Encoding, Frame, Priority, SourceRef
from worker.runtime import InferenceExecutor, build_builtin_model
from worker.runtime.models import ModelContract
from worker.runtime.runners import EagerRunner

OUT = Path(__file__).resolve().parent / "results"


def build_model(name: str) -> torch.nn.Module:
    if name == "builtin":
        return build_builtin_model(5)
    import torchvision

    torch.manual_seed(0)
    return getattr(torchvision.models, name)(weights=None, num_classes=5).eval()


def frames(n: int, size: int) -> list[Frame]:
    now = time.time()
    data = bytes(random.Random(0).randrange(256) for _ in range(size * size * 3))
    return [Frame(stream_id="bench", frame_index=i, tenant="t", priority=Priority.BULK, capture_ts_ms=int(now * 1000),
                  width=size, height=size, channels=3, encoding=Encoding.RAW_RGB8, data=data,
                  source=SourceRef("bench", 0, i), received_at=now) for i in range(n)]


def run_backlog(ex: InferenceExecutor, settings: BatchingSettings, cost: CostModel | None, batch: list[Frame]
                ) -> dict[str, Any]:
    """Drain a backlog through the batcher and executor, 2 batches in flight like the worker."""
    batcher = MicroBatcher(settings, time.time, (), cost)
    for f in batch:
        batcher.add(f)
    inflight: deque = deque()
    sizes: list[int] = []
    w0, c0 = time.perf_counter(), time.process_time()
    while batcher.pending_frames or inflight:
        while len(inflight) < 2 and (b := batcher.pop_batch()) is not None:
            inflight.append((b, ex.submit(b.frames, b.shape, b.priority)))
            sizes.append(b.size)
        if inflight:
            b, fut = inflight.popleft()
            out = fut.result()
            if cost is not None:
                cost.observe(b.shape, out.batch_size, (out.preprocess_ms + out.inference_ms) / 1000.0)
        else:
            due = batcher.next_due()
            time.sleep(max(0.0, (due or time.time()) - time.time()))
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    return {"fps": len(batch) / wall, "cpu_ms_per_frame": cpu * 1000.0 / len(batch),
            "sizes": sorted(set(sizes))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--frames", type=int, default=0, help="backlog per run (default 192, quick 96)")
    p.add_argument("--torch-threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    n = args.frames or (96 if args.quick else 192)
    contract = ModelContract.from_settings(ModelSettings())
    ex = InferenceExecutor([EagerRunner(build_model(args.model), contract, torch.device("cpu"))], contract)
    shape = (args.size, args.size, 3)
    print(f"[adaptive] {args.model} at {args.size}x{args.size}, {n} frames per run, {args.rounds} rounds, "
          f"torch threads {args.torch_threads}", flush=True)
    t0 = time.perf_counter()
    seeded = ex.calibrate([shape], 32)
    print(f"[adaptive] calibration {time.perf_counter() - t0:.1f}s: "
          + ", ".join(f"{k}: {s * 1000:.0f} ms ({k / s:.1f}/s)" for _, k, s in seeded), flush=True)
    base = dataclasses.replace(BatchingSettings(), rare_shape_min_count=1, max_blocking_ms=1e9,
                               max_pending_frames=100_000, max_pending_bytes=1 << 40, max_batch_bytes=1 << 40)
    configs: dict[str, tuple[BatchingSettings, bool]] = {"auto (no batch settings)": (base, True)}
    for size in (4, 8, 16, 32):
        configs[f"fixed {size}"] = (dataclasses.replace(base, max_batch_size=size, adaptive_batch_size=False), False)
    batch = frames(n, args.size)
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in configs}
    rng = random.Random(1)
    for r in range(args.rounds):
        order = list(configs)
        rng.shuffle(order)
        for name in order:
            settings, adaptive = configs[name]
            cost = None
            if adaptive:
                cost = CostModel()
                for s, k, secs in seeded:
                    cost.observe(s, k, secs)
            res = run_backlog(ex, settings, cost, batch)
            runs[name].append(res)
            print(f"[adaptive] round {r + 1} {name:<26} {res['fps']:6.2f} frames/s  "
                  f"{res['cpu_ms_per_frame']:7.1f} CPU-ms/frame  sizes {res['sizes']}", flush=True)
    ex.close()
    rows = []
    ref = statistics.median(x["fps"] for x in runs["fixed 32"])
    for name, rs in runs.items():
        fps = [x["fps"] for x in rs]
        cpu = [x["cpu_ms_per_frame"] for x in rs]
        rows.append({"config": name, "fps_median": statistics.median(fps), "fps_min": min(fps), "fps_max": max(fps),
                     "cpu_ms_median": statistics.median(cpu), "cpu_ms_min": min(cpu), "cpu_ms_max": max(cpu),
                     "vs_fixed_32": statistics.median(fps) / ref,
                     "sizes": sorted({s for x in rs for s in x["sizes"]})})
    print("\nconfig                     | frames/s median (min-max) | CPU-ms/frame median (min-max) | x fixed 32 "
          "| sizes")
    for row in rows:
        print(f"{row['config']:<26} | {row['fps_median']:6.2f} ({row['fps_min']:.2f}-{row['fps_max']:.2f})"
              f"       | {row['cpu_ms_median']:7.1f} ({row['cpu_ms_min']:.1f}-{row['cpu_ms_max']:.1f})"
              f"          | {row['vs_fixed_32']:.2f}       | {row['sizes']}")
    OUT.mkdir(exist_ok=True)
    (OUT / "adaptive_batching.json").write_text(json.dumps(
        {"benchmark": "adaptive_batching", "model": args.model, "size": args.size, "frames_per_run": n,
         "rounds": args.rounds, "torch_threads": args.torch_threads, "calibration": seeded, "rows": rows,
         "runs": runs}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
