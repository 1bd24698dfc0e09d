"""The result schema's model-set fields (decided_by, models): new fields with defaults, so a reader of the schema
before them still reads new results, and a new reader reads old results with the defaults."""

from __future__ import annotations

import io
import json

import fastavro

from worker.codec.schemas import SCHEMA_DIR, ResultContext, build_result, decode_result
from worker.frames import Detection, Encoding, Frame, ModelVerdict, Priority, SourceRef, Verdict

NEW_FIELDS = ("decided_by", "models")


def _schema(old: bool) -> dict:
    schema = json.loads((SCHEMA_DIR / "moderation_result.avsc").read_text())
    if old:  # the schema as it was before the model set: the same file without its new fields
        schema["fields"] = [f for f in schema["fields"] if f["name"] not in NEW_FIELDS]
    return schema


def _frame() -> Frame:
    return Frame(stream_id="s", frame_index=3, tenant="t", priority=Priority.BULK, capture_ts_ms=1_700_000_000_000,
                 width=4, height=4, channels=3, encoding=Encoding.RAW_RGB8, data=bytes(48),
                 source=SourceRef("frames.bulk", 0, 7))


def _set_verdict() -> Verdict:
    classifier = Verdict({"sfw": 0.2, "nsfw": 0.8}, ("nsfw",))
    box = Detection("FACE_FEMALE", 0.72, 173.0, 82.5, 102.5, 98.4)
    detector = Verdict({"FACE_FEMALE": 0.72}, (), (box,))
    return Verdict({"sfw": 0.2, "nsfw": 0.8}, ("nsfw",),
                   models=(ModelVerdict("open_nsfw", "1", classifier), ModelVerdict("nudenet", "2", detector),
                           ModelVerdict("later", "3", None, "skipped: open_nsfw scored nsfw 0.1 < 0.2")),
                   decided_by="open_nsfw")


def _result(verdict: Verdict) -> bytes:
    return build_result(_frame(), verdict, "OK", ResultContext("open_nsfw+nudenet", "1+2", "w"), 1.0, 2, 3.0,
                        1_700_000_000.0)


def test_a_new_result_carries_every_models_output_and_who_decided():
    rec = decode_result(_result(_set_verdict()))
    assert rec["decided_by"] == "open_nsfw"
    classifier, detector, skipped = rec["models"]
    assert classifier["ran"] and classifier["flagged_labels"] == ["nsfw"]
    assert detector["detections"][0]["label"] == "FACE_FEMALE" and abs(detector["detections"][0]["x"] - 173) < 1e-3
    assert not skipped["ran"] and skipped["skipped_reason"].startswith("skipped:") and skipped["scores"] == {}


def test_an_old_reader_reads_a_new_result():
    old = fastavro.parse_schema(_schema(old=True))
    new = fastavro.parse_schema(_schema(old=False))
    rec = fastavro.schemaless_reader(io.BytesIO(_result(_set_verdict())), new, old)
    assert rec["flagged_labels"] == ["nsfw"] and rec["scores"]["nsfw"] > 0.79
    assert not set(NEW_FIELDS) & set(rec)


def test_a_new_reader_reads_an_old_result_with_the_defaults():
    old = fastavro.parse_schema(_schema(old=True))
    new = fastavro.parse_schema(_schema(old=False))
    record = {k: v for k, v in fastavro.schemaless_reader(io.BytesIO(_result(Verdict({"x": 0.1}, ()))), new).items()
              if k not in NEW_FIELDS}
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, old, record)
    rec = fastavro.schemaless_reader(io.BytesIO(buf.getvalue()), old, new)
    assert rec["decided_by"] == "" and rec["models"] == []


def test_a_single_model_result_has_empty_model_set_fields():
    rec = decode_result(_result(Verdict({"nudity": 0.9}, ("nudity",))))
    assert rec["decided_by"] == "" and rec["models"] == []
