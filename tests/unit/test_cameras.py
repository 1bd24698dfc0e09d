"""Live cameras' policy, with a fake clock and fake cameras: backoff, stalls, the fresh queue, wall-clock
sampling, capture times, camera states, and a reader that reconnects under the same stream id."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from worker.frames import Encoding, Priority
from worker.testing import wait_for
from worker.tools.cameras import (
    Backoff,
    CameraReader,
    CameraState,
    CameraStats,
    FrameFormat,
    FreshQueue,
    LiveCameras,
    LivePolicy,
    WallClockSampler,
    capture_ts_ms,
    is_live_source,
    is_stalled,
    redact,
)
from worker.tools.publish_frames import ProducerInputError

FMT = FrameFormat(Priority.REALTIME, "tenant", Encoding.RAW_RGB8)


class FakeClock:
    def __init__(self, start: float = 1_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


def pixels() -> np.ndarray:
    return np.zeros((2, 2, 3), np.uint8)


def test_backoff_doubles_from_the_initial_delay_up_to_the_cap() -> None:
    backoff = Backoff(initial_s=0.5, max_s=4.0, jitter=0.5)
    assert [backoff.delay_s(n, lambda: 0.0) for n in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_backoff_jitter_takes_off_up_to_its_fraction_drawn_from_the_random_source() -> None:
    backoff = Backoff(initial_s=1.0, max_s=8.0, jitter=0.5)
    assert backoff.delay_s(3, lambda: 1.0) == 4.0
    assert backoff.delay_s(3, lambda: 0.25) == 7.0
    assert backoff.delay_s(10_000, lambda: 0.0) == 8.0  # no overflow far past the cap


def test_live_sources_are_streaming_urls_and_recordings_are_paths() -> None:
    assert all(is_live_source(s) for s in ("rtsp://cam/1", "RTSP://cam", "http://cam/video.mjpg",
                                           "https://cdn/live.m3u8", "srt://cam:9000"))
    assert not any(is_live_source(s) for s in ("a.mp4", "/videos/b.mkv", "file:///videos/c.mp4"))


def test_a_camera_is_stalled_once_no_frame_came_for_longer_than_the_read_timeout() -> None:
    assert not is_stalled(last_frame_at=100.0, connected_at=90.0, now=104.9, read_timeout_s=5.0)
    assert is_stalled(last_frame_at=100.0, connected_at=90.0, now=105.1, read_timeout_s=5.0)
    assert is_stalled(last_frame_at=None, connected_at=90.0, now=95.1, read_timeout_s=5.0)
    # A reconnect restarts the count: the last frame of the previous connection is older.
    assert not is_stalled(last_frame_at=80.0, connected_at=100.0, now=101.0, read_timeout_s=5.0)


def test_the_fresh_queue_drops_the_oldest_and_counts_the_drops() -> None:
    queue: FreshQueue[int] = FreshQueue(3)
    assert [queue.put(i) for i in range(5)] == [0, 0, 0, 1, 1]
    assert queue.dropped == 2 and len(queue) == 3
    assert [queue.pop(), queue.pop(), queue.pop(), queue.pop()] == [2, 3, 4, None]


@given(st.integers(1, 5), st.lists(st.booleans(), max_size=200))
def test_the_fresh_queue_holds_its_cap_and_loses_nothing_uncounted(capacity: int, ops: list[bool]) -> None:
    queue: FreshQueue[int] = FreshQueue(capacity)
    put = 0
    popped: list[int] = []
    for is_put in ops:
        if is_put:
            queue.put(put)
            put += 1
        elif (item := queue.pop()) is not None:
            popped.append(item)
        assert len(queue) <= capacity
    assert put == len(popped) + queue.dropped + len(queue)
    assert popped == sorted(popped)


def test_the_sampler_takes_every_frame_without_fps() -> None:
    sampler = WallClockSampler(None)
    assert all(sampler.take(t / 25) for t in range(100))


def test_the_sampler_takes_fps_frames_per_second_of_wall_clock_from_a_faster_camera() -> None:
    sampler = WallClockSampler(5.0)
    taken = [t for t in (i / 25 for i in range(250)) if sampler.take(t)]  # 10 s of a 25 fps camera
    assert 50 <= len(taken) <= 51  # 5 per second over 10 s, plus the one at each end
    # A frame may go up to a quarter interval early (camera jitter), never more; none is skipped.
    assert all(0.15 <= b - a <= 0.25 for a, b in zip(taken, taken[1:], strict=False))


def test_the_sampler_sends_no_burst_after_a_gap() -> None:
    sampler = WallClockSampler(10.0)
    assert sampler.take(0.0)
    assert sampler.take(5.0)  # the camera was away for 5 s
    assert not sampler.take(5.01)
    assert sampler.take(5.1)


def test_the_capture_time_is_the_read_time_and_never_goes_back() -> None:
    assert capture_ts_ms(1_700_000_000.1234, None) == 1_700_000_000_123
    assert capture_ts_ms(1_700_000_000.0, previous_ms=1_700_000_000_500) == 1_700_000_000_500


def test_a_state_change_logs_one_line_and_terminal_states_stick(caplog: pytest.LogCaptureFixture) -> None:
    stats = CameraStats("cam0", "rtsp://cam")
    with caplog.at_level(logging.INFO, logger="worker.cameras"):
        assert stats.change(CameraState.CONNECTED)
        assert not stats.change(CameraState.CONNECTED)
        assert stats.change(CameraState.GIVEN_UP, "5 connections in a row failed")
        assert not stats.change(CameraState.RECONNECTING)
    assert [r.getMessage() for r in caplog.records] == [
        "camera cam0 connected", "camera cam0 given up: 5 connections in a row failed"]
    assert stats.state is CameraState.GIVEN_UP


def test_a_password_in_a_source_is_redacted() -> None:
    assert redact("rtsp://admin:secret@cam:554/live") == "rtsp://admin:***@cam:554/live"
    assert redact("rtsp://cam:554/live") == "rtsp://cam:554/live"


def test_bad_live_settings_are_refused_naming_the_option() -> None:
    with pytest.raises(ProducerInputError, match="--read-timeout"):
        LivePolicy(read_timeout_s=0)
    with pytest.raises(ProducerInputError, match="--max-queued-frames"):
        LivePolicy(max_queued=0)


# -- the reader, with fake cameras -------------------------------------------------------------------------
Script = list[int | str]  # per connection: frames to deliver, or an error to raise on open


def fake_opener(connections: list[int | str], clock: FakeClock, step_s: float,
                stop: threading.Event | None = None) -> Callable[[str], object]:
    """Connection i delivers connections[i] frames (advancing the clock by step_s each) then ends, or fails
    to open with the error text connections[i]; after the script, sets `stop`."""
    attempts = iter(connections)

    @contextmanager
    def open_camera(_source: str) -> Iterator[Iterator[Callable[[], np.ndarray]]]:
        plan = next(attempts, None)
        if plan is None:
            if stop is not None:
                stop.set()
            raise OSError("script over")
        if isinstance(plan, str):
            raise OSError(plan)

        def frames() -> Iterator[Callable[[], np.ndarray]]:
            for _ in range(plan):
                clock.now += step_s
                yield pixels

        yield frames()

    return open_camera


def run_reader(connections: list[int | str], policy: LivePolicy = LivePolicy(max_queued=1000),
               fps: float | None = None, max_frames: int | None = None) -> tuple[CameraStats, list[float]]:
    clock = FakeClock()
    stop = threading.Event()
    stats = CameraStats("run-v0-cam", "rtsp://cam", queue=FreshQueue(policy.max_queued))
    waits: list[float] = []
    reader = CameraReader(stats, fake_opener(connections, clock, 0.1, stop), policy, FMT, fps, max_frames,
                          stop, clock=clock, monotonic=clock, rand=lambda: 0.0, wait=waits.append)
    reader.run()
    return stats, waits


def queued(stats: CameraStats) -> list:
    out = []
    while (rec := stats.queue.pop()) is not None:
        out.append(rec)
    return out


def test_a_camera_that_drops_reconnects_under_the_same_stream_id_with_increasing_indices() -> None:
    stats, _ = run_reader([3, "connection refused", 2])
    records = queued(stats)
    assert {r.stream_id for r in records} == {"run-v0-cam"}
    assert [r.frame_index for r in records] == [0, 1, 2, 3, 4]
    assert stats.read == 5 and stats.reconnects == 3  # after the end of stream, the refusal, the script's end


def test_reconnects_back_off_exponentially_and_a_frame_resets_the_backoff() -> None:
    policy = LivePolicy(backoff=Backoff(initial_s=0.5, max_s=2.0, jitter=0.5), max_queued=1000)
    _, waits = run_reader(["refused", "refused", "refused", "refused", 1, "refused"], policy)
    assert waits == [0.5, 1.0, 2.0, 2.0, 0.5, 0.5]  # a connection that gave a frame starts again


def test_capture_times_are_the_read_times_of_the_reader_clock() -> None:
    stats, _ = run_reader([3])
    assert [r.capture_ts_ms for r in queued(stats)] == [1_000_100, 1_000_200, 1_000_300]


def test_a_camera_is_given_up_after_that_many_failed_connections_in_a_row() -> None:
    stats, waits = run_reader([2, "refused", "refused", "refused"], LivePolicy(give_up_after=3, max_queued=100))
    # The connection that gave frames does not count: three refusals after it do.
    assert stats.state is CameraState.GIVEN_UP and len(waits) == 3
    assert stats.last_error == "refused"


def test_the_reader_stops_after_count_frames_and_samples_by_wall_clock() -> None:
    stats, _ = run_reader([100], fps=2.0, max_frames=4)  # frames every 0.1 s, two taken per second
    records = queued(stats)
    # Due every 0.5 s from the first; each frame 0.1 s before its due time is within the quarter-interval slack.
    assert [r.frame_index for r in records] == [0, 4, 9, 14]
    assert stats.state is CameraState.ENDED


def test_a_reader_that_cannot_send_keeps_only_the_freshest_frames_and_counts_drops() -> None:
    stats, _ = run_reader([50], LivePolicy(max_queued=4))
    assert [r.frame_index for r in queued(stats)] == [46, 47, 48, 49]
    assert stats.dropped == 46 and stats.read == 50


def test_live_cameras_interleave_streams_and_flush_what_was_read_when_stopped() -> None:
    release = threading.Event()

    @contextmanager
    def opener(source: str) -> Iterator[Iterator[Callable[[], np.ndarray]]]:
        def frames() -> Iterator[Callable[[], np.ndarray]]:
            for _ in range(3):
                yield pixels
            release.wait()  # then the camera goes quiet until the test stops it
        yield frames()

    cameras = LiveCameras(["rtsp://a", "rtsp://b"], ["a", "b"], opener, LivePolicy(max_queued=10), FMT).start()
    wait_for(lambda: all(c.read == 3 for c in cameras.cameras), 10, "both cameras to read their frames",
             interval_s=0.01)
    got = []
    for rec in cameras.frames():
        got.append((rec.stream_id, rec.frame_index))
        if len(got) == 1:
            cameras.stop()  # a SIGTERM after the first frame: the other five read are still sent
    release.set()
    cameras.join(timeout_s=10)
    assert sorted(got) == [(s, i) for s in ("a", "b") for i in range(3)]
    summary = cameras.summary()
    assert summary["a"]["sent"] == summary["b"]["sent"] == 3
    assert {c["state"] for c in summary.values()} == {"stopped"}


def test_the_cameras_counters_are_served_for_prometheus() -> None:
    import urllib.request

    from worker.tools.cameras import serve_metrics

    stats, _ = run_reader([6], LivePolicy(max_queued=4))
    cameras = LiveCameras(["rtsp://cam"], ["run-v0-cam"], fake_opener([], FakeClock(), 0.1), LivePolicy(), FMT)
    cameras.cameras[0] = stats
    port = serve_metrics(cameras, 0, host="127.0.0.1")
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'streamfer_camera_frames_read_total{stream_id="run-v0-cam"} 6.0' in text
    assert 'streamfer_camera_frames_dropped_total{stream_id="run-v0-cam"} 2.0' in text
    assert 'streamfer_camera_reconnects_total{stream_id="run-v0-cam"} 1.0' in text
    assert "streamfer_camera_seconds_since_last_frame" in text
