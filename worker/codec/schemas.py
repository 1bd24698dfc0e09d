"""Avro encoding of frames and moderation results; `schemas/*.avsc` are the source of truth.

Messages are plain (schemaless) Avro bodies, so any fastavro or Avro client with the `.avsc` files can produce
frames and read results; with a Schema Registry (`[schema_registry]`) results carry the Confluent wire format's
5-byte header, and frames may carry it: a frame's writer schema is then resolved to the worker's. The rule that
tells them apart is `is_registry_framed`.
"""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import fastavro

from worker.codec.resultwriter import ResultWriter
from worker.config import LimitsSettings
from worker.frames import Encoding, Frame, Priority, SourceRef, Verdict, replay_count_of


def _schema_dir() -> Path:
    """`schemas/` of a source checkout, else the copy a wheel installs under `<prefix>/share/streamfer/`."""
    candidates = [Path(__file__).resolve().parents[2] / "schemas",
                  Path(sys.prefix) / "share" / "streamfer" / "schemas"]
    for candidate in candidates:
        if (candidate / "frame.avsc").is_file():
            return candidate
    raise FileNotFoundError(f"Avro schemas not found in {[str(c) for c in candidates]}: reinstall streamfer")


SCHEMA_DIR = _schema_dir()

DEFAULT_LIMITS = LimitsSettings()
# Channel counts a frame may declare: a property of the formats (grey, RGB, RGBA/CMYK), not a tunable limit.
SUPPORTED_CHANNELS = (1, 3, 4)
# The frame's encoding by its Avro enum symbol (a dict look-up: Encoding(symbol) costs a microsecond a frame).
ENCODINGS = {e.value: e for e in Encoding}
PRIORITIES = {p.name: p for p in Priority}  # the same for the record's priority symbol


class MessageDecodeError(ValueError):
    """A Kafka message is not a valid frame: the worker dead-letters it with this message as the reason."""


# The Confluent wire format: a magic byte 0, the writer schema's registry id (4 bytes, big-endian), the body.
MAGIC_BYTE = 0
FRAMING_BYTES = 5


class WriterSchemas(Protocol):
    """Writer schemas by registry id (worker.kafka.registry.WriterSchemaCache): a parsed fastavro schema, with
    logical types dropped like FRAME_READ_SCHEMA's, or MessageDecodeError saying why the id cannot be read."""

    def writer_schema(self, schema_id: int) -> Any: ...


def registry_framing(schema_id: int) -> bytes:
    """The 5 bytes a registry-framed message starts with."""
    return bytes((MAGIC_BYTE,)) + schema_id.to_bytes(4, "big")


def is_registry_framed(payload: bytes) -> bool:
    """Whether a message read with a registry configured is registry-framed: its first byte is the magic byte 0.

    A plain Frame body starts with its stream_id's length (an Avro zig-zag varint), which is 0 only for an empty
    stream_id; so with a registry, a plain frame needs a non-empty stream_id (an empty one is read as framed)."""
    return bool(payload) and payload[0] == MAGIC_BYTE


def _load_json(name: str) -> Any:
    with open(SCHEMA_DIR / name, encoding="utf-8") as fh:
        return json.load(fh)


FRAME_SCHEMA = fastavro.parse_schema(_load_json("frame.avsc"))
RESULT_SCHEMA = fastavro.parse_schema(_load_json("moderation_result.avsc"))


def _without_logical_types(schema: Any) -> Any:
    """The schema with `logicalType` annotations dropped: the same bytes, read as plain values, so a
    timestamp-millis outside datetime's range is a number the range checks reject, not an OverflowError."""
    if isinstance(schema, dict):
        return {k: _without_logical_types(v) for k, v in schema.items() if k != "logicalType"}
    if isinstance(schema, list):
        return [_without_logical_types(v) for v in schema]
    return schema


# What frames are read with: frame.avsc, capture_ts_ms as a plain long (epoch milliseconds).
FRAME_READ_SCHEMA = fastavro.parse_schema(_without_logical_types(_load_json("frame.avsc")))


def _write(schema: Any, record: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, schema, record)
    return buf.getvalue()


def _read(schema: Any, payload: bytes) -> dict[str, Any]:
    buf = io.BytesIO(payload)
    record = fastavro.schemaless_reader(buf, schema, None)
    if buf.tell() != len(payload):
        raise MessageDecodeError(
            f"{len(payload) - buf.tell()} trailing bytes after the Avro record (not a frame, or written with a "
            f"newer schema than this worker's: see Schema evolution in docs/configuration.md)")
    return record  # type: ignore[return-value]


def _read_framed(reader: Any, payload: bytes, writer_schemas: WriterSchemas) -> dict[str, Any]:
    """A registry-framed message's body, written with its id's schema, resolved to `reader` (Avro resolution:
    fields the reader lacks are skipped, fields the writer lacks take the reader's defaults)."""
    if len(payload) < FRAMING_BYTES:
        raise MessageDecodeError(f"registry-framed message of {len(payload)} bytes: shorter than its "
                                 f"{FRAMING_BYTES}-byte header (magic byte 0, 4-byte schema id)")
    schema_id = int.from_bytes(payload[1:FRAMING_BYTES], "big")
    writer = writer_schemas.writer_schema(schema_id)
    buf = io.BytesIO(payload)
    buf.seek(FRAMING_BYTES)
    try:
        record = fastavro.schemaless_reader(buf, writer, reader)
    except fastavro.read.SchemaResolutionError as exc:
        raise MessageDecodeError(f"written with registry schema id {schema_id}, which this worker's schema cannot "
                                 f"read ({exc}): an incompatible writer schema, see Schema evolution in "
                                 f"docs/configuration.md") from None
    except Exception as exc:  # noqa: BLE001 (fastavro raises EOFError, ValueError, UnicodeDecodeError...)
        raise MessageDecodeError(f"not an Avro record of registry schema id {schema_id} "
                                 f"({type(exc).__name__}: {exc})") from None
    if buf.tell() != len(payload):
        raise MessageDecodeError(f"{len(payload) - buf.tell()} trailing bytes after the Avro record of registry "
                                 f"schema id {schema_id}")
    return record  # type: ignore[return-value]


def _not_a_frame(payload: bytes, exc: Exception) -> MessageDecodeError:
    hint = (" (its first byte is 0, as in the Schema Registry wire format: set schema_registry.url to read "
            "registry-framed frames)" if is_registry_framed(payload) else "")
    return MessageDecodeError(f"not a Frame Avro record ({type(exc).__name__}: {exc}){hint}")


@dataclass(frozen=True)
class FrameRecord:
    """What a producer sends: the frame without Kafka coordinates."""

    stream_id: str
    frame_index: int
    capture_ts_ms: int
    tenant: str
    priority: Priority
    width: int
    height: int
    channels: int
    encoding: Encoding
    data: bytes


def encode_frame(frame: FrameRecord) -> bytes:
    return _write(
        FRAME_SCHEMA,
        {
            "stream_id": frame.stream_id,
            "frame_index": frame.frame_index,
            "capture_ts_ms": frame.capture_ts_ms,
            "tenant": frame.tenant,
            "priority": frame.priority.name,
            "width": frame.width,
            "height": frame.height,
            "channels": frame.channels,
            "encoding": frame.encoding.value,
            "data": frame.data,
        },
    )


def reencode_frame(frame: Frame) -> bytes:
    """The Avro message a decoded frame came from (for dead letters of frames that decoded but failed later)."""
    return encode_frame(FrameRecord(
        stream_id=frame.stream_id, frame_index=frame.frame_index, capture_ts_ms=frame.capture_ts_ms,
        tenant=frame.tenant, priority=frame.declared_priority or frame.priority, width=frame.width,
        height=frame.height,
        channels=frame.channels, encoding=frame.encoding, data=frame.data))


def read_frame_record(payload: bytes) -> FrameRecord:
    """The frame record as written, unchecked: for tools that inspect messages the worker refused (dead
    letters, a lagging partition's next frame). Raises MessageDecodeError when it is not a frame record."""
    try:
        rec = _read(FRAME_READ_SCHEMA, payload)
    except MessageDecodeError:
        raise
    except Exception as exc:  # noqa: BLE001 (fastavro raises EOFError, ValueError, UnicodeDecodeError...)
        raise MessageDecodeError(f"not a Frame Avro record ({type(exc).__name__}: {exc})") from None
    return FrameRecord(stream_id=rec["stream_id"], frame_index=rec["frame_index"], capture_ts_ms=rec["capture_ts_ms"],
                       tenant=rec["tenant"], priority=Priority[rec["priority"]], width=rec["width"],
                       height=rec["height"], channels=rec["channels"], encoding=ENCODINGS[rec["encoding"]],
                       data=rec["data"])


def decode_frame(payload: bytes | None, source: SourceRef, priority: Priority, received_at: float,
                 limits: LimitsSettings = DEFAULT_LIMITS,
                 headers: Sequence[tuple[str, bytes | None]] | None = None,
                 writer_schemas: WriterSchemas | None = None) -> Frame:
    """Decode and sanity-check a frame message; raises MessageDecodeError with a reason a human can act on.

    The priority class comes from the topic (the caller), not from the record's informational field.
    `received_at` (wall seconds) is the worker's now, against which the capture time is checked. `headers`: the
    message's Kafka headers, kept on the frame for its dead letter. With `writer_schemas` (a registry), a
    registry-framed message (`is_registry_framed`) is read with its writer schema; any other as a plain body.
    """
    if not payload:
        raise MessageDecodeError("empty message value")
    if writer_schemas is not None and is_registry_framed(payload):
        rec = _read_framed(FRAME_READ_SCHEMA, payload, writer_schemas)
    else:
        try:
            rec = _read(FRAME_READ_SCHEMA, payload)
        except MessageDecodeError:
            raise
        except Exception as exc:  # noqa: BLE001 (fastavro raises EOFError, ValueError, UnicodeDecodeError...)
            raise _not_a_frame(payload, exc) from None
    width, height, channels = rec["width"], rec["height"], rec["channels"]
    if width <= 0 or height <= 0:
        raise MessageDecodeError(f"impossible dimensions {width}x{height}")
    if channels not in SUPPORTED_CHANNELS:
        raise MessageDecodeError(f"unsupported channel count {channels} (1, 3 or 4)")
    if width * height > limits.max_frame_pixels:
        raise MessageDecodeError(
            f"frame {width}x{height} exceeds the {limits.max_frame_pixels}-pixel limit (limits.max_frame_pixels)")
    encoding = ENCODINGS[rec["encoding"]]
    if encoding is Encoding.RAW_RGB8 and len(rec["data"]) != width * height * channels:
        raise MessageDecodeError(
            f"RAW_RGB8 frame {width}x{height}x{channels} needs {width * height * channels} bytes, "
            f"got {len(rec['data'])}"
        )
    for name in ("stream_id", "tenant"):
        # A character is 1 to 4 UTF-8 bytes: only an identifier of over a quarter of the limit is encoded to count.
        if 4 * len(rec[name]) > limits.max_identifier_bytes:
            size = len(rec[name].encode())
            if size > limits.max_identifier_bytes:
                raise MessageDecodeError(
                    f"{name} is {size} bytes; at most {limits.max_identifier_bytes} (limits.max_identifier_bytes)")
    if rec["frame_index"] < 0:
        raise MessageDecodeError(f"frame_index {rec['frame_index']} is negative: it counts frames from 0")
    capture_ms = rec["capture_ts_ms"]
    _check_capture_time(capture_ms, received_at, limits)
    if headers:
        try:
            replay_count_of(headers)
        except ValueError as exc:
            raise MessageDecodeError(f"{exc} (`worker dlq replay` writes it as a decimal count)") from None
    # Positional, in Frame's field order: a frame per message, and keywords cost a tenth more.
    return Frame(rec["stream_id"], rec["frame_index"], rec["tenant"], priority, capture_ms, width, height, channels,
                 encoding, rec["data"], source, received_at, PRIORITIES[rec["priority"]],
                 tuple(headers) if headers else ())


def _check_capture_time(capture_ms: int, now_s: float, limits: LimitsSettings) -> None:
    """capture_ts_ms within [limits.min_capture_ts_ms, now + limits.max_capture_skew_ms], else dead-lettered:
    a nonsense capture time would feed the latency metrics and the expiry decision with nonsense."""
    if capture_ms < limits.min_capture_ts_ms:
        raise MessageDecodeError(
            f"capture_ts_ms {capture_ms} is before {limits.min_capture_ts_ms} (limits.min_capture_ts_ms): "
            f"it must be the capture time in epoch milliseconds")
    latest = int(now_s * 1000) + limits.max_capture_skew_ms
    if capture_ms > latest:
        raise MessageDecodeError(
            f"capture_ts_ms {capture_ms} is {capture_ms - int(now_s * 1000)} ms in the future, more than the "
            f"{limits.max_capture_skew_ms} ms clock skew allowed (limits.max_capture_skew_ms): fix the producer's "
            f"clock, or its unit (epoch milliseconds)")


def encode_result(record: dict[str, Any]) -> bytes:
    return _write(RESULT_SCHEMA, record)


def decode_result(payload: bytes, writer_schemas: WriterSchemas | None = None) -> dict[str, Any]:
    """Decode a result; `capture_ts_ms` is returned as epoch milliseconds (int). With `writer_schemas`, a
    registry-framed result is read with its writer schema."""
    if writer_schemas is not None and is_registry_framed(payload):
        rec = _read_framed(RESULT_SCHEMA, payload, writer_schemas)
    else:
        rec = _read(RESULT_SCHEMA, payload)
    capture = rec["capture_ts_ms"]
    if hasattr(capture, "timestamp"):
        rec["capture_ts_ms"] = int(round(capture.timestamp() * 1000))
    return rec


@dataclass(frozen=True)
class ResultContext:
    """What every result of this worker carries besides the frame and its verdict."""

    model_name: str
    model_version: str
    worker_id: str
    # Written before each result's body: registry_framing(id) of the results schema with a registry, else none.
    framing: bytes = b""


def result_writer(ctx: ResultContext) -> ResultWriter:
    """The hand-written encoder of this context's results (worker.codec.resultwriter): hold one, it caches encodings."""
    return ResultWriter(ctx.model_name, ctx.model_version, ctx.worker_id, ctx.framing)


def build_result(frame: Frame, verdict: Verdict | None, status: str, ctx: ResultContext, queued_ms: float,
                 batch_size: int, inference_ms: float, now: float) -> bytes:
    """The encoded moderation result of one frame (verdict None for an EXPIRED frame), after `ctx.framing`, by a
    writer of its own: for one-off results (the loop holds a writer and writes a batch's results at once)."""
    return result_writer(ctx).write_frames([(frame, verdict, queued_ms)], status, batch_size, inference_ms,
                                           now * 1000.0)[0]
