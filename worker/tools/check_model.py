"""`worker check-model`: would the worker start with this model, and what does it make of real images?

It takes the settings `worker run` takes (`--config`, `WORKER_*`; `--model` sets model.source) and starts the
runtime with the worker's own code, `worker.runtime.start_runtime` (model source, contract, ONNX cache, the
host-sync check, warm-up with, on a GPU, the CUDA-graph captures). A model this accepts is one the worker
accepts, and a refusal is the worker's own error. Then it scores images the way the worker scores frames
(each encoded as a JPEG frame message, decoded by the worker's frame decoder, preprocessed and run by the
executor) and times one batch per CUDA-graph bucket. It never contacts Kafka.

With a model set (`[models.<name>]`) every model is loaded, described and run, each image's line carrying each
model's output.

Exit codes (docs/operations.md): 0 the worker would start and every image has scores; 1 it would start, but an
image got none (each is named); 2 it would not start here (the reason, naming the setting), host syncs were
found with --require-graphs, or the arguments are wrong; 70 an unexpected error (a bug: one line naming what
failed, the traceback with --verbose).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from worker.codec.schemas import FrameRecord, MessageDecodeError, decode_frame, encode_frame
from worker.config import ModelSettings, Settings, load_settings, warmup_frame_shapes
from worker.errors import EXIT_INTERNAL_ERROR, EXIT_OPERATOR_ERROR, OperatorError, StartError
from worker.frames import Encoding, Frame, Priority, SourceRef
from worker.photos import PHOTOS, photo
from worker.runtime import InferenceExecutor, ModelContract
from worker.runtime.cascade import describe_outputs
from worker.runtime.engine import engine_of
from worker.runtime.hostsync import HOST_SYNC_FIX, HostSync, HostSyncError
from worker.runtime.quantize import int8_decisions
from worker.runtime.start import start_runtime
from worker.tools.publish_frames import DEFAULT_JPEG_QUALITY, IMAGE_SUFFIXES, encode_pixels

EXIT_OK = 0
EXIT_IMAGE_NOT_SCORED = 1
EXIT_WOULD_NOT_START = EXIT_OPERATOR_ERROR
EXIT_CRASHED = EXIT_INTERNAL_ERROR
# On a CPU, batches above this many frames are not timed unless --max-batch says so: open_nsfw (a ResNet-50)
# takes 35-55 ms a frame on 2 cores, and CPU numbers only say whether a model is in the right range.
CPU_TIMED_BATCH_MAX = 8
# Timed runs per batch size, after one untimed run (first-call costs, a lazy capture); the median is reported.
TIMING_ROUNDS = 3
SAMPLE_STREAM = "check-model"

log = logging.getLogger(__name__)


class CheckInputError(OperatorError):
    """The images to score cannot be found (not the model's fault): exit 2, naming the argument."""


@dataclass(frozen=True)
class SampleImage:
    """An image to score: RGB pixels, or why the file could not be read."""

    name: str
    pixels: np.ndarray | None = field(default=None, repr=False)
    error: str = ""


@dataclass(frozen=True)
class ImageScore:
    """The worker's verdict on one image, or why it got none: the error type the worker would dead-letter it with
    (as in frames.dlq), or "unreadable" for a file Pillow cannot read."""

    name: str
    width: int
    height: int
    scores: dict[str, float] = field(default_factory=dict)
    flagged: tuple[str, ...] = ()
    error_type: str = ""
    error: str = ""
    # A model set's per-model outputs, a detector's boxes (worker.runtime.cascade.describe_outputs), one line each.
    outputs: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"image": self.name, "width": self.width, "height": self.height}
        if self.error_type:
            return {**out, "error_type": self.error_type, "error": self.error}
        return {**out, "scores": {k: round(v, 6) for k, v in self.scores.items()}, "flagged": list(self.flagged),
                **({"outputs": list(self.outputs)} if self.outputs else {})}


@dataclass(frozen=True)
class Spread:
    """Median, min and max of a few timed runs, in milliseconds."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values))

    def to_json(self) -> dict[str, float]:
        return {"median": round(self.median, 3), "min": round(self.low, 3), "max": round(self.high, 3)}


@dataclass(frozen=True)
class BatchTiming:
    """One batch size timed through the executor: its inference (the runner: graph replay or eager forward, and
    the scores back on the host) and its preprocessing (decode, resize, the copy to the device)."""

    size: int
    bucket: int
    used_graph: bool
    inference_ms: Spread
    preprocess_ms: Spread
    not_scored: int = 0  # frames of the batch that came back as failures (should be 0)

    @property
    def frames_per_s(self) -> float:
        return self.size * 1000.0 / self.inference_ms.median if self.inference_ms.median > 0 else float("inf")

    def to_json(self) -> dict[str, Any]:
        return {"batch_size": self.size, "bucket": self.bucket, "used_graph": self.used_graph,
                "inference_ms": self.inference_ms.to_json(), "preprocess_ms": self.preprocess_ms.to_json(),
                "frames_per_s": round(self.frames_per_s, 1), "not_scored": self.not_scored}


@dataclass(frozen=True)
class GraphStatus:
    """Whether the model runs in CUDA graphs here, and whether it would where the worker uses them."""

    used: bool  # CUDA graphs are used on this machine with these settings
    captured: int  # graphs captured at warm-up here
    would_capture: bool  # no host syncs (and, where used, every capture succeeded)
    note: str


@dataclass(frozen=True)
class Refusal:
    """Why the worker would not start: its own error, with the setting to change."""

    error_type: str
    message: str
    setting: str | None
    by_require_graphs: bool = False  # host syncs made fatal by --require-graphs (the worker would start here)

    @classmethod
    def of(cls, exc: OperatorError, by_require_graphs: bool = False) -> Refusal:
        return cls(type(exc).__name__, exc.message, exc.setting, by_require_graphs)

    def render(self) -> str:
        where = f" (change: {self.setting})" if self.setting and self.setting not in self.message else ""
        return f"{self.message}{where}"


@dataclass
class CheckedModel:
    """One model the worker would run (the only one, or one of a set): its settings' contract, and how it loaded."""

    name: str
    source: str
    contract: ModelContract
    runs_if: str = ""  # a cascade's condition, as a person reads it
    kind: str = ""
    load_seconds: float = 0.0  # reading / converting the model

    @classmethod
    def of(cls, m: ModelSettings) -> CheckedModel:
        runs_if = f"{m.run_if_model} scored {m.run_if_label} >= {m.run_if_score:g}" if m.run_if_model else ""
        return cls(m.name, m.source, ModelContract.from_settings(m), runs_if)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "kind": self.kind, "runs_if": self.runs_if,
                "load_seconds": round(self.load_seconds, 3), "contract": contract_json(self.contract)}


@dataclass
class CheckReport:
    """Everything `worker check-model` found, in the order it found it; later parts are empty after a refusal."""

    source: str = ""
    models: list[CheckedModel] = field(default_factory=list)  # one, or each of a set in its order
    device: str = ""
    int8: tuple[str, ...] = ()  # runtime.precision = "int8": the start's decision per model, with its reasons
    start_seconds: float = 0.0  # load, validation, host-sync check and warm-up: what `worker run` spends too
    host_syncs: tuple[HostSync, ...] | None = None  # None: not checked (refused before)
    require_graphs: bool = False
    graphs: GraphStatus | None = None
    images_from: str = ""
    scores: list[ImageScore] = field(default_factory=list)
    timing: list[BatchTiming] = field(default_factory=list)
    timing_how: str = ""  # where and how the batches were timed; "" when timing did not run
    not_timed: tuple[int, ...] = ()  # buckets left out
    not_timed_why: str = ""
    refused: Refusal | None = None
    crashed: str = ""  # an unexpected error, in one line naming what failed

    @property
    def contract(self) -> ModelContract | None:
        """The first model's (the only one's)."""
        return self.models[0].contract if self.models else None

    @property
    def kind(self) -> str:
        return "+".join(m.kind for m in self.models if m.kind)

    @property
    def exit_code(self) -> int:
        if self.crashed:
            return EXIT_CRASHED
        if self.refused is not None:
            return EXIT_WOULD_NOT_START
        return EXIT_IMAGE_NOT_SCORED if any(s.error_type for s in self.scores) else EXIT_OK

    def to_json(self) -> dict[str, Any]:
        return {
            "would_start": self.refused is None and not self.crashed,
            "exit_code": self.exit_code,
            "refused": dataclasses.asdict(self.refused) if self.refused else None,
            "crashed": self.crashed or None,
            "model": {"source": self.source, "kind": self.kind, "device": self.device, "int8": list(self.int8),
                      "load_seconds": round(sum(m.load_seconds for m in self.models), 3),
                      "start_seconds": round(self.start_seconds, 3)},
            "contract": contract_json(self.contract) if self.contract else None,
            "models": [m.to_json() for m in self.models],
            "host_syncs": None if self.host_syncs is None else [dataclasses.asdict(f) for f in self.host_syncs],
            "cuda_graphs": dataclasses.asdict(self.graphs) if self.graphs else None,
            "images_from": self.images_from,
            "scores": [s.to_json() for s in self.scores],
            "timing": {"how": self.timing_how, "batches": [t.to_json() for t in self.timing],
                       "not_timed": list(self.not_timed), "not_timed_why": self.not_timed_why},
        }

    def render(self) -> str:
        lines: list[str] = []
        started = f", ready in {self.start_seconds:.1f} s" if self.graphs else ""
        device = [f"device       {self.device}"] if self.device else []
        device += [f"int8         {line}" for line in self.int8]
        if len(self.models) > 1:
            lines.append(f"models       {len(self.models)}, in this order: {', '.join(m.name for m in self.models)}; "
                         f"each frame decoded once, one verdict{started}")
            lines += device
        for m in self.models:
            c = m.contract
            loaded = f", {m.kind} model, loaded in {m.load_seconds:.1f} s" if m.kind else ""
            lines.append(f"model        {m.source}: {c.name} {c.version}{loaded}"
                         f"{started if len(self.models) == 1 else ''}")
            if len(self.models) == 1:
                lines += device
            if m.runs_if:
                lines.append(f"runs if      {m.runs_if} (else skipped, the reason in the result)")
            lines.append(f"input        {describe_input(c)}")
            lines.append(f"output       {describe_output(c)}")
        if self.host_syncs is not None:
            lines.append(f"host syncs   {len(self.host_syncs) or 'none'} found in forward")
            lines.extend(f"  {f.describe()}" for f in self.host_syncs)
        if self.graphs is not None:
            lines.append(f"CUDA graphs  {self.graphs.note}")
        if self.scores:
            lines += ["", f"scores of {self.images_from}", *_score_table(self.scores)]
        if self.timing_how:
            lines += ["", f"timing       {self.timing_how}"]
            if self.not_timed:
                hint = " (--max-batch N)" if self.not_timed_why == "on a CPU" else ""
                sizes = ", ".join(map(str, self.not_timed))
                lines.append(f"             not timed {self.not_timed_why}: {sizes}{hint}")
            lines.extend(_timing_table(self.timing, graphs=bool(self.graphs and self.graphs.used)))
        lines += ["", self.verdict()]
        return "\n".join(lines)

    def verdict(self) -> str:
        code = f"exit {self.exit_code}"
        if self.crashed:
            return f"crashed ({code}): {self.crashed} (the traceback: --verbose)"
        if self.refused is not None:
            if self.refused.error_type == HostSyncError.__name__ and self.host_syncs:
                # The places are listed above: the reason without them.
                where = "with --require-graphs" if self.refused.by_require_graphs else "where CUDA graphs are used"
                return (f"would not start ({code}) {where}: the forward reads device values on the host (above), "
                        f"which no CUDA graph can capture; {HOST_SYNC_FIX}, or set runtime.cuda_graphs = false "
                        "to run it eager")
            return f"would not start ({code}): {self.refused.render()}"
        failed = [f"{s.name} ({s.error_type})" for s in self.scores if s.error_type]
        if failed:
            return f"would start, but {len(failed)} image(s) got no score ({code}): {', '.join(failed)}"
        if self.graphs is not None and not self.graphs.would_capture:
            return (f"would start here, eager ({code}); would not start on a GPU with runtime.cuda_graphs = true "
                    "(--require-graphs: exit 2 here)")
        return f"ok: the worker would start with this model ({code})"


def check_model(config: str | None, source: str | None, images: Sequence[SampleImage], images_from: str,
                require_graphs: bool = False, max_batch: int | None = None) -> CheckReport:
    """Start the runtime as `worker run` would (settings from `config`, the environment, and `source` for
    model.source), score `images` (described by `images_from`) and time the buckets; see the module doc."""
    report = CheckReport(source=source or "", require_graphs=require_graphs, images_from=images_from)
    try:
        settings = load_settings(config, overrides={"model": {"source": source}})
    except OperatorError as exc:
        report.refused = Refusal.of(exc)
        return report
    report.source = settings.model.source
    report.models = [CheckedModel.of(m) for m in settings.models or (settings.model,)]
    step = "starting the runtime"
    try:
        executor = _start(settings, report)
        if executor is None:
            return report
        with executor:
            step = "scoring the images"
            report.scores = score_images(executor, images, settings)
            step = "timing the batches"
            _time_buckets(executor, settings, images, max_batch, report)
    except StartError as exc:  # the runtime's own account of what failed
        log.debug("start-up failed", exc_info=exc)
        report.crashed = str(exc)
    except Exception as exc:  # a bug: one line here, the traceback in the debug log
        log.debug("%s failed", step, exc_info=exc)
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else "no message"
        report.crashed = f"check-model failed {step}: {type(exc).__name__}: {text}"
    return report


def _start(settings: Settings, report: CheckReport) -> InferenceExecutor | None:
    """The worker's start-up, model side (worker.runtime.start_runtime: load, contract, host-sync check, the
    in-flight limit for its runners, warm-up with, on a GPU, the CUDA-graph captures), without the calibration,
    which seeds only the batcher: this tool times its own batches. None when refused."""
    t0 = time.perf_counter()

    def loaded(executor: InferenceExecutor) -> None:
        report.host_syncs = executor.host_syncs
        for checked, loaded in zip(report.models, executor.loaded):
            checked.kind, checked.load_seconds = loaded.kind, loaded.load_seconds
        report.device = executor.device_description
        names = {c.contract.name for c in report.models}
        report.int8 = tuple(f"{d.model}: {d.describe()}" for d in int8_decisions().values() if d.model in names)
        if executor.host_syncs and report.require_graphs:
            raise _RefusedByRequireGraphs(HostSyncError(report.kind, executor.host_syncs))

    try:
        executor = start_runtime(settings, before_warm_up=loaded, calibrate=False).executor
    except _RefusedByRequireGraphs as exc:
        report.refused = Refusal.of(exc.error, by_require_graphs=True)
        return None
    except HostSyncError as exc:
        report.host_syncs = exc.findings
        report.refused = Refusal.of(exc)
        return None
    except OperatorError as exc:
        report.refused = Refusal.of(exc)
        return None
    report.start_seconds = time.perf_counter() - t0
    report.graphs = graph_status(executor.runners[0].device.type, settings.runtime.cuda_graphs,
                                 bool(executor.preferred_batch_sizes), executor.capture_count,
                                 bool(executor.host_syncs), executor.preferred_batch_sizes)
    return executor


class _RefusedByRequireGraphs(Exception):
    """--require-graphs refuses a model the worker would run eager: start-up stops before the warm-up."""

    def __init__(self, error: HostSyncError) -> None:
        super().__init__(str(error))
        self.error = error


def graph_status(device_type: str, graphs_enabled: bool, graphs_used: bool, captured: int, host_syncs: bool,
                 buckets: Sequence[int] = ()) -> GraphStatus:
    """What to say about CUDA graphs once the runtime has started (a refusal never gets here)."""
    if graphs_used:
        return GraphStatus(True, captured, True, f"yes: {captured} captured at warm-up (buckets {list(buckets)})")
    on_gpu_with_graphs = "on a GPU with runtime.cuda_graphs = true"
    if device_type == "cpu":
        here = "not used on a CPU"
    else:
        here = "not used here (runtime.cuda_graphs = false)" if not graphs_enabled else "not used here"
    if host_syncs:
        return GraphStatus(False, 0, False, f"{here}; {on_gpu_with_graphs} the worker refuses this model (the host "
                           "syncs above)")
    return GraphStatus(False, 0, True, f"{here}; {on_gpu_with_graphs} it would be captured (no host syncs; the "
                       "capture itself is tried on a GPU only)")


# --- images ---

def load_images(folder: str | None) -> tuple[list[SampleImage], str]:
    """The images to score and a line saying what they are: those in `folder`, else the scikit-image photos."""
    sent_as = f"each sent as a JPEG frame (quality {DEFAULT_JPEG_QUALITY}, as `worker produce` sends it)"
    if folder is not None:
        images = folder_images(Path(folder))
        return images, f"{len(images)} images in {folder}, {sent_as}"
    return sample_photos(), f"{len(PHOTOS)} scikit-image photos, {sent_as}"


def sample_photos() -> list[SampleImage]:
    """scikit-image's bundled public-domain photos (the demo's and the tests'; nothing is downloaded)."""
    if importlib.util.find_spec("skimage") is None:
        raise CheckInputError("the sample photos come from scikit-image, which is not installed: "
                              "pip install 'streamfer[models]' (./dev setup does), or give --images DIR")
    return [SampleImage(name, photo(name)) for name in PHOTOS]


def folder_images(folder: Path) -> list[SampleImage]:
    """The images in `folder` (the suffixes `worker produce --from-folder` sends), in name order, as RGB; a file
    Pillow cannot read is kept with the reason, so it is reported beside the others."""
    if not folder.is_dir():
        raise CheckInputError(f"--images {folder}: not a folder")
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise CheckInputError(f"--images {folder}: no images ({', '.join(sorted(IMAGE_SUFFIXES))}) in it")
    out = []
    for path in files:
        try:
            with Image.open(path) as img:
                out.append(SampleImage(path.name, np.asarray(img.convert("RGB"))))
        except (OSError, ValueError, Image.DecompressionBombError) as exc:
            out.append(SampleImage(path.name, error=f"Pillow cannot read it: {exc}"))
    return out


def jpeg_frame(pixels: np.ndarray, index: int, settings: Settings) -> Frame:
    """The frame the worker decodes from a message carrying `pixels` as a JPEG (as `worker produce` sends them):
    encoded, Avro-encoded, then decoded and checked against settings.limits. Raises MessageDecodeError where the
    worker would dead-letter the message."""
    h, w = pixels.shape[:2]
    record = FrameRecord(stream_id=SAMPLE_STREAM, frame_index=index, capture_ts_ms=int(time.time() * 1000),
                         tenant=SAMPLE_STREAM, priority=Priority.STANDARD, width=w, height=h, channels=3,
                         encoding=Encoding.JPEG, data=encode_pixels(pixels, Encoding.JPEG, DEFAULT_JPEG_QUALITY))
    return decode_frame(encode_frame(record), SourceRef(SAMPLE_STREAM, 0, index), Priority.STANDARD, time.time(),
                        settings.limits)


# --- scoring and timing ---

def score_images(executor: InferenceExecutor, images: Sequence[SampleImage], settings: Settings) -> list[ImageScore]:
    """Each image as its own batch of its own shape (what the worker runs for a frame alone): its verdict, or the
    reason and error type of the dead letter the worker would write instead."""
    out = []
    for index, image in enumerate(images):
        if image.pixels is None:
            out.append(ImageScore(image.name, 0, 0, error_type="unreadable", error=image.error))
            continue
        h, w = image.pixels.shape[:2]
        try:
            frame = jpeg_frame(image.pixels, index, settings)
        except MessageDecodeError as exc:
            out.append(ImageScore(image.name, w, h, error_type="MessageDecodeError", error=str(exc)))
            continue
        outcome = executor.submit([frame], frame.shape).result()
        if outcome.verdicts:
            verdict = outcome.verdicts[0][1]
            out.append(ImageScore(image.name, w, h, dict(verdict.scores), verdict.flagged_labels,
                                  outputs=describe_outputs(verdict)))
        else:
            failure = outcome.failures[0]
            out.append(ImageScore(image.name, w, h, error_type=failure.error_type, error=failure.reason))
    return out


def timed_sizes(buckets: Sequence[int], on_cpu: bool, max_batch: int | None) -> tuple[list[int], list[int]]:
    """(sizes to time, sizes left out) of the buckets: all on a GPU, up to CPU_TIMED_BATCH_MAX on a CPU, up to
    `max_batch` when given (0: none)."""
    limit = max_batch if max_batch is not None else (CPU_TIMED_BATCH_MAX if on_cpu else None)
    sizes = sorted(set(buckets))
    timed = [n for n in sizes if limit is None or n <= limit]
    return timed, [n for n in sizes if n not in timed]


def time_batches(submit: Callable[[list[Frame]], Any], frames: Sequence[Frame], sizes: Sequence[int],
                 rounds: int = TIMING_ROUNDS) -> list[BatchTiming]:
    """Per size, one untimed batch then `rounds` timed ones of `frames` cycled; `submit` runs a batch and returns
    its BatchOutcome (the executor's submit(...).result())."""
    out = []
    for n in sizes:
        batch = [frames[i % len(frames)] for i in range(n)]
        submit(batch)
        outcomes = [submit(batch) for _ in range(rounds)]
        last = outcomes[-1]
        out.append(BatchTiming(n, last.bucket, last.used_graph, Spread.of([o.inference_ms for o in outcomes]),
                               Spread.of([o.preprocess_ms for o in outcomes]),
                               not_scored=max(len(o.failures) for o in outcomes)))
    return out


def _time_buckets(executor: InferenceExecutor, settings: Settings, images: Sequence[SampleImage],
                  max_batch: int | None, report: CheckReport) -> None:
    """Batches of runtime.graph_batch_sizes frames of the first warm-up shape (what graphs are captured for), made
    from the images that scored, resized to it and sent as JPEG frames."""
    on_cpu = executor.runners[0].device.type == "cpu"
    sizes, not_timed = timed_sizes(settings.runtime.graph_batch_sizes, on_cpu, max_batch)
    report.not_timed = tuple(not_timed)
    report.not_timed_why = "on a CPU" if on_cpu and max_batch is None else "above --max-batch"
    h, w, _ = warmup_frame_shapes(settings)[0]
    usable = [image.pixels for image, score in zip(images, report.scores)
              if image.pixels is not None and not score.error_type]
    mode = "CUDA graphs" if report.graphs is not None and report.graphs.used else engine_of(executor.runners[0])
    devices = executor.device_description.rsplit(", ", 3)[0]  # before ", precision, mode, kind model"
    one_runner = f", one batch at a time on one of {executor.runner_count} runners" if executor.runner_count > 1 else ""
    report.timing_how = (f"{devices}, {mode}: {w}x{h} JPEG frames (the first "
                         f"runtime.warmup_shapes), median of {TIMING_ROUNDS} runs (min-max){one_runner}")
    if not sizes:
        return
    if not usable:
        report.timing_how += "; nothing timed: no image scored"
        return
    try:
        frames = [jpeg_frame(np.asarray(Image.fromarray(p).resize((w, h), Image.Resampling.BILINEAR)), i, settings)
                  for i, p in enumerate(usable)]
    except MessageDecodeError as exc:
        report.timing_how += f"; nothing timed: the worker refuses a {w}x{h} frame ({exc})"
        return
    shape = frames[0].shape
    report.timing = time_batches(lambda batch: executor.submit(batch, shape).result(), frames, sizes)


# --- rendering ---

def describe_input(c: ModelContract) -> str:
    """The preprocessing contract in one line, as the worker applies it."""
    colour = c.channel_order if c.channels == 3 else "grey"
    size = "any size (frames batched by shape)" if c.input_size is None else _wxh(c.input_size)
    text = (f"{size} {c.input_layout} {colour}, pixels {c.pixel_range}, mean {_numbers(c.mean)}, "
            f"std {_numbers(c.std)}")
    if c.input_size is not None:
        if c.resize == "stretch_crop" and c.resize_to is not None:
            text += f"; frames stretched to {_wxh(c.resize_to)}, centre crop"
        elif c.resize == "shorter_side_crop":
            text += f"; frames' shorter side to {c.resize_shorter_side}, centre crop"
        else:
            text += f"; frames {'letterboxed' if c.resize == 'letterbox' else 'stretched'}"
    if c.jpeg_roundtrip_quality:
        text += f"; JPEG round trip at quality {c.jpeg_roundtrip_quality}"
    return text


def describe_output(c: ModelContract) -> str:
    flaggable = [label for label in c.labels if label not in c.never_flag]
    each = ", ".join(f"{label} >= {c.threshold_for(label):g}" for label in flaggable) or "no label"
    if c.detects:  # many labels, few of them flaggable: those are named
        return (f"boxes of {len(c.labels)} labels (score >= {c.score_threshold:g}, NMS IoU {c.iou_threshold:g}, "
                f"at most {c.max_detections}); a label's score is its best box's; flags at {each}")
    thresholds = {c.threshold_for(label) for label in flaggable}
    flags = f"{thresholds.pop():g} (any label)" if len(thresholds) == 1 and len(flaggable) > 1 else each
    text = f"{', '.join(c.labels)} (activation {c.activation}); flags at {flags}"
    if c.never_flag:
        text += f"; never flags {', '.join(label for label in c.labels if label in c.never_flag)}"
    return text


def contract_json(c: ModelContract) -> dict[str, Any]:
    out = dataclasses.asdict(c)
    out["thresholds"] = {label: c.threshold_for(label) for label in c.labels}
    out["never_flag"] = [label for label in c.labels if label in c.never_flag]
    for key in ("labels", "input_size", "mean", "std", "resize_to"):
        out[key] = list(out[key]) if out[key] is not None else None
    return out


def _score_table(scores: Sequence[ImageScore]) -> list[str]:
    """One row per image: its size and a column per label, or why it was not scored."""
    labels = next((list(s.scores) for s in scores if s.scores), [])
    name_width = max(len("image"), *(len(s.name) for s in scores))
    widths = [max(6, len(label)) for label in labels]
    head = "  ".join(f"{label:>{w}}" for label, w in zip(labels, widths))
    lines = [f"  {'image':<{name_width}}  {'size':>9}  {head}  flagged"]
    for s in scores:
        size = f"{s.width}x{s.height}" if s.width else ""
        if s.error_type:
            lines.append(f"  {s.name:<{name_width}}  {size:>9}  not scored, {s.error_type}: {s.error}")
            continue
        values = "  ".join(f"{s.scores[label]:>{w}.4f}" for label, w in zip(labels, widths))
        lines.append(f"  {s.name:<{name_width}}  {size:>9}  {values}  {', '.join(s.flagged) or '-'}")
        lines.extend(f"  {'':<{name_width}}  {'':>9}  {line}" for line in s.outputs)
    return lines


def _timing_table(timing: Sequence[BatchTiming], graphs: bool) -> list[str]:
    if not timing:
        return []
    lines = [f"  batch  {'bucket  graph  ' if graphs else ''}inference ms (min-max)  ms/frame  frames/s  "
             "preprocess ms"]
    for t in timing:
        spread = f"{t.inference_ms.median:.1f} ({t.inference_ms.low:.1f}-{t.inference_ms.high:.1f})"
        graph = f"{t.bucket:>6}  {'yes' if t.used_graph else 'no':>5}  " if graphs else ""
        failed = f"  {t.not_scored} not scored" if t.not_scored else ""
        lines.append(f"  {t.size:>5}  {graph}{spread:<22}  {t.inference_ms.median / t.size:>8.1f}  "
                     f"{t.frames_per_s:>8.1f}  {t.preprocess_ms.median:>13.1f}{failed}")
    return lines


def _wxh(hw: tuple[int, int]) -> str:
    return f"{hw[1]}x{hw[0]}"


def _numbers(values: Sequence[float]) -> str:
    return "[" + ", ".join(f"{v:g}" for v in values) + "]"
