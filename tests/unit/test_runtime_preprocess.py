"""Decoding frames and laying them out as one normalised, padded NCHW batch."""

from __future__ import annotations

import concurrent.futures
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))

from model_factories import jpeg_frame, pixels, raw_frame

from worker.config import ModelSettings
from worker.runtime import FrameDecodeError
from worker.runtime.fitting import fit_to_input
from worker.runtime.hostbatch import HostBuffers
from worker.runtime.models import ModelContract
from worker.runtime.normalise import Normaliser
from worker.runtime.preprocess import Preprocessor, decode_pixels

CONTRACT = ModelContract.from_settings(ModelSettings())
WAIT_S = 10.0
MEAN = np.array(CONTRACT.mean, dtype=np.float32).reshape(3, 1, 1)
STD = np.array(CONTRACT.std, dtype=np.float32).reshape(3, 1, 1)


def _normalised(img: np.ndarray) -> np.ndarray:
    return (img.transpose(2, 0, 1).astype(np.float32) / 255.0 - MEAN) / STD


def _model_input(batch, contract=CONTRACT) -> torch.Tensor:
    return Normaliser(contract)(batch.pixels, batch.regions)


# --- decode ---

def test_raw_frame_decodes_to_its_pixels():
    np.testing.assert_array_equal(decode_pixels(raw_frame(1, 6, 5)), pixels(1, 6, 5))


def test_raw_frame_with_wrong_byte_count_is_a_decode_error():
    with pytest.raises(FrameDecodeError, match="has 10 bytes, expected .* = 96"):
        decode_pixels(raw_frame(1, 4, 8, data=b"x" * 10))


def test_frame_with_zero_dimension_is_a_decode_error():
    with pytest.raises(FrameDecodeError, match="must be > 0"):
        decode_pixels(raw_frame(1, 0, 8, data=b""))


def test_raw_frame_with_other_channel_count_than_the_model_is_a_decode_error():
    with pytest.raises(FrameDecodeError, match="4 channels; the model takes 3"):
        decode_pixels(raw_frame(1, 2, 2, data=b"\0" * 16, channels=4))


def test_jpeg_frame_decodes_to_rgb_of_its_declared_size():
    img = decode_pixels(jpeg_frame(2, 24, 40))
    assert img.shape == (24, 40, 3) and img.dtype == np.uint8
    # JPEG is lossy: close to the source pixels, not equal.
    assert np.abs(img.astype(int) - pixels(2, 24, 40).astype(int)).mean() < 40


def test_corrupt_jpeg_is_a_decode_error():
    with pytest.raises(FrameDecodeError, match="JPEG does not decode"):
        decode_pixels(jpeg_frame(3, data=b"\xff\xd8\xff\xe0 not really a jpeg"))


def test_truncated_jpeg_is_a_decode_error():
    whole = jpeg_frame(3, 32, 32).data
    with pytest.raises(FrameDecodeError, match="JPEG does not decode"):
        decode_pixels(jpeg_frame(3, 32, 32, data=whole[: len(whole) // 2]))


def test_jpeg_whose_size_differs_from_the_declared_one_is_a_decode_error():
    frame = jpeg_frame(4, 24, 40, declared=(40, 24))
    with pytest.raises(FrameDecodeError, match="decodes to 40x24, but the frame declares 24x40"):
        decode_pixels(frame)


# --- batch layout ---

def test_batch_is_nchw_float32_normalised_with_mean_and_std():
    batch = Preprocessor(CONTRACT).prepare([raw_frame(1, 8, 8), raw_frame(2, 8, 8)], (8, 8, 3))
    assert batch.pixels.shape == (2, 8, 8, 3) and batch.pixels.dtype == torch.uint8
    x = _model_input(batch)
    assert x.shape == (2, 3, 8, 8) and x.dtype == torch.float32
    np.testing.assert_allclose(x[1].numpy(), _normalised(pixels(2, 8, 8)), rtol=1e-5, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(
    batch_hw=st.tuples(st.integers(1, 24), st.integers(1, 24)),
    frame_fracs=st.lists(st.tuples(st.floats(0.01, 1.0), st.floats(0.01, 1.0)), min_size=1, max_size=4),
)
def test_smaller_frames_are_padded_bottom_right_with_zeros_after_normalisation(batch_hw, frame_fracs):
    bh, bw = batch_hw
    sizes = [(max(1, int(bh * fh)), max(1, int(bw * fw))) for fh, fw in frame_fracs]
    frames = [raw_frame(i, h, w) for i, (h, w) in enumerate(sizes)]
    x = _model_input(Preprocessor(CONTRACT).prepare(frames, (bh, bw, 3)))
    assert x.shape == (len(frames), 3, bh, bw)
    for i, (h, w) in enumerate(sizes):
        row = x[i].numpy()
        np.testing.assert_allclose(row[:, :h, :w], _normalised(pixels(i, h, w)), rtol=1e-5, atol=1e-5)
        assert not row[:, h:, :].any() and not row[:, :, w:].any()


def test_undecodable_frames_are_reported_and_the_rest_keep_their_order():
    frames = [raw_frame(0, 8, 8), raw_frame(1, 8, 8, data=b"short"), jpeg_frame(2, 8, 8, data=b"bad"),
              raw_frame(3, 8, 8)]
    batch = Preprocessor(CONTRACT).prepare(frames, (8, 8, 3))
    assert [f.frame_index for f in batch.frames] == [0, 3]
    assert [f.frame_index for f, _ in batch.failures] == [1, 2]
    assert batch.pixels.shape[0] == 2
    np.testing.assert_array_equal(batch.pixels[1].numpy(), pixels(3, 8, 8))  # rows moved up past the failures


def test_frame_larger_than_the_batch_shape_is_reported_not_cropped():
    batch = Preprocessor(CONTRACT).prepare([raw_frame(0, 8, 9)], (8, 8, 3))
    assert not batch.frames
    assert "larger than its batch shape" in str(batch.failures[0][1])


def test_fixed_input_size_resizes_every_frame_instead_of_padding():
    contract = ModelContract.from_settings(ModelSettings(input_size=(16, 12)))
    batch = Preprocessor(contract).prepare([raw_frame(0, 32, 24), raw_frame(1, 8, 8)], (32, 24, 3))
    assert batch.pixels.shape == (2, 16, 12, 3)
    # The small frame is stretched over the whole input, not padded with zeros.
    assert batch.regions is None and (_model_input(batch, contract)[1] != 0).all()


def test_all_frames_bad_gives_an_empty_batch():
    batch = Preprocessor(CONTRACT).prepare([raw_frame(0, 4, 4, data=b"")], (4, 4, 3))
    assert batch.pixels.shape[0] == 0 and len(batch.failures) == 1


# --- decoding the frames of one batch in parallel ---

def test_frames_of_one_batch_are_decoded_on_several_threads_at_once(monkeypatch):
    """Two chunks must be inside decoding together: a barrier of 2 fails (times out) if they run one by one."""
    barrier = threading.Barrier(2, timeout=WAIT_S)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        preprocessor = Preprocessor(CONTRACT, pool=pool, workers=2)
        decode_one = preprocessor._decode_one

        def meeting_decode(frame, batch_hw, out):
            if frame.frame_index in (0, 2):  # the first frame of each chunk
                barrier.wait()
            return decode_one(frame, batch_hw, out)

        monkeypatch.setattr(preprocessor, "_decode_one", meeting_decode)
        batch = preprocessor.prepare([raw_frame(i, 8, 8) for i in range(4)], (8, 8, 3))
    assert [f.frame_index for f in batch.frames] == [0, 1, 2, 3]


def test_parallel_decoding_gives_the_serial_batch_failures_included():
    frames = [raw_frame(0, 8, 8), raw_frame(1, 8, 8, data=b"short"), jpeg_frame(2, 8, 8), raw_frame(3, 6, 8),
              jpeg_frame(4, 8, 8, data=b"bad"), raw_frame(5, 8, 8)]
    serial = Preprocessor(CONTRACT).prepare(frames, (8, 8, 3))
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        parallel = Preprocessor(CONTRACT, pool=pool, workers=3).prepare(frames, (8, 8, 3))
    assert [f.frame_index for f in parallel.frames] == [f.frame_index for f in serial.frames] == [0, 2, 3, 5]
    def failed(batch):
        return [(f.frame_index, str(e)) for f, e in batch.failures]

    assert failed(parallel) == failed(serial)
    torch.testing.assert_close(parallel.pixels, serial.pixels, rtol=0, atol=0)
    torch.testing.assert_close(parallel.regions, serial.regions, rtol=0, atol=0)


# --- uint8 to the device: the Normaliser equals the float32 host path it replaced ---

def _float_reference(contract: ModelContract, frames, shape) -> np.ndarray:
    """The former host path, kept here as the specification: decoded pixels normalised in numpy float32 straight
    into a zeroed batch in the model's layout (padding and letterbox border stay 0)."""
    preprocessor = Preprocessor(contract)
    hw = contract.model_input_hw(shape[:2])
    out = np.zeros((len(frames), *contract.input_shape(hw)), dtype=np.float32)
    c = contract.channels
    unit = 1.0 / 255.0 if contract.pixel_range == "0-1" else 1.0
    scale = (unit / np.asarray(contract.std, dtype=np.float32).reshape(c, 1, 1)).astype(np.float32)
    bias = (np.asarray(contract.mean, dtype=np.float32).reshape(c, 1, 1)
            / np.asarray(contract.std, dtype=np.float32).reshape(c, 1, 1)).astype(np.float32)
    for row, frame in enumerate(frames):
        decoded = preprocessor._decode_one(frame, shape[:2], None)
        pixels, (top, left) = preprocessor._fit(decoded, contract, frame)
        chw = out[row].transpose(2, 0, 1) if contract.input_layout == "NHWC" else out[row]
        h, w = pixels.shape[:2]
        region = chw[:, top:top + h, left:left + w]
        src = pixels.transpose(2, 0, 1)
        np.multiply(src[::-1] if contract.channel_order == "BGR" and c == 3 else src, scale, out=region,
                    casting="unsafe")
        np.subtract(region, bias, out=region)
    return out


VARIANTS = {
    "stretch NCHW RGB": dict(input_size=(12, 16)),
    "letterbox NCHW RGB": dict(input_size=(16, 16), resize="letterbox"),
    "shorter side crop NHWC": dict(input_size=(16, 16), resize="shorter_side_crop", input_layout="NHWC"),
    "stretch crop NHWC BGR 0-255": dict(input_size=(16, 16), resize="stretch_crop", resize_to=(20, 24),
                                        input_layout="NHWC", channel_order="BGR", pixel_range="0-255",
                                        mean=(104.0, 117.0, 123.0), std=(1.0, 1.0, 1.0)),
    "padding NCHW RGB": dict(),
    "padding NHWC grey": dict(input_layout="NHWC", mean=(0.45,), std=(0.25,)),
    "padding NCHW BGR": dict(channel_order="BGR", mean=(0.4, 0.5, 0.6), std=(0.2, 0.3, 0.4)),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_uint8_batch_normalised_by_torch_equals_the_float32_host_path(variant):
    """Same float32 operations in the same order (pixel * scale, then - bias), so equal to the last bit on a CPU;
    the bound allows 1e-6 for a device whose kernels fuse them."""
    contract = ModelContract.from_settings(ModelSettings(**VARIANTS[variant]))
    frames = [raw_frame(0, 24, 20), raw_frame(1, 9, 24), jpeg_frame(2, 24, 24), raw_frame(3, 5, 7),
              raw_frame(4, 24, 24, data=pixels(4, 24, 24)[:, :, :1].tobytes(), channels=1)]
    batch = Preprocessor(contract).prepare(frames, (24, 24, 3))
    assert not batch.failures
    assert (batch.regions is None) == (variant.startswith(("stretch", "shorter")))
    ours = Normaliser(contract)(batch.pixels, batch.regions).numpy()
    np.testing.assert_allclose(ours, _float_reference(contract, frames, (24, 24, 3)), rtol=0, atol=1e-6)


@pytest.mark.parametrize("contiguous", [False, True], ids=["channels_last", "contiguous"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_normalised_batch_is_bit_equal_to_the_float32_host_path_on_cpu_with_positive_zero_padding(variant, contiguous):
    """On a CPU the same float32 operations in the same order give the same bits; padding is +0.0, never -0.0
    (the region mask multiplies negative values by 0). An NCHW model gets its shape in channels_last memory, or in
    contiguous memory where its runtime takes only that (onnxruntime)."""
    contract = ModelContract.from_settings(ModelSettings(**VARIANTS[variant]))
    frames = [raw_frame(0, 24, 20), raw_frame(1, 9, 24), jpeg_frame(2, 24, 24), raw_frame(3, 5, 7)]
    batch = Preprocessor(contract).prepare(frames, (24, 24, 3))
    normaliser = Normaliser(contract, contiguous=contiguous)
    normaliser(torch.full_like(batch.pixels, 255), None)  # the kept buffer holds another batch first
    out = normaliser(batch.pixels, batch.regions)
    reference = _float_reference(contract, frames, (24, 24, 3))
    assert out.numpy().tobytes() == np.ascontiguousarray(reference).tobytes()
    assert not torch.signbit(out[out == 0]).any()
    if contract.input_layout == "NCHW" and contract.channels > 1:
        assert out.is_contiguous(memory_format=torch.contiguous_format if contiguous else torch.channels_last)


def test_padding_is_zero_whatever_a_reused_buffer_held_before():
    buffers = HostBuffers()
    preprocessor = Preprocessor(CONTRACT, buffers)
    full = preprocessor.prepare([raw_frame(i, 8, 8) for i in range(4)], (8, 8, 3))
    full.release()
    batch = preprocessor.prepare([raw_frame(9, 3, 5)], (8, 8, 3))
    assert batch.pixels.data_ptr() == full.pixels.data_ptr()  # the same buffer, reused
    row = Normaliser(CONTRACT)(batch.pixels, batch.regions)[0].numpy()
    assert not row[:, 3:, :].any() and not row[:, :, 5:].any()
    np.testing.assert_allclose(row[:, :3, :5], _normalised(pixels(9, 3, 5)), rtol=1e-5, atol=1e-5)


def test_host_buffers_are_reused_per_shape_and_grow_to_a_power_of_two():
    buffers = HostBuffers()
    first = buffers.take(5, (4, 4, 3))
    assert first.shape == (8, 4, 4, 3) and first.dtype == torch.uint8
    buffers.give_back(first)
    assert buffers.take(3, (4, 4, 3)) is first
    assert buffers.take(3, (4, 4, 3)) is not first  # taken: a second batch gets its own
    assert buffers.take(2, (4, 5, 3)).shape == (2, 4, 5, 3)


def test_idle_host_buffers_are_bounded_least_recently_used_shape_first():
    buffers = HostBuffers(max_bytes=2 * 4 * 4 * 3)
    a, b, c = (buffers.take(1, (4, 4, 3)) for _ in range(3))
    for buf in (a, b, c):
        buffers.give_back(buf)
    kept = {id(buffers.take(1, (4, 4, 3))) for _ in range(3)}
    assert len(kept & {id(a), id(b), id(c)}) == 2


def test_the_jpeg_scale_is_not_reduced_when_the_contract_says_full_size_decode(monkeypatch):
    seen = []
    monkeypatch.setattr("worker.runtime.preprocess.decode_pixels",
                        lambda frame, channels, min_hw=None, out=None: seen.append(min_hw) or pixels(0, 64, 64))
    for scaled in (True, False):
        contract = ModelContract.from_settings(ModelSettings(input_size=(16, 16), jpeg_scaled_decode=scaled))
        Preprocessor(contract).prepare([jpeg_frame(0, 64, 64)], (64, 64, 3))
    assert seen == [(16, 16), None]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_normaliser_on_cuda_equals_the_float32_host_path(variant):
    """One code path: the same torch operations on the GPU as on the CPU."""
    contract = ModelContract.from_settings(ModelSettings(**VARIANTS[variant]))
    frames = [raw_frame(0, 24, 20), raw_frame(1, 9, 24), jpeg_frame(2, 24, 24), raw_frame(3, 5, 7)]
    batch = Preprocessor(contract).prepare(frames, (24, 24, 3))
    device = torch.device("cuda", 0)
    regions = None if batch.regions is None else batch.regions.to(device)
    ours = Normaliser(contract, device)(batch.pixels.to(device), regions).cpu().numpy()
    np.testing.assert_allclose(ours, _float_reference(contract, frames, (24, 24, 3)), rtol=0, atol=1e-6)


def test_a_jpeg_of_the_rows_size_is_decoded_into_its_row_with_the_same_pixels(monkeypatch):
    """The decoder writes the batch row itself (no array of its own, no copy) when the decoded pixels are the row's
    size (at full or a reduced DCT scale), giving what a plain decode gives; else it decodes as before."""
    import worker.runtime.preprocess as preprocess_module

    frames = [jpeg_frame(i, 24, 32) for i in range(3)]  # 24 high, 32 wide
    identity = {"pixel_range": "0-255", "mean": (0.0,) * 3, "std": (1.0,) * 3}
    real = preprocess_module.decode_pixels
    into_row: list[bool] = []

    def spying_decode(frame, channels, min_hw=None, out=None):
        pixels_ = real(frame, channels, min_hw=min_hw, out=out)
        into_row.append(out is not None and pixels_ is out)
        return pixels_

    monkeypatch.setattr(preprocess_module, "decode_pixels", spying_decode)
    for input_hw, expect_into_row in (((24, 32), True), ((12, 16), True), ((20, 20), False)):
        contract = ModelContract.from_settings(ModelSettings(input_size=input_hw, **identity))
        buffers = HostBuffers()
        stale = buffers.take(3, (*input_hw, 3))
        stale.fill_(77)  # a reused buffer holds an older batch's pixels
        buffers.give_back(stale)
        into_row.clear()
        batch = Preprocessor(contract, buffers).prepare(frames, (24, 32, 3))
        want = np.stack([fit_to_input(real(f, min_hw=input_hw), contract, (24, 32))[0] for f in frames])
        np.testing.assert_array_equal(batch.pixels.numpy(), want)
        assert into_row == [expect_into_row] * 3, input_hw


def test_decode_into_a_row_of_another_shape_leaves_it_alone():
    frame = jpeg_frame(0, 24, 32)
    wrong = np.full((24, 31, 3), 5, dtype=np.uint8)
    pixels_ = decode_pixels(frame, out=wrong)
    assert pixels_.shape == (24, 32, 3) and not np.shares_memory(pixels_, wrong) and (wrong == 5).all()
    grey_row = np.zeros((24, 32, 1), dtype=np.uint8)
    grey = decode_pixels(frame, channels=1, out=grey_row)
    assert grey is grey_row
    np.testing.assert_array_equal(grey, decode_pixels(frame, channels=1))
