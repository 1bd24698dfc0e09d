"""int8 on a CPU (`runtime.precision = "int8"`): an ONNX model statically quantised by onnxruntime, checked at start.

The model is quantised once (`onnxruntime.quantization.quantize_static`: QDQ, per-tensor, uint8 activations and
int8 weights, min-max calibration) on the shipped sample photos (`worker.tools.sample_video.PHOTOS`, each whole and
three crops of it) preprocessed exactly as the worker preprocesses frames, and cached next to the ONNX conversions,
keyed by the model file's hash, onnxruntime's version, the quantisation's parameters and the model's input. At every
start the quantised model's verdicts on those images are compared with the fp32 model's (`check_int8`): below
`model.int8_min_agreement` the worker refuses to start; the largest score difference is logged either way.

int8 does not pay on every CPU: without VNNI (AVX-512 VNNI, AVX-VNNI) or AMX its integer kernels gain little over
fp32's (an AMD EPYC with AVX2 ran the quantised open_nsfw at 0.93-0.97x fp32). So the start times the two models
on the same batches (`time_int8_against_fp32`: interleaved rounds, thread CPU where a session has one thread) and
`decide_int8` keeps int8 only where it is at least INT8_MIN_SPEEDUP x fp32's speed, unless
`runtime.precision_policy = "always"`; the decision, the ratio and the CPU's int8 instruction sets are logged once
per model (and printed by `worker check-model`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worker.config import ModelSettings
from worker.errors import OperatorError
from worker.frames import Encoding, Frame, Priority, SourceRef, Verdict
from worker.runtime.contract import VALIDATION_HW, ModelContract, ModelContractError
from worker.runtime.detection import decode_detections, detection_verdict, input_transform
from worker.runtime.models import apply_activation
from worker.runtime.normalise import Normaliser
from worker.runtime.onnx_cache import _file_sha256
from worker.runtime.preprocess import Preprocessor

log = logging.getLogger(__name__)

# Bump when the quantisation or its calibration changes, so old cache entries are ignored.
QUANT_FORMAT = 1
# uint8 activations and int8 weights, per tensor: onnxruntime's advice for x86 CPUs (and what its fastest kernels
# take); reduce_range keeps AVX2's 16-bit accumulations from saturating where the CPU has no VNNI.
QUANT_PARAMS = "QDQ per-tensor QUInt8 activations QInt8 weights reduce_range minmax"
# Each sample photo whole and three crops of it (left and right two thirds, the centre half): 20 calibration images.
CROPS = (("whole", (0.0, 0.0, 1.0, 1.0)), ("left", (0.0, 0.0, 1.0, 2 / 3)), ("right", (0.0, 1 / 3, 1.0, 1.0)),
         ("centre", (0.25, 0.25, 0.75, 0.75)))

Model = Callable[[torch.Tensor], torch.Tensor]

# int8 is kept (runtime.precision_policy = "when_faster") only at this speed over fp32 or more: it costs score
# accuracy, so a tie, or a gain within the timing's noise on a shared machine, is not worth it.
INT8_MIN_SPEEDUP = 1.05
# Frames per timed batch and interleaved rounds (fp32 then int8, then int8 then fp32, ...) of the start's timing.
INT8_TIMING_BATCH = 8
INT8_TIMING_ROUNDS = 6
# /proc/cpuinfo flags that decide what int8 gains: AVX2's 16-bit multiply-adds (what onnxruntime falls back to),
# AVX-512, and the int8 dot-product instructions (VNNI) and tile units (AMX) its fast int8 kernels use.
INT8_CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8", "amx_bf16")


@dataclass(frozen=True)
class CalibrationImage:
    """One calibration image: its name, its frame size and its model input (float32, [1, ...] in the layout)."""

    name: str
    frame_hw: tuple[int, int]
    input: np.ndarray


@dataclass(frozen=True)
class Int8Check:
    """The int8 model against fp32 on the calibration images: the share whose verdicts (flagged labels) agree, the
    largest difference of any label's score, and the images that disagree."""

    images: int
    agreeing: int
    largest_difference: float
    disagreeing: tuple[str, ...]

    @property
    def agreement(self) -> float:
        return self.agreeing / self.images if self.images else 0.0


@dataclass(frozen=True)
class CpuInfo:
    """The CPU's model name and which of INT8_CPU_FLAGS it has (from /proc/cpuinfo; empty where unreadable)."""

    model: str
    flags: tuple[str, ...]

    @classmethod
    def read(cls, text: str | None = None) -> CpuInfo:
        if text is None:
            try:
                text = Path("/proc/cpuinfo").read_text()
            except OSError:
                return cls("unknown CPU", ())
        fields: dict[str, str] = {}
        for line in text.splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
        have = set(fields.get("flags", "").split())
        return cls(fields.get("model name", "unknown CPU"), tuple(f for f in INT8_CPU_FLAGS if f in have))

    def describe(self) -> str:
        vnni = [f for f in self.flags if "vnni" in f]
        amx = [f for f in self.flags if f.startswith("amx")]
        return (f"{self.model}; {', '.join(self.flags) or 'none of ' + ', '.join(INT8_CPU_FLAGS)}"
                f"{'' if vnni else '; no VNNI'}{'' if amx else '; no AMX'}")


@dataclass(frozen=True)
class Int8Speed:
    """fp32 and int8 timed on the same batches: the median per batch of each over interleaved rounds."""

    fp32_ms: float
    int8_ms: float
    batch: int
    rounds: int
    clock: str  # "thread CPU" or "wall"

    @property
    def ratio(self) -> float:
        """int8's speed over fp32's (2.0: int8 runs a batch in half the time)."""
        return self.fp32_ms / self.int8_ms if self.int8_ms > 0 else float("inf")


@dataclass(frozen=True)
class Int8Decision:
    """Whether the worker runs the quantised model, and why: its speed against fp32 on this CPU and the policy."""

    model: str
    speed: Int8Speed
    cpu: CpuInfo
    policy: str
    use_int8: bool

    def describe(self) -> str:
        s = self.speed
        timed = (f"int8 ran {s.ratio:.2f}x fp32's speed ({s.batch}-frame batches, {s.clock} median of {s.rounds} "
                 f"interleaved rounds: fp32 {s.fp32_ms:.1f} ms, int8 {s.int8_ms:.1f} ms) on {self.cpu.describe()}")
        if self.use_int8 and s.ratio >= INT8_MIN_SPEEDUP:
            return f"{timed}: running int8"
        if self.use_int8:
            return (f"{timed}: running int8 anyway (runtime.precision_policy = \"always\"), though it is not "
                    f"{INT8_MIN_SPEEDUP:.2f}x faster here")
        return (f"{timed}: running fp32, int8 is not at least {INT8_MIN_SPEEDUP:.2f}x faster here, and its scores are "
                f"less exact (runtime.precision_policy = \"always\" keeps int8 regardless)")


def decide_int8(model: str, speed: Int8Speed, cpu: CpuInfo, policy: str,
                min_speedup: float = INT8_MIN_SPEEDUP) -> Int8Decision:
    """int8 where it is at least `min_speedup` x fp32's speed, or always with policy "always"."""
    return Int8Decision(model, speed, cpu, policy, policy == "always" or speed.ratio >= min_speedup)


def time_int8_against_fp32(fp32: Model, int8: Model, contract: ModelContract, clock: Callable[[], float],
                           clock_name: str, batch: int = INT8_TIMING_BATCH,
                           rounds: int = INT8_TIMING_ROUNDS) -> Int8Speed:
    """Both models on the same batch of calibration images, after one untimed call each, in `rounds` interleaved
    rounds (the order alternating, so neither always runs second); the median of each, in `clock`'s ms."""
    images = calibration_images(contract)
    x = torch.from_numpy(np.concatenate([images[i % len(images)].input for i in range(batch)]))
    times: dict[str, list[float]] = {"fp32": [], "int8": []}
    models = {"fp32": fp32, "int8": int8}
    with torch.inference_mode():
        for m in models.values():
            m(x)
        for r in range(rounds):
            for name in ("fp32", "int8") if r % 2 == 0 else ("int8", "fp32"):
                t0 = clock()
                models[name](x)
                times[name].append((clock() - t0) * 1000.0)
    return Int8Speed(statistics.median(times["fp32"]), statistics.median(times["int8"]), batch, rounds, clock_name)


# Decided once per quantised model file, session threads and policy: every runner's copy of a model runs the same.
_DECISIONS: dict[tuple[str, int, str], Int8Decision] = {}
_decisions_lock = threading.Lock()


def int8_decision(fp32: Any, int8: Any, contract: ModelContract, policy: str) -> Int8Decision:
    """The start's decision for this model (timed once, then reused by every runner's copy), logged once."""
    threads = int(getattr(int8, "threads", 0))
    key = (str(getattr(int8, "path", id(int8))), threads, policy)
    with _decisions_lock:
        decision = _DECISIONS.get(key)
        if decision is None:
            # One intra-op thread runs in the calling thread: its CPU is the steadier clock on shared cores.
            clock, name = (time.thread_time, "thread CPU") if threads == 1 else (time.perf_counter, "wall")
            speed = time_int8_against_fp32(fp32, int8, contract, clock, name)
            decision = _DECISIONS[key] = decide_int8(contract.name, speed, CpuInfo.read(), policy)
            log.log(logging.INFO if decision.use_int8 else logging.WARNING, "int8 decision model=%s: %s",
                    contract.name, decision.describe())
    return decision


def int8_decisions() -> dict[str, Int8Decision]:
    """The decisions made in this process, by model name (for `worker check-model`)."""
    with _decisions_lock:
        return {d.model: d for d in _DECISIONS.values()}


def quantized_model(path: Path, input_name: str, model: ModelSettings, contract: ModelContract) -> Path:
    """The int8 copy of the ONNX file at `path` (whose input is `input_name`), from the cache or quantised and cached
    now."""
    images = calibration_images(contract)
    cache_dir = Path(model.cache_dir).expanduser() / "onnx"
    key = "|".join([_file_sha256(path), f"format {QUANT_FORMAT}", f"onnxruntime {_ort_version()}", QUANT_PARAMS,
                    f"input {list(images[0].input.shape[1:])}", f"images {[i.name for i in images]}"])
    cached = cache_dir / f"{path.stem}-int8-{hashlib.sha256(key.encode()).hexdigest()[:24]}.onnx"
    if cached.is_file():
        return cached
    t0 = time.perf_counter()
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        _quantize(path, input_name, cached, images)
    except OSError as exc:
        raise OperatorError(f"runtime.precision = \"int8\": cannot write the quantised model to {cached} ({exc}); "
                            "point model.cache_dir at a writable directory", setting="model.cache_dir") from exc
    log.info("quantised ONNX model %s to int8 in %.1fs on %d sample images; cached as %s", path,
             time.perf_counter() - t0, len(images), cached)
    return cached


def check_int8(fp32: Model, int8: Model, contract: ModelContract, min_agreement: float) -> Int8Check:
    """Compare the two models' verdicts on the calibration images; OperatorError below `min_agreement`."""
    images = calibration_images(contract)
    with torch.inference_mode():
        want = _verdicts(fp32, contract, images)
        got = _verdicts(int8, contract, images)
    disagreeing = tuple(i.name for i, a, b in zip(images, want, got, strict=True)
                        if a.flagged_labels != b.flagged_labels)
    largest = max((abs(a.scores[label] - b.scores[label]) for a, b in zip(want, got, strict=True)
                   for label in a.scores), default=0.0)
    check = Int8Check(len(images), len(images) - len(disagreeing), largest, disagreeing)
    log.info("int8 model checked against fp32 model=%s images=%d agreement=%.3f largest_score_difference=%.4f "
             "disagreeing=%s", contract.name, check.images, check.agreement, largest, list(disagreeing))
    if check.agreement < min_agreement:
        raise OperatorError(
            f"runtime.precision = \"int8\": the quantised {contract.name} gives the fp32 model's verdict on "
            f"{check.agreeing} of {check.images} sample images ({check.agreement:.3f}), below model.int8_min_agreement "
            f"= {min_agreement} (differing: {', '.join(disagreeing)}; largest score difference {largest:.4f}); run "
            "this model in fp32, or lower model.int8_min_agreement if these differences are acceptable",
            setting="runtime.precision")
    return check


def calibration_images(contract: ModelContract) -> list[CalibrationImage]:
    """The sample photos and their crops, preprocessed as the worker does (Preprocessor, then Normaliser)."""
    try:
        from worker.photos import PHOTOS, photo

        photos = [(name, photo(name)) for name in PHOTOS]
    except ImportError as exc:
        raise ModelContractError(f"runtime.precision = \"int8\" calibrates on the sample photos of scikit-image, "
                                 f"which is not installed ({exc.name}): pip install 'streamfer[models]'",
                                 setting="runtime.precision") from None
    preprocessor, normaliser = Preprocessor(contract), Normaliser(contract)
    images = []
    for name, pixels in photos:
        for crop, (top, left, bottom, right) in CROPS:
            h, w = pixels.shape[:2]
            cut = np.ascontiguousarray(pixels[int(top * h):int(bottom * h), int(left * w):int(right * w)])
            if contract.input_size is None:  # a model of any size sees the default warm-up size
                from PIL import Image

                cut = np.asarray(Image.fromarray(cut).resize(VALIDATION_HW[::-1], Image.Resampling.BILINEAR))
            frame = _raw_frame(cut)
            batch = preprocessor.prepare([frame], frame.shape)
            with torch.inference_mode():
                x = normaliser(batch.pixels, batch.regions).contiguous().numpy().copy()
            batch.release()
            images.append(CalibrationImage(f"{name}-{crop}", (frame.height, frame.width), x))
    return images


def _verdicts(model: Model, contract: ModelContract, images: Sequence[CalibrationImage]) -> list[Verdict]:
    out = [model(torch.from_numpy(i.input)).numpy().copy() for i in images]
    if contract.detects:
        return [detection_verdict(contract, dets[0]) for i, raw in zip(images, out, strict=True)
                for dets in [decode_detections(raw, [input_transform(contract, i.frame_hw)], contract)]]
    scores = apply_activation(torch.from_numpy(np.concatenate(out)), contract.activation).numpy()
    return contract.verdicts(scores)


def _quantize(path: Path, input_name: str, target: Path, images: Sequence[CalibrationImage]) -> None:
    """quantize_static into a file next to `target`, then renamed onto it (a concurrent start never reads half)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self, name: str) -> None:
            self._items: Iterator[np.ndarray] = iter(i.input for i in images)
            self._name = name

        def get_next(self) -> dict[str, np.ndarray] | None:
            item = next(self._items, None)
            return None if item is None else {self._name: item}

    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
    os.close(fd)
    try:
        quantize_static(str(path), tmp, Reader(input_name), quant_format=QuantFormat.QDQ, per_channel=False,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, reduce_range=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _raw_frame(pixels: np.ndarray) -> Frame:
    h, w, c = pixels.shape
    return Frame(stream_id="int8-calibration", frame_index=0, tenant="", priority=Priority.BULK, capture_ts_ms=0,
                 width=w, height=h, channels=c, encoding=Encoding.RAW_RGB8, data=pixels.tobytes(),
                 source=SourceRef("", 0, 0))


def _ort_version() -> str:
    import onnxruntime

    return str(onnxruntime.__version__)
