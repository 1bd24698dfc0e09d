"""What the benchmarks feed the worker: the workloads (frame shapes, encodings, priorities) and the models.

No Kafka here: the GPU check (bench/gpu_check.py) uses the same definitions on a machine without a broker.

    mixed      the original workload: three priorities, raw RGB and JPEG, 96-320 px frames, any-size model
    jpeg224 / jpeg360 / jpeg720 / jpeg1080
               one camera-like stream shape as JPEG (224x224, 640x360, 1280x720, 1920x1080) on the standard
               topic, each resized into a 224x224 model input: decode and resize cost grow, the model's does not
    jpeg720+1080
               half 1280x720, half 1920x1080 JPEG on the standard topic into a 224x224 input: two frame sizes
               that one batch of a fixed-input model can hold (settings_ab.py --in-step: the batch sizes on it)
    null       a slice of the input as scores (bench/nullmodel.py): next to nothing, so what is measured is the
               pipeline's own cost
    toy        the builtin CNN: a small model (about 1 CPU-ms a frame at 224x224 here)
    opennsfw   Yahoo's open_nsfw ResNet-50 preset (the `models` extra): a real model's cost
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from worker.frames import Encoding, Priority


@dataclass(frozen=True)
class ClassLoad:
    share: float  # of all frames
    encoding: Encoding
    shapes: tuple[tuple[int, int], ...]  # (width, height), cycled


@dataclass(frozen=True)
class Workload:
    name: str
    classes: dict[Priority, ClassLoad]
    # The toy model's fixed input (height, width); None: it takes each frame's own size (batched by shape).
    toy_input_hw: tuple[int, int] | None
    note: str

    def describe(self) -> dict[str, Any]:
        return {p.label: {"share": c.share, "encoding": c.encoding.value,
                          "shapes_wxh": [f"{w}x{h}" for w, h in c.shapes]} for p, c in self.classes.items()}

    def label(self) -> str:
        return "; ".join(f"{p.label} {c.share:.0%} {c.encoding.value} {'/'.join(f'{w}x{h}' for w, h in c.shapes)}"
                         for p, c in self.classes.items())


def _jpeg(name: str, *shapes: tuple[int, int]) -> Workload:
    sizes = " and ".join(f"{w}x{h}" for w, h in shapes)
    return Workload(name, {Priority.STANDARD: ClassLoad(1.0, Encoding.JPEG, shapes)}, (224, 224),
                    f"{sizes} JPEG, standard priority, resized into a 224x224 model input")


WORKLOADS: dict[str, Workload] = {
    # Mixed shapes on three priorities, sized like downscaled video frames. Standard frames arrive as JPEG
    # (decoded in the worker's preprocessing pool), the others as raw RGB.
    "mixed": Workload("mixed", {
        Priority.REALTIME: ClassLoad(0.2, Encoding.RAW_RGB8, ((160, 120), (128, 96))),
        Priority.STANDARD: ClassLoad(0.4, Encoding.JPEG, ((320, 240), (224, 224))),
        Priority.BULK: ClassLoad(0.4, Encoding.RAW_RGB8, ((320, 240), (224, 224))),
    }, None, "three priorities, raw RGB and JPEG, 96-320 px"),
    "jpeg224": _jpeg("jpeg224", (224, 224)),
    "jpeg360": _jpeg("jpeg360", (640, 360)),
    "jpeg720": _jpeg("jpeg720", (1280, 720)),
    "jpeg1080": _jpeg("jpeg1080", (1920, 1080)),
    "jpeg720+1080": _jpeg("jpeg720+1080", (1280, 720), (1920, 1080)),
}
JPEG_WORKLOADS = ("jpeg224", "jpeg360", "jpeg720", "jpeg1080")

MODELS: dict[str, str] = {
    "null": "a slice of the input as scores (near-zero model: the pipeline's own cost)",
    "toy": "the builtin CNN (a small model)",
    "opennsfw": "open_nsfw ResNet-50 preset (a real model)",
}


def model_settings(model: str, workload: Workload) -> dict[str, Any]:
    """The [model] settings of a benchmark model for a workload (as load_settings overrides)."""
    size = {"input_size": list(workload.toy_input_hw)} if workload.toy_input_hw else {}
    if model == "null":
        return {"source": "bench.nullmodel:null_model", **size}
    if model == "toy":
        return {"source": "builtin", **size}
    if model == "opennsfw":
        return {"source": "opennsfw"}  # the preset brings its own 224x224 input and preprocessing
    raise ValueError(f"unknown benchmark model {model!r}; known: {', '.join(MODELS)}")


def model_env(settings: dict[str, Any]) -> dict[str, str]:
    """The same settings as WORKER_MODEL_* environment variables, for a worker process."""
    return {f"WORKER_MODEL_{k.upper()}": ",".join(str(x) for x in v) if isinstance(v, (list, tuple)) else str(v)
            for k, v in settings.items()}
