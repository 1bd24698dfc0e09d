"""Verdict reuse (worker.reuse.policy) and its thumbnails (worker.reuse.thumbnail): when a frame is answered with its
stream's reference verdict, when it is scored, and that no frame held for a reference is ever lost."""

from __future__ import annotations

import dataclasses
import io
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from worker.frames import Encoding, Frame, Priority, SourceRef, Verdict
from worker.reuse.policy import Decision, FrameReuse, Reused
from worker.reuse.thumbnail import THUMB_SIDE, Thumbnails, change, thumbnail

TOPIC = "frames.realtime"
VERDICT = Verdict({"nsfw": 0.2}, ())


def frame(index: int, capture_ms: int = 0, stream: str = "cam", partition: int = 0, side: int = 64,
          priority: Priority = Priority.REALTIME, epoch: int = 0) -> Frame:
    return Frame(stream_id=stream, frame_index=index, tenant="t", priority=priority, capture_ts_ms=capture_ms,
                 width=side, height=side, channels=3, encoding=Encoding.RAW_RGB8, data=bytes(side * side * 3),
                 source=SourceRef(TOPIC, partition, index, epoch))


def thumb(level: float) -> np.ndarray:
    return np.full((4, 4), level, dtype=np.float32)


def policy(max_age_ms: float = 1_000, threshold: float = 2.0, max_streams: int = 100) -> FrameReuse:
    return FrameReuse({Priority.REALTIME: max_age_ms, Priority.STANDARD: 0, Priority.BULK: 0}, threshold,
                      max_streams)


def scored_reference(reuse: FrameReuse, f: Frame, level: float = 100) -> None:
    assert reuse.offer(f, thumb(level)) is Decision.SCORE
    assert reuse.scored(f, VERDICT) == []


def test_reuse_is_on_only_for_classes_with_a_maximum_age():
    reuse = policy()
    assert reuse.enabled(Priority.REALTIME) and not reuse.enabled(Priority.BULK) and reuse.any_enabled
    assert not FrameReuse(dict.fromkeys(Priority, 0.0), 2.0).any_enabled


def test_the_first_frame_of_a_stream_is_scored_and_an_unchanged_next_one_reused_with_its_verdict():
    reuse = policy()
    scored_reference(reuse, frame(0))
    assert reuse.offer(frame(1, 40), thumb(101)) == Reused(frame(1, 40), VERDICT, 0)


def test_a_change_at_the_threshold_is_scored_and_becomes_the_reference():
    reuse = policy(threshold=2.0)
    scored_reference(reuse, frame(0))
    assert reuse.offer(frame(1, 40), thumb(102)) is Decision.SCORE
    reuse.scored(frame(1, 40), Verdict({"nsfw": 0.9}, ("nsfw",)))
    reused = reuse.offer(frame(2, 80), thumb(102.5))
    assert isinstance(reused, Reused) and reused.reference == 1 and reused.verdict.flagged


def test_age_is_counted_by_capture_time_from_the_reference_not_from_the_last_reused_frame():
    reuse = policy(max_age_ms=1_000)
    scored_reference(reuse, frame(0, capture_ms=0))
    assert isinstance(reuse.offer(frame(1, capture_ms=1_000), thumb(100)), Reused)
    assert reuse.offer(frame(2, capture_ms=1_001), thumb(100)) is Decision.SCORE


def test_a_frame_captured_before_its_reference_is_scored():
    reuse = policy()
    scored_reference(reuse, frame(1, capture_ms=500))
    assert reuse.offer(frame(2, capture_ms=499), thumb(100)) is Decision.SCORE


def test_a_shape_change_is_scored_even_when_the_thumbnails_match():
    reuse = policy()
    scored_reference(reuse, frame(0, side=64))
    assert reuse.offer(frame(1, 40, side=32), thumb(100)) is Decision.SCORE


def test_streams_are_kept_apart_by_stream_id_and_partition():
    reuse = policy()
    scored_reference(reuse, frame(0, stream="a"))
    assert reuse.offer(frame(1, 40, stream="b"), thumb(100)) is Decision.SCORE
    assert reuse.offer(frame(2, 40, stream="a", partition=1), thumb(100)) is Decision.SCORE
    assert reuse.streams == 3


def test_a_frame_whose_reference_is_in_flight_waits_and_is_answered_with_its_verdict():
    reuse = policy()
    ref = frame(0)
    assert reuse.offer(ref, thumb(100)) is Decision.SCORE
    assert reuse.offer(frame(1, 40), thumb(100)) is Decision.HELD
    assert reuse.offer(frame(2, 80), thumb(100.5)) is Decision.HELD
    assert reuse.held == 2
    assert reuse.scored(ref, VERDICT) == [Reused(frame(1, 40), VERDICT, 0), Reused(frame(2, 80), VERDICT, 0)]
    assert reuse.held == 0
    assert reuse.scored(ref, VERDICT) == []  # answered once


def test_frames_held_for_a_superseded_reference_still_get_that_references_verdict():
    reuse = policy()
    assert reuse.offer(frame(0), thumb(100)) is Decision.SCORE
    assert reuse.offer(frame(1, 40), thumb(100)) is Decision.HELD
    assert reuse.offer(frame(2, 80), thumb(200)) is Decision.SCORE  # a cut: the new reference
    assert reuse.offer(frame(3, 120), thumb(200)) is Decision.HELD
    assert reuse.scored(frame(0), VERDICT) == [Reused(frame(1, 40), VERDICT, 0)]
    other = Verdict({"nsfw": 0.7}, ())
    assert reuse.scored(frame(2, 80), other) == [Reused(frame(3, 120), other, 2)]


def test_a_reference_that_ends_without_a_verdict_hands_its_held_frames_back_and_stops_being_the_reference():
    reuse = policy()
    ref = frame(0)
    reuse.offer(ref, thumb(100))
    reuse.offer(frame(1, 40), thumb(100))
    reuse.offer(frame(2, 80), thumb(101))
    back = reuse.ended(ref)  # dead-lettered or expired
    assert [(f.frame_index, float(t[0, 0])) for f, t in back] == [(1, 100.0), (2, 101.0)]
    assert reuse.held == 0 and reuse.ended(ref) == []
    # Offered again, the first becomes the new reference and the next waits for it.
    assert reuse.offer(*back[0]) is Decision.SCORE
    assert reuse.offer(*back[1]) is Decision.HELD
    assert reuse.scored(back[0][0], VERDICT) == [Reused(frame(2, 80), VERDICT, 1)]


def test_a_frame_that_is_no_reference_ends_or_scores_without_effect():
    reuse = policy()
    scored_reference(reuse, frame(0))
    assert reuse.ended(frame(5)) == [] and reuse.scored(frame(6), VERDICT) == []
    assert isinstance(reuse.offer(frame(1, 40), thumb(100)), Reused)


def test_the_least_recently_seen_stream_is_dropped_past_the_bound_but_its_held_frames_are_still_answered():
    reuse = policy(max_streams=2)
    a0 = frame(0, stream="a")
    reuse.offer(a0, thumb(100))
    reuse.offer(frame(1, 40, stream="a"), thumb(100))  # held for a0
    scored_reference(reuse, frame(2, stream="b"))
    scored_reference(reuse, frame(3, stream="c"))  # drops a, the least recently seen
    assert reuse.streams == 2
    assert reuse.scored(a0, VERDICT) == [Reused(frame(1, 40, stream="a"), VERDICT, 0)]
    assert reuse.offer(frame(4, 80, stream="a"), thumb(100)) is Decision.SCORE  # a has no reference any more
    assert isinstance(reuse.offer(frame(5, 40, stream="c"), thumb(100)), Reused)


def test_releasing_a_partition_forgets_its_streams_and_held_frames_only():
    reuse = policy()
    p0 = frame(0, partition=0)
    reuse.offer(p0, thumb(100))
    reuse.offer(frame(1, 40, partition=0), thumb(100))
    scored_reference(reuse, frame(2, partition=1))
    reuse.drop_partitions([(TOPIC, 0)])
    assert reuse.streams == 1 and reuse.held == 0
    assert reuse.scored(p0, VERDICT) == []  # a stale batch's verdict answers nothing
    assert reuse.offer(frame(3, 40, partition=0), thumb(100)) is Decision.SCORE
    assert isinstance(reuse.offer(frame(4, 40, partition=1), thumb(100)), Reused)


def test_a_reference_of_an_older_assignment_epoch_answers_nothing_after_the_partition_comes_back():
    reuse = policy()
    reuse.offer(frame(0, epoch=1), thumb(100))
    reuse.drop_partitions([(TOPIC, 0)])
    assert reuse.offer(frame(0, epoch=2), thumb(100)) is Decision.SCORE
    assert reuse.offer(frame(1, 40, epoch=2), thumb(100)) is Decision.HELD
    assert reuse.scored(frame(0, epoch=1), VERDICT) == []
    assert len(reuse.scored(frame(0, epoch=2), VERDICT)) == 1


def test_dropping_every_partition_read_forgets_everything():
    reuse = policy()
    reuse.offer(frame(0), thumb(100))
    reuse.offer(frame(1, 40), thumb(100))
    reuse.drop_partitions([(TOPIC, 0)])
    assert reuse.streams == 0 and reuse.held == 0


# -- thumbnails ------------------------------------------------------------------------------------------------

def jpeg_frame(pixels: np.ndarray, quality: int = 90) -> Frame:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=quality)
    h, w, _ = pixels.shape
    return Frame(stream_id="cam", frame_index=0, tenant="t", priority=Priority.REALTIME, capture_ts_ms=0, width=w,
                 height=h, channels=3, encoding=Encoding.JPEG, data=buf.getvalue(), source=SourceRef(TOPIC, 0, 0))


def raw_frame(pixels: np.ndarray) -> Frame:
    h, w, _ = pixels.shape
    return Frame(stream_id="cam", frame_index=0, tenant="t", priority=Priority.REALTIME, capture_ts_ms=0, width=w,
                 height=h, channels=3, encoding=Encoding.RAW_RGB8, data=pixels.tobytes(), source=SourceRef(TOPIC, 0, 0))


def gradient(h: int, w: int) -> np.ndarray:
    ys, xs = np.mgrid[0:h, 0:w]
    return np.stack([(xs * 255 // w), (ys * 255 // h), np.full_like(xs, 128)], axis=2).astype(np.uint8)


@pytest.mark.parametrize("h,w", [(720, 1280), (1080, 1920), (37, 50)])
def test_a_jpeg_thumbnail_is_at_most_32_a_side_and_close_to_the_raw_frames(h, w):
    pixels = gradient(h, w)
    from_jpeg, from_raw = thumbnail(jpeg_frame(pixels)), thumbnail(raw_frame(pixels))
    assert from_jpeg is not None and from_raw is not None
    assert max(from_jpeg.shape) <= THUMB_SIDE and min(from_jpeg.shape) >= 1
    if from_jpeg.shape == from_raw.shape:
        assert change(from_jpeg, from_raw) < 2.0


def test_sensor_noise_moves_the_thumbnail_little_and_a_different_picture_far():
    rng = np.random.default_rng(1)
    pixels = gradient(720, 1280)
    noisy = np.clip(pixels + rng.normal(0, 4, pixels.shape), 0, 255).astype(np.uint8)
    base, same, other = (thumbnail(jpeg_frame(p)) for p in (pixels, noisy, 255 - pixels))
    assert base is not None and same is not None and other is not None
    assert change(base, same) < 3.0
    assert change(base, other) > 50.0


def test_a_small_object_entering_a_corner_moves_the_change_far_past_noise():
    rng = np.random.default_rng(2)
    pixels = gradient(720, 1280)
    noisy = np.clip(pixels + rng.normal(0, 4, pixels.shape), 0, 255).astype(np.uint8)
    entered = noisy.copy()
    entered[40:100, 40:100] = 255  # 60x60 pixels: 0.4% of the frame
    base, same, moved = (thumbnail(jpeg_frame(p)) for p in (pixels, noisy, entered))
    assert base is not None and same is not None and moved is not None
    assert change(base, moved) > 8.0 > 3 * change(base, same)


def test_thumbnails_of_different_sizes_differ_completely():
    assert change(np.zeros((2, 2), np.float32), np.zeros((3, 2), np.float32)) == 255.0


def test_a_jpeg_that_does_not_decode_has_no_thumbnail():
    bad = jpeg_frame(gradient(64, 64))
    assert thumbnail(dataclasses.replace(bad, data=bad.data[:200])) is None


def test_a_polls_thumbnails_are_computed_off_the_calling_thread_in_order_and_equal_to_one_by_one(monkeypatch):
    """What the loop hands to its thumbnail threads: every frame's thumbnail, in order across the chunks, the same
    values as computed inline (so the same reuse decisions), None in place for one that does not decode."""
    import threading

    import worker.reuse.thumbnail as module

    rng = np.random.default_rng(3)
    frames = [jpeg_frame(np.clip(gradient(90, 160) + rng.normal(0, 20 * i, (90, 160, 3)), 0, 255).astype(np.uint8))
              for i in range(7)]
    frames[3] = dataclasses.replace(frames[3], data=frames[3].data[:200])
    frames.append(raw_frame(gradient(40, 64)))
    want = [thumbnail(f) for f in frames]
    ran_on: list[str] = []
    real = module.thumbnail
    monkeypatch.setattr(module, "thumbnail", lambda f: ran_on.append(threading.current_thread().name) or real(f))
    pool = Thumbnails(threads=3)
    try:
        got = pool.of(frames)
    finally:
        pool.close()
    assert [g is None for g in got] == [w is None for w in want] == [i == 3 for i in range(len(frames))]
    for g, w in zip(got, want, strict=True):
        if w is not None:
            np.testing.assert_array_equal(g, w)
    assert len(ran_on) == len(frames) and all(name.startswith("thumbnail") for name in ran_on)
    assert pool.of([]) == []


# -- the invariant, over random traffic ------------------------------------------------------------------------

OPS = st.lists(st.one_of(
    st.tuples(st.just("frame"), st.integers(0, 2), st.integers(0, 1), st.sampled_from([100, 101, 150])),
    st.tuples(st.just("verdict"), st.integers(0, 50)), st.tuples(st.just("fail"), st.integers(0, 50)),
    st.tuples(st.just("release"), st.integers(0, 1))), max_size=60)


@settings(max_examples=300, deadline=None)
@given(OPS, st.integers(1, 3))
def test_every_frame_ends_scored_reused_or_released_once_and_a_reuse_is_of_an_earlier_scored_frame(ops, bound):
    """A driver plays the loop: frames offered (SCORE goes in flight), verdicts and failures of frames in flight
    in any order, frames a failed reference hands back offered again, partitions released. At the end every frame
    offered was scored, failed, reused or released exactly once."""
    reuse = policy(max_age_ms=10_000, max_streams=bound)
    inflight: list[Frame] = []
    outcome: dict[tuple[str, int], str] = {}
    verdict_of: dict[tuple[str, int], Verdict] = {}
    next_index: dict[str, int] = {}
    frames_of: dict[int, list[Frame]] = {0: [], 1: []}  # offered frames by partition, not yet ended

    def ended(f: Frame, how: str) -> None:
        key = (f.stream_id, f.frame_index)
        assert key not in outcome, f"{key} ended twice: {outcome[key]} and {how}"
        outcome[key] = how
        frames_of[f.source.partition].remove(f)

    def reused(r: Reused) -> None:
        ref = (r.frame.stream_id, r.reference)
        assert outcome.get(ref) == "scored" and r.reference < r.frame.frame_index and r.verdict is verdict_of[ref]
        ended(r.frame, "reused")

    def offer(f: Frame, thumb: np.ndarray) -> None:
        decision = reuse.offer(f, thumb)
        if decision is Decision.SCORE:
            inflight.append(f)
        elif isinstance(decision, Reused):
            reused(decision)

    def finish(f: Frame, ok: bool) -> None:
        inflight.remove(f)
        if ok:
            verdict_of[(f.stream_id, f.frame_index)] = v = Verdict({"nsfw": f.frame_index / 100}, ())
            ended(f, "scored")
            for r in reuse.scored(f, v):
                reused(r)
        else:
            ended(f, "failed")
            for held, thumb in reuse.ended(f):
                offer(held, thumb)

    for op in ops:
        if op[0] == "frame":
            _, s, partition, level = op
            stream = f"s{s}p{partition}"
            index = next_index[stream] = next_index.get(stream, -1) + 1
            f = frame(index, capture_ms=40 * index, stream=stream, partition=partition)
            f = dataclasses.replace(f, source=SourceRef(TOPIC, partition, 1000 * s + index))
            frames_of[partition].append(f)
            offer(f, thumb(level))
        elif op[0] in ("verdict", "fail") and inflight:
            finish(inflight[op[1] % len(inflight)], op[0] == "verdict")
        elif op[0] == "release":
            reuse.drop_partitions([(TOPIC, op[1])])
            for f in list(frames_of[op[1]]):
                ended(f, "released")
            inflight[:] = [f for f in inflight if f.source.partition != op[1]]
    while inflight:
        finish(inflight[0], True)
    assert frames_of == {0: [], 1: []} and reuse.held == 0


def test_reuse_and_its_thumbnails_import_neither_kafka_nor_torch() -> None:
    """The thumbnail decoder (worker.runtime.decode) needs no torch: importing it must not load the runtime's."""
    code = ("import sys, worker.reuse.policy, worker.reuse.thumbnail; "
            "print(sorted(m for m in ('confluent_kafka', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
