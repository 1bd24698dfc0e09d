"""A model set: open_nsfw and the nudenet detector on one batch decoded once, one verdict per frame carrying both
models' outputs; a cascade that skips the detector where the classifier is sure; the set's config.

Needs the `models` extra and OpenCV (the nudenet package's own detections); skipped with the reason otherwise.
"""

from __future__ import annotations

import pytest

from tests.unit.photo_frames import frame_of
from tests.unit.test_runtime_detection import (
    NEEDS_NUDENET,
    assert_detections_match,
    package_detections,
    sample_photos,
)
from worker.cascade import CascadeRule, combine
from worker.config import ConfigError, load_settings
from worker.frames import Detection, Encoding, ModelVerdict, Verdict
from worker.runtime import InferenceExecutor

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
    with InferenceExecutor.from_settings(settings.model, settings.runtime, models=settings.models
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
    from worker.cascade import describe_outputs
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
    from worker.cascade import describe_outputs

    verdict = combine([ModelVerdict("open_nsfw", "1", Verdict({"sfw": 0.9, "nsfw": 0.1}, ())),
                       ModelVerdict("nudenet", "2", Verdict({"FACE_FEMALE": 0.0}, ()), detector=True)])
    assert describe_outputs(verdict)[1] == "nudenet: no boxes (decided)"
