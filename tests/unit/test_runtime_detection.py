"""Detector outputs: YOLOv8-style decoding with NMS, boxes mapped back through each resize mode, and the nudenet
preset against the nudenet package's own onnxruntime detections on the sample photos.

The package comparison needs the `models` extra (onnx, onnx2torch, onnxruntime, nudenet, scikit-image) and OpenCV
(nudenet's own preprocessing); skipped with the reason when one is missing.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.unit.photo_frames import frame_of
from worker.config import MODEL_PRESETS, ModelSettings, load_settings
from worker.frames import Encoding, Frame
from worker.runtime.contract import ModelContract
from worker.runtime.detection import decode_detections, detection_verdict, input_transform
from worker.runtime.fitting import fit_to_input
from worker.runtime.normalise import Normaliser
from worker.runtime.preprocess import Preprocessor

NUDENET_MISSING = [m for m in ("onnx", "onnx2torch", "onnxruntime", "nudenet", "cv2", "skimage")
                   if importlib.util.find_spec(m) is None]
NEEDS_NUDENET = pytest.mark.skipif(bool(NUDENET_MISSING), reason=f"needs the models extra and OpenCV "
                                   f"({', '.join(NUDENET_MISSING)} missing): pip install -e '.[models]'")
# The package's box is int()-truncated [x, y, w, h] of float coordinates: ours may be up to a pixel above it, and
# we allow half a pixel more for float rounding. Scores: the same model on the same input, converted.
BOX_TOLERANCE_PX = 1.5
SCORE_TOLERANCE = 1e-3
LABELS = ("a", "b", "c")


def _contract(**kw: object) -> ModelContract:
    base: dict[str, object] = {"labels": LABELS, "output": "detections", "input_size": [100, 100],
                               "activation": "none", "mean": [0.0, 0.0, 0.0], "std": [1.0, 1.0, 1.0]}
    base.update(kw)
    return ModelContract.from_settings(ModelSettings(**base))  # type: ignore[arg-type]


def _raw(anchors: list[tuple[float, float, float, float, str, float]], n_anchors: int = 8) -> torch.Tensor:
    """One frame's [1, 4 + labels, anchors] output: (cx, cy, w, h, label, score) per anchor, the rest empty."""
    out = torch.zeros(1, 4 + len(LABELS), n_anchors)
    for i, (cx, cy, w, h, label, score) in enumerate(anchors):
        out[0, :4, i] = torch.tensor([cx, cy, w, h])
        out[0, 4 + LABELS.index(label), i] = score
    return out


def test_overlapping_boxes_of_one_label_keep_the_best_one():
    c = _contract(resize="stretch")
    raw = _raw([(50, 50, 20, 20, "a", 0.9), (51, 50, 20, 20, "a", 0.8), (20, 20, 10, 10, "a", 0.7)])
    dets = decode_detections(raw, [input_transform(c, (100, 100))], c)[0]
    assert [(d.label, round(d.score, 3)) for d in dets] == [("a", 0.9), ("a", 0.7)]


def test_overlapping_boxes_of_two_labels_both_stay_unless_nms_is_class_agnostic():
    raw = _raw([(50, 50, 20, 20, "a", 0.9), (51, 50, 20, 20, "b", 0.8)])
    per_label = _contract(resize="stretch")
    agnostic = _contract(resize="stretch", class_agnostic_nms=True)
    assert [d.label for d in decode_detections(raw, [input_transform(per_label, (100, 100))], per_label)[0]] == \
        ["a", "b"]
    assert [d.label for d in decode_detections(raw, [input_transform(agnostic, (100, 100))], agnostic)[0]] == ["a"]


def test_boxes_below_the_score_threshold_and_beyond_max_detections_are_dropped():
    c = _contract(resize="stretch", score_threshold=0.5, max_detections=2)
    raw = _raw([(10, 10, 5, 5, "a", 0.4), (30, 30, 5, 5, "a", 0.6), (60, 60, 5, 5, "b", 0.7),
                (90, 90, 5, 5, "c", 0.55)])
    dets = decode_detections(raw, [input_transform(c, (100, 100))], c)[0]
    assert [d.score for d in dets] == pytest.approx([0.7, 0.6])


@pytest.mark.parametrize("resize,extra", [("stretch", {}), ("letterbox", {}), ("pad_stretch", {}),
                                          ("stretch_crop", {"resize_to": [120, 120]}),
                                          ("shorter_side_crop", {})])
def test_a_box_maps_back_to_where_the_object_is_in_the_frame(resize, extra):
    """A white rectangle drawn in a 80x200 frame, found in the model input as preprocessing placed it, decodes to
    the rectangle's frame coordinates (within the resize's blur)."""
    c = _contract(resize=resize, resampler="torch", **extra)
    frame = np.zeros((80, 200, 3), dtype=np.uint8)
    x0, y0, x1, y1 = 90, 20, 130, 60
    frame[y0:y1, x0:x1] = 255
    pixels, (top, left) = fit_to_input(frame, c)
    ys, xs = np.nonzero(pixels[:, :, 0] > 127)
    bx0, by0, bx1, by1 = xs.min() + left, ys.min() + top, xs.max() + 1 + left, ys.max() + 1 + top
    raw = _raw([((bx0 + bx1) / 2, (by0 + by1) / 2, bx1 - bx0, by1 - by0, "b", 0.9)])
    (det,) = decode_detections(raw, [input_transform(c, (80, 200))], c)[0]
    scale = max(200 / 100, 80 / 100)  # one input pixel in frame pixels, at most
    assert det.label == "b"
    np.testing.assert_allclose([det.x, det.y, det.x + det.width, det.y + det.height], [x0, y0, x1, y1],
                               atol=scale + 0.5)


def test_boxes_are_clipped_to_the_frame():
    c = _contract(resize="stretch")
    raw = _raw([(95, 5, 30, 30, "c", 0.9)])
    (det,) = decode_detections(raw, [input_transform(c, (50, 200))], c)[0]
    assert det.x + det.width == pytest.approx(200.0) and det.y == 0.0


def test_a_detectors_verdict_scores_each_label_by_its_best_box_and_flags_by_threshold():
    c = _contract(resize="stretch", thresholds={"a": 0.5, "b": 0.95}, never_flag=["c"])
    raw = _raw([(20, 20, 10, 10, "a", 0.6), (60, 60, 10, 10, "a", 0.8), (80, 20, 10, 10, "b", 0.9),
                (20, 80, 10, 10, "c", 0.99)])
    dets = decode_detections(raw, [input_transform(c, (100, 100))], c)[0]
    verdict = detection_verdict(c, dets)
    assert verdict.scores == pytest.approx({"a": 0.8, "b": 0.9, "c": 0.99})
    assert verdict.flagged_labels == ("a",) and len(verdict.detections) == 4


# --- the nudenet preset against the nudenet package ---

def sample_photos() -> dict[str, np.ndarray]:
    """scikit-image's photos (two with a face), and two made of them: a crop and a side-by-side pair (not square,
    so the pad before the resize matters)."""
    import skimage.data

    photos = {n: getattr(skimage.data, n)() for n in ("astronaut", "coffee", "chelsea", "rocket", "camera",
                                                      "hubble_deep_field")}
    camera_rgb = np.repeat(photos["camera"][:, :, None], 3, axis=2)
    photos["astronaut_and_camera"] = np.concatenate([photos["astronaut"], camera_rgb], axis=1)
    photos["astronaut_crop"] = np.ascontiguousarray(photos["astronaut"][30:330, 100:500])
    return photos


def package_detections(detector, frame: Frame, tmp: Path) -> list[dict]:
    """NudeDetector.detect as its users call it: on a PNG file of the raw pixels, or the JPEG bytes."""
    if frame.encoding is Encoding.JPEG:
        return detector.detect(frame.data)
    path = tmp / f"{frame.frame_index}.png"
    Image.fromarray(np.frombuffer(frame.data, np.uint8).reshape(frame.shape).squeeze()).save(path)
    return detector.detect(str(path))


def assert_detections_match(ours, theirs) -> None:
    assert [d.label for d in ours] == [t["class"] for t in theirs]
    for d, t in zip(ours, theirs, strict=True):
        assert d.score == pytest.approx(t["score"], abs=SCORE_TOLERANCE)
        np.testing.assert_allclose([d.x, d.y, d.width, d.height], t["box"], atol=BOX_TOLERANCE_PX)


@NEEDS_NUDENET
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("encoding", [Encoding.RAW_RGB8, Encoding.JPEG])
def test_nudenet_preset_matches_the_packages_own_detections(tmp_path_factory, tmp_path, encoding):
    from nudenet import NudeDetector

    from worker.runtime import load_model

    cache = tmp_path_factory.getbasetemp() / "nudenet-cache"
    loaded = load_model(load_settings(env={}, overrides={"model": {"source": "nudenet",
                                                                   "cache_dir": str(cache)}}).model)
    assert loaded.kind == "onnx" and loaded.contract.detects
    assert loaded.contract.labels == tuple(MODEL_PRESETS["nudenet"]["model"]["labels"])
    detector = NudeDetector()
    found = 0
    for i, pixels in enumerate(sample_photos().values()):
        frame = frame_of(pixels, encoding, i)
        batch = Preprocessor(loaded.contract).prepare([frame], frame.shape)
        with torch.inference_mode():
            raw = loaded.module(Normaliser(loaded.contract)(batch.pixels, batch.regions))
        ours = decode_detections(raw, [input_transform(loaded.contract, (frame.height, frame.width))],
                                 loaded.contract)[0]
        theirs = package_detections(detector, frame, tmp_path)
        assert_detections_match(ours, theirs)
        found += len(ours)
    assert found >= 3  # the faces of the astronaut, the cameraman and the crop: the comparison compares boxes


@NEEDS_NUDENET
def test_pinning_nudenets_shape_arguments_keeps_its_output_at_another_batch_size():
    """The pinned graph (constant reshapes, the batch left dynamic) computes what the original does, onnxruntime
    on both, at a batch size the probes never used."""
    import numpy as np
    import onnx
    import onnxruntime

    from worker.runtime.models import preset_model_file
    from worker.runtime.onnx_static import pin_shape_arguments

    original = onnx.load(str(preset_model_file("nudenet")))
    pinned, count = pin_shape_arguments(original, (2, 3, 320, 320))
    assert count > 0
    x = np.random.default_rng(0).random((3, 3, 320, 320), dtype=np.float32)

    def run(proto):
        session = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        return session.run(None, {"images": x})[0]

    np.testing.assert_allclose(run(pinned), run(original), rtol=0, atol=1e-4)
