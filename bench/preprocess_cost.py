"""CPU cost per frame of the runtime path (decode, resize, normalise, copy, a near-zero model, verdicts), for one
source tree against another, in interleaved rounds (A B A B ...), each round a fresh process.

The model does next to nothing (a slice of its input), so the figure is what the worker pays around a model:
`InferenceExecutor.submit` of batches of `--batch` frames, 2 in flight as in the worker (bench/executor_load.py's
closed loop). Kafka (consume, Avro, produce, commit) is not included. The frames are made here, once, and
handed to each round, so an older tree is measured on the same bytes.

    python bench/preprocess_cost.py --base /tmp/base_tree [--rounds 5] [--seconds 2]

`--base` is a checkout of the other version (e.g. `git archive <commit> worker schemas | tar -x -C /tmp/base`);
without it only this tree's variants run. Prints a table (median (min-max) over rounds) and writes JSON.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import stats  # pure; the child imports nothing else of bench/: common would put this tree's `worker` first

HERE = Path(__file__).resolve().parent
INFLIGHT = 2  # the worker's delivery.max_inflight_batches default
# name: (frame width, height, image kind, encoding, model input [h, w])
CASES = {
    "jpeg224_to_224": (224, 224, "synthetic", "JPEG", (224, 224)),
    "raw224_to_224": (224, 224, "synthetic", "RAW_RGB8", (224, 224)),
    "jpeg720p_to_224": (1280, 720, "synthetic", "JPEG", (224, 224)),
    "jpeg720p_photo_to_224": (1280, 720, "photo", "JPEG", (224, 224)),
    "jpeg1080p_photo_to_224": (1920, 1080, "photo", "JPEG", (224, 224)),
}


def one_round(case: str, threads: str, batch: int, seconds: float, data: bytes) -> dict[str, Any]:
    """Runs in the child process, against whichever `worker` package is first on sys.path (the round's tree)."""
    import torch

    from worker.config import ModelSettings, RuntimeSettings
    from worker.frames import Encoding, Frame, Priority, SourceRef
    from worker.runtime import InferenceExecutor

    torch.set_num_threads(1)
    width, height, _kind, encoding, input_size = CASES[case]
    frames = [Frame(stream_id="s", frame_index=i, tenant="t", priority=Priority.STANDARD, capture_ts_ms=0,
                    width=width, height=height, channels=3, encoding=Encoding[encoding], data=data,
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


def frame_bytes(case: str) -> bytes:
    """The case's frame as sent: the test kit's synthetic blocks, or a photo-like image as JPEG (quality 85,
    worker produce's default)."""
    from PIL import Image

    from tests.pixels import photo_like
    from worker.frames import Encoding, Priority
    from worker.testing import synthetic_frames

    width, height, kind, encoding, _ = CASES[case]
    if kind == "synthetic":
        return synthetic_frames(1, [(width, height)], Encoding[encoding], Priority.STANDARD, "pc")[0].data
    buf = io.BytesIO()
    Image.fromarray(photo_like(width, height), "RGB").save(buf, format="JPEG", quality=85)
    return buf.getvalue()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, help="the other source tree (holding worker/), run as 'base'")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0, help="measured seconds per round")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--threads", default="1,default", help="this tree's preprocess_threads variants")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "preprocess_cost.json")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        case, threads, batch, seconds, data_path = args.child
        print(json.dumps(one_round(case, threads, int(batch), float(seconds), Path(data_path).read_bytes())))
        return 0

    import common  # the parent only (see the import of stats above)

    # The base tree runs with the same thread settings as this one: a ratio compares code, not thread counts.
    trees = ([("base", args.base)] if args.base else []) + [("this", common.REPO)]
    variants = {f"{name}, preprocess_threads={t}": (tree, t) for t in args.threads.split(",") for name, tree in trees}
    results: dict[str, Any] = {}
    rows, ratios = [], []
    with tempfile.TemporaryDirectory(prefix="streamfer-preprocess-") as tmp:
        for case in args.cases.split(","):
            (data := Path(tmp) / case).write_bytes(frame_bytes(case))

            def measure(name: str, case: str = case, data: Path = data) -> dict[str, Any]:
                tree, threads = variants[name]
                env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{HERE}"}
                out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", case, threads,
                                      str(args.batch), str(args.seconds), str(data)], env=env, capture_output=True,
                                     text=True)
                if out.returncode:
                    raise RuntimeError(f"{case} {name}: exit {out.returncode}\n{out.stderr[-3000:]}")
                row = json.loads(out.stdout.strip().splitlines()[-1])
                print(f"{case} {name}: {row['cpu_ms_per_frame']:.3f} CPU ms/frame, {row['frames_per_s']:.0f} frames/s",
                      flush=True)
                return row

            # interleaved: background load hits every variant alike
            runs = results[case] = stats.run_rounds(stats.interleaved(list(variants), args.rounds), measure)
            rows += [[case, name, stats.spread(by, "cpu_ms_per_frame").text(3), stats.spread(by, "frames_per_s").text()]
                     for name, by in runs.items()]
            for t in args.threads.split(",") if args.base else ():  # per round, then median (min-max)
                ratio = stats.ratio_spread(stats.figure(runs[f"this, preprocess_threads={t}"], "cpu_ms_per_frame"),
                                           stats.figure(runs[f"base, preprocess_threads={t}"], "cpu_ms_per_frame"))
                rows.append([case, f"this/base, preprocess_threads={t}", ratio.text(3), ""])
                ratios.append({"case": case, "preprocess_threads": t, "this_over_base_cpu_ms_per_frame": ratio})
    text = common.table(f"runtime path CPU cost, batch {args.batch}, {args.rounds} interleaved rounds in fresh "
                        "processes (median (min-max))", ["case", "variant", "CPU ms/frame", "frames/s"], rows,
                        note="" if args.base else "no --base: this tree only")
    common.write_json(args.out.stem, {"benchmark": "preprocess_cost", "machine": common.machine(), "batch": args.batch,
                                      "inflight": INFLIGHT, "seconds_per_round": args.seconds, "rounds": args.rounds,
                                      "runs": results, "ratios": ratios, "tables": [text]}, args.out.parent)
    return 0


def summary(result: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Rows for bench/results/summary.md: this tree's CPU-ms per frame of each case, 1 preprocessing thread."""
    name = "this, preprocess_threads=1"
    cells = "; ".join(f"{case} **{stats.spread(runs[name], 'cpu_ms_per_frame').text(2)}**"
                      for case, runs in result["runs"].items() if name in runs)
    label = "runtime path CPU-ms/frame, 1 preprocessing thread"
    return [(label, cells, stats.rounds(result["rounds"]))] if cells else []


if __name__ == "__main__":
    sys.exit(main())
