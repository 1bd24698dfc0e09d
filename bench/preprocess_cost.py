"""What the runtime costs around a model, measured in fresh processes for one source tree against another, in
interleaved rounds (every case and variant once a round).

Cases (data, CASES and STARTUP): the CPU-ms per frame of the runtime path (decode, resize, normalise, copy, a
near-zero model, verdicts: `InferenceExecutor.submit` of batches of `--batch` frames, 2 in flight as in the worker;
no Kafka) for frames of a size, image, encoding and model preprocessing, e.g. open_nsfw's with and without its JPEG
round trip (a case may name another to be compared with, per round); and the start-up host-sync check's cost
(worker.runtime.hostsync: the check as the worker runs it, `load_model` beside it, the forward under the check's
modes), a fresh process being a fresh start. The frames are made here, once, and handed to each round, so an older
tree is measured on the same bytes.

    python bench/preprocess_cost.py --base /tmp/base_tree [--rounds 5] [--seconds 2]
    python bench/preprocess_cost.py --cases roundtrip --threads 1    # open_nsfw's preprocessing with / without
    python bench/preprocess_cost.py --cases startup --rounds 7       # the host-sync check at start-up
    python bench/preprocess_cost.py --cases nudenet --threads 1 --batch 8 --base /tmp/base   # NudeNet's

`--base` is a checkout of the other version (e.g. `git archive <commit> worker schemas | tar -x -C /tmp/base`);
without it only this tree's variants run. Prints tables (median (min-max) over rounds) and writes JSON.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import stats  # pure; the child imports nothing else of bench/: common would put this tree's `worker` first

HERE = Path(__file__).resolve().parent
INFLIGHT = 2  # the worker's delivery.max_inflight_batches default
NEAR_ZERO = {"source": "nullmodel:null_model", "input_size": [224, 224]}
# open_nsfw's preprocessing (worker.config.MODEL_PRESETS) on the near-zero model: stretch to 256x256, crop 224, BGR.
NSFW_PREP = {**NEAR_ZERO, "resize": "stretch_crop", "resize_to": [256, 256], "resampler": "pillow",
             "jpeg_scaled_decode": False, "channel_order": "BGR", "pixel_range": "0-255", "mean": [104.0, 117.0, 123.0],
             "std": [1.0, 1.0, 1.0]}
# NudeNet's (the nudenet preset) on the near-zero model: pad to a square, cv2-exact bilinear to 320x320, BGR, 0-1, NCHW.
NUDENET_PREP = {**NEAR_ZERO, "input_size": [320, 320], "input_layout": "NCHW", "resize": "pad_stretch",
                "resampler": "opencv", "jpeg_scaled_decode": False, "channel_order": "BGR", "pixel_range": "0-1",
                "mean": [0.0, 0.0, 0.0], "std": [1.0, 1.0, 1.0]}


@dataclass(frozen=True)
class Case:
    width: int
    height: int
    image: str  # "synthetic" (the kit's blocks), "photo" (worker.testing.pixels.photo_like), "skimage" (a real photo)
    encoding: str  # worker.frames.Encoding name
    model: dict[str, Any] = field(default_factory=lambda: NEAR_ZERO)  # [model] settings
    against: str | None = None  # the case this one is compared with, per round


CASES = {
    "jpeg224_to_224": Case(224, 224, "synthetic", "JPEG"),
    "raw224_to_224": Case(224, 224, "synthetic", "RAW_RGB8"),
    "jpeg720p_to_224": Case(1280, 720, "synthetic", "JPEG"),
    "jpeg720p_photo_to_224": Case(1280, 720, "photo", "JPEG"),
    "jpeg1080p_photo_to_224": Case(1920, 1080, "photo", "JPEG"),
    **{f"nsfw_prep_{label}{rt}": Case(w, h, "skimage", "JPEG", {**NSFW_PREP, "jpeg_roundtrip_quality": q},
                                      f"nsfw_prep_{label}" if q else None)
       for label, (w, h) in {"224": (224, 224), "720p": (1280, 720), "1080p": (1920, 1080)}.items()
       for rt, q in (("", 0), ("_roundtrip75", 75))},
    **{f"nudenet_prep_{label}": Case(w, h, "skimage", "JPEG", NUDENET_PREP)
       for label, (w, h) in {"224": (224, 224), "720p": (1280, 720)}.items()},
}
STARTUP = {"startup_opennsfw": "opennsfw", "startup_builtin": "builtin"}  # case -> model.source
GROUPS = {"default": [c for c in CASES if not c.startswith(("nsfw_prep", "nudenet_prep"))],
          "roundtrip": [c for c in CASES if c.startswith("nsfw_prep")],
          "nudenet": [c for c in CASES if c.startswith("nudenet_prep")], "startup": list(STARTUP),
          "all": [*CASES, *STARTUP], "none": []}


def one_round(case: str, threads: str, batch: int, seconds: float, data: bytes) -> dict[str, Any]:
    """Runs in the child process, against whichever `worker` package is first on sys.path (the round's tree)."""
    import torch

    from worker.config import ModelSettings, RuntimeSettings
    from worker.frames import Encoding, Frame, Priority, SourceRef
    from worker.runtime.start import build_executor

    torch.set_num_threads(1)
    c = CASES[case]
    frames = [Frame(stream_id="s", frame_index=i, tenant="t", priority=Priority.STANDARD, capture_ts_ms=0,
                    width=c.width, height=c.height, channels=3, encoding=Encoding[c.encoding], data=data,
                    source=SourceRef("in", 0, i)) for i in range(batch)]
    model = ModelSettings(**{k: tuple(v) if isinstance(v, list) else v for k, v in c.model.items()})
    runtime = RuntimeSettings(device="cpu", warmup_batches=1, torch_threads=1,
                              **({} if threads == "default" else {"preprocess_threads": int(threads)}))
    shape = (c.height, c.width, 3)
    with build_executor(model, runtime) as ex:
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
    return {"cpu_ms_per_frame": cpu / done * 1000.0, "frames_per_s": done / wall, "frames": done}


def startup_round(source: str) -> dict[str, Any]:
    """Runs in the child process: one start's model load and host-sync check (its first call is what counts)."""
    import warnings

    from worker.config import load_settings
    from worker.runtime.hostsync import check_host_syncs, trace_forward
    from worker.runtime.models import load_model, validation_input

    warnings.simplefilter("ignore", FutureWarning)
    t0 = time.perf_counter()
    loaded = load_model(load_settings(env={}, overrides={"model": {"source": source}}).model)
    t1 = time.perf_counter()
    findings = check_host_syncs(loaded, refuse=True)
    t2 = time.perf_counter()
    trace_forward(loaded.module, validation_input(loaded.contract, loaded.device))
    t3 = time.perf_counter()
    return {"check_ms": (t2 - t1) * 1000, "load_model_ms": (t1 - t0) * 1000,
            "forward_under_modes_ms": (t3 - t2) * 1000, "findings": len(findings)}


def frame_bytes(case: str) -> bytes:
    """The case's frame as sent: the test kit's synthetic blocks, a photo-like image or the first scikit-image
    photo (worker/testing/pixels.py) as JPEG (quality 85, worker produce's default)."""
    from PIL import Image

    from worker.frames import Encoding, Priority
    from worker.testing import synthetic_frames
    from worker.testing.pixels import photo_frames, photo_like

    c = CASES[case]
    if c.image == "synthetic":
        return synthetic_frames(1, [(c.width, c.height)], Encoding[c.encoding], Priority.STANDARD, "pc")[0].data
    if c.image == "skimage":
        return photo_frames((c.width, c.height))[0].data
    buf = io.BytesIO()
    Image.fromarray(photo_like(c.width, c.height), "RGB").save(buf, format="JPEG", quality=85)
    return buf.getvalue()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, help="the other source tree (holding worker/), run as 'base'")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0, help="measured seconds per round")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--cases", default="default", help=f"comma-separated cases or groups ({', '.join(GROUPS)})")
    parser.add_argument("--threads", default="1,default", help="this tree's preprocess_threads variants")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "preprocess_cost.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one round, in the round's tree (common.run_child)
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child)
        case = spec["case"]
        print(json.dumps(startup_round(STARTUP[case]) if case in STARTUP else
                         one_round(case, spec["threads"], spec["batch"], spec["seconds"],
                                   Path(spec["data"]).read_bytes())))
        return 0
    cases = [c for name in args.cases.split(",") for c in GROUPS.get(name, [name])]
    if unknown := [c for c in cases if c not in CASES and c not in STARTUP]:
        parser.error(f"unknown cases {unknown}; known: {', '.join(GROUPS['all'])}")

    import common  # the parent only (see the import of stats above)

    # The base tree runs with the same thread settings as this one: a ratio compares code, not thread counts.
    trees = {"this": common.REPO, **({"base": args.base} if args.base else {})}

    def suffixes(case: str) -> list[str]:  # a start-up case has no preprocessing threads to vary
        return [""] if case in STARTUP else [f", preprocess_threads={t}" for t in args.threads.split(",")]

    variants = {case: {name + sfx: (tree, sfx.rpartition("=")[2] or "default") for sfx in suffixes(case)
                       for name, tree in trees.items()} for case in cases}
    runs: dict[str, dict[str, dict[int, dict[str, Any]]]] = {case: {} for case in cases}
    with tempfile.TemporaryDirectory(prefix="streamfer-preprocess-") as tmp:
        for case in cases:
            (Path(tmp) / case).write_bytes(b"" if case in STARTUP else frame_bytes(case))

        def child(case: str, name: str) -> dict[str, Any]:
            tree, threads = variants[case][name]
            row = common.run_child(__file__, {"case": case, "threads": threads, "batch": args.batch,
                                              "seconds": args.seconds, "data": str(Path(tmp) / case)}, Path(tree))
            print(f"{case} {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
            return row

        for case in (c for c in cases if c in STARTUP):  # one untimed start: an ONNX conversion is cached after it
            for name in variants[case]:
                child(case, name)
        pairs = {f"{case} | {name}": (case, name) for case in cases for name in variants[case]}
        for pair, by_round in stats.run_rounds(stats.interleaved(list(pairs), args.rounds),
                                               lambda pair: child(*pairs[pair])).items():
            runs[pairs[pair][0]][pairs[pair][1]] = by_round
    rows, ratios = [], []
    for case, by in runs.items():
        key = "check_ms" if case in STARTUP else "cpu_ms_per_frame"
        rows += [[case, name, "; ".join(f"{k} {stats.spread(r, k).text(3 if 'cpu' in k else None)}" for k in next(
            (t for t in r.values() if "failed" not in t), {}))] for name, r in by.items()]
        comparisons = [(f"this/base{sfx}", by[f"this{sfx}"], by[f"base{sfx}"]) for sfx in suffixes(case) if args.base]
        if (other := CASES[case].against if case in CASES else None) in runs:
            comparisons += [(f"{case} / {other}, this{sfx}", by[f"this{sfx}"], runs[other][f"this{sfx}"])
                            for sfx in suffixes(case)]
        for label, numerator, denominator in comparisons:  # per round, then median (min-max)
            ratio = stats.ratio_spread(stats.figure(numerator, key), stats.figure(denominator, key))
            rows.append([case, label, f"{key} ratio {ratio.text(3)}"])
            ratios.append({"case": case, "ratio": label, key: ratio})
    text = [common.table(f"runtime costs, batch {args.batch}, {args.rounds} interleaved rounds in fresh processes "
                         "(median (min-max))", ["case", "variant", "figures"], rows,
                         note="" if args.base else "no --base: this tree only")]
    result = {"benchmark": "preprocess_cost", "batch": args.batch, "inflight": INFLIGHT,
              "seconds_per_round": args.seconds, "rounds": args.rounds, "runs": runs, "ratios": ratios}
    common.write_json(args.out.stem, {**result, "tables": text}, args.out.parent)
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
