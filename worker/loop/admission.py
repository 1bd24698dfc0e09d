"""Taking what a poll read into the loop: each message's offset is tracked (it must end in exactly one
output), repeats are dead-lettered, frames already past their deadline are answered EXPIRED at the cost of
reading them only, and the rest go to the batcher."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field

from worker.batching import MicroBatcher
from worker.config import Settings, usable_cores
from worker.frames import DUPLICATE_FRAME, TP, BatchOutcome, Frame, Output, Polled, Priority, SourceRef
from worker.loop.answers import Answers
from worker.loop.flow import FlowControl
from worker.metrics import Children, Metrics
from worker.partitions.dedup import DuplicateFrames, duplicate_reason
from worker.partitions.offsets import OffsetTracker
from worker.reuse.policy import Decision, FrameReuse, Reused
from worker.reuse.thumbnail import Thumbnail, Thumbnails


@dataclass
class Admitted:
    """What the loop answers at once for one poll (the rest is in the batcher)."""

    outputs: list[Output] = field(default_factory=list)
    expired: int = 0  # frames answered EXPIRED as they were read


class Admission:
    """Sorts each poll's messages to their first stage; see the module docstring."""

    def __init__(self, settings: Settings, tracker: OffsetTracker, duplicates: DuplicateFrames,
                 batcher: MicroBatcher, answers: Answers, flow: FlowControl, metrics: Metrics) -> None:
        self._tracker = tracker
        self._duplicates = duplicates
        self._batcher = batcher
        self._answers = answers
        self._flow = flow
        self._metrics = metrics
        self._consumed = Children(metrics.frames_consumed)
        self._max_age_s = {p: settings.batching.for_class(p).max_age_ms / 1000.0 for p in Priority}
        # Verdict reuse (issue 59), this worker's own, for the classes that turn it on (None: no class does, and no
        # frame pays for it).
        reuse = FrameReuse({p: settings.batching.for_class(p).reuse_max_age_ms for p in Priority},
                           settings.batching.reuse_change_threshold)
        self.reuse = reuse if reuse.any_enabled else None
        # Their thumbnails are computed off this (the loop's) thread, a poll's at once, one thread per core.
        self._thumbnails = Thumbnails(usable_cores())

    def take(self, polled: Polled, now: float) -> Admitted:
        # Track in each partition's offset order (the tracker refuses an offset below one already read).
        read = [f.source for f in polled.frames]
        if polled.dead_letters or polled.held:
            read = sorted(read + [d.source for d in polled.dead_letters] + polled.held)
        if polled.released:  # held by an earlier poll, tracked then
            read = [ref for ref in read if ref not in polled.released]
        if polled.already_done:
            self._track_already_done(read, polled)
        else:
            for ref in read:
                self._tracker.track(ref.topic_partition, ref.offset)
        taken = Admitted()
        if polled.frames:
            self._metrics.count_by_tenant(self._consumed, polled.frames)
        late: list[Frame] = []
        reused: list[Reused] = []
        thumbs = self._thumbnails_of(polled.frames, now)
        oldest: dict[Priority, int] = {}  # capture_ts_ms of the oldest frame read, per class
        for frame in polled.frames:
            if frame.capture_ts_ms < oldest.get(frame.priority, frame.capture_ts_ms + 1):
                oldest[frame.priority] = frame.capture_ts_ms
            # A replayed frame is a new copy on purpose: its replay count is part of its identity
            # (worker/partitions/dedup.py).
            identity = (frame.stream_id, frame.frame_index, frame.replay_count)
            first = self._duplicates.first_offset(frame.source.topic_partition, identity, frame.source.offset)
            if first is not None:
                taken.outputs.append(self._answers.dead_letter(frame, DUPLICATE_FRAME,
                                                               duplicate_reason(identity, first)))
            elif self._past_deadline(frame, now):
                late.append(frame)  # answered EXPIRED at the cost of reading it: no batcher, no runtime
            elif self.reuse is None or not self.reuse.enabled(frame.priority):
                self._batcher.add(frame)
            else:
                self._score_or_reuse(frame, thumbs[id(frame)], reused)
        if reused:
            taken.outputs.extend(self._answers.reused(reused, now))
        if self.reuse is not None:
            self._metrics.reuse_streams.set(self.reuse.streams)
        if late:
            taken.outputs.extend(self._answers.expired(late, now))
            taken.expired = len(late)
        if polled.dead_letters:
            for topic, n in Counter(dl.source.topic for dl in polled.dead_letters).items():
                self._consumed.labels(topic, "unknown").inc(n)
            taken.outputs.extend(Output.of_dead_letter(dl) for dl in polled.dead_letters)
        by_class = Counter(f.priority for f in polled.frames)
        by_class.update(self._flow.class_of_topic[dl.source.topic] for dl in polled.dead_letters)
        by_partition = Counter(f.source.topic_partition for f in polled.frames)
        by_partition.update(dl.source.topic_partition for dl in polled.dead_letters)
        self._flow.record_read(by_class, Counter(f.priority for f in late),
                               {p: ms / 1000.0 for p, ms in oldest.items()}, polled.drained, by_partition)
        self._record(polled)
        return taken

    def _track_already_done(self, read: list[SourceRef], polled: Polled) -> None:
        """Track a poll's offsets in order, those a previous owner finished (issue 67) as done at once."""
        done = set(polled.already_done)
        for ref in sorted(read + polled.already_done):
            if ref in done:
                self._tracker.track_done(ref.topic_partition, ref.offset)
            else:
                self._tracker.track(ref.topic_partition, ref.offset)
        self._metrics.frames_already_done.inc(len(done))

    def _record(self, polled: Polled) -> None:
        """The poll's counters, and the gauges of what is read and not yet done."""
        if polled.redelivered:
            self._metrics.redelivered.inc(polled.redelivered)
        if polled.committed_offset_waits:
            self._metrics.committed_offset_waits.inc(polled.committed_offset_waits)
        self._metrics.inflight_frames.set(self._tracker.in_flight())
        self._metrics.uncommitted_frames.set(self._tracker.uncommitted())
        self._metrics.done_offsets_held.set(self._tracker.done_beyond())
        self._metrics.inflight_bytes.set(self._batcher.pending_bytes)

    def _past_deadline(self, frame: Frame, now: float) -> bool:
        """The batcher's expiry rule (capture + class max_age_ms < now), applied as a frame is read."""
        max_age_s = self._max_age_s[frame.priority]
        return max_age_s > 0 and frame.capture_ts_ms / 1000.0 + max_age_s < now

    # -- verdict reuse (worker.reuse.policy) -------------------------------------------------------------------------
    def drop_partitions(self, tps: Collection[TP]) -> None:
        """Partitions given up or rewound: their streams' references forgotten, and the frames verdict reuse offered
        again while the partitions were being finished taken back from the batcher (read again from the commit)."""
        if self.reuse is not None:
            self.reuse.drop_partitions(tps)
            released = set(tps)
            self._batcher.discard(lambda f: f.source.topic_partition in released)

    def model_promoted(self) -> None:
        """A promote: verdict reuse forgets the old model's verdicts (worker.reuse.policy)."""
        if self.reuse is not None:
            self.reuse.forget_verdicts()

    def close(self) -> None:
        self._thumbnails.close()

    def _thumbnails_of(self, frames: list[Frame], now: float) -> dict[int, Thumbnail | None]:
        """By id(frame), the thumbnails of the frames that may reach the reuse policy (a class with reuse on, not
        past its deadline: a repeat is found later and costs its thumbnail only)."""
        if self.reuse is None:
            return {}
        wanted = [f for f in frames if self.reuse.enabled(f.priority) and not self._past_deadline(f, now)]
        return dict(zip(map(id, wanted), self._thumbnails.of(wanted), strict=True))

    def _score_or_reuse(self, frame: Frame, thumb: Thumbnail | None, reused: list[Reused]) -> None:
        """The frame to the batcher (a new reference), to `reused` (answered now), or held by the policy. A frame
        without a thumbnail (its pixels do not decode) is scored: the runtime dead-letters it, with the reason."""
        assert self.reuse is not None
        if thumb is None:
            self._batcher.add(frame)
            return
        decision = self.reuse.offer(frame, thumb)
        if decision is Decision.SCORE:
            self._batcher.add(frame)
        elif isinstance(decision, Reused):
            reused.append(decision)

    def verdicts_known(self, outcome: BatchOutcome, now: float) -> list[Output]:
        """Frames held for a reference of this batch answered with its verdict; those held for a reference that
        failed offered again (scored, or held for a new reference)."""
        if self.reuse is None:
            return []
        models = outcome.scored_by or itertools.repeat(None)
        reused = [r for (frame, verdict), model in zip(outcome.verdicts, models)
                  for r in self.reuse.scored(frame, verdict, model)]
        self._offer_again([failure.frame for failure in outcome.failures], reused)
        return self._answers.reused(reused, now) if reused else []

    def expired(self, frames: list[Frame], now: float) -> list[Output]:
        """Frames answered EXPIRED: those held for one of them as their reference are offered again (each
        expires in turn by its own deadline, never lost)."""
        if self.reuse is None:
            return []
        reused: list[Reused] = []
        self._offer_again(frames, reused)
        return self._answers.reused(reused, now) if reused else []

    def _offer_again(self, references: list[Frame], reused: list[Reused]) -> None:
        """References that ended without a verdict: the frames held for each offered again, in turn."""
        assert self.reuse is not None
        for ended in references:
            for frame, thumb in self.reuse.ended(ended):
                self._score_or_reuse(frame, thumb, reused)
