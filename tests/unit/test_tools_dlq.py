"""`worker dlq`'s decisions without a broker: how a dead letter is read back, which are selected, what `show`
counts, which are replayed and with what headers (worker/tools/dlq/). The broker round trip is
tests/integration/test_dlq_and_lag.py."""

from __future__ import annotations

import json

import pytest

from worker.cli import main
from worker.codec.schemas import FrameRecord, encode_frame
from worker.config import Settings, load_settings
from worker.frames import Encoding, Priority
from worker.tools.dlq import (
    DeadLetterSummary,
    Original,
    Selection,
    expires,
    is_replayed,
    ledger_record,
    ledger_topic,
    parse_duration_ms,
    parse_entry,
    parse_time_ms,
    render_summary,
    replay_message,
    replay_selection,
    skip_reason,
)

NOW_MS = 1_800_000_000_000
DLQ = "frames.dlq"


def frame(stream: str = "cam", index: int = 7, tenant: str = "t1", capture_ts_ms: int = NOW_MS - 5_000) -> bytes:
    return encode_frame(FrameRecord(stream, index, capture_ts_ms, tenant, Priority.STANDARD, 2, 2, 3,
                                    Encoding.RAW_RGB8, bytes(12)))


def context(error_type: str = "ModelError", offset: int = 40, topic: str = "frames.standard"
            ) -> list[tuple[str, bytes | None]]:
    return [("streamfer.error", b"model raised on this frame"), ("streamfer.error_type", error_type.encode()),
            ("streamfer.source_topic", topic.encode()), ("streamfer.source_partition", b"1"),
            ("streamfer.source_offset", str(offset).encode()), ("streamfer.worker_id", b"w0")]


def entry(error_type: str = "ModelError", value: bytes | None = None, own: list[tuple[str, bytes | None]] | None = None,
          offset: int = 3, ts: int = NOW_MS, key: bytes | None = b"cam", **frame_args: object):
    payload = frame(**frame_args) if value is None else value  # type: ignore[arg-type]
    return parse_entry(DLQ, 0, offset, ts, key, payload, (own or []) + context(error_type))


# -- time -------------------------------------------------------------------------------------------------------
def test_durations_take_a_unit() -> None:
    assert parse_duration_ms("90s") == 90_000 and parse_duration_ms("1.5h") == 5_400_000
    assert parse_duration_ms("250ms") == 250 and parse_duration_ms("2d") == 172_800_000
    for bad in ("5", "5x", "0s", "-1h", "h"):
        with pytest.raises(ValueError):
            parse_duration_ms(bad)


def test_a_time_is_a_duration_ago_or_an_iso_time_utc_unless_it_says() -> None:
    assert parse_time_ms("2h", NOW_MS) == NOW_MS - 7_200_000
    assert parse_time_ms("2027-01-15T08:00:00Z", NOW_MS) == 1_800_000_000_000
    assert parse_time_ms("2027-01-15T08:00:00", NOW_MS) == 1_800_000_000_000
    assert parse_time_ms("2027-01-15T09:00:00+01:00", NOW_MS) == 1_800_000_000_000
    with pytest.raises(ValueError, match="ISO 8601"):
        parse_time_ms("yesterday", NOW_MS)


# -- reading a dead letter back ---------------------------------------------------------------------------------
def test_a_dead_letter_is_read_back_with_its_context_and_its_frames_identity() -> None:
    e = entry(own=[("trace", b"x"), ("streamfer.replay_count", b"2"), ("streamfer.replayed_from", b"frames.dlq/0@1")])
    assert (e.error_type, e.reason, e.worker_id) == ("ModelError", "model raised on this frame", "w0")
    assert (e.source.topic, e.source.partition, e.source.offset) == ("frames.standard", 1, 40)  # type: ignore[union-attr]
    assert (e.stream, e.frame_index, e.tenant, e.replay_count) == ("cam", 7, "t1", 2)
    assert e.capture_ts_ms == NOW_MS - 5_000 and e.coordinates == "frames.dlq/0@3" and not e.reference_only
    assert e.own_headers() == (("trace", b"x"),)


def test_a_dead_letter_that_is_no_frame_is_named_by_its_key_and_missing_headers_are_unknown() -> None:
    e = parse_entry(DLQ, 2, 9, NOW_MS, b"cam-9", b"\x00garbage", [("streamfer.replay_count", b"x")])
    assert (e.stream, e.frame_index, e.tenant, e.source) == ("cam-9", None, None, None)
    assert (e.error_type, e.replay_count) == ("unknown", None)
    assert parse_entry(DLQ, 2, 9, NOW_MS, None, b"", None).stream == "unknown"


def test_only_an_output_rejected_dead_letter_without_payload_is_reference_only() -> None:
    assert entry("OutputRejected", value=b"").reference_only
    assert not entry("MessageDecodeError", value=b"").reference_only  # an empty message: that is the frame


# -- selection --------------------------------------------------------------------------------------------------
def test_each_filter_selects_on_its_own_field() -> None:
    e = entry(ts=NOW_MS)
    assert Selection().matches(e)
    assert Selection(error_types=frozenset({"ModelError"})).matches(e)
    assert not Selection(error_types=frozenset({"FrameDecodeError"})).matches(e)
    assert Selection(since_ms=NOW_MS, until_ms=NOW_MS + 1).matches(e)
    assert not Selection(since_ms=NOW_MS + 1).matches(e) and not Selection(until_ms=NOW_MS).matches(e)
    assert Selection(streams=frozenset({"cam"}), tenants=frozenset({"t1"})).matches(e)
    assert not Selection(streams=frozenset({"other"})).matches(e)
    assert not Selection(tenants=frozenset({"t2"})).matches(e)
    assert Selection(source_topics=frozenset({"frames.standard"})).matches(e)
    assert not Selection(source_topics=frozenset({"frames.bulk"})).matches(e)


def test_replay_leaves_duplicates_out_unless_asked_for_by_name() -> None:
    duplicate = entry("DuplicateFrame")
    assert not replay_selection(Selection()).matches(duplicate)
    assert replay_selection(Selection()).matches(entry("ModelError"))
    assert replay_selection(Selection(error_types=frozenset({"DuplicateFrame"}))).matches(duplicate)


# -- show -------------------------------------------------------------------------------------------------------
def test_show_counts_by_each_dimension_and_keeps_the_newest_newest_first() -> None:
    s = DeadLetterSummary(DLQ, window_ms=3_600_000, max_replays=2, newest_wanted=2)
    s.add(entry("ModelError", offset=1, ts=NOW_MS, stream="a"), replayed=True, retained=None)
    s.add(entry("ModelError", offset=2, ts=NOW_MS + 3_600_000, stream="b", own=[("streamfer.replay_count", b"2")]),
          replayed=False, retained=None)
    s.add(entry("OutputRejected", value=b"", offset=3, ts=NOW_MS + 10, key=b"c"), replayed=False, retained=False)
    assert s.total == 3 and s.by_error_type == {"ModelError": 2, "OutputRejected": 1}
    assert s.by_stream == {"a": 1, "b": 1, "c": 1} and s.by_tenant == {"t1": 2, "unknown": 1}
    assert s.by_window == {NOW_MS - NOW_MS % 3_600_000: 2, NOW_MS + 3_600_000 - NOW_MS % 3_600_000: 1}
    assert s.by_replay_count == {"0": 2, "2": 1} and s.at_replay_limit == 1 and s.replayed == 1
    assert (s.reference_only, s.reference_gone) == (1, 1)
    assert [e.offset for e, _replayed, _retained in s.newest()] == [2, 3]
    out = s.to_json(top=1)
    assert out["by_stream"] == {"a": 1, "(others)": 2} and out["at_replay_limit"] == 1
    assert [n["dead_letter"]["offset"] for n in out["newest"]] == [2, 3]
    assert "payload_base64" not in out["newest"][0] and json.dumps(out)


def test_show_prints_the_frame_bytes_only_when_asked() -> None:
    s = DeadLetterSummary(DLQ, window_ms=60_000, max_replays=3, newest_wanted=5)
    s.add(entry(), replayed=False, retained=None)
    text = render_summary(s, top=5)
    assert "1 dead letters in frames.dlq" in text and "reason: model raised on this frame" in text
    assert "base64" not in text and "base64" in render_summary(s, top=5, with_payload=True)
    assert "payload_base64" in s.to_json(top=5, with_payload=True)["newest"][0]


# -- replay decisions -------------------------------------------------------------------------------------------
def test_what_is_not_replayed_and_why() -> None:
    assert skip_reason(entry(), 3, None, already_replayed=False) is None
    assert "already replayed" in str(skip_reason(entry(), 3, None, already_replayed=True))
    at_limit = entry(own=[("streamfer.replay_count", b"3")])
    assert "replay limit" in str(skip_reason(at_limit, 3, None, False))
    assert skip_reason(at_limit, 4, None, False) is None
    assert "not a count" in str(skip_reason(entry(own=[("streamfer.replay_count", b"x")]), 3, None, False))
    no_source = parse_entry(DLQ, 0, 1, NOW_MS, b"k", frame(), [("streamfer.error_type", b"ModelError")])
    assert "give --topic" in str(skip_reason(no_source, 3, None, False))
    assert skip_reason(no_source, 3, "frames.bulk", False) is None


def test_a_replayed_frame_keeps_its_key_value_and_own_headers_and_gets_the_marker() -> None:
    e = entry(own=[("trace", b"x"), ("streamfer.replay_count", b"1"), ("streamfer.replayed_from", b"old")])
    m = replay_message(e, "frames.standard")
    assert (m.topic, m.key, m.value) == ("frames.standard", b"cam", e.value)
    assert m.headers == (("trace", b"x"), ("streamfer.replay_count", b"2"),
                         ("streamfer.replayed_from", b"frames.dlq/0@3"))


def test_a_reference_only_dead_letter_is_replayed_from_the_original_message() -> None:
    e = entry("OutputRejected", value=b"", key=b"cam")
    original = Original(b"orig-key", frame(), (("trace", b"y"), ("streamfer.replay_count", b"0")))
    m = replay_message(e, "frames.standard", original)
    assert (m.key, m.value) == (b"orig-key", original.value)
    assert m.headers == (("trace", b"y"), ("streamfer.replay_count", b"1"),
                         ("streamfer.replayed_from", b"frames.dlq/0@3"))


def test_the_ledger_names_a_dead_letter_by_its_coordinates_and_timestamp() -> None:
    e = entry()
    key, value = ledger_record(e, replay_message(e, "frames.standard"), NOW_MS)
    assert key == b"frames.dlq/0@3" and json.loads(value)["replay_count"] == 1
    ledger = {key.decode(): json.loads(value)["dead_letter_timestamp_ms"]}
    assert is_replayed(ledger, e)
    assert not is_replayed(ledger, entry(ts=NOW_MS + 1))  # a recreated topic's dead letter at the same offset
    assert ledger_topic(DLQ) == "frames.dlq.replayed"


def test_a_frame_older_than_its_class_max_age_is_flagged_as_going_to_expire() -> None:
    settings = Settings()  # standard: max_age_ms 30000; bulk: 0 (never expires)
    e = entry(capture_ts_ms=NOW_MS - 60_000)
    m = replay_message(e, settings.topics.standard)
    assert expires(settings, settings.topics.standard, m, NOW_MS / 1000)
    assert not expires(settings, settings.topics.bulk, replay_message(e, settings.topics.bulk), NOW_MS / 1000)
    assert not expires(settings, settings.topics.standard, replay_message(entry(capture_ts_ms=NOW_MS - 1_000),
                                                                          settings.topics.standard), NOW_MS / 1000)


def test_the_replay_limit_is_a_validated_setting() -> None:
    assert Settings().dlq.max_replays == 3
    assert load_settings(env={"WORKER_DLQ_MAX_REPLAYS": "0"}).dlq.max_replays == 0
    with pytest.raises(ValueError, match="dlq.max_replays"):
        load_settings(env={"WORKER_DLQ_MAX_REPLAYS": "-1"})


@pytest.mark.parametrize("argv", [["dlq"], ["dlq", "show"], ["dlq", "replay"], ["lag"]])
def test_each_commands_help_fits_on_a_screen(argv: list[str], monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and out.startswith("usage: worker " + " ".join(argv))
    assert len(out.splitlines()) <= 50, out
