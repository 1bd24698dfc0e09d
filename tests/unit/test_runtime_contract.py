"""The preprocessing and output contract: layout, channel order, pixel range, resize modes, channel
conversion, labels that never flag, factory options; validated once by the config."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))

from model_factories import pixels, raw_frame

from worker.config import ConfigError, ModelSettings, load_settings
from worker.runtime import load_model
from worker.runtime.models import ModelContract
from worker.runtime.normalise import Normaliser
from worker.runtime.preprocess import Preprocessor
from worker.runtime.resample import resize, resize_like_opencv


def _contract(**kw: object) -> ModelContract:
    return ModelContract.from_settings(ModelSettings(**kw))


def _prepare(contract: ModelContract, *frames, shape=None) -> np.ndarray:
    batch = Preprocessor(contract).prepare(list(frames), shape or frames[0].shape)
    assert not batch.failures, batch.failures
    return Normaliser(contract)(batch.pixels, batch.regions).numpy()


def _bilinear(img: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
    return np.asarray(Image.fromarray(img).resize((hw[1], hw[0]), Image.Resampling.BILINEAR))


# --- layout, channel order, pixel range ---

def test_nhwc_layout_holds_the_same_values_as_nchw_transposed():
    frame = raw_frame(1, 6, 5)
    nchw = _prepare(_contract(), frame)
    nhwc = _prepare(_contract(input_layout="NHWC"), frame)
    assert nhwc.shape == (1, 6, 5, 3)
    np.testing.assert_array_equal(nhwc, nchw.transpose(0, 2, 3, 1))


def test_bgr_order_reverses_the_channels_and_mean_follows_the_model_order():
    frame = raw_frame(2, 4, 4)
    out = _prepare(_contract(channel_order="BGR", pixel_range="0-255", mean=(10.0, 20.0, 30.0),
                             std=(1.0, 1.0, 1.0)), frame)[0]
    img = pixels(2, 4, 4).astype(np.float32)
    np.testing.assert_array_equal(out[0], img[:, :, 2] - 10.0)  # blue first, minus the first mean
    np.testing.assert_array_equal(out[2], img[:, :, 0] - 30.0)


def test_pixel_range_0_255_skips_the_division_by_255():
    frame = raw_frame(3, 4, 4)
    out = _prepare(_contract(pixel_range="0-255", mean=(0.0, 0.0, 0.0), std=(2.0, 2.0, 2.0)), frame)[0]
    np.testing.assert_allclose(out, pixels(3, 4, 4).transpose(2, 0, 1) / 2.0)


# --- resize modes ---
# Pillow's resize is the reference preprocessing's (matched exactly); torch's uint8 kernel, the default, is within
# one grey level of the exact filter, as Pillow's is (the property tests below), so of Pillow's on these images.
RESAMPLERS = pytest.mark.parametrize("resampler, tolerance", [("pillow", 0), ("torch", 1)])


def _assert_resized(out: np.ndarray, want: np.ndarray, tolerance: int) -> None:
    np.testing.assert_allclose(out, want.astype(np.float32), rtol=0, atol=tolerance)


@RESAMPLERS
def test_stretch_ignores_the_aspect_ratio(resampler, tolerance):
    frame = raw_frame(4, 20, 40)
    out = _prepare(_contract(input_size=(10, 10), pixel_range="0-255", mean=(0.0,) * 3, std=(1.0,) * 3,
                             resampler=resampler), frame)[0]
    _assert_resized(out, _bilinear(pixels(4, 20, 40), (10, 10)).transpose(2, 0, 1), tolerance)


@RESAMPLERS
def test_letterbox_keeps_the_aspect_ratio_and_pads_with_the_mean_colour(resampler, tolerance):
    frame = raw_frame(5, 20, 40)  # 2:1 into 16x16 -> 8x16 content, 4 rows of border above and below
    out = _prepare(_contract(input_size=(16, 16), resize="letterbox", pixel_range="0-255", mean=(0.0,) * 3,
                             std=(1.0,) * 3, resampler=resampler), frame)[0]
    assert not out[:, :4].any() and not out[:, 12:].any()
    _assert_resized(out[:, 4:12], _bilinear(pixels(5, 20, 40), (8, 16)).transpose(2, 0, 1), tolerance)


@RESAMPLERS
def test_shorter_side_crop_resizes_the_shorter_side_then_crops_the_centre(resampler, tolerance):
    frame = raw_frame(6, 30, 60)  # shorter side 30 -> 20: 20x40, centre 16x16 starts at row 2, column 12
    out = _prepare(_contract(input_size=(16, 16), resize="shorter_side_crop", resize_shorter_side=20,
                             pixel_range="0-255", mean=(0.0,) * 3, std=(1.0,) * 3, resampler=resampler), frame)[0]
    want = _bilinear(pixels(6, 30, 60), (20, 40))[2:18, 12:28]
    _assert_resized(out, want.transpose(2, 0, 1), tolerance)


@RESAMPLERS
def test_stretch_crop_stretches_to_resize_to_then_crops_the_centre(resampler, tolerance):
    frame = raw_frame(7, 30, 50)
    out = _prepare(_contract(input_size=(16, 16), resize="stretch_crop", resize_to=(20, 24), pixel_range="0-255",
                             mean=(0.0,) * 3, std=(1.0,) * 3, resampler=resampler), frame)[0]
    want = _bilinear(pixels(7, 30, 50), (20, 24))[2:18, 4:20]
    _assert_resized(out, want.transpose(2, 0, 1), tolerance)


def _bilinear_weights(n_in: int, n_out: int) -> np.ndarray:
    """Pillow's antialiased bilinear filter as a matrix, in float64 (its `precompute_coeffs`, written out): a
    triangle centred on each output pixel, widened by the scale when shrinking, normalised to sum 1."""
    scale = n_in / n_out
    width = max(scale, 1.0)
    weights = np.zeros((n_out, n_in))
    for out in range(n_out):
        centre = (out + 0.5) * scale
        first, stop = max(int(centre - width + 0.5), 0), min(int(centre + width + 0.5), n_in)
        for i in range(first, stop):
            weights[out, i] = max(0.0, 1.0 - abs((i - centre + 0.5) / width))
        weights[out] /= weights[out].sum()
    return weights


def _exact_bilinear(img: np.ndarray, dst: tuple[int, int]) -> np.ndarray:
    """The filter without rounding: what both uint8 resamplers approximate (each rounds after each pass)."""
    rows, cols = _bilinear_weights(img.shape[0], dst[0]), _bilinear_weights(img.shape[1], dst[1])
    return np.einsum("oh,hwc,pw->opc", rows, img.astype(np.float64), cols)


SIZES = st.tuples(st.integers(1, 80), st.integers(1, 80))
ROUNDING = 1e-6  # float64 noise in the reference, far below a grey level


@settings(max_examples=40, deadline=None)
@given(src=SIZES, width=st.integers(1, 80), seed=st.integers(0, 2**16))
def test_the_exact_filter_is_pillows_rounded_once(src, width, seed):
    """Resizing one dimension, Pillow rounds once: it must equal the reference rounded, which checks the reference."""
    img = np.random.default_rng(seed).integers(0, 256, (*src, 3), dtype=np.uint8)
    dst = (src[0], width)
    assert np.abs(resize(img, dst, "pillow") - _exact_bilinear(img, dst)).max() <= 0.5 + ROUNDING


@settings(max_examples=60, deadline=None)
@given(src=SIZES, channels=st.sampled_from([1, 3]), dst=SIZES, seed=st.integers(0, 2**16))
@pytest.mark.parametrize("resampler", ["torch", "pillow"])
def test_both_resamplers_stay_within_one_grey_level_of_the_exact_filter(resampler, src, channels, dst, seed):
    """Noise (the hardest case for a resampler), shrinking and enlarging, grey and RGB. Each pass rounds to uint8,
    so each resampler is off by under one level; torch's and Pillow's can then differ by two, in opposite
    directions (measured: 1 pixel in 10^7 on noise)."""
    img = np.random.default_rng(seed).integers(0, 256, (*src, channels), dtype=np.uint8)
    ours = resize(img, dst, resampler)
    assert ours.shape == (*dst, channels) and ours.dtype == np.uint8
    assert np.abs(ours - _exact_bilinear(img, dst)).max() <= 1 + ROUNDING


@settings(max_examples=40, deadline=None)
@given(src=SIZES, channels=st.sampled_from([1, 3]), dst=SIZES, seed=st.integers(0, 2**16))
def test_torch_resize_into_a_batch_row_is_torchs_interpolate_exactly(src, channels, dst, seed):
    """The resize writes HWC memory through the kernel's out= form: the values of F.interpolate, in the row given
    (no copy), or in a new C-contiguous array when there is none (so placing it in a row is a plain copy)."""
    img = np.random.default_rng(seed).integers(0, 256, (*src, channels), dtype=np.uint8)
    x = torch.from_numpy(img).permute(2, 0, 1).unsqueeze(0)
    want = torch.nn.functional.interpolate(x, size=dst, mode="bilinear", antialias=True, align_corners=False)
    want_hwc = want[0].permute(1, 2, 0).numpy()
    fresh = resize(img, dst, "torch")
    if dst != src:
        assert fresh.flags.c_contiguous
    np.testing.assert_array_equal(fresh, want_hwc)
    rows = np.full((2, *dst, channels), 99, dtype=np.uint8)
    written = resize(img, dst, "torch", out=rows[1])
    if dst != src:
        assert written is rows[1] or np.shares_memory(written, rows[1])
    np.testing.assert_array_equal(written, want_hwc)
    assert (rows[0] == 99).all()  # nothing written outside the row given


def _nudenet_input(pixels: np.ndarray) -> np.ndarray:
    """NudeNet's own preprocessing (nudenet.nudenet._read_image: cv2.copyMakeBorder to a square, then
    cv2.dnn.blobFromImage's cv2.resize INTER_LINEAR to 320x320, 1/255, BGR) of RGB `pixels`, given as the BGR
    array cv2.imread would have made of them."""
    from nudenet.nudenet import _read_image

    return _read_image(np.ascontiguousarray(pixels[:, :, ::-1]), 320)[0]


NEEDS_NUDENET = pytest.mark.skipif(
    any(__import__("importlib").util.find_spec(m) is None for m in ("nudenet", "cv2")),
    reason="needs the models extra (nudenet, opencv-python-headless)")


@NEEDS_NUDENET
@settings(max_examples=60, deadline=None)
@given(hw=st.tuples(st.integers(1, 700), st.integers(1, 700)), seed=st.integers(0, 2**16),
       values=st.sampled_from(["noise", "extremes"]))
def test_the_nudenet_preset_preprocesses_as_nudenet_itself_bit_for_bit(hw, seed, values):
    """The worker's path (Preprocessor: pad to a square, cv2.resize; Normaliser: BGR, 1/255) gives the float
    input NudeNet's own preprocessing gives, exactly, enlarging and shrinking, noise and 0/255 extremes."""
    rng = np.random.default_rng(seed)
    img = (rng.integers(0, 256, (*hw, 3), dtype=np.uint8) if values == "noise"
           else rng.integers(0, 2, (*hw, 3), dtype=np.uint8) * 255)
    contract = ModelContract.from_settings(load_settings(env={}, overrides={"model": {"source": "nudenet"}}).model)
    frame = raw_frame(0, *hw, data=img.tobytes())
    batch = Preprocessor(contract).prepare([frame], frame.shape)
    ours = Normaliser(contract)(batch.pixels, batch.regions).contiguous().numpy()
    np.testing.assert_array_equal(ours, _nudenet_input(img))


@NEEDS_NUDENET
@settings(max_examples=100, deadline=None)
@given(src=st.tuples(st.integers(1, 120), st.integers(1, 120)), dst=st.tuples(st.integers(1, 120), st.integers(1, 120)),
       channels=st.sampled_from([1, 2, 3, 4]), seed=st.integers(0, 2**16))
def test_the_opencv_resampler_is_cv2_resize_fresh_or_in_a_row(src, dst, channels, seed):
    """Any channel count (grey is cv2's 2-D array, the same memory), into a new array or straight into a batch
    row, with nothing written outside it."""
    import cv2

    img = np.random.default_rng(seed).integers(0, 256, (*src, channels), dtype=np.uint8)
    want = cv2.resize(img, (dst[1], dst[0]), interpolation=cv2.INTER_LINEAR).reshape(*dst, channels)
    if dst != src:
        np.testing.assert_array_equal(resize_like_opencv(img, dst), want)
    rows = np.full((2, *dst, channels), 99, dtype=np.uint8)
    written = resize_like_opencv(img, dst, out=rows[1])
    assert np.shares_memory(written, rows[1])
    np.testing.assert_array_equal(rows[1], want)
    assert (rows[0] == 99).all()


@NEEDS_NUDENET
def test_the_opencv_resampler_runs_in_the_calling_thread():
    """cv2's own pool is kept from competing with the preprocessing threads and the runners (decided once)."""
    import cv2

    resize(np.zeros((8, 8, 3), dtype=np.uint8), (4, 4), "opencv")
    assert cv2.getNumThreads() == 1  # setNumThreads(0): sequential, in the caller


def test_without_cv2_the_opencv_resampler_is_a_config_error_naming_the_extra(monkeypatch):
    import worker.runtime.resample as resample

    monkeypatch.setattr(resample, "_cv2", None)
    monkeypatch.setitem(sys.modules, "cv2", None)  # import cv2 raises ImportError
    with pytest.raises(ConfigError, match=r"streamfer\[models\]"):
        Preprocessor(_contract(input_size=(8, 8), resampler="opencv"))


def test_a_row_of_another_size_is_not_written():
    img = np.random.default_rng(3).integers(0, 256, (40, 60, 3), dtype=np.uint8)
    wrong = np.full((20, 21, 3), 7, dtype=np.uint8)
    out = resize(img, (20, 20), "torch", out=wrong)
    assert out.shape == (20, 20, 3) and not np.shares_memory(out, wrong) and (wrong == 7).all()


# --- channels ---

def test_grey_and_rgba_frames_are_converted_for_an_rgb_model():
    grey = pixels(8, 4, 4)[:, :, :1]
    rgba = np.concatenate([pixels(9, 4, 4), np.full((4, 4, 1), 7, np.uint8)], axis=2)
    identity = _contract(pixel_range="0-255", mean=(0.0,) * 3, std=(1.0,) * 3)
    out_grey = _prepare(identity, raw_frame(0, 4, 4, data=grey.tobytes(), channels=1))[0]
    out_rgba = _prepare(identity, raw_frame(0, 4, 4, data=rgba.tobytes(), channels=4))[0]
    np.testing.assert_array_equal(out_grey, np.repeat(grey.transpose(2, 0, 1), 3, axis=0))
    np.testing.assert_array_equal(out_rgba, pixels(9, 4, 4).transpose(2, 0, 1))


def test_rgb_frames_become_luma_for_a_greyscale_model():
    out = _prepare(_contract(pixel_range="0-255", mean=(0.0,), std=(1.0,)), raw_frame(10, 4, 4))[0]
    want = np.asarray(Image.fromarray(pixels(10, 4, 4)).convert("L"))
    np.testing.assert_array_equal(out[0], want)


# --- output contract ---

def test_a_never_flag_label_is_scored_but_never_flags():
    contract = _contract(labels=("sfw", "nsfw"), never_flag=("sfw",))
    verdict = contract.verdict([0.99, 0.01])
    assert verdict.scores == pytest.approx({"sfw": 0.99, "nsfw": 0.01}) and verdict.flagged_labels == ()
    assert contract.verdict([0.1, 0.9]).flagged_labels == ("nsfw",)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6).flatmap(lambda n: st.tuples(
    st.lists(st.floats(0, 1), min_size=n, max_size=n),  # thresholds
    st.lists(st.booleans(), min_size=n, max_size=n),  # never flag
    st.lists(st.lists(st.floats(-2, 2, width=32), min_size=n, max_size=n), max_size=8))))
def test_a_batchs_verdicts_are_each_rows_verdict(case):
    thresholds, never, rows = case
    labels = tuple(f"l{i}" for i in range(len(thresholds)))
    contract = _contract(labels=labels, thresholds=dict(zip(labels, thresholds, strict=True)),
                         never_flag=tuple(label for label, n in zip(labels, never, strict=True) if n))
    scores = np.array(rows, dtype=np.float32).reshape(len(rows), len(labels))
    assert contract.verdicts(scores) == [contract.verdict(row) for row in scores]


def test_factory_gets_model_options_as_keyword_arguments(tmp_path):
    cfg = tmp_path / "w.toml"
    cfg.write_text('[model]\nsource = "model_factories:scaled_model"\nlabels = ["a", "b"]\n'
                   '[model.options]\nnum_labels = 2\nscale = 0.0\n')
    loaded = load_model(load_settings(cfg, env={}).model)
    with torch.inference_mode():
        out = loaded.module(torch.rand(3, 3, 16, 16))
    assert out.shape == (3, 2) and torch.equal(out, out[:1].expand(3, 2))  # scale 0: the bias alone


def test_factory_options_it_does_not_take_name_the_setting():
    from worker.runtime import ModelContractError

    with pytest.raises(ModelContractError, match="with model.options") as err:
        load_model(ModelSettings(source="model_factories:scaled_model", options={"colour": "red"}))
    assert err.value.setting == "model.options"


# --- validation, once, in the config ---

@pytest.mark.parametrize(("env", "field"), [
    ({"WORKER_MODEL_INPUT_LAYOUT": "CHW"}, "model.input_layout: must be one of 'NCHW', 'NHWC'"),
    ({"WORKER_MODEL_CHANNEL_ORDER": "GBR"}, "model.channel_order"),
    ({"WORKER_MODEL_PIXEL_RANGE": "0-65535"}, "model.pixel_range"),
    ({"WORKER_MODEL_RESIZE": "shorter_side_crop"}, "model.resize: 'shorter_side_crop' needs model.input_size"),
    ({"WORKER_MODEL_RESIZE": "stretch_crop", "WORKER_MODEL_INPUT_SIZE": "224,224", "WORKER_MODEL_RESIZE_TO": "200,200"},
     "model.resize_to"),
    ({"WORKER_MODEL_NEVER_FLAG": "sfw"}, "model.never_flag: unknown labels ['sfw']"),
    ({"WORKER_MODEL_LABELS": "a", "WORKER_MODEL_NEVER_FLAG": "a"}, "model.never_flag: lists every label"),
    ({"WORKER_MODEL_JPEG_ROUNDTRIP_QUALITY": "101"}, "model.jpeg_roundtrip_quality"),
])
def test_bad_contract_settings_are_named_by_the_config(env, field):
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        load_settings(env=env)


@settings(max_examples=300, deadline=None)
@given(src=st.tuples(st.integers(1, 600), st.integers(1, 600)), target=st.sampled_from([256, 128, 255, 320, 224]),
       crop=st.integers(1, 224), channels=st.sampled_from([1, 3]), seed=st.integers(0, 2**16))
def test_a_centre_crop_of_a_pillow_resize_is_the_same_bits_whether_or_not_only_the_crop_is_computed(
        src, target, crop, channels, seed):
    """`resize_centre_crop` computes only the kept pixels where Pillow gives them the same bits (open_nsfw: 256x256,
    then 224x224 kept); the bits are those of a full resize then a crop, either way."""
    from worker.runtime.resample import resize_centre_crop

    crop = min(crop, target)
    img = np.random.default_rng(seed).integers(0, 256, (*src, channels), dtype=np.uint8)
    full = np.asarray(Image.fromarray(img if channels == 3 else img[:, :, 0]).resize((target, target),
                                                                                      Image.Resampling.BILINEAR))
    top = left = (target - crop) // 2
    want = full[top:top + crop, left:left + crop].reshape(crop, crop, channels)
    np.testing.assert_array_equal(resize_centre_crop(img, (target, target), (crop, crop), "pillow"), want)


def test_open_nsfws_crop_is_computed_alone_for_every_frame_size_a_camera_sends():
    from worker.runtime.resample import _box_is_exact

    for hw in ((224, 224), (240, 320), (360, 640), (480, 640), (720, 1280), (1080, 1920), (2160, 3840)):
        assert _box_is_exact((*hw, 3), (256, 256), (224, 224)), hw
    assert not _box_is_exact((1920, 1080, 3), (256, 256), (224, 224))  # Pillow's passes run in another order
