"""The GPU check's first section, about 45 s: the device path's hazards of issue 45, each in a few seconds, so a GPU
run yields them even if a later section hangs.

  kinds     decode output shape and channels per JPEG kind (baseline, progressive, grey, CMYK) for an RGB and a grey
            model, and the largest difference from the CPU path's pixels (nvJPEG's chroma upsampling differs)
  corrupt   a corrupt JPEG inside a batch: only that frame fails, its neighbours are decoded
  ordering  issue 45 item 1: batches of one runner prepared at once (several preparation threads, every batch in
            flight, the device data path) against the same batches run one at a time: same scores
  hostsync  open_nsfw's host-sync check (the worker refuses a model whose forward reads device values on the host)
  capture   a lazy CUDA-graph capture while serving, then torch.cuda.empty_cache(), then another capture (issue 45
            item 3: after a failed capture, empty_cache raises)
  nvjpeg    nvJPEG frames/s and CPU-ms per frame at batch 32, 224x224 and 720p photo JPEGs
With --cpu, kinds/corrupt/ordering run torchvision's CPU decoder (a code-path check, not nvJPEG) and hostsync runs on
the CPU; capture and nvjpeg need CUDA and are skipped, saying so.
"""

from __future__ import annotations

import io
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
from gpu_e2e import photo_jpegs
from workloads import WORKLOADS, model_settings

from worker.config import load_settings
from worker.frames import Encoding, Frame, Priority, SourceRef
from worker.runtime.contract import ModelContract
from worker.runtime.start import start_runtime

KINDS = ("baseline", "progressive", "grey", "cmyk")
SIZE = (96, 64)  # (width, height) of the kinds' JPEGs
ORDERING_BATCHES, ORDERING_BATCH, ORDERING_ROUNDS = 8, 16, 3
ORDERING_BOUND = 1e-4  # the same batch on the same runner: equal scores but for kernels' own nondeterminism
NVJPEG_BATCH = 32
_LOADED: dict[str, Any] = {}  # open_nsfw as the hostsync part loaded it, for the capture part


def section_smoke(check: Any, section: Any) -> None:
    """Every part in turn; one that raises is a failed row (the section fails), the next still runs."""
    import torch

    device = torch.device("cuda", 0) if check.cuda else torch.device("cpu")
    cuda_only = "skipped: needs CUDA (torch sees no GPU, or --cpu)"
    parts: list[tuple[str, Callable[[], str] | None]] = [
        ("kinds", lambda: jpeg_kinds(device)),
        ("corrupt", lambda: corrupt_in_batch(device)),
        ("ordering", lambda: concurrent_vs_serial(check, section)),
        ("hostsync", lambda: open_nsfw_host_syncs(section, device)),
        ("capture", (lambda: lazy_capture_then_empty_cache(section, device)) if check.cuda else None),
        ("nvjpeg", (lambda: nvjpeg_rate(section, device)) if check.cuda else None),
    ]
    failed: list[str] = []
    for name, part in parts:
        if part is None:
            section.add(name, cuda_only)
            continue
        t0 = time.monotonic()
        try:
            value = part()
        except Exception as exc:  # noqa: BLE001 (one part failing must not lose the others)
            traceback.print_exc()
            value = f"FAILED: {type(exc).__name__}: {str(exc)[:300]}"
        if value.startswith("FAILED"):
            failed.append(name)
        section.add(name, f"{value} ({time.monotonic() - t0:.1f}s)")
    if failed:
        section.fail(f"failed: {', '.join(failed)}")


# -- the parts ------------------------------------------------------------------------------------------------------
def jpeg_of(pixels: np.ndarray, kind: str) -> bytes:
    """One photo crop as a JPEG of `kind` (PIL, libjpeg-turbo): baseline, progressive, grey (L) or CMYK."""
    from PIL import Image

    img = Image.fromarray(pixels)
    buf = io.BytesIO()
    if kind == "grey":
        img = img.convert("L")
    elif kind == "cmyk":
        img = img.convert("CMYK")
    img.save(buf, format="JPEG", quality=90, progressive=kind == "progressive")
    return buf.getvalue()


def photo_crop(width: int, height: int) -> np.ndarray:
    from worker.photos import PHOTOS, photo

    pixels = photo(PHOTOS[0])
    return np.ascontiguousarray(pixels[:height, :width, :3])


def make_frame(data: bytes, width: int, height: int, index: int = 0) -> Frame:
    return Frame(stream_id="smoke", frame_index=index, tenant="t", priority=Priority.STANDARD, capture_ts_ms=0,
                 width=width, height=height, channels=3, encoding=Encoding.JPEG, data=data,
                 source=SourceRef("frames.standard", 0, index))


def contract_of(channels: int) -> ModelContract:
    """A model input of the JPEGs' own size (no resize: the decoders' own pixels), RGB or grey."""
    w, h = SIZE
    if channels == 1:
        return ModelContract(name="smoke", version="1", labels=("a", "b"), jpeg_scaled_decode=False,
                             input_size=(h, w), mean=(0.5,), std=(0.25,))
    return ModelContract(name="smoke", version="1", labels=("a", "b"), jpeg_scaled_decode=False, input_size=(h, w))


def jpeg_kinds(device: Any) -> str:
    from worker.runtime.devicepath import DevicePreprocessor
    from worker.runtime.preprocess import Preprocessor

    w, h = SIZE
    pixels = photo_crop(w, h)
    out, bad = [], []
    for channels in (3, 1):
        c = contract_of(channels)
        for kind in KINDS:
            frame = make_frame(jpeg_of(pixels, kind), w, h)
            got = DevicePreprocessor(c).prepare([frame], (h, w, 3), device)
            want = Preprocessor(c).prepare([frame], (h, w, 3))
            if got.failures or not got.frames:
                bad.append(f"{kind}/{channels}ch")
                out.append(f"{kind} {channels}ch: failed ({got.failures[0][1] if got.failures else 'no frame'})")
                continue
            shape = tuple(got.pixels.shape)
            diff = int((got.pixels.cpu().int() - want.pixels.int()).abs().max())
            if shape != (1, h, w, channels):
                bad.append(f"{kind}/{channels}ch")
            out.append(f"{kind} {channels}ch: {list(shape)} max |device - CPU path| {diff}")
    verdict = "ok" if not bad else f"FAILED ({', '.join(bad)} not [1, {h}, {w}, channels])"
    return f"{verdict}: " + "; ".join(out)


def corrupt_in_batch(device: Any) -> str:
    """Baseline, corrupt (the progressive JPEG with a bogus Huffman table past its header, which every host check
    passes), progressive: the first and last are decoded, the middle one alone fails."""
    from worker.runtime.devicepath import DevicePreprocessor

    w, h = SIZE
    pixels = photo_crop(w, h)
    progressive = jpeg_of(pixels, "progressive")
    at = progressive.rindex(b"\xff\xc4") + 5
    bad = progressive[:at] + b"\xff" * 16 + progressive[at + 16:]
    frames = [make_frame(jpeg_of(pixels, "baseline"), w, h, 0), make_frame(bad, w, h, 1),
              make_frame(progressive, w, h, 2)]
    batch = DevicePreprocessor(contract_of(3)).prepare(frames, (h, w, 3), device)
    kept = [f.frame_index for f in batch.frames]
    failed = {f.frame_index: str(e) for f, e in batch.failures}
    ok = kept == [0, 2] and list(failed) == [1]
    return (f"{'ok' if ok else 'FAILED'}: decoded frames {kept}, failed {failed or 'none'} "
            "(want decoded [0, 2], failed [1])")


def concurrent_vs_serial(check: Any, section: Any) -> str:
    """The builtin model (224x224) on the device data path, started as the worker starts it, 4 preparation threads:
    ORDERING_BATCHES batches of distinct photo JPEGs submitted at once (prepared side by side, queued behind each
    other on the runner), ORDERING_ROUNDS times, against each batch submitted alone and awaited."""
    import torch

    jpegs = photo_jpegs((224, 224))
    frames = [make_frame(jpegs[i % len(jpegs)], 224, 224, i) for i in range(len(jpegs))]
    batches = [[frames[(b * 5 + i) % len(frames)] for i in range(ORDERING_BATCH)] for b in range(ORDERING_BATCHES)]
    settings = load_settings(env={}, overrides={
        "model": {"source": "builtin", "input_size": [224, 224]},
        "runtime": {"device": "cuda:0" if check.cuda else "cpu", "decode": "device", "preprocess_threads": 4,
                    "warmup_shapes": ["224x224"], "torch_threads": check.torch_threads,
                    "calibrate_batch_sizes": False},
        "batching": {"max_batch_size": ORDERING_BATCH}})
    executor = start_runtime(settings).executor
    shape = (224, 224, 3)
    try:
        serial = [executor.submit(b, shape).result() for b in batches]
        worst, failures = 0.0, 0
        for _ in range(ORDERING_ROUNDS):
            futures = [executor.submit(b, shape) for b in batches]
            for want, got in zip(serial, (f.result() for f in futures)):
                failures += len(got.failures)
                if [f.frame_index for f, _ in got.verdicts] != [f.frame_index for f, _ in want.verdicts]:
                    failures += 1  # frames out of their batch's order
                for (_, a), (_, b) in zip(want.verdicts, got.verdicts):
                    worst = max(worst, max(abs(a.scores[k] - b.scores[k]) for k in a.scores))
    finally:
        executor.close()
        if check.cuda:
            torch.cuda.empty_cache()
    section.data["ordering"] = {"batches": ORDERING_BATCHES, "batch": ORDERING_BATCH, "rounds": ORDERING_ROUNDS,
                                "max_abs_diff": worst, "failures": failures, "bound": ORDERING_BOUND}
    ok = worst <= ORDERING_BOUND and failures == 0
    where = "" if check.cuda else " (CPU decoder: a code-path check, the hazard needs CUDA streams)"
    return (f"{'ok' if ok else 'FAILED'}: {ORDERING_ROUNDS} rounds of {ORDERING_BATCHES} batches of {ORDERING_BATCH} "
            f"at once vs one at a time: max |score difference| {worst:.2g} (bound {ORDERING_BOUND:g}), "
            f"{failures} frame failures{where}")


def open_nsfw_host_syncs(section: Any, device: Any) -> str:
    from worker.runtime.hostsync import check_host_syncs
    from worker.runtime.models import load_model

    settings = load_settings(env={}, overrides={"model": model_settings("opennsfw", WORKLOADS["jpeg224"])})
    t0 = time.perf_counter()
    loaded = load_model(settings.model, device)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    findings = check_host_syncs(loaded, refuse=False)
    _LOADED["opennsfw"] = loaded  # the capture part reuses it
    found = "; ".join(f.describe() for f in findings)
    return (f"{'ok' if not findings else 'FAILED'}: {len(findings)} host sync(s){': ' + found if found else ''} "
            f"(load {load_s:.1f}s, check {time.perf_counter() - t0:.1f}s, {loaded.kind} model on {device})")


def lazy_capture_then_empty_cache(section: Any, device: Any) -> str:
    """open_nsfw on a CudaGraphRunner with no warm-up: batch 2 served until its graph is captured lazily, then
    torch.cuda.empty_cache(), then batch 4 captured the same way; replays against the eager runner."""
    import torch

    from worker.runtime.runners import CudaGraphRunner, EagerRunner

    loaded = _LOADED.pop("opennsfw", None)
    if loaded is None:
        from worker.runtime.models import load_model

        settings = load_settings(env={}, overrides={"model": model_settings("opennsfw", WORKLOADS["jpeg224"])})
        loaded = load_model(settings.model, device)
    shape = (*loaded.contract.model_input_hw((224, 224)), loaded.contract.channels)
    runner = CudaGraphRunner(loaded.module, loaded.contract, device, buckets=(1, 2, 4), warmup_batches=1,
                             capture_after=1)
    eager = EagerRunner(loaded.module, loaded.contract, device)
    gen = torch.Generator().manual_seed(0)
    worst, steps = 0.0, []
    for n in (2, 4):
        x = torch.randint(0, 256, (n, *shape), dtype=torch.uint8, generator=gen).to(device)
        before = runner.capture_count
        for _ in range(3):
            got = runner.run(x)
        want = eager.run(x)
        worst = max(worst, float((got.scores - want.scores).abs().max()))
        steps.append(f"batch {n}: {runner.capture_count - before} captured, replayed {got.used_graph}")
        if n == 2:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            steps.append("empty_cache() returned")
    ok = runner.capture_count >= 2 and worst <= 1e-3
    return f"{'ok' if ok else 'FAILED'}: {'; '.join(steps)}; max |graph - eager| {worst:.2g}"


def nvjpeg_rate(section: Any, device: Any) -> str:
    """DevicePreprocessor.prepare of NVJPEG_BATCH photo JPEGs on a stream of its own, each batch awaited, for about
    1.5 s per size: frames/s and the process's CPU-ms per frame."""
    import torch

    from worker.runtime.devicepath import ByteStaging, DevicePreprocessor

    out = []
    stream = torch.cuda.Stream(device)
    for label, (w, h) in (("224x224", (224, 224)), ("720p", (1280, 720))):
        jpegs = photo_jpegs((w, h))
        frames = [make_frame(jpegs[i % len(jpegs)], w, h, i) for i in range(NVJPEG_BATCH)]
        contract = ModelContract(name="smoke", version="1", labels=("a", "b"), jpeg_scaled_decode=False,
                                 input_size=(224, 224))
        pre = DevicePreprocessor(contract, ByteStaging(pin_memory=True))
        decode_batch(pre, frames, (h, w, 3), device, stream)
        n, t0, c0 = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - t0 < 1.5:
            decode_batch(pre, frames, (h, w, 3), device, stream)
            n += NVJPEG_BATCH
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        section.data.setdefault("nvjpeg", {})[label] = {"frames": n, "frames_per_s": n / wall,
                                                        "cpu_ms_per_frame": cpu * 1000.0 / n}
        out.append(f"{label} {n / wall:.0f} frames/s, {cpu * 1000.0 / n:.2f} CPU-ms/frame")
    return f"ok: batch {NVJPEG_BATCH}, decoded and resized to 224x224: {'; '.join(out)}"


def decode_batch(pre: Any, frames: list[Frame], shape: tuple[int, int, int], device: Any, stream: Any) -> None:
    """One batch prepared and awaited; a frame that fails is an error here (photo JPEGs all decode)."""
    batch = pre.prepare(frames, shape, device, stream)
    if batch.ready_event is not None:
        batch.ready_event.synchronize()
    batch.release()
    if batch.failures:
        raise RuntimeError(f"{len(batch.failures)} frame(s) failed: {batch.failures[0][1]}")
