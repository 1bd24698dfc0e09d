"""CPU cost per frame of the runtime path (decode, resize, normalise, copy, a near-zero model, verdicts), for one
source tree against another, in interleaved rounds (A B A B ...), each round a fresh process.

The model does next to nothing (a slice of its input), so the figure is what the worker pays around a model:
`InferenceExecutor.submit` of batches of `--batch` frames, `INFLIGHT` batches in flight as in the worker,
timed from the first submit to the last result. Kafka (consume, Avro, produce, commit) is not included.

    python bench/preprocess_cost.py --base /tmp/base_tree [--rounds 5] [--seconds 2]

`--base` is a checkout of the other version (e.g. `git archive <commit> worker schemas | tar -x -C /tmp/base`);
without it only this tree's variants run. Prints a table (median, min, max over rounds) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# For tests.pixels; appended, so a round's own tree (first on PYTHONPATH) provides `worker`.
sys.path.append(str(ROOT))
INFLIGHT = 2  # the worker's in-flight batches for its one runner (delivery.inflight_batches_per_runner)
# name: (frame width, height, image kind, encoding, model input [h, w])
CASES = {
    "jpeg224_to_224": (224, 224, "synthetic", "JPEG", (224, 224)),
    "raw224_to_224": (224, 224, "synthetic", "RAW_RGB8", (224, 224)),
    "jpeg720p_to_224": (1280, 720, "synthetic", "JPEG", (224, 224)),
    "jpeg720p_photo_to_224": (1280, 720, "photo", "JPEG", (224, 224)),
    "jpeg1080p_photo_to_224": (1920, 1080, "photo", "JPEG", (224, 224)),
}


def one_round(case: str, threads: str, batch: int, seconds: float) -> dict[str, Any]:
    """Runs in the child process, against whichever `worker` package is first on sys.path."""
    import numpy as np
    import torch

    from tests.pixels import photo_like
    from worker.config import ModelSettings, RuntimeSettings
    from worker.frames import Encoding, Frame, Priority, SourceRef
    from worker.runtime import InferenceExecutor
    from worker.tools.publish_frames import encode_pixels, synthetic_pixels

    torch.set_num_threads(1)
    width, height, kind, encoding_name, input_size = CASES[case]
    encoding = Encoding[encoding_name]
    pixels = (synthetic_pixels(np.random.default_rng(7), width, height) if kind == "synthetic"
              else photo_like(width, height))
    data = encode_pixels(pixels, encoding)
    frames = [Frame(stream_id="s", frame_index=i, tenant="t", priority=Priority.STANDARD, capture_ts_ms=0,
                    width=width, height=height, channels=3, encoding=encoding, data=data,
                    source=SourceRef("in", 0, i)) for i in range(batch)]
    model = ModelSettings(source="nullmodel:null_model", input_size=input_size)
    runtime = RuntimeSettings(device="cpu", warmup_batches=1, torch_threads=1,
                              **({} if threads == "default" else {"preprocess_threads": int(threads)}))
    shape = (height, width, 3)
    with InferenceExecutor.from_settings(model, runtime) as ex:
        ex.warm_up([shape])
        for _ in range(3):
            ex.submit(frames, shape).result()
        done, pending = 0, []
        cpu0, wall0 = time.process_time(), time.perf_counter()
        while time.perf_counter() - wall0 < seconds or pending:
            while len(pending) < INFLIGHT and time.perf_counter() - wall0 < seconds:
                pending.append(ex.submit(frames, shape))
            outcome = pending.pop(0).result()
            assert len(outcome.verdicts) == batch, outcome.failures[:1]
            done += batch
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return {"cpu_ms_per_frame": cpu / done * 1000.0, "frames_per_s": done / wall, "frames": done,
            "frame_bytes": len(data)}


def _spawn(tree: Path, case: str, threads: str, batch: int, seconds: float) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{HERE}"}
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", case, threads, str(batch),
                          str(seconds)], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, help="the other source tree (holding worker/), run as 'base'")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0, help="measured seconds per round")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--threads", default="1,default", help="this tree's preprocess_threads variants")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "preprocess_cost.json")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        case, threads, batch, seconds = args.child
        print(json.dumps(one_round(case, threads, int(batch), float(seconds))))
        return 0

    # The base tree runs with the same thread settings as this one: a ratio compares code, not thread counts.
    variants = [(f"{name}, preprocess_threads={t}", tree, t) for t in args.threads.split(",")
                for name, tree in ([("base", args.base)] if args.base else []) + [("this", ROOT)]]
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for case in args.cases.split(","):
        for r in range(args.rounds):
            for name, tree, threads in variants:  # interleaved: background load hits every variant alike
                row = _spawn(tree, case, threads, args.batch, args.seconds)
                results.setdefault(case, {}).setdefault(name, []).append(row)
                print(f"{case} round {r + 1} {name}: {row['cpu_ms_per_frame']:.3f} CPU ms/frame, "
                      f"{row['frames_per_s']:.0f} frames/s", flush=True)
    summary = []
    print(f"\n{'case':24s} {'variant':34s} {'CPU ms/frame median [min, max]':32s} frames/s median [min, max]")
    for case, by_variant in results.items():
        for name, rows in by_variant.items():
            cpu = [x["cpu_ms_per_frame"] for x in rows]
            fps = [x["frames_per_s"] for x in rows]
            summary.append({"case": case, "variant": name, "rounds": len(rows),
                            "cpu_ms_per_frame": {"median": statistics.median(cpu), "min": min(cpu), "max": max(cpu)},
                            "frames_per_s": {"median": statistics.median(fps), "min": min(fps), "max": max(fps)},
                            "frame_bytes": rows[0]["frame_bytes"]})
            print(f"{case:24s} {name:34s} {statistics.median(cpu):7.3f} [{min(cpu):.3f}, {max(cpu):.3f}]"
                  f"{'':9s} {statistics.median(fps):6.0f} [{min(fps):.0f}, {max(fps):.0f}]")
    ratios = []
    if args.base:  # per round (background load hits both trees of a round alike), then median (min-max)
        for case, by_variant in results.items():
            for t in args.threads.split(","):
                base_rows = by_variant[f"base, preprocess_threads={t}"]
                this_rows = by_variant[f"this, preprocess_threads={t}"]
                per_round = [b["cpu_ms_per_frame"] / a["cpu_ms_per_frame"] for a, b in zip(base_rows, this_rows)]
                ratios.append({"case": case, "preprocess_threads": t, "this_over_base_cpu_ms_per_frame": {
                    "median": statistics.median(per_round), "min": min(per_round), "max": max(per_round)}})
                print(f"{case:24s} this/base CPU ms/frame, preprocess_threads={t}: {statistics.median(per_round):.3f} "
                      f"[{min(per_round):.3f}, {max(per_round):.3f}]")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"benchmark": "preprocess_cost", "batch": args.batch, "inflight": INFLIGHT,
                                    "seconds_per_round": args.seconds, "cpus": os.cpu_count(),
                                    "load_average": os.getloadavg(), "summary": summary, "ratios": ratios,
                                    "rounds": results},
                                   indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
