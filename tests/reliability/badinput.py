"""Bad input messages with what the worker must do with each: a catalogue of named cases (each one kind of
damage) and seeded mutations of valid frames. The hypothesis tests draw their own; the suite runner uses
these, so a table row is reproducible from its seed.
"""

from __future__ import annotations

import io
import itertools
import json
import random
import struct
import time
from dataclasses import dataclass

import numpy as np

from worker.codec.schemas import FrameRecord, encode_frame, encode_result
from worker.frames import Encoding, Priority
from worker.testing import DEAD_LETTER, EITHER, RESULT

from .harness import CLIENT_MAX_MESSAGE_BYTES


@dataclass(frozen=True)
class BadInput:
    kind: str
    value: bytes | None
    expect: str  # DEAD_LETTER, RESULT (a control) or EITHER (a mutation that may still be a valid frame)


_frame_indices = itertools.count()


def frame_bytes(width: int = 32, height: int = 32, channels: int = 3, encoding: Encoding = Encoding.RAW_RGB8,
                data: bytes | None = None, stream_id: str = "bad-input", capture_ts_ms: int | None = None,
                tenant: str = "t", frame_index: int | None = None) -> bytes:
    """A frame message with any header values, valid or not. By default it is captured now (the worker
    dead-letters capture times outside limits.min_capture_ts_ms .. now + max_capture_skew_ms) and has an
    identity of its own (a repeated (stream_id, frame_index) may be dead-lettered as a duplicate)."""
    if data is None:
        data = raw_pixels(width, height, channels) if encoding is Encoding.RAW_RGB8 else jpeg_pixels(width, height)
    return encode_frame(FrameRecord(
        stream_id=stream_id, frame_index=next(_frame_indices) if frame_index is None else frame_index,
        capture_ts_ms=int(time.time() * 1000) if capture_ts_ms is None else capture_ts_ms, tenant=tenant,
        priority=Priority.STANDARD, width=width, height=height, channels=channels, encoding=encoding, data=data))


def with_sof_size(jpeg: bytes, width: int, height: int) -> bytes:
    """The JPEG with its frame header (SOF) patched to declare width x height: a decompression bomb."""
    pos = 2
    while jpeg[pos + 1] not in (0xC0, 0xC1, 0xC2):
        pos += 2 + struct.unpack_from(">H", jpeg, pos + 2)[0]
    return jpeg[:pos + 5] + struct.pack(">HH", height, width) + jpeg[pos + 9:]


def jpeg_frame(data: bytes, width: int = 32, height: int = 32) -> bytes:
    """A frame message marked JPEG holding `data` (valid or not) and declaring width x height."""
    return frame_bytes(width, height, 3, Encoding.JPEG, data)


def raw_pixels(width: int, height: int, channels: int = 3) -> bytes:
    return np.random.default_rng(width * 7 + height).integers(0, 201, max(0, width * height * channels),
                                                              dtype=np.uint8).tobytes()


def jpeg_pixels(width: int, height: int, fmt: str = "JPEG") -> bytes:
    from PIL import Image

    img = np.random.default_rng(3).integers(0, 201, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format=fmt)
    return buf.getvalue()


def catalogue(seed: int = 0) -> list[BadInput]:
    """One message per kind of damage named in the issue: each must be dead-lettered with a reason."""
    rng = random.Random(seed)
    good = frame_bytes()
    jpeg = jpeg_pixels(32, 32)
    bad_utf8 = frame_bytes(stream_id="ZZZZ").replace(b"ZZZZ", b"\xff\xfe\xff\xfe", 1)
    result = encode_result({
        "stream_id": "s", "frame_index": 1, "tenant": "t", "status": "OK", "model_name": "m", "model_version": "1",
        "scores": {"a": 0.5}, "flagged": False, "flagged_labels": [], "source_topic": "x", "source_partition": 0,
        "source_offset": 0, "capture_ts_ms": 0, "queued_ms": 0.0, "batch_size": 1, "inference_ms": 0.0,
        "end_to_end_ms": 0.0, "worker_id": "w"})
    cases = [
        BadInput("null value", None, DEAD_LETTER),
        BadInput("empty value", b"", DEAD_LETTER),
        BadInput("random bytes (1)", rng.randbytes(1), DEAD_LETTER),
        BadInput("random bytes (100)", rng.randbytes(100), DEAD_LETTER),
        BadInput("random bytes (5000)", rng.randbytes(5000), DEAD_LETTER),
        BadInput("truncated (10 bytes)", good[:10], DEAD_LETTER),
        BadInput("truncated (half)", good[: len(good) // 2], DEAD_LETTER),
        BadInput("truncated (last byte)", good[:-1], DEAD_LETTER),
        BadInput("trailing bytes", good + b"\x00\x01", DEAD_LETTER),
        BadInput("wrong schema (a result record)", result, DEAD_LETTER),
        BadInput("wrong schema (JSON)", json.dumps({"stream_id": "s", "width": 32}).encode(), DEAD_LETTER),
        BadInput("invalid UTF-8 stream id", bad_utf8, DEAD_LETTER),
        BadInput("zero width", frame_bytes(width=0, data=b""), DEAD_LETTER),
        BadInput("zero height", frame_bytes(height=0, data=b""), DEAD_LETTER),
        BadInput("negative dimensions", frame_bytes(width=-32, height=-32, data=b""), DEAD_LETTER),
        BadInput("huge dimensions", frame_bytes(width=100_000, height=100_000, data=b"\x00" * 64), DEAD_LETTER),
        # Grey (1), grey+alpha (2), RGB (3) and RGBA (4) frames are converted for the model; others are not.
        BadInput("5 channels", frame_bytes(channels=5), DEAD_LETTER),
        BadInput("RAW byte count short", frame_bytes(data=raw_pixels(32, 32)[:-1]), DEAD_LETTER),
        BadInput("RAW byte count long", frame_bytes(data=raw_pixels(32, 32) + b"\x00"), DEAD_LETTER),
        BadInput("RAW 8 channels (the worker reads 1 to 4)", frame_bytes(channels=8), DEAD_LETTER),
        BadInput("corrupt JPEG (truncated)", jpeg_frame(jpeg[: len(jpeg) // 2]), DEAD_LETTER),
        BadInput("corrupt JPEG (random bytes)", jpeg_frame(rng.randbytes(600)), DEAD_LETTER),
        BadInput("corrupt JPEG (empty)", jpeg_frame(b""), DEAD_LETTER),
        BadInput("JPEG holding a PNG", jpeg_frame(jpeg_pixels(32, 32, "PNG")), DEAD_LETTER),
        BadInput("JPEG size not as declared", jpeg_frame(jpeg, width=48), DEAD_LETTER),
        BadInput("JPEG decompression bomb (SOF 12000x12000, header 64x64)",
                 jpeg_frame(with_sof_size(jpeg_pixels(8, 8), 12000, 12000), 64, 64), DEAD_LETTER),
        BadInput("corrupt JPEG (truncated, closed with EOI, SOF 4096x4096 as its header)",
                 jpeg_frame(with_sof_size(jpeg_pixels(8, 8), 4096, 4096), 4096, 4096), DEAD_LETTER),
        BadInput("capture time 0", frame_bytes(capture_ts_ms=0), DEAD_LETTER),
        BadInput("capture time 2^62", frame_bytes(capture_ts_ms=2**62), DEAD_LETTER),
        BadInput("capture time an hour ahead", frame_bytes(capture_ts_ms=int(time.time() * 1000) + 3_600_000),
                 DEAD_LETTER),
        BadInput("negative frame index", frame_bytes(frame_index=-1), DEAD_LETTER),
        BadInput("900 KB tenant", frame_bytes(tenant="t" * 900_000), DEAD_LETTER),
    ]
    return cases


def mutations(count: int, seed: int = 0) -> list[BadInput]:
    """Seeded damage to valid frames (bit flips, cuts, inserted bytes): some still decode, so EITHER."""
    rng = random.Random(seed)
    bases = [frame_bytes(), frame_bytes(48, 32), frame_bytes(encoding=Encoding.JPEG)]
    out = []
    for _ in range(count):
        value = bytearray(rng.choice(bases))
        how = rng.choice(("flip", "cut", "insert"))
        if how == "flip":
            for _ in range(rng.randint(1, 8)):
                value[rng.randrange(len(value))] ^= 1 << rng.randrange(8)
        elif how == "cut":
            value = value[: rng.randrange(len(value))]
        else:
            at = rng.randrange(len(value))
            value[at:at] = rng.randbytes(rng.randint(1, 16))
        out.append(BadInput(f"mutation ({how})", bytes(value), EITHER))
    return out


def oversized() -> list[BadInput]:
    """Messages at the client's size limit: one that decodes (a big RAW frame, a control) and ones that do not.
    A dead letter carries the original bytes plus reason headers, so it is a little larger than its input."""
    room = CLIENT_MAX_MESSAGE_BYTES - 1_000  # leave room for the Avro header fields and the record overhead
    side = int((room / 3) ** 0.5)
    return [
        BadInput("oversized valid RAW frame (control)", frame_bytes(side, side), RESULT),
        BadInput("oversized RAW with wrong byte count", frame_bytes(16, 16, data=b"\x07" * room), DEAD_LETTER),
        BadInput("oversized corrupt JPEG", jpeg_frame(b"\xff\xd8" + b"\x07" * room, 64, 64), DEAD_LETTER),
    ]
