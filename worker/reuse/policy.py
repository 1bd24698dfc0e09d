"""Verdict reuse: a frame of a stream whose picture has not changed since the stream's last scored frame is
answered with that frame's verdict, without taking a batch slot or running the model (issue 59).

Pure policy: no Kafka, no torch, no clock (ages are by capture time). Per stream (its partition and stream id)
the policy keeps the reference, the last frame it sent to be scored: its thumbnail (worker.reuse.thumbnail), shape,
capture time, frame index and verdict once known. A frame is reused when its thumbnail differs from the
reference's by less than the threshold (worker.reuse.thumbnail.change), the reference is at most the class's
`reuse_max_age_ms` older by capture time, and both have the same shape; otherwise it is scored and becomes the
reference. A frame whose reference is still in flight is held here until the reference's verdict arrives
(`scored`); a reference that ends without one (`ended`: dead letter, EXPIRED) hands its held frames back to be
offered again, so none is lost. The streams kept are bounded (least recently seen dropped first) and a released
partition's state goes with it. A reused result names the model that scored its reference (a canary stream's is the
candidate); a promote forgets the known verdicts, so each stream's next frame is scored by the new model.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from worker.frames import TP, Frame, ModelId, Priority, SourceRef, Verdict
from worker.reuse.thumbnail import Thumbnail, change

# Streams whose reference is kept, per worker: a thumbnail is at most 32x32 bytes, so 10k streams are ~10 MiB.
MAX_STREAMS = 10_000


class Decision(enum.Enum):
    SCORE = "score"  # send it to the batcher: it is the stream's new reference
    HELD = "held"  # same picture as a reference still in flight: answered when that reference's verdict comes


@dataclass(frozen=True)
class Reused:
    """A frame answered with its reference's verdict; `reference` is the reference's frame_index, `model` the model
    that scored it."""

    frame: Frame
    verdict: Verdict
    reference: int
    model: ModelId | None = None  # None: the serving model


@dataclass
class _Reference:
    source: SourceRef
    frame_index: int
    capture_ts_ms: int
    shape: tuple[int, int, int]
    thumbnail: Thumbnail
    verdict: Verdict | None = None
    model: ModelId | None = None
    waiting: list[tuple[Frame, Thumbnail]] = field(default_factory=list)


class FrameReuse:
    """Decides, per frame of a class with reuse on, whether it is scored or answered with its stream's reference
    verdict; see the module docstring. The loop's thread alone uses one; never shared between workers."""

    def __init__(self, max_age_ms: Mapping[Priority, float], change_threshold: float,
                 max_streams: int = MAX_STREAMS) -> None:
        self._max_age_ms = {p: ms for p, ms in max_age_ms.items() if ms > 0}
        self._threshold = change_threshold
        self._max_streams = max_streams
        self._streams: OrderedDict[tuple[str, int, str], _Reference] = OrderedDict()
        self._inflight: dict[SourceRef, _Reference] = {}  # references sent to be scored, verdict not yet known

    def enabled(self, priority: Priority) -> bool:
        return priority in self._max_age_ms

    @property
    def any_enabled(self) -> bool:
        return bool(self._max_age_ms)

    @property
    def streams(self) -> int:
        """Streams whose reference is kept (the streams-held gauge)."""
        return len(self._streams)

    @property
    def partitions(self) -> set[TP]:
        """The partitions whose streams have a reference kept."""
        return {(topic, partition) for topic, partition, _ in self._streams}

    @property
    def held(self) -> int:
        """Frames waiting for a reference's verdict."""
        return sum(len(ref.waiting) for ref in self._inflight.values())

    def offer(self, frame: Frame, thumbnail: Thumbnail) -> Reused | Decision:
        """The frame answered now (Reused), held for its in-flight reference (HELD), or to be scored (SCORE)."""
        key = (frame.source.topic, frame.source.partition, frame.stream_id)
        ref = self._streams.get(key)
        if ref is not None and self._same_picture(ref, frame, thumbnail):
            self._streams.move_to_end(key)
            if ref.verdict is not None:
                return Reused(frame, ref.verdict, ref.frame_index, ref.model)
            ref.waiting.append((frame, thumbnail))
            return Decision.HELD
        new = _Reference(frame.source, frame.frame_index, frame.capture_ts_ms, frame.shape, thumbnail)
        self._streams[key] = new
        self._streams.move_to_end(key)
        if len(self._streams) > self._max_streams:
            self._streams.popitem(last=False)  # its frames still waiting are answered through _inflight
        self._inflight[frame.source] = new
        return Decision.SCORE

    def _same_picture(self, ref: _Reference, frame: Frame, thumbnail: Thumbnail) -> bool:
        age_ms = frame.capture_ts_ms - ref.capture_ts_ms
        return (ref.shape == frame.shape and 0 <= age_ms <= self._max_age_ms.get(frame.priority, 0)
                and change(ref.thumbnail, thumbnail) < self._threshold)

    def scored(self, frame: Frame, verdict: Verdict, model: ModelId | None = None) -> list[Reused]:
        """A frame's verdict came back, scored by `model`: if it is a reference, the frames held for it are answered
        with it."""
        if not self._inflight:
            return []
        ref = self._inflight.pop(frame.source, None)
        if ref is None:
            return []
        ref.verdict, ref.model = verdict, model
        held, ref.waiting = ref.waiting, []
        return [Reused(f, verdict, ref.frame_index, model) for f, _ in held]

    def forget_verdicts(self) -> None:
        """Another model serves from now on (a promote): no frame is answered with a verdict already known, so each
        stream's next frame is scored by it. References still in flight stay: they answer the frames held for them,
        and later ones, named by the model that scores them."""
        for key in [k for k, ref in self._streams.items() if ref.verdict is not None]:
            del self._streams[key]

    def ended(self, frame: Frame) -> list[tuple[Frame, Thumbnail]]:
        """A frame ended without a verdict (dead letter, EXPIRED): if it is a reference, it is one no longer, and
        the frames held for it come back, with their thumbnails, to be offered again."""
        if not self._inflight:
            return []
        ref = self._inflight.pop(frame.source, None)
        if ref is None:
            return []
        key = (frame.source.topic, frame.source.partition, frame.stream_id)
        if self._streams.get(key) is ref:
            del self._streams[key]
        held, ref.waiting = ref.waiting, []
        return held

    def drop_partitions(self, tps: Iterable[TP]) -> None:
        """Partitions released (revoked, lost, rewound): their references and held frames are forgotten (held
        frames are uncommitted, so the partition's next reader reads them again)."""
        gone = set(tps)
        for key in [k for k in self._streams if (k[0], k[1]) in gone]:
            del self._streams[key]
        for source in [s for s in self._inflight if s.topic_partition in gone]:
            del self._inflight[source]
