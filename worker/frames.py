"""Values passed between the stages: a decoded frame, where it came from, and what became of it.

Pure data: no Kafka, no torch. Every stage below the source speaks in these types.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# A Kafka message's headers as confluent-kafka gives them: (name, value) pairs, names may repeat.
Headers = tuple[tuple[str, bytes | None], ...]
# A topic partition: (topic, partition).
TP = tuple[str, int]

# The context a dead letter carries in its headers (worker/kafka/producer.py), after the input message's own headers.
HEADER_ERROR = "streamfer.error"
HEADER_ERROR_TYPE = "streamfer.error_type"
HEADER_SOURCE_TOPIC = "streamfer.source_topic"
HEADER_SOURCE_PARTITION = "streamfer.source_partition"
HEADER_SOURCE_OFFSET = "streamfer.source_offset"
HEADER_WORKER_ID = "streamfer.worker_id"
DEAD_LETTER_HEADERS = frozenset({HEADER_ERROR, HEADER_ERROR_TYPE, HEADER_SOURCE_TOPIC, HEADER_SOURCE_PARTITION,
                                 HEADER_SOURCE_OFFSET, HEADER_WORKER_ID})
# What `worker dlq replay` adds to a frame it publishes again: how many times the frame has been replayed, and
# the dead letter it was replayed from. An input message's headers travel into its dead letter, so a replayed
# frame that fails again is dead-lettered with its count (worker/tools/dlq/replay.py stops at dlq.max_replays).
HEADER_REPLAY_COUNT = "streamfer.replay_count"
HEADER_REPLAYED_FROM = "streamfer.replayed_from"
REPLAY_HEADERS = frozenset({HEADER_REPLAY_COUNT, HEADER_REPLAYED_FROM})


def replay_count_of(headers: Sequence[tuple[str, bytes | None]] | None) -> int:
    """How many times the message was replayed (its last `streamfer.replay_count` header), 0 without one.
    Raises ValueError when the header is not a count."""
    if not headers:
        return 0
    count = 0
    for name, value in headers:
        if name == HEADER_REPLAY_COUNT:
            text = (value or b"").decode("ascii", errors="replace")
            if not (text.isascii() and text.isdigit()):
                raise ValueError(f"header {HEADER_REPLAY_COUNT} is {text!r}: not a count")
            count = int(text)
    return count


class Priority(enum.IntEnum):
    """Service class of a frame, taken from the topic it was read from. Lower value is served first."""

    REALTIME = 0
    STANDARD = 1
    BULK = 2

    @property
    def label(self) -> str:
        return self.name.lower()


class Encoding(enum.Enum):
    RAW_RGB8 = "RAW_RGB8"
    JPEG = "JPEG"


@dataclass(frozen=True, order=True)
class SourceRef:
    """Kafka coordinates of the message a frame came from (the unit of offset tracking), and the assignment
    epoch of its partition it was read under: work of an older epoch is stale (see worker.partitions.assignment)."""

    topic: str
    partition: int
    offset: int
    epoch: int = 0

    @property
    def topic_partition(self) -> tuple[str, int]:
        return (self.topic, self.partition)


@dataclass(frozen=True)
class Frame:
    """One decoded frame header plus its (still encoded) pixel bytes.

    `received_at` is the worker's clock (wall seconds) when the frame was polled; the batcher and the
    latency metrics measure from it. `capture_ts_ms` is the producer's wall clock.
    """

    stream_id: str
    frame_index: int
    tenant: str
    priority: Priority
    capture_ts_ms: int
    width: int
    height: int
    channels: int
    encoding: Encoding
    data: bytes
    source: SourceRef
    received_at: float = 0.0
    # The record's own (informational) priority field, kept so a dead letter can carry the original bytes.
    declared_priority: Priority | None = None
    # The message's Kafka headers, carried into its dead letter (a replayed frame's replay count among them).
    headers: Headers = ()

    @property
    def shape(self) -> tuple[int, int, int]:
        """(height, width, channels) of the decoded image."""
        return (self.height, self.width, self.channels)

    @property
    def frame_id(self) -> str:
        return f"{self.stream_id}/{self.frame_index}"

    @property
    def replay_count(self) -> int:
        """How many times `worker dlq replay` published this frame again (0: the producer's own message)."""
        return replay_count_of(self.headers) if self.headers else 0


@dataclass(frozen=True)
class Detection:
    """One box a detector found: its label and score, and where in the frame's own pixels (top-left x, y and size)."""

    label: str
    score: float
    x: float
    y: float
    width: float
    height: float


@dataclass(frozen=True)
class Verdict:
    """The model's output for one frame: per-label scores and the thresholded decision.

    A detector's scores are its best box's per label (0 without one), its boxes in `detections`. In a model set
    (worker.runtime.modelset) the frame's verdict carries every model's own in `models`, and `decided_by` names
    the model whose output decided it."""

    scores: dict[str, float]
    flagged_labels: tuple[str, ...]
    detections: tuple[Detection, ...] = ()
    models: tuple[ModelVerdict, ...] = ()
    decided_by: str = ""

    @property
    def flagged(self) -> bool:
        return bool(self.flagged_labels)


@dataclass(frozen=True)
class ModelVerdict:
    """One model of a model set on one frame: its verdict, or None with the reason it did not run (a cascade)."""

    model: str
    version: str
    verdict: Verdict | None
    skipped: str = ""
    detector: bool = False  # its output is boxes (`verdict.detections`), its scores each label's best box's


@dataclass(frozen=True)
class DeadLetter:
    """A message the worker could not process, with the reason, destined for the dead-letter topic.

    `headers`: the input message's own headers, which the dead letter keeps (before its context headers)."""

    source: SourceRef
    reason: str
    error_type: str
    payload: bytes = field(repr=False, default=b"")
    key: bytes | None = field(repr=False, default=None)
    headers: Headers = field(repr=False, default=())


class Status(str, enum.Enum):
    """What became of a frame: a result (OK, EXPIRED) or a dead letter (DLQ)."""

    OK = "OK"
    EXPIRED = "EXPIRED"
    DLQ = "DLQ"


@dataclass(frozen=True)
class Output:
    """The one message to produce for one source offset: an encoded result or a dead letter.

    Every offset read ends in exactly one Output (or is left uncommitted for the next owner). `headers`: the
    input message's, for the reference-only dead letter that replaces an output the broker refuses.
    `result_headers`: the result message's own (its W3C trace context, worker.tracing; empty with tracing off).
    `routes`: topics that get a copy of the result; its offset is done only when the result and every copy are."""

    source: SourceRef
    key: bytes | None
    value: bytes
    tenant: str
    status: Status
    dead_letter: DeadLetter | None = None
    headers: Headers = field(repr=False, default=())
    result_headers: Headers = field(repr=False, default=())
    # The route topics a copy of the result also goes to (topics.review / topics.flagged, by the policy's verdict).
    routes: tuple[str, ...] = ()

    @staticmethod
    def of_dead_letter(dl: DeadLetter, tenant: str = "unknown") -> Output:
        return Output(dl.source, dl.key, dl.payload, tenant, Status.DLQ, dl, dl.headers)


# A dead letter's error_type: what went wrong, from a fixed set (it is also a metric label).
MESSAGE_DECODE_ERROR = "MessageDecodeError"  # not a frame message (Avro, header fields, limits)
DECODE_ERROR = "FrameDecodeError"  # its pixels do not decode
MODEL_ERROR = "ModelError"  # the model raised on this frame alone
NON_FINITE_OUTPUT = "NonFiniteOutput"  # the model scored it NaN or infinite
DUPLICATE_FRAME = "DuplicateFrame"  # its (stream_id, frame_index) was read at another offset just before
OUTPUT_REJECTED = "OutputRejected"  # its result could not be produced (too large, invalid record)
DEAD_LETTER_ERROR_TYPES = frozenset({MESSAGE_DECODE_ERROR, DECODE_ERROR, MODEL_ERROR, NON_FINITE_OUTPUT,
                                     DUPLICATE_FRAME, OUTPUT_REJECTED})


# -- what the source hands the loop ------------------------------------------------------------------------------
@dataclass(frozen=True)
class CommitOutcome:
    """The broker's answer to one offset commit (librdkafka reports every commit, synchronous ones too): the offsets
    it now has, the partitions whose commit failed, and why."""

    committed: dict[TP, int]
    failed: list[TP]
    reason: str | None = None


@dataclass
class Polled:
    """One poll's worth of input: decodable frames and the messages that go to the dead-letter topic."""

    frames: list[Frame]
    dead_letters: list[DeadLetter]
    # Messages dropped because this assignment had already delivered their offsets (see FrameSource.poll).
    redelivered: int = 0
    # Partitions that began waiting, since the last poll, for a committed offset the broker could not tell yet
    # (see FrameSource.seek_to_committed); each is paused until it is known.
    committed_offset_waits: int = 0
    # The poll returned fewer messages than asked for: it took all the consumer had fetched, so the worker is
    # level with what the broker has sent it (a backlog's polls come back full).
    drained: bool = False
    # Messages read and held until the registry gives their writer schema (worker.kafka.schemalookups): tracked now,
    # answered by a later poll, whose frames and dead letters then include them (`released`: not tracked again).
    held: list[SourceRef] = field(default_factory=list)
    released: set[SourceRef] = field(default_factory=set)
    # All held now, with the unframed frames answered past them on their partitions: offsets no commit passes until
    # the registry answers (HeldFrames.pinned_frames).
    pinned_frames: int = 0
    # The outcomes of offset commits served since the last poll (asynchronous ones arrive in a later poll), for
    # the loop to hand to delivery.
    commits: list[CommitOutcome] = field(default_factory=list)
    # Messages a previous owner answered beyond its commit point (the commit's metadata said so: issue 67): read, to
    # be tracked as done, neither scored nor produced again.
    already_done: list[SourceRef] = field(default_factory=list)


RebalanceHandler = Callable[[list[TP]], None]
# Called inside the source's poll with the partitions being revoked and the commit outcomes served before it (the
# loop has not seen them yet): when it returns, the consumer gives the partitions up, so it must deliver and commit
# (or end the transaction of) what is done of them before returning.
RevokeHandler = Callable[[list[TP], list[CommitOutcome]], None]


@dataclass(frozen=True)
class FrameFailure:
    """A frame of a batch that was not scored (undecodable, the model failed on it alone, non-finite scores)."""

    frame: Frame
    reason: str
    error_type: str


# A model as results name it: (model_name, model_version).
ModelId = tuple[str, str]


@dataclass(frozen=True)
class BatchOutcome:
    """What the runtime hands back for one submitted batch: every frame is in exactly one of the two lists."""

    verdicts: list[tuple[Frame, Verdict]]  # frames that ran, in batch order
    failures: list[FrameFailure]  # undecodable frames, then frames the model failed on or scored NaN/inf
    batch_size: int  # frames the model ran on (the decodable ones)
    preprocess_ms: float
    inference_ms: float
    started_at: float  # wall seconds when the batch started preprocessing
    bucket: int  # padded batch size executed (the CUDA-graph bucket; == batch_size in eager; 1 after a retry)
    used_graph: bool
    # Thread CPU of the batch's work (its preparation's threads and its inference thread; an intra-op pool's
    # other threads not seen), None where not measured (the device data path).
    cpu_ms: float | None = None
    # (model name, version) that scored each verdict, in order, where models can change while serving (issue 69:
    # worker.rollout.swap); empty: the worker's one model.
    scored_by: tuple[ModelId, ...] = ()
