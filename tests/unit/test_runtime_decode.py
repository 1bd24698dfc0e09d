"""Pixel decoding is bounded before it starts: a JPEG's own header is checked against the frame header and
the pixel limit, and truncated or padded JPEG data is an error, never a score (worker/runtime/decode.py)."""

from __future__ import annotations

import contextlib
import io
import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import simplejpeg
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageFile

import worker.runtime.decode as decode_module
from worker.frames import Encoding, Frame, Priority, SourceRef
from worker.runtime.decode import FrameDecodeError, check_jpeg, decode_pixels, jpeg_scale
from worker.runtime.fitting import fit_to_input, resize_target
from worker.runtime.models import ModelContract
from worker.testing.pixels import photo_like

ROOT = Path(__file__).resolve().parents[2]
SOF_MARKERS = (0xC0, 0xC1, 0xC2)


def jpeg_bytes(width: int, height: int, seed: int = 1, mode: str = "RGB", **save: object) -> bytes:
    """A real JPEG of smooth random content (8x8 blocks), as a camera frame compresses."""
    small = np.random.default_rng(seed).integers(0, 256, (-(-height // 8), -(-width // 8), 3), dtype=np.uint8)
    img = np.repeat(np.repeat(small, 8, axis=0), 8, axis=1)[:height, :width]
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(img)).convert(mode).save(buf, format="JPEG", **save)
    return buf.getvalue()


def with_sof_size(data: bytes, width: int, height: int) -> bytes:
    """The JPEG with its frame header (SOF) patched to declare width x height; the scan data is unchanged."""
    pos = 2
    while True:
        marker = data[pos + 1]
        (length,) = struct.unpack_from(">H", data, pos + 2)
        if marker in SOF_MARKERS:
            return data[:pos + 5] + struct.pack(">HH", height, width) + data[pos + 9:]
        pos += 2 + length


def with_sof_marker(data: bytes, marker: int) -> bytes:
    pos = data.index(bytes((0xFF, 0xC0)))
    return data[:pos + 1] + bytes((marker,)) + data[pos + 2:]


def with_sampling(jpeg: bytes, factors: tuple[int, ...]) -> bytes:
    """The JPEG with its components' sampling-factor bytes (0xHV) in the frame header replaced."""
    sof = jpeg.index(b"\xff\xc0")
    out = bytearray(jpeg)
    for i, hv in enumerate(factors):
        out[sof + 11 + 3 * i] = hv
    return bytes(out)


def scan_starts(data: bytes) -> list[int]:
    return [i for i in range(len(data) - 1) if data[i] == 0xFF and data[i + 1] == 0xDA]


def frame(data: bytes, width: int, height: int, encoding: Encoding = Encoding.JPEG, channels: int = 3) -> Frame:
    return Frame(stream_id="cam", frame_index=0, tenant="t", priority=Priority.STANDARD, capture_ts_ms=0,
                 width=width, height=height, channels=channels, encoding=encoding, data=data,
                 source=SourceRef("frames.standard", 0, 0))


@contextlib.contextmanager
def scan_walk(vectorised: bool):
    """check_jpeg delimits scans with `_ScanEnds` (numpy, for large files) or `_scan_data_end` (regex): either one
    here, whatever the file's size."""
    saved = decode_module.VECTOR_SCAN_MIN_BYTES, decode_module.VECTOR_SCAN_MAX_BYTES
    decode_module.VECTOR_SCAN_MIN_BYTES = 0 if vectorised else 1 << 62
    decode_module.VECTOR_SCAN_MAX_BYTES = 1 << 62
    try:
        yield
    finally:
        decode_module.VECTOR_SCAN_MIN_BYTES, decode_module.VECTOR_SCAN_MAX_BYTES = saved


def bomb(declared: int = 12000) -> bytes:
    """A few hundred bytes of real 8x8 JPEG whose SOF declares declared x declared pixels."""
    return with_sof_size(jpeg_bytes(8, 8, quality=10), declared, declared)


# -- what decodes --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("save", [{}, {"progressive": True}, {"subsampling": 0}, {"optimize": True},
                                  {"quality": 100}, {"restart_marker_blocks": 3}, {"quality": 5, "progressive": True}],
                         ids=str)
def test_a_complete_jpeg_decodes_to_what_pillow_decodes(save):
    data = jpeg_bytes(67, 45, **save)
    pixels = decode_pixels(frame(data, 67, 45))
    expected = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    np.testing.assert_array_equal(pixels, expected)


@pytest.mark.parametrize("mode", ["L", "CMYK"])
def test_grey_and_cmyk_jpegs_decode_to_the_models_channels(mode):
    assert decode_pixels(frame(jpeg_bytes(16, 8, mode=mode), 16, 8)).shape == (8, 16, 3)


def test_bytes_after_the_eoi_marker_are_ignored_as_pillow_does():
    data = jpeg_bytes(16, 16)
    np.testing.assert_array_equal(decode_pixels(frame(data + b"camera trailer", 16, 16)),
                                  decode_pixels(frame(data, 16, 16)))


def test_check_jpeg_reads_size_components_and_scans_without_decoding():
    info = check_jpeg(jpeg_bytes(40, 24, progressive=True))
    assert (info.width, info.height, info.components, info.progressive) == (40, 24, 3, True)
    assert info.scans > 1


# -- headers walked before (decode.HEADERS) ---------------------------------------------------------------------------
@pytest.fixture
def headers(monkeypatch):
    """A fresh, empty header cache for the test, counting the marker segments the walk reads one by one."""
    cache = decode_module.HeaderCache(max_entries=4)
    monkeypatch.setattr(decode_module, "HEADERS", cache)
    walked = [0]
    real = decode_module._next_marker

    def counted(data, pos):
        walked[0] += 1
        return real(data, pos)

    monkeypatch.setattr(decode_module, "_next_marker", counted)
    cache.walked = walked
    return cache


@pytest.mark.parametrize("save", [{}, {"progressive": True}, {"restart_marker_blocks": 3}], ids=str)
def test_a_header_walked_before_is_not_walked_again_and_reads_the_same(headers, save):
    data = jpeg_bytes(40, 24, **save)
    first = check_jpeg(data, (40, 24))
    walked_first, headers.walked[0] = headers.walked[0], 0
    assert check_jpeg(data, (40, 24)) == first
    assert headers.walked[0] < walked_first  # the header's segments were not read again
    if not save:
        assert headers.walked[0] == 1  # only the EOI after the scan


def test_a_frame_with_a_known_header_but_cut_short_and_closed_with_eoi_is_still_refused(headers):
    data = jpeg_bytes(512, 512)
    check_jpeg(data, (512, 512))
    scan = scan_starts(data)[0]
    with pytest.raises(FrameDecodeError, match="fewer than the .* its .* blocks need"):
        check_jpeg(data[:scan + 40] + b"\xff\xd9", (512, 512))
    with pytest.raises(FrameDecodeError, match="truncated"):
        check_jpeg(data[:len(data) * 3 // 4], (512, 512))


def test_a_progressive_frame_with_a_known_header_missing_scans_is_still_refused(headers):
    data = JPEGS["progressive"]
    check_jpeg(data, (96, 64))
    with pytest.raises(FrameDecodeError, match="not fully coded|in no scan"):
        check_jpeg(data[:scan_starts(data)[1]] + b"\xff\xd9", (96, 64))


def test_a_known_header_is_still_held_to_the_frames_declared_size(headers):
    data = jpeg_bytes(40, 24)
    check_jpeg(data, (40, 24))
    with pytest.raises(FrameDecodeError, match="JPEG decodes to 40x24, but the frame declares 24x40"):
        check_jpeg(data, (24, 40))


def test_an_ff_da_inside_a_segment_before_the_scan_is_walked_not_taken_for_the_header(headers):
    """Segment payloads are not stuffed: an APP segment may hold FF DA. The cache's search finds it first, its bytes
    match no header walked, and the walk reads the frame as it is, every time."""
    data = jpeg_bytes(512, 512)
    app = b"\xff\xe5" + struct.pack(">H", 2 + 8) + b"\xff\xda\x00\x04\x01\x02\x03\x04"
    tricky = data[:2] + app + data[2:]
    assert check_jpeg(tricky, (512, 512)) == check_jpeg(data, (512, 512))
    assert check_jpeg(tricky, (512, 512)) == check_jpeg(data, (512, 512))
    with pytest.raises(FrameDecodeError, match="fewer than the .* its .* blocks need"):
        check_jpeg(tricky[:scan_starts(data)[0] + len(app) + 40] + b"\xff\xd9", (512, 512))


def test_libjpeg_reads_a_header_once_and_one_it_refuses_every_time(headers, monkeypatch):
    """A hit stands for libjpeg-turbo's header read as well as the walk: a header is remembered only once both
    accepted it, so one that libjpeg refuses is never a hit."""
    reads = []
    real = simplejpeg.decode_jpeg_header
    monkeypatch.setattr(simplejpeg, "decode_jpeg_header", lambda data: reads.append(1) or real(data))
    good = jpeg_bytes(32, 32)
    for _ in range(3):
        check_jpeg(good, (32, 32))
    assert len(reads) == 1
    odd = with_sampling(good, (0x13, 0x11, 0x11))  # valid JPEG, but the TurboJPEG API cannot name it
    for _ in range(2):
        with pytest.raises(FrameDecodeError, match="subsampling"):
            check_jpeg(odd, (32, 32))
    assert len(reads) == 3


def test_a_known_header_whose_scan_header_is_invalid_is_refused_every_time(headers):
    data = bytearray(jpeg_bytes(40, 24))
    sos = data.index(b"\xff\xda")
    count = data[sos + 4]
    data[sos + 5 + 2 * count + 1] = 62  # Se: the sequential scan stops short of coefficient 63
    for _ in range(2):
        with pytest.raises(FrameDecodeError, match="does not cover all 64 coefficients"):
            check_jpeg(bytes(data), (40, 24))


def test_a_known_header_followed_by_a_marker_other_than_eoi_after_its_scan_is_walked_to_the_end(headers):
    data = jpeg_bytes(40, 24)
    check_jpeg(data, (40, 24))
    with pytest.raises(FrameDecodeError, match="DNL marker"):
        check_jpeg(data[:-2] + b"\xff\xdc\x00\x04\x00\x18\xff\xd9", (40, 24))
    with pytest.raises(FrameDecodeError, match="truncated"):
        check_jpeg(data[:-2], (40, 24))


def test_the_header_cache_keeps_at_most_its_entries_and_headers_up_to_its_size(headers):
    for seed in range(10):
        check_jpeg(jpeg_bytes(16 + 8 * seed, 16, seed=seed), (16 + 8 * seed, 16))
    assert len(headers._known) == headers.max_entries
    big = jpeg_bytes(16, 16, exif=b"Exif\x00\x00" + bytes(headers.max_header_bytes))
    headers.walked[0] = 0
    check_jpeg(big, (16, 16))
    check_jpeg(big, (16, 16))
    assert headers.walked[0] > 4  # walked both times: a header over the size is not kept
    assert all(len(k) <= headers.max_header_bytes for k in headers._known)


# -- decompression bombs ----------------------------------------------------------------------------------------------
def test_a_jpeg_larger_than_its_frame_header_is_rejected_before_pillow_sees_it(monkeypatch):
    monkeypatch.setattr(Image, "open", lambda *a, **k: pytest.fail("Pillow was asked to open the bomb"))
    with pytest.raises(FrameDecodeError, match="JPEG decodes to 12000x12000, but the frame declares 64x64"):
        decode_pixels(frame(bomb(12000), 64, 64))


def test_a_jpeg_whose_header_matches_but_whose_data_is_far_too_short_is_rejected_before_pillow(monkeypatch):
    monkeypatch.setattr(Image, "open", lambda *a, **k: pytest.fail("Pillow was asked to open the bomb"))
    with pytest.raises(FrameDecodeError, match="a scan holds .* bits, fewer than the .* its .* blocks need"):
        decode_pixels(frame(bomb(8000), 8000, 8000), max_pixels=8000 * 8000)


def test_a_frame_over_the_pixel_limit_is_rejected_whatever_its_encoding():
    with pytest.raises(FrameDecodeError, match="exceeds the 100-pixel limit"):
        decode_pixels(frame(bytes(11 * 10 * 3), 11, 10, Encoding.RAW_RGB8), max_pixels=100)
    with pytest.raises(FrameDecodeError, match="exceeds the 100-pixel limit"):
        decode_pixels(frame(jpeg_bytes(11, 10), 11, 10), max_pixels=100)


_MEASURE = """
import io, json, sys
from PIL import Image
from worker.frames import Encoding, Frame, Priority, SourceRef
from worker.runtime.decode import FrameDecodeError, decode_pixels

how, width, height, max_pixels = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
data = sys.stdin.buffer.read()
frame = Frame(stream_id="s", frame_index=0, tenant="t", priority=Priority.STANDARD, capture_ts_ms=0, width=width,
              height=height, channels=3, encoding=Encoding.JPEG, data=data, source=SourceRef("t", 0, 0))
def status_kb(field):
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(field + ":"))
try:  # reset the peak (VmHWM) to the current RSS, so the peak below is this call's alone
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
except OSError:
    pass
rss_before = status_kb("VmRSS") * 1024
outcome = "decoded"
try:
    if how == "worker":
        decode_pixels(frame, max_pixels=max_pixels)
    else:  # what the worker did before: Pillow decodes whatever the JPEG's header says
        with Image.open(io.BytesIO(data)) as img:
            img.load()
except FrameDecodeError as exc:
    outcome = str(exc)
peak = status_kb("VmHWM") * 1024
print(json.dumps({"outcome": outcome, "growth_mb": (peak - rss_before) / 2**20}))
"""


def peak_rss_growth_mb(how: str, data: bytes, width: int, height: int, max_pixels: int) -> tuple[str, float]:
    """Peak RSS (VmHWM, reset just before) of a fresh process decoding `data`, less its RSS just before."""
    proc = subprocess.run([sys.executable, "-c", _MEASURE, how, str(width), str(height), str(max_pixels)],
                          input=data, capture_output=True, cwd=ROOT, timeout=240, check=True)
    out = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    return out["outcome"], out["growth_mb"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("declared, header, max_pixels", [
    (12000, 64, 16384 * 16384),  # the bomb: 12000x12000 in ~600 bytes, sent with a 64x64 header
    (8000, 8000, 16384 * 16384),  # the truncated JPEG with a matching header (and the limit raised)
])
def test_a_decompression_bomb_is_rejected_with_under_50_mb_of_peak_memory_growth(declared, header, max_pixels):
    data = bomb(declared)
    assert len(data) < 1000
    outcome, growth_mb = peak_rss_growth_mb("worker", data, header, header, max_pixels)
    assert outcome.startswith("JPEG"), outcome
    assert growth_mb < 50, f"decoding the bomb grew the peak RSS by {growth_mb:.0f} MB"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_the_memory_measurement_sees_a_bomb_that_pillow_alone_decodes():
    """The control of the test above: the same measurement of Pillow decoding a 5000x5000 bomb (75 MB of RGB)
    unchecked does exceed 50 MB, so the bound above can fail."""
    outcome, growth_mb = peak_rss_growth_mb("pillow", bomb(5000), 5000, 5000, 5000 * 5000)
    assert outcome == "decoded"
    assert growth_mb > 50, growth_mb


# -- truncated, padded, partial ---------------------------------------------------------------------------------------
JPEGS = {
    "baseline": jpeg_bytes(96, 64),
    "progressive": jpeg_bytes(96, 64, progressive=True),
    "restart markers": jpeg_bytes(96, 64, restart_marker_blocks=2),
    "grey": jpeg_bytes(96, 64, mode="L"),
}


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(JPEGS)), st.floats(0.0, 1.0, exclude_max=True), st.booleans())
def test_a_jpeg_cut_anywhere_is_a_decode_error(kind, share, vectorised):
    data = JPEGS[kind]
    cut = data[:int(len(data) * share)]
    with scan_walk(vectorised), pytest.raises(FrameDecodeError, match="JPEG does not decode"):
        decode_pixels(frame(cut, 96, 64))


@pytest.mark.parametrize("vectorised", [False, True])
@pytest.mark.parametrize("kind", sorted(JPEGS))
def test_a_jpeg_missing_only_its_last_byte_is_a_decode_error(kind, vectorised):
    with scan_walk(vectorised), pytest.raises(FrameDecodeError, match="truncated"):
        decode_pixels(frame(JPEGS[kind][:-1], 96, 64))


@pytest.mark.parametrize("kind", sorted(JPEGS))
def test_a_large_jpeg_is_walked_in_one_vectorised_pass_to_the_same_structure(kind, monkeypatch):
    save = {"baseline": {}, "progressive": {"progressive": True}, "restart markers": {"restart_marker_blocks": 2},
            "grey": {}}[kind]
    data = jpeg_bytes(1280, 720, mode="L" if kind == "grey" else "RGB", **save)
    assert len(data) >= decode_module.VECTOR_SCAN_MIN_BYTES
    walks: list[bytes] = []
    real = decode_module._ScanEnds.__init__

    def recording_init(self, data: bytes) -> None:
        walks.append(data)
        real(self, data)

    monkeypatch.setattr(decode_module._ScanEnds, "__init__", recording_init)
    vectorised = check_jpeg(data, (1280, 720))
    assert walks == [data]
    with scan_walk(False):
        assert vectorised == check_jpeg(data, (1280, 720))


def test_a_jpeg_over_the_vectorised_walks_maximum_is_walked_without_its_index(monkeypatch):
    """The index holds 8 bytes per 0xFF byte: a frame made of them would cost 8x its size."""
    data = jpeg_bytes(1280, 720)
    monkeypatch.setattr(decode_module, "VECTOR_SCAN_MAX_BYTES", len(data) - 1)
    monkeypatch.setattr(decode_module, "_ScanEnds", None)  # calling it would fail
    assert check_jpeg(data, (1280, 720)).scans == 1


def test_truncated_data_stays_an_error_even_if_something_sets_pillows_load_truncated_images(monkeypatch):
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    data = JPEGS["baseline"]
    with pytest.raises(FrameDecodeError, match="truncated"):
        decode_pixels(frame(data[:len(data) * 3 // 4], 96, 64))


@pytest.mark.parametrize("vectorised", [False, True])
def test_a_progressive_jpeg_cut_after_a_scan_and_closed_with_eoi_is_a_decode_error(vectorised):
    """Pillow decodes it without complaint (a blurred or grey image); the missing scans give it away."""
    data = JPEGS["progressive"]
    for start in scan_starts(data)[1:]:
        partial = data[:start] + b"\xff\xd9"
        Image.open(io.BytesIO(partial)).load()  # what the worker used to score
        with scan_walk(vectorised), pytest.raises(FrameDecodeError, match="not fully coded|in no scan"):
            decode_pixels(frame(partial, 96, 64))


@pytest.mark.parametrize("vectorised", [False, True])
def test_a_baseline_jpeg_cut_to_a_sliver_of_its_scan_and_closed_with_eoi_is_a_decode_error(vectorised):
    data = jpeg_bytes(512, 512)
    scan = scan_starts(data)[0]
    partial = data[:scan + 40] + b"\xff\xd9"
    Image.open(io.BytesIO(partial)).load()  # libjpeg pads the missing blocks grey, without an error
    with scan_walk(vectorised), pytest.raises(FrameDecodeError, match="fewer than the .* its .* blocks need"):
        decode_pixels(frame(partial, 512, 512))


@pytest.mark.parametrize("vectorised", [False, True])
def test_a_baseline_jpeg_cut_in_half_and_closed_with_eoi_is_a_decode_error(vectorised):
    data = JPEGS["baseline"]
    with scan_walk(vectorised), pytest.raises(FrameDecodeError):
        decode_pixels(frame(data[:len(data) // 2] + b"\xff\xd9", 96, 64))


# -- not a supported JPEG -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("marker, name", [(0xC9, "arithmetic"), (0xC3, "lossless"), (0xC5, "hierarchical")])
def test_jpeg_coding_processes_other_than_huffman_baseline_or_progressive_are_refused(marker, name):
    with pytest.raises(FrameDecodeError, match=f"unsupported coding process \\(SOF FF {marker:02X}\\)"):
        decode_pixels(frame(with_sof_marker(jpeg_bytes(16, 16), marker), 16, 16))


def test_a_png_marked_jpeg_is_refused_by_the_structure_check():
    buf = io.BytesIO()
    Image.new("RGB", (16, 16)).save(buf, format="PNG")
    with pytest.raises(FrameDecodeError, match="no SOI marker"):
        decode_pixels(frame(buf.getvalue(), 16, 16))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.sampled_from(sorted(JPEGS)))
def test_any_bytes_after_a_jpeg_header_decode_or_fail_with_frame_decode_error(junk, kind):
    data = JPEGS[kind]
    scan = scan_starts(data)[0]
    try:
        decode_pixels(frame(data[:scan] + junk, 96, 64))
    except FrameDecodeError as exc:
        assert str(exc)


def test_a_bomb_in_a_batch_is_a_failure_beside_it_and_the_other_frames_still_run():
    """What the executor turns into a FrameDecodeError dead letter, with this reason."""
    from worker.runtime.models import ModelContract
    from worker.runtime.preprocess import Preprocessor

    good = frame(jpeg_bytes(64, 64), 64, 64)
    batch = Preprocessor(ModelContract(name="m", version="1", labels=("a",))).prepare(
        [good, frame(bomb(12000), 64, 64)], (64, 64, 3))
    assert batch.frames == [good]
    [(_, error)] = batch.failures
    assert "12000x12000" in str(error)


def test_stray_bytes_between_segments_are_corrupt_data_and_refused():
    # libjpeg skips them with a "Corrupt JPEG data: extraneous bytes" warning; warnings are errors here.
    data = jpeg_bytes(16, 16)
    after_app0 = 4 + struct.unpack_from(">H", data, 4)[0]
    padded = data[:after_app0] + b"\x00\x00" + data[after_app0:]
    with pytest.raises(FrameDecodeError, match="extraneous bytes"):
        decode_pixels(frame(padded, 16, 16))


# -- decoding at a reduced DCT scale ----------------------------------------------------------------------------------
@pytest.mark.parametrize("frame_hw, min_hw, scale", [
    ((720, 1280), (224, 224), 2), ((1080, 1920), (224, 224), 4), ((1080, 1920), (126, 224), 8),
    ((720, 1280), (361, 100), 1), ((224, 224), (224, 224), 1), ((720, 1280), None, 1),
    ((9, 9), (2, 2), 8), ((9, 9), (3, 3), 4)])
def test_the_jpeg_scale_is_the_largest_reduction_still_at_least_the_size_needed(frame_hw, min_hw, scale):
    assert jpeg_scale(frame_hw, min_hw) == scale


def test_a_jpeg_is_decoded_at_the_reduced_scale_libjpeg_rounds_up_to():
    data = jpeg_bytes(1000, 563)
    assert decode_pixels(frame(data, 1000, 563), min_hw=(140, 200)).shape == (141, 250, 3)  # 1/4
    assert decode_pixels(frame(data, 1000, 563), min_hw=(70, 125)).shape == (71, 125, 3)  # 1/8


@pytest.mark.parametrize("resize, extra", [("stretch", {}), ("letterbox", {}),
                                           ("shorter_side_crop", {"resize_shorter_side": 256}),
                                           ("stretch_crop", {"resize_to": (256, 256)})])
def test_scaled_decode_then_resize_stays_close_to_full_decode_then_the_same_resize(resize, extra):
    """Both are low-pass downsamplings of the same JPEG (libjpeg's scaled IDCT, then Pillow's antialiased
    bilinear over fewer pixels); they differ only where the frame has detail finer than the model input keeps,
    so on a photo-like 1280x720 frame the mean difference stays under 1.5 of 255 levels and 99% of pixels within
    10 (hard edges can differ more, in a pixel or two beside them)."""
    contract = ModelContract(name="m", version="1", labels=("a",), input_size=(224, 224), resize=resize, **extra)
    data = Image.fromarray(photo_like(1280, 720))
    buf = io.BytesIO()
    data.save(buf, format="JPEG", quality=90)
    jpeg = frame(buf.getvalue(), 1280, 720)
    target = resize_target(contract, (720, 1280))
    scaled_pixels = decode_pixels(jpeg, min_hw=target)
    assert scaled_pixels.shape[0] < 720  # the test is about a reduced decode
    scaled, scaled_offset = fit_to_input(scaled_pixels, contract, (720, 1280))
    full, full_offset = fit_to_input(decode_pixels(jpeg), contract)
    assert scaled.shape == full.shape and scaled_offset == full_offset
    diff = np.abs(scaled.astype(int) - full.astype(int))
    assert diff.mean() < 1.5 and np.percentile(diff, 99) <= 10


def test_a_scaled_decode_still_checks_the_jpeg_before_libjpeg_sees_it(monkeypatch):
    monkeypatch.setattr(simplejpeg, "decode_jpeg", lambda *a, **k: pytest.fail("libjpeg was asked to decode"))
    with pytest.raises(FrameDecodeError, match="JPEG decodes to 12000x12000, but the frame declares 64x64"):
        decode_pixels(frame(bomb(12000), 64, 64), min_hw=(8, 8))


def test_a_scaled_decode_of_corrupt_scan_data_is_a_decode_error_strict_libjpeg_reports():
    """The structure walk cannot see bad Huffman data; libjpeg's warning about it is an error (strict)."""
    data = jpeg_bytes(512, 512)
    middle = (scan_starts(data)[0] + len(data)) // 2
    corrupt = data[:middle] + b"\x55" * 300 + data[middle + 300:]
    check_jpeg(corrupt)
    simplejpeg.decode_jpeg(corrupt, strict=False, min_height=64, min_width=64)  # lenient libjpeg: grey blocks
    with pytest.raises(FrameDecodeError, match="Corrupt JPEG data"):
        decode_pixels(frame(corrupt, 512, 512), min_hw=(64, 64))


# -- the walk over entropy-coded data ------------------------------------------------------------------------------
RESTART_CODES = range(0xD0, 0xD8)


def scan_end_byte_by_byte(data: bytes, pos: int, restarts: bool) -> tuple[int, int] | None:
    """The definition, read byte by byte: the first 0xFF of the first run of 0xFFs after `pos` that is followed by
    a marker code (not 00 stuffing, not RST0..7); and the 0xFFs (plus restart codes, with `restarts`) before it."""
    i = pos
    while True:
        i = data.find(b"\xff", i)
        if i < 0:
            return None
        j = i
        while j < len(data) and data[j] == 0xFF:
            j += 1
        if j == len(data):
            return None
        if data[j] != 0x00 and data[j] not in RESTART_CODES:
            codes = sum(1 for k in range(pos, i) if data[k] == 0xFF and data[k + 1] in RESTART_CODES)
            return i, data.count(b"\xff", pos, i) + (codes if restarts else 0)
        i = j


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from([0x00, 0x12, 0xFF, 0xFF, 0xD0, 0xD7, 0xD9, 0xDA, 0xC4]), max_size=40),
       st.integers(0, 40), st.booleans(), st.booleans())
def test_scan_data_ends_where_a_byte_by_byte_reading_says(content, pos, restarts, vectorised):
    data = bytes(content)
    pos = min(pos, len(data))
    expected = scan_end_byte_by_byte(data, pos, restarts)
    walk = decode_module._ScanEnds(data).scan_data_end if vectorised else decode_module._scan_data_end
    if expected is None:
        with pytest.raises(FrameDecodeError, match="truncated"):
            walk(data, pos, restarts)
    else:
        assert walk(data, pos, restarts) == expected


@pytest.mark.timeout(60)
@pytest.mark.parametrize("vectorised", [False, True])
def test_a_scan_padded_with_megabytes_of_ff_bytes_is_walked_in_linear_time(vectorised):
    """A run of 0xFF fill bytes ending in 00 stuffing is no marker; a regular expression for "a run of 0xFF, then
    a marker code" took 9 s on 30 KB of them (quadratic), hours on the 2 MB here."""
    good = jpeg_bytes(64, 64)
    start = scan_starts(good)[0]
    data_at = start + 2 + struct.unpack_from(">H", good, start + 2)[0]
    padded = good[:data_at] + b"\xff" * 2_000_000 + b"\x00" + good[data_at:]
    with scan_walk(vectorised):
        assert check_jpeg(padded, (64, 64)).scans == 1  # the structure holds: libjpeg judges the data itself
