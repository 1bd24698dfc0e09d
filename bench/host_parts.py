"""The host path's parts per frame (issue 68), in CPU-ms of the calling thread (`time.thread_time`), this tree
against another (`--base`), each round a fresh process per tree, interleaved: for 224x224 and 720p JPEG photos
(scikit-image's, quality 85) and each model's preprocessing (the open_nsfw and nudenet presets', and a plain
224x224 stretch with scaled decode, the default), the parts the worker runs on one frame:

- `check`: the structure walk before any pixel (`decode.check_frame`);
- `decode`: the worker's `decode_pixels` (the walk, then libjpeg-turbo: entropy decode, IDCT, colour conversion);
- `fit`: resize and crop to the model's input (`fit_to_input`, channels included);
- `place`: the copy of the fitted pixels into the frame's batch row;
- `prepare`: the whole host side, `Preprocessor.prepare` of a batch of 32 on 1 thread, per frame;
- `normalise`: the torch `Normaliser` on that batch (1 torch thread), per frame, as an onnxruntime session takes it
  (contiguous float32 memory: the runner's Normaliser writes that where the tree can, else the copy into it);

and the libraries alone beside them (`lib_*`): simplejpeg's (libjpeg-turbo's) decode at the size the worker decodes;
`lib_colour`, what colour costs in it: that decode to RGB minus the same decode to grey (libjpeg then skips the
chroma's IDCT, upsampling and the colour conversion; the entropy decode of every component stays), so an upper
bound of the conversion itself; and the resize alone (Pillow, cv2 or torch, as the contract's resampler) from an
already-decoded array.

    python bench/host_parts.py --base /tmp/base68 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import stats  # pure; the child imports nothing else of bench/

HERE = Path(__file__).resolve().parent
SIZES = {"224": (224, 224), "720p": (720, 1280)}
MODELS: dict[str, dict[str, Any]] = {"opennsfw": {"source": "opennsfw"}, "nudenet": {"source": "nudenet"},
          "stretch224": {"source": "nullmodel:null_model", "input_size": [224, 224]}}
BATCH = 32


def _per_frame(fn: Any, frames: int, min_s: float = 0.25) -> float:
    """Thread CPU-ms per call of fn, repeated for at least `min_s` of CPU (after one untimed call)."""
    fn()
    calls, t0 = 0, time.thread_time()
    while True:
        fn()
        calls += 1
        spent = time.thread_time() - t0
        if spent >= min_s:
            return spent / calls / frames * 1000.0


def one_round(size: str, model: str, data: bytes) -> dict[str, float]:
    """In the child: every part once, against whichever `worker` is first on sys.path."""
    import numpy as np
    import simplejpeg
    import torch
    from PIL import Image

    from worker.config import load_settings
    from worker.frames import Encoding, Frame, Priority, SourceRef
    from worker.runtime.decode import check_frame, decode_pixels, jpeg_scale
    from worker.runtime.models import ModelContract

    try:  # this tree's rooms, or the tree before the split
        from worker.runtime.fitting import fit_to_input, resize_target, to_channels
        from worker.runtime.normalise import Normaliser
    except ImportError:
        from worker.runtime.preprocess import Normaliser, fit_to_input, resize_target, to_channels  # type: ignore
    from worker.runtime.preprocess import Preprocessor, _place

    torch.set_num_threads(1)
    h, w = SIZES[size]
    settings = load_settings(env={}, overrides={"model": MODELS[model]}).model
    contract = ModelContract.from_settings(settings)
    frames = [Frame(stream_id="s", frame_index=i, tenant="t", priority=Priority.STANDARD, capture_ts_ms=0,
                    width=w, height=h, channels=3, encoding=Encoding.JPEG, data=data, source=SourceRef("in", 0, i))
              for i in range(BATCH)]
    frame = frames[0]
    target = resize_target(contract, (h, w))
    min_hw = target if contract.jpeg_scaled_decode else None
    scale = jpeg_scale((h, w), min_hw)
    dh, dw = -(-h // scale), -(-w // scale)
    decoded = decode_pixels(frame, 3, min_hw=min_hw)
    in_hw = contract.model_input_hw((h, w))
    row = np.empty((*in_hw, contract.channels), dtype=np.uint8)
    fitted = fit_to_input(to_channels(decoded, contract.channels), contract, (h, w), row)
    pre = Preprocessor(contract)
    batch = pre.prepare(frames, (h, w, 3))
    try:  # as an onnxruntime runner builds it (this tree), or the Normaliser before `contiguous`
        norm = Normaliser(contract, contiguous=True)
    except TypeError:
        norm = Normaliser(contract)

    def prepare() -> None:
        pre.prepare(frames, (h, w, 3)).release()

    out = {
        "check": _per_frame(lambda: check_frame(frame), 1),
        "decode": _per_frame(lambda: decode_pixels(frame, 3, min_hw=min_hw), 1),
        "fit": _per_frame(lambda: fit_to_input(to_channels(decoded, contract.channels), contract, (h, w), row), 1),
        "place": _per_frame(lambda: _place(fitted, row), 1),
        "prepare": _per_frame(prepare, BATCH),
        "normalise": _per_frame(lambda: np.ascontiguousarray(norm(batch.pixels, batch.regions).numpy()), BATCH),
        "lib_decode": _per_frame(lambda: simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=dh,
                                                                min_width=dw), 1),
    }

    gray = _per_frame(lambda: simplejpeg.decode_jpeg(data, colorspace="GRAY", min_height=dh, min_width=dw), 1)
    out["lib_colour"] = out["lib_decode"] - gray
    if target is not None and target != decoded.shape[:2]:
        th, tw = target
        if contract.resampler == "pillow":
            img = Image.fromarray(decoded)
            out["lib_resize"] = _per_frame(lambda: img.resize((tw, th), Image.Resampling.BILINEAR), 1)
        elif contract.resampler == "opencv":
            import cv2
            side = max(h, w)
            canvas = np.zeros((side, side, 3), dtype=np.uint8)
            canvas[:h, :w] = decoded
            out["lib_resize"] = _per_frame(lambda: cv2.resize(canvas, (tw, th), interpolation=cv2.INTER_LINEAR), 1)
        else:
            x = torch.from_numpy(decoded.copy()).permute(2, 0, 1).unsqueeze(0)
            out["lib_resize"] = _per_frame(
                lambda: torch.nn.functional.interpolate(x, (th, tw), mode="bilinear", antialias=True), 1)
    return out


PARTS = ["check", "decode", "lib_decode", "lib_colour", "fit", "lib_resize", "place",
         "prepare", "normalise"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, help="the other source tree (holding worker/), run as 'base'")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", default="224,720p")
    parser.add_argument("--models", default="opennsfw,nudenet,stretch224")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(one_round(spec["size"], spec["model"], Path(spec["data"]).read_bytes())))
        return 0

    import tempfile

    import common

    from worker.testing.pixels import photo_frames

    trees = {"this": common.REPO, **({"base": args.base} if args.base else {})}
    cells = [(s, m) for s in args.sizes.split(",") for m in args.models.split(",")]
    keys = [f"{s} {m} | {t}" for s, m in cells for t in trees]
    with tempfile.TemporaryDirectory(prefix="streamfer-parts-") as tmp:
        for s in args.sizes.split(","):
            h, w = SIZES[s]
            (Path(tmp) / s).write_bytes(photo_frames((w, h))[0].data)

        def child(key: str) -> dict[str, Any]:
            cell, tree = key.split(" | ")
            size, model = cell.split()
            row = common.run_child(__file__, {"size": size, "model": model, "data": str(Path(tmp) / size)},
                                   Path(trees[tree]))
            print(key + ": " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
            return row

        runs = stats.run_rounds(stats.interleaved(keys, args.rounds), child)
    table = []
    for s, m in cells:
        for part in PARTS:
            cols = {}
            for t in trees:
                sp = stats.spread(runs[f"{s} {m} | {t}"], part)
                cols[t] = sp.text(3) if sp.n else None
            if any(v is not None for v in cols.values()):
                table.append({"frame": s, "model": m, "part": part, **cols})
    headers = ["frame", "model", "part", *trees]
    print("\n| " + " | ".join(headers) + " |\n|" + "---|" * len(headers))
    for r in table:
        print("| " + " | ".join(str(r[h]) if r[h] is not None else "-" for h in headers) + " |")
    common.write_json("host_parts", {"rounds": args.rounds, "runs": runs, "table": table})
    return 0


if __name__ == "__main__":
    sys.exit(main())
