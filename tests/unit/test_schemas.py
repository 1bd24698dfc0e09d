"""Frames and results round-trip through the Avro schemas; bad messages raise MessageDecodeError."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.frames import Encoding, Priority, SourceRef
from worker.schemas import (FrameRecord, MessageDecodeError, decode_frame, decode_result, encode_frame,
                            encode_result, reencode_frame)

SRC = SourceRef("frames.standard", 2, 41)


def record(**kw):
    base = dict(stream_id="cam-1", frame_index=7, capture_ts_ms=1_700_000_000_123, tenant="acme",
                priority=Priority.BULK, width=4, height=2, channels=3, encoding=Encoding.RAW_RGB8, data=bytes(24))
    base.update(kw)
    return FrameRecord(**base)


def test_frame_round_trip_takes_priority_from_topic():
    frame = decode_frame(encode_frame(record()), SRC, Priority.REALTIME, received_at=5.0)
    assert (frame.stream_id, frame.frame_index, frame.tenant) == ("cam-1", 7, "acme")
    assert frame.capture_ts_ms == 1_700_000_000_123
    assert frame.shape == (2, 4, 3)
    assert frame.priority is Priority.REALTIME
    assert frame.source == SRC and frame.received_at == 5.0


@pytest.mark.parametrize("rec, reason", [
    (record(width=0), "impossible dimensions"),
    (record(channels=2), "channel count"),
    (record(data=bytes(23)), "needs 24 bytes"),
    (record(width=100_000, height=100_000, data=b""), "pixel limit"),
])
def test_impossible_frames_are_rejected_with_a_reason(rec, reason):
    with pytest.raises(MessageDecodeError, match=reason):
        decode_frame(encode_frame(rec), SRC, Priority.STANDARD, 0.0)


def test_empty_and_trailing_bytes_are_rejected():
    with pytest.raises(MessageDecodeError, match="empty"):
        decode_frame(b"", SRC, Priority.STANDARD, 0.0)
    with pytest.raises(MessageDecodeError, match="trailing"):
        decode_frame(encode_frame(record()) + b"xx", SRC, Priority.STANDARD, 0.0)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_crash_the_decoder(payload):
    try:
        decode_frame(payload, SRC, Priority.STANDARD, 0.0)
    except MessageDecodeError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=1, max_value=60))
def test_truncated_frames_are_rejected(cut):
    payload = encode_frame(record())
    with pytest.raises(MessageDecodeError):
        decode_frame(payload[: max(0, len(payload) - cut)], SRC, Priority.STANDARD, 0.0)


def test_result_round_trip():
    rec = {"stream_id": "s", "frame_index": 1, "tenant": "t", "status": "OK", "model_name": "m", "model_version": "1",
           "scores": {"nudity": 0.25}, "flagged": False, "flagged_labels": [], "source_topic": "frames.bulk",
           "source_partition": 0, "source_offset": 9, "capture_ts_ms": 1_700_000_000_000, "queued_ms": 1.5,
           "batch_size": 8, "inference_ms": 3.0, "end_to_end_ms": 12.0, "worker_id": "w"}
    assert decode_result(encode_result(rec)) == rec


def test_reencoded_frame_decodes_to_the_same_frame():
    frame = decode_frame(encode_frame(record()), SRC, Priority.BULK, 1.0)
    again = decode_frame(reencode_frame(frame), SRC, Priority.BULK, 1.0)
    assert again == frame


def test_reencoded_frame_is_the_original_message_even_when_topic_and_record_priority_differ():
    original = encode_frame(record(priority=Priority.BULK))
    frame = decode_frame(original, SRC, Priority.REALTIME, 1.0)
    assert frame.priority is Priority.REALTIME
    assert reencode_frame(frame) == original
