"""The hand-written result writer (worker.codec.resultwriter) against fastavro: the same bytes from the same values, and
the schema's fields as the writer knows them."""

import io
import json

import fastavro
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.codec.resultwriter import RESULT_FIELDS, STATUS_SYMBOLS, ResultWriter, write_long
from worker.codec.schemas import RESULT_SCHEMA, SCHEMA_DIR
from worker.frames import Detection, Encoding, Frame, ModelVerdict, Priority, SourceRef, Verdict
from worker.policy.verdicts import Decision

LONG = st.integers(-(2**63), 2**63 - 1)
INT = st.integers(-(2**31), 2**31 - 1)
TEXT = st.text(max_size=12)
FLOAT32 = st.floats(width=32, allow_nan=False)


def _schema_fields(name: str) -> list[dict]:
    return json.loads((SCHEMA_DIR / name).read_text())["fields"]


def test_the_writer_knows_every_field_of_the_schema_in_its_order():
    """A field added to or moved in moderation_result.avsc fails here until worker.codec.resultwriter writes it too."""
    assert tuple(f["name"] for f in _schema_fields("moderation_result.avsc")) == RESULT_FIELDS
    status = next(f["type"]["symbols"] for f in _schema_fields("moderation_result.avsc") if f["name"] == "status")
    assert tuple(status) == STATUS_SYMBOLS


def _fastavro_bytes(schema, record) -> bytes:
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, schema, record)
    return buf.getvalue()


@given(LONG)
def test_a_long_is_written_as_fastavro_writes_it(n):
    assert write_long(n) == _fastavro_bytes("long", n)


def test_a_long_outside_avros_range_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        write_long(2**63)


DETECTIONS = st.builds(Detection, TEXT, FLOAT32, FLOAT32, FLOAT32, FLOAT32, FLOAT32)
SCORES = st.dictionaries(TEXT, st.floats(allow_nan=False, width=32), max_size=4)
LABELS = st.lists(TEXT, max_size=3).map(tuple)
VERDICTS = st.builds(Verdict, SCORES, LABELS, st.lists(DETECTIONS, max_size=2).map(tuple))
MODEL_VERDICTS = st.builds(ModelVerdict, TEXT, TEXT, st.none() | VERDICTS, TEXT)
SET_VERDICTS = st.builds(Verdict, SCORES, LABELS, st.just(()), st.lists(MODEL_VERDICTS, min_size=1, max_size=3)
                         .map(tuple), TEXT)


def _reference(verdict, fields, decision=None, policy_version="") -> dict:
    """The result as a dict for fastavro: what build_result wrote through fastavro before this codec; with a policy's
    `decision`, its verdict decides `flagged` and `flagged_labels`."""
    def model(m):
        v = m.verdict
        return {"model": m.model, "version": m.version, "ran": v is not None, "skipped_reason": m.skipped,
                "scores": dict(v.scores) if v else {}, "flagged_labels": list(v.flagged_labels) if v else [],
                "detections": [{"label": d.label, "score": d.score, "x": d.x, "y": d.y, "width": d.width,
                                "height": d.height} for d in (v.detections if v else ())]}
    sets = verdict is not None and verdict.models
    flagged = list(verdict.flagged_labels) if verdict else []
    judged = {"verdict": "", "verdict_labels": [], "policy_version": ""}
    if decision is not None:
        flagged = list(decision.labels) if verdict and decision.verdict == "flag" else []
        judged = {"verdict": decision.verdict, "verdict_labels": list(decision.labels),
                  "policy_version": policy_version}
    return {**fields, "scores": dict(verdict.scores) if verdict else {},
            "flagged": bool(flagged),
            "flagged_labels": flagged,
            "decided_by": verdict.decided_by if sets else "",
            "models": [model(m) for m in verdict.models] if sets else [], **judged}


def _frame(stream_id: str, frame_index: int, tenant: str, topic: str, partition: int, offset: int,
           capture_ts_ms: int) -> Frame:
    return Frame(stream_id=stream_id, frame_index=frame_index, tenant=tenant, priority=Priority.STANDARD,
                 capture_ts_ms=capture_ts_ms, width=1, height=1, channels=3, encoding=Encoding.RAW_RGB8,
                 data=bytes(3), source=SourceRef(topic, partition, offset))


FRAMES = st.builds(_frame, TEXT, LONG, TEXT, st.sampled_from(["frames.standard", "t", "é"]), INT, LONG, LONG)


DECISIONS = st.builds(Decision, st.sampled_from(["", "allow", "review", "flag"]), LABELS)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(FRAMES, st.none() | VERDICTS | SET_VERDICTS, st.floats(allow_nan=False), DECISIONS),
                max_size=4),
       TEXT, TEXT, TEXT, st.sampled_from(STATUS_SYMBOLS), INT, st.floats(allow_nan=False),
       st.floats(-1e15, 1e15), st.binary(max_size=5), st.none() | LONG, st.none() | TEXT)
def test_a_batchs_results_are_written_byte_for_byte_as_fastavro_writes_each(judged, model_name, model_version,
                                                                            worker_id, status, batch_size,
                                                                            inference_ms, now_ms, framing,
                                                                            reused_from, policy_version):
    writer = ResultWriter(model_name, model_version, worker_id, framing)
    results = [r[:3] for r in judged]
    decisions = None if policy_version is None else [r[3] for r in judged]
    for _ in range(2):  # the second time from the writer's caches of encoded strings and partitions
        written = writer.write_frames(results, status, batch_size, inference_ms, now_ms, reused_from, decisions,
                                      policy_version or "")
        assert len(written) == len(results)
        for value, (frame, verdict, queued_ms, decision) in zip(written, judged, strict=True):
            expected = _reference(verdict, {
                "stream_id": frame.stream_id, "frame_index": frame.frame_index, "tenant": frame.tenant,
                "status": status, "model_name": model_name, "model_version": model_version,
                "source_topic": frame.source.topic, "source_partition": frame.source.partition,
                "source_offset": frame.source.offset, "capture_ts_ms": frame.capture_ts_ms, "queued_ms": queued_ms,
                "batch_size": batch_size, "inference_ms": inference_ms,
                "end_to_end_ms": max(0.0, now_ms - frame.capture_ts_ms), "worker_id": worker_id,
                "reused_from_frame": reused_from}, None if decisions is None else decision, policy_version or "")
            assert value == framing + _fastavro_bytes(RESULT_SCHEMA, expected)


def test_a_score_past_float32s_range_is_written_as_infinity_as_fastavro_writes_it():
    writer = ResultWriter("m", "1", "w")
    verdict = Verdict({"big": 1e39, "small": -1e39}, ())
    [written] = writer.write_frames([(_frame("s", 0, "t", "topic", 0, 0, 0), verdict, 0.0)], "OK", 1, 0.0, 0.0)
    expected = _reference(verdict, {"stream_id": "s", "frame_index": 0, "tenant": "t", "status": "OK",
                                    "model_name": "m", "model_version": "1", "source_topic": "topic",
                                    "source_partition": 0, "source_offset": 0, "capture_ts_ms": 0, "queued_ms": 0.0,
                                    "batch_size": 1, "inference_ms": 0.0, "end_to_end_ms": 0.0, "worker_id": "w",
                                    "reused_from_frame": None})
    assert written == _fastavro_bytes(RESULT_SCHEMA, expected)
    assert fastavro.schemaless_reader(io.BytesIO(written), RESULT_SCHEMA, None)["scores"] == {
        "big": float("inf"), "small": float("-inf")}


def _old_result_schema() -> dict:
    """moderation_result.avsc as it was before `reused_from_frame` (issue 59)."""
    schema = json.loads((SCHEMA_DIR / "moderation_result.avsc").read_text())
    schema["fields"] = [f for f in schema["fields"] if f["name"] != "reused_from_frame"]
    return schema


def _result_fields(**extra) -> dict:
    return {"stream_id": "s", "frame_index": 7, "tenant": "t", "status": "OK", "model_name": "m",
            "model_version": "1", "scores": {"nsfw": 0.25}, "flagged": False, "flagged_labels": [],
            "source_topic": "frames", "source_partition": 0, "source_offset": 3, "capture_ts_ms": 5,
            "queued_ms": 0.0, "batch_size": 0, "inference_ms": 0.0, "end_to_end_ms": 1.0, "worker_id": "w", **extra}


def test_an_old_reader_reads_a_reused_result_and_a_new_reader_reads_an_old_result():
    old, new = fastavro.parse_schema(_old_result_schema()), fastavro.parse_schema(
        json.loads((SCHEMA_DIR / "moderation_result.avsc").read_text()))
    [written] = ResultWriter("m", "1", "w").write_frames([(_frame("s", 7, "t", "frames", 0, 3, 5),
                                                           Verdict({"nsfw": 0.25}, ()), 0.0)], "OK", 0, 0.0, 6.0, 4)
    as_old = fastavro.schemaless_reader(io.BytesIO(written), new, old)
    assert "reused_from_frame" not in as_old and as_old["frame_index"] == 7 and as_old["scores"] == {"nsfw": 0.25}
    old_bytes = _fastavro_bytes(old, _result_fields())
    as_new = fastavro.schemaless_reader(io.BytesIO(old_bytes), old, new)
    assert as_new["reused_from_frame"] is None and as_new["source_offset"] == 3
    assert fastavro.schemaless_reader(io.BytesIO(written), new, None)["reused_from_frame"] == 4


def _schema_before_policies() -> dict:
    """moderation_result.avsc as it was before the policy's fields (issue 66)."""
    schema = json.loads((SCHEMA_DIR / "moderation_result.avsc").read_text())
    schema["fields"] = [f for f in schema["fields"] if f["name"] not in ("verdict", "verdict_labels", "policy_version")]
    return schema


def test_an_old_reader_reads_a_judged_result_and_a_new_reader_reads_one_from_before_policies():
    old, new = fastavro.parse_schema(_schema_before_policies()), fastavro.parse_schema(
        json.loads((SCHEMA_DIR / "moderation_result.avsc").read_text()))
    [written] = ResultWriter("m", "1", "w").write_frames(
        [(_frame("s", 7, "kids", "frames", 0, 3, 5), Verdict({"nudity": 0.4}, ()), 0.0)], "OK", 1, 0.0, 6.0, None,
        [Decision("flag", ("nudity",))], "r3")
    as_old = fastavro.schemaless_reader(io.BytesIO(written), new, old)
    assert "verdict" not in as_old and "policy_version" not in as_old
    assert as_old["flagged"] is True and as_old["flagged_labels"] == ["nudity"] and as_old["frame_index"] == 7
    as_new = fastavro.schemaless_reader(io.BytesIO(_fastavro_bytes(old, _result_fields(reused_from_frame=None))),
                                        old, new)
    assert (as_new["verdict"], as_new["verdict_labels"], as_new["policy_version"]) == ("", [], "")
    assert as_new["source_offset"] == 3
    current = fastavro.schemaless_reader(io.BytesIO(written), new, None)
    assert (current["verdict"], current["verdict_labels"], current["policy_version"]) == ("flag", ["nudity"], "r3")
