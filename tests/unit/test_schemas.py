"""Frames and results round-trip through the Avro schemas; bad messages raise MessageDecodeError."""

import dataclasses
import io
import json

import fastavro
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.codec.schemas import (
    FRAME_SCHEMA,
    SCHEMA_DIR,
    FrameRecord,
    MessageDecodeError,
    decode_frame,
    decode_result,
    encode_frame,
    encode_result,
    reencode_frame,
)
from worker.config import LimitsSettings
from worker.frames import Encoding, Priority, SourceRef

SRC = SourceRef("frames.standard", 2, 41)
NOW = 1_700_000_000.5  # the worker's clock (wall seconds) in these tests: record()'s capture is 377 ms earlier


def record(**kw):
    base = dict(stream_id="cam-1", frame_index=7, capture_ts_ms=1_700_000_000_123, tenant="acme",
                priority=Priority.BULK, width=4, height=2, channels=3, encoding=Encoding.RAW_RGB8, data=bytes(24))
    base.update(kw)
    return FrameRecord(**base)


@pytest.mark.parametrize("encoding", list(Encoding))
def test_every_encoding_the_frame_schema_allows_decodes_to_its_own(encoding):
    symbols = next(f["type"]["symbols"] for f in json.loads((SCHEMA_DIR / "frame.avsc").read_text())["fields"]
                   if f["name"] == "encoding")
    assert sorted(symbols) == sorted(e.value for e in Encoding)
    frame = decode_frame(encode_frame(record(encoding=encoding, data=bytes(24))), SRC, Priority.BULK, received_at=NOW)
    assert frame.encoding is encoding


def test_frame_round_trip_takes_priority_from_topic():
    frame = decode_frame(encode_frame(record()), SRC, Priority.REALTIME, received_at=NOW)
    assert (frame.stream_id, frame.frame_index, frame.tenant) == ("cam-1", 7, "acme")
    assert frame.capture_ts_ms == 1_700_000_000_123
    assert frame.shape == (2, 4, 3)
    assert frame.priority is Priority.REALTIME
    assert frame.source == SRC and frame.received_at == NOW


@pytest.mark.parametrize("rec, reason", [
    (record(width=0), "impossible dimensions"),
    (record(channels=2), "channel count"),
    (record(data=bytes(23)), "needs 24 bytes"),
    (record(width=100_000, height=100_000, data=b""), "pixel limit"),
])
def test_impossible_frames_are_rejected_with_a_reason(rec, reason):
    with pytest.raises(MessageDecodeError, match=reason):
        decode_frame(encode_frame(rec), SRC, Priority.STANDARD, NOW)


def test_empty_and_trailing_bytes_are_rejected():
    with pytest.raises(MessageDecodeError, match="empty"):
        decode_frame(b"", SRC, Priority.STANDARD, NOW)
    with pytest.raises(MessageDecodeError, match="trailing"):
        decode_frame(encode_frame(record()) + b"xx", SRC, Priority.STANDARD, NOW)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_crash_the_decoder(payload):
    try:
        decode_frame(payload, SRC, Priority.STANDARD, NOW)
    except MessageDecodeError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=1, max_value=60))
def test_truncated_frames_are_rejected(cut):
    payload = encode_frame(record())
    with pytest.raises(MessageDecodeError):
        decode_frame(payload[: max(0, len(payload) - cut)], SRC, Priority.STANDARD, NOW)


def test_result_round_trip():
    rec = {"stream_id": "s", "frame_index": 1, "tenant": "t", "status": "OK", "model_name": "m", "model_version": "1",
           "scores": {"nudity": 0.25}, "flagged": False, "flagged_labels": [], "source_topic": "frames.bulk",
           "source_partition": 0, "source_offset": 9, "capture_ts_ms": 1_700_000_000_000, "queued_ms": 1.5,
           "batch_size": 8, "inference_ms": 3.0, "end_to_end_ms": 12.0, "worker_id": "w"}
    # A model set's fields (decided_by, models), reuse's and the policy's are written with their defaults when a
    # record leaves them out.
    assert decode_result(encode_result(rec)) == {**rec, "decided_by": "", "models": [], "reused_from_frame": None,
                                                 "verdict": "", "verdict_labels": [], "policy_version": ""}


def test_reencoded_frame_decodes_to_the_same_frame():
    frame = decode_frame(encode_frame(record()), SRC, Priority.BULK, NOW)
    again = decode_frame(reencode_frame(frame), SRC, Priority.BULK, NOW)
    assert again == frame


def test_reencoded_frame_is_the_original_message_even_when_topic_and_record_priority_differ():
    original = encode_frame(record(priority=Priority.BULK))
    frame = decode_frame(original, SRC, Priority.REALTIME, NOW)
    assert frame.priority is Priority.REALTIME
    assert reencode_frame(frame) == original


# -- limits: identifiers, indices, capture time (limits.*) ---------------------------------------------------------
LIMITS = LimitsSettings()


def test_a_frame_at_the_default_pixel_limit_is_accepted_and_one_past_it_is_not():
    assert decode_frame(encode_frame(record(width=4096, height=4096, data=b"", encoding=Encoding.JPEG)), SRC,
                        Priority.STANDARD, NOW).shape == (4096, 4096, 3)
    with pytest.raises(MessageDecodeError, match="limits.max_frame_pixels"):
        decode_frame(encode_frame(record(width=4097, height=4096, data=b"", encoding=Encoding.JPEG)), SRC,
                     Priority.STANDARD, NOW)


def test_the_pixel_limit_is_the_setting():
    small = dataclasses.replace(LIMITS, max_frame_pixels=7)
    with pytest.raises(MessageDecodeError, match="exceeds the 7-pixel limit"):
        decode_frame(encode_frame(record()), SRC, Priority.STANDARD, NOW, small)


@pytest.mark.parametrize("field", ["stream_id", "tenant"])
def test_an_identifier_longer_than_the_limit_is_rejected_and_one_at_it_is_not(field):
    at_limit = "é" * (LIMITS.max_identifier_bytes // 2)  # 2 bytes each in UTF-8: the limit counts bytes
    assert getattr(decode_frame(encode_frame(record(**{field: at_limit})), SRC, Priority.STANDARD, NOW),
                   field) == at_limit
    with pytest.raises(MessageDecodeError, match=f"{field} is {LIMITS.max_identifier_bytes + 2} bytes"):
        decode_frame(encode_frame(record(**{field: at_limit + "é"})), SRC, Priority.STANDARD, NOW)


def test_a_negative_frame_index_is_rejected_and_a_huge_one_is_a_frame():
    with pytest.raises(MessageDecodeError, match="frame_index -1 is negative"):
        decode_frame(encode_frame(record(frame_index=-1)), SRC, Priority.STANDARD, NOW)
    huge = decode_frame(encode_frame(record(frame_index=2**63 - 1)), SRC, Priority.STANDARD, NOW)
    assert huge.frame_index == 2**63 - 1


@pytest.mark.parametrize("capture_ts_ms, reason", [
    (0, "before 946684800000"),
    (-1, "before 946684800000"),
    (-(2**63), "before 946684800000"),
    (1_700_000_000, "before 946684800000"),  # seconds sent as milliseconds
    (2**62, "in the future"),
    (2**63 - 1, "in the future"),
    (1_700_000_000_500 * 1000, "in the future"),  # microseconds
    (int(NOW * 1000) + LIMITS.max_capture_skew_ms + 1, "more than the 60000 ms clock skew"),
])
def test_a_capture_time_outside_the_window_is_a_decode_error_with_the_setting_to_look_at(capture_ts_ms, reason):
    with pytest.raises(MessageDecodeError, match=reason) as info:
        decode_frame(encode_frame(record(capture_ts_ms=capture_ts_ms)), SRC, Priority.STANDARD, NOW)
    assert "limits.m" in str(info.value) and "Overflow" not in str(info.value)


@pytest.mark.parametrize("capture_ts_ms", [
    LIMITS.min_capture_ts_ms,  # a backlog may be old: only the floor applies
    int(NOW * 1000) - 400 * 86_400_000,
    int(NOW * 1000) + LIMITS.max_capture_skew_ms,  # a producer clock a little ahead
])
def test_a_capture_time_inside_the_window_is_kept_as_sent(capture_ts_ms):
    frame = decode_frame(encode_frame(record(capture_ts_ms=capture_ts_ms)), SRC, Priority.STANDARD, NOW)
    assert frame.capture_ts_ms == capture_ts_ms


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=-(2**63), max_value=2**63 - 1), st.integers(min_value=-(2**63), max_value=2**63 - 1))
def test_any_long_index_or_capture_time_is_a_frame_or_a_decode_error(frame_index, capture_ts_ms):
    try:
        frame = decode_frame(encode_frame(record(frame_index=frame_index, capture_ts_ms=capture_ts_ms)), SRC,
                             Priority.STANDARD, NOW)
    except MessageDecodeError:
        return
    assert frame.frame_index >= 0
    assert LIMITS.min_capture_ts_ms <= frame.capture_ts_ms <= NOW * 1000 + LIMITS.max_capture_skew_ms


# -- schema evolution ---------------------------------------------------------------------------------------------
def _newer_writer_schema():
    newer = json.loads((SCHEMA_DIR / "frame.avsc").read_text())
    newer["fields"].append({"name": "camera_model", "type": "string", "default": ""})
    return fastavro.parse_schema(newer)


def test_a_frame_written_with_a_newer_schema_is_rejected_with_a_pointer_to_the_docs():
    """Schemaless Avro carries no writer schema: the appended field's bytes are left over after the record."""
    buf = io.BytesIO()
    rec = {**dataclasses.asdict(record()), "priority": "BULK", "encoding": "RAW_RGB8", "camera_model": "x"}
    fastavro.schemaless_writer(buf, _newer_writer_schema(), rec)
    with pytest.raises(MessageDecodeError, match="newer schema .* docs/configuration.md"):
        decode_frame(buf.getvalue(), SRC, Priority.STANDARD, NOW)


def test_with_its_writer_schema_known_a_newer_frame_resolves_to_the_workers_schema():
    """Why docs/configuration.md names a writer-schema id as the way to evolve: Avro resolution needs it."""
    buf = io.BytesIO()
    rec = {**dataclasses.asdict(record()), "priority": "BULK", "encoding": "RAW_RGB8", "camera_model": "x"}
    fastavro.schemaless_writer(buf, _newer_writer_schema(), rec)
    buf.seek(0)
    resolved = fastavro.schemaless_reader(buf, _newer_writer_schema(), FRAME_SCHEMA)
    assert resolved["stream_id"] == "cam-1" and "camera_model" not in resolved
