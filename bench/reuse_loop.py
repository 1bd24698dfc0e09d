"""The loop thread's CPU per frame with verdict reuse on (issue 68), this tree against another (`--base`).

The worker's loop (`build_pipeline` over the in-memory Kafka kit, no broker) with the standard class's reuse on
(`reuse_max_age_ms` 1000), on a static-camera workload: 4 streams of noisy 720p JPEG photos (quality 90, sensor
noise sigma 3), all published before the loop starts, drained to the last answer. The model is the near-zero one
(bench/nullmodel.py, 224x224 stretch), so what is timed is the loop and the thumbnails, not a model. Each round is
a fresh process per tree, interleaved; the loop runs in a thread of its own, and its CPU (time.thread_time, read in
that thread when the last answer is in) and the thumbnail threads' (/proc, `thumbnail-N`, where the tree has them)
are divided by the frames. Reuse decisions are compared too: the frames reused must be the same in both trees.

    python bench/reuse_loop.py --base /tmp/base68 --rounds 5 [--frames 200]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import stats  # pure; the child imports nothing else of bench/

STREAMS = 4
SIZE = (1280, 720)


def _thread_cpu(prefix: str) -> float:
    """CPU seconds of this process's live threads whose OS name starts with `prefix`."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path("/proc/self/task").glob("*"):
        try:
            if not (task / "comm").read_text().startswith(prefix):
                continue
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def one_round(jpegs: list[list[bytes]]) -> dict[str, Any]:
    """In the child, against whichever `worker` is first on sys.path."""
    from worker.codec.schemas import FrameRecord, encode_frame
    from worker.config import load_settings
    from worker.frames import Encoding, Priority
    from worker.loop.pipeline import build_pipeline
    from worker.metrics import Health, Metrics
    from worker.runtime.start import build_executor
    from worker.testing import InMemoryKafka

    s = load_settings(env={"WORKER_BATCHING_STANDARD_REUSE_MAX_AGE_MS": "1000",
                           "WORKER_BATCHING_STANDARD_MAX_AGE_MS": "0"},
                      overrides={"model": {"source": "nullmodel:null_model", "input_size": [224, 224]},
                                 "runtime": {"device": "cpu", "warmup_batches": 1},
                                 "observability": {"worker_id": "bench", "metrics_enabled": False}})
    kafka = InMemoryKafka()
    captured_ms = int(time.time() * 1000) - 60_000
    total = 0
    for s_i, stream in enumerate(jpegs):
        kafka.send((s.topics.standard, 0), *(encode_frame(FrameRecord(
            stream_id=f"cam{s_i}", frame_index=i, capture_ts_ms=captured_ms + 40 * i, tenant="t",
            priority=Priority.STANDARD, width=SIZE[0], height=SIZE[1], channels=3, encoding=Encoding.JPEG,
            data=data)) for i, data in enumerate(stream)))
        total += len(stream)
    with build_executor(s.model, s.runtime) as executor:
        executor.warm_up([(224, 224, 3)])
        pipeline = build_pipeline(s, executor, Metrics(), Health(), clients=kafka.clients)
        box: dict[str, float] = {}

        def stop() -> bool:
            if pipeline.delivery.results + pipeline.delivery.dead_lettered < total:
                return False
            if "loop" not in box:
                box["loop"], box["t1"] = time.thread_time(), time.perf_counter()
                box["thumb"] = _thread_cpu("thumbnail")
            return True

        def loop() -> None:
            box["loop0"], box["t0"] = time.thread_time(), time.perf_counter()
            pipeline.run(stop)

        thread = threading.Thread(target=loop, name="loop")
        thread.start()
        thread.join()
    results = kafka.results()
    assert len(results) == total, (len(results), total)
    reused = sorted((r["stream_id"], r["frame_index"]) for r in results if r["reused_from_frame"] is not None)
    digest = hashlib.sha256(json.dumps(reused).encode()).hexdigest()[:16]  # the same frames reused in both trees
    return {"frames": total, "reused": len(reused), "reused_ids": digest,
            "loop_cpu_ms_per_frame": (box["loop"] - box["loop0"]) * 1000 / total,
            "thumbnail_cpu_ms_per_frame": box["thumb"] * 1000 / total,
            "frames_per_s": total / (box["t1"] - box["t0"])}


def workload(per_stream: int) -> list[list[bytes]]:
    import io

    import numpy as np
    from PIL import Image

    from worker.photos import PHOTOS, photo

    rng = np.random.default_rng(0)
    out = []
    for s in range(STREAMS):
        base = np.asarray(Image.fromarray(photo(PHOTOS[s % len(PHOTOS)])).resize(SIZE), dtype=np.float32)
        frames = []
        for _ in range(per_stream):
            buf = io.BytesIO()
            noisy = np.clip(base + rng.normal(0, 3.0, base.shape), 0, 255).astype(np.uint8)
            Image.fromarray(noisy).save(buf, format="JPEG", quality=90)
            frames.append(buf.getvalue())
        out.append(frames)
    return out


FIGURES = ("loop_cpu_ms_per_frame", "thumbnail_cpu_ms_per_frame", "frames_per_s", "reused")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, help="the other source tree (holding worker/), run as 'base'")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--frames", type=int, default=200, help="frames per stream (4 streams)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child)
        streams = json.loads(Path(spec["data"]).read_text(encoding="latin-1"))
        print(json.dumps(one_round([[f.encode("latin-1") for f in s] for s in streams])))
        return 0

    import common

    trees = {"this": common.REPO, **({"base": args.base} if args.base else {})}
    with tempfile.TemporaryDirectory(prefix="streamfer-reuse-loop-") as tmp:
        data = Path(tmp) / "frames.json"
        data.write_text(json.dumps([[f.decode("latin-1") for f in s] for s in workload(args.frames)]),
                        encoding="latin-1")

        def child(tree: str) -> dict[str, Any]:
            row = common.run_child(__file__, {"data": str(data)}, Path(trees[tree]))
            print(f"{tree}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k != "reused_ids"), flush=True)
            return row

        runs = stats.run_rounds(stats.interleaved(list(trees), args.rounds), child)
    rows = [[tree, *(stats.spread(runs[tree], f).text(3) for f in FIGURES)] for tree in trees]
    if args.base:
        ratio = stats.ratio_spread(stats.figure(runs["this"], FIGURES[0]), stats.figure(runs["base"], FIGURES[0]))
        rows.append(["this / base", ratio.text(3), "", "", ""])
        same = {r.get("reused_ids") for t in trees for r in runs[t].values() if "failed" not in r}
        print(f"reuse decisions identical across trees and rounds: {len(same) == 1}")
    common.table(f"loop thread CPU with reuse on: {STREAMS} streams x {args.frames} noisy 720p JPEG, null model",
                 ["tree", *FIGURES], rows)
    common.write_json("reuse_loop", {"rounds": args.rounds, "frames_per_stream": args.frames, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
