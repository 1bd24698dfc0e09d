"""The micro-batcher's policy, one behaviour per test, on a fake clock."""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys
import weakref

import pytest

from worker.batching import Batch, BatcherFullError, MicroBatcher
from worker.batching.costmodel import CostModel
from worker.config import BatchingSettings, ClassSettings, ConfigError
from worker.devices.memory import DeviceMemories, MemoryPolicy
from worker.frames import Encoding, Frame, Priority, SourceRef
from worker.testing import FakeClock

REALTIME, STANDARD, BULK = Priority.REALTIME, Priority.STANDARD, Priority.BULK
MS = 0.001
_frame_index = itertools.count()

# Seconds where the batcher's millisecond sums stay exact enough (at epoch-sized times they round).
T0 = 1_000.0


def make_frame(clock: FakeClock, *, tenant: str = "t0", priority: Priority = STANDARD,
               shape: tuple[int, int, int] = (64, 64, 3), captured_s_ago: float = 0.0) -> Frame:
    """A frame received now, captured `captured_s_ago` seconds before."""
    i = next(_frame_index)
    height, width, channels = shape
    return Frame(stream_id=f"{tenant}-stream", frame_index=i, tenant=tenant, priority=priority,
                 capture_ts_ms=round((clock.now - captured_s_ago) * 1000), width=width, height=height,
                 channels=channels, encoding=Encoding.RAW_RGB8, data=b"",
                 source=SourceRef(f"frames.{priority.label}", 0, i), received_at=clock.now)


def make_settings(**overrides) -> BatchingSettings:
    """Small batches, the rare-shape lane off (min count 1), memory caps out of the way; override anything.
    A class may be given as a (max_wait_ms, max_age_ms, weight[, latency_budget_ms, pending_share, max_batch_size])
    tuple."""
    values = dict(max_batch_size=8, rare_shape_min_count=1, max_batch_bytes=1 << 30,
                  max_pending_frames=100_000, max_pending_bytes=1 << 40)
    values.update(overrides)
    for name in ("realtime", "standard", "bulk"):
        if isinstance(values.get(name), tuple):
            values[name] = ClassSettings(*values[name])
    return dataclasses.replace(BatchingSettings(), **values)


def shares(realtime: float, standard: float, bulk: float, bulk_wait_ms: float = 100) -> dict[str, ClassSettings]:
    """The three default classes with these pending_share values (and bulk's max_wait_ms)."""
    d = BatchingSettings()
    out = {name: dataclasses.replace(getattr(d, name), pending_share=v)
           for name, v in (("realtime", realtime), ("standard", standard), ("bulk", bulk))}
    out["bulk"] = dataclasses.replace(out["bulk"], max_wait_ms=bulk_wait_ms)
    return out


def add_frames(batcher: MicroBatcher, clock: FakeClock, count: int, **frame_kw) -> list[Frame]:
    frames = [make_frame(clock, **frame_kw) for _ in range(count)]
    for f in frames:
        batcher.add(f)
    return frames


def drain(batcher: MicroBatcher) -> list[Batch]:
    batches = []
    while (batch := batcher.pop_batch()) is not None:
        batches.append(batch)
    return batches


def ids(frames) -> list[int]:
    return [f.frame_index for f in frames]


# ------------------------------------------------------------------------------------------- release rules

def test_frames_of_one_shape_are_released_together_once_the_batch_is_full():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(max_batch_size=4), clock)
    frames = add_frames(batcher, clock, 5)

    batch = batcher.pop_batch()

    assert batch is not None
    assert (batch.size, batch.reason, batch.lane, batch.shape) == (4, "full", "exact", (64, 64, 3))
    assert ids(batch.frames) == ids(frames[:4])
    assert batch.padding_waste == 0.0 and batch.released_at == clock.now and batch.priority == STANDARD
    assert batcher.pop_batch() is None
    assert batcher.pending_frames == 1


def test_a_partial_batch_waits_for_its_class_max_wait_then_goes():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(standard=(15, 0, 3)), clock)
    add_frames(batcher, clock, 3)

    clock.advance(14 * MS)
    assert batcher.pop_batch() is None
    clock.advance(1 * MS)
    batch = batcher.pop_batch()

    assert batch is not None and (batch.size, batch.reason) == (3, "deadline")


def test_an_idle_runtime_takes_a_partial_group_before_its_wait():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(bulk=(100, 0, 1)), clock)
    frames = add_frames(batcher, clock, 3, priority=BULK)

    assert batcher.pop_batch() is None
    batch = batcher.pop_batch(idle=True)

    assert batch is not None and (ids(batch.frames), batch.reason) == (ids(frames), "idle")
    assert batcher.pending_frames == 0 and batcher.pop_batch(idle=True) is None


def test_an_idle_release_serves_the_most_urgent_class_and_its_oldest_group_first():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(padding_waste_max=0.0), clock)
    add_frames(batcher, clock, 5, priority=BULK)
    add_frames(batcher, clock, 2, priority=STANDARD, shape=(32, 32, 3))
    clock.advance(1 * MS)
    add_frames(batcher, clock, 2, priority=STANDARD)
    clock.advance(1 * MS)
    realtime = add_frames(batcher, clock, 1, priority=REALTIME)

    order = [batcher.pop_batch(idle=True) for _ in range(4)]

    assert [(b.priority, b.shape[0], b.size) for b in order if b is not None] == [
        (REALTIME, 64, 1), (STANDARD, 32, 2), (STANDARD, 64, 2), (BULK, 64, 5)]
    assert ids(order[0].frames) == ids(realtime)


def test_an_idle_release_of_a_full_group_keeps_its_own_reason_and_leaves_the_rest():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(max_batch_size=4), clock)
    add_frames(batcher, clock, 6)

    first, second = batcher.pop_batch(idle=True), batcher.pop_batch(idle=True)

    assert first is not None and (first.size, first.reason) == (4, "full")
    assert second is not None and (second.size, second.reason) == (2, "idle")


def test_each_class_waits_its_own_max_wait():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(realtime=(5, 0, 8), bulk=(100, 0, 1)), clock)
    add_frames(batcher, clock, 1, priority=REALTIME)
    add_frames(batcher, clock, 1, priority=BULK)

    clock.advance(5 * MS)
    first = drain(batcher)
    clock.advance(95 * MS)
    second = drain(batcher)

    assert [b.priority for b in first] == [REALTIME]
    assert [b.priority for b in second] == [BULK]


def test_the_largest_preferred_size_is_released_at_once():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(max_batch_size=32), clock, preferred_batch_sizes=(8, 16))
    add_frames(batcher, clock, 15)
    assert batcher.pop_batch() is None

    add_frames(batcher, clock, 1)
    batch = batcher.pop_batch()

    assert batch is not None and (batch.size, batch.reason) == (16, "preferred")


def test_preferred_sizes_from_settings_and_runner_are_merged():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(max_batch_size=32, preferred_batch_sizes=(12,)), clock,
                           preferred_batch_sizes=(4, 64))  # 64 > max_batch_size: never reached
    add_frames(batcher, clock, 12)

    batch = batcher.pop_batch()

    assert batch is not None and (batch.size, batch.reason) == (12, "preferred")


def test_a_deadline_batch_is_cut_to_a_preferred_size_keeping_newer_frames_waiting():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(max_batch_size=32, standard=(15, 0, 3)), clock,
                           preferred_batch_sizes=(8, 16))
    oldest = add_frames(batcher, clock, 1)
    clock.advance(10 * MS)
    newer = add_frames(batcher, clock, 8)
    clock.advance(5 * MS)

    batches = drain(batcher)

    assert [(b.size, b.reason) for b in batches] == [(8, "deadline")]
    assert ids(oldest)[0] in ids(batches[0].frames)
    assert batcher.next_due() == pytest.approx(clock.now + 10 * MS)
    (kept,) = [f for b in batcher.flush() for f in b.frames]
    assert kept.frame_index in ids(newer)


def test_at_the_deadline_no_frame_is_left_past_its_wait():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(max_batch_size=32, standard=(15, 0, 3)), clock,
                           preferred_batch_sizes=(8, 16))
    frames = add_frames(batcher, clock, 9)
    clock.advance(15 * MS)

    batches = drain(batcher)

    # All nine are overdue: one batch of 9 (the runner pads it to 16), not 8 now and 1 left behind.
    assert [(b.size, b.reason) for b in batches] == [(9, "deadline")]
    assert sorted(ids(batches[0].frames)) == sorted(ids(frames))


def test_without_preferred_sizes_a_deadline_batch_takes_all_it_can():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(max_batch_size=8, standard=(15, 0, 3)), clock)
    add_frames(batcher, clock, 3)
    clock.advance(10 * MS)
    add_frames(batcher, clock, 3)
    clock.advance(5 * MS)

    assert [b.size for b in drain(batcher)] == [6]


# ------------------------------------------------------------------------------------------- shapes

def test_close_shapes_share_a_padded_batch_within_the_waste_limit():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(padding_waste_max=0.20, standard=(15, 0, 3)), clock)
    add_frames(batcher, clock, 3, shape=(100, 100, 3))
    add_frames(batcher, clock, 3, shape=(90, 100, 3))
    clock.advance(15 * MS)

    batches = drain(batcher)

    assert len(batches) == 1
    batch = batches[0]
    assert (batch.size, batch.lane, batch.shape) == (6, "padded", (100, 100, 3))
    assert batch.padding_waste == pytest.approx(3 * 1000 / (6 * 10_000))  # 5%


def test_padding_stops_where_the_waste_limit_would_be_crossed():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(padding_waste_max=0.20, standard=(15, 0, 3)), clock)
    add_frames(batcher, clock, 1, shape=(100, 100, 3))
    add_frames(batcher, clock, 5, shape=(70, 100, 3))  # 30% padding each
    clock.advance(15 * MS)

    batches = drain(batcher)

    assert all(b.padding_waste <= 0.20 for b in batches)
    padded = [b for b in batches if b.lane == "padded"]
    # 1 full frame + k frames at 70%: waste 0.3k/(1+k) <= 0.2 holds for k <= 2 only.
    assert [b.size for b in padded] == [3]
    assert sum(b.size for b in batches) == 6


def test_shapes_too_far_apart_are_not_padded_together():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(standard=(15, 0, 3)), clock)
    add_frames(batcher, clock, 2, shape=(100, 100, 3))
    add_frames(batcher, clock, 2, shape=(50, 50, 3))
    clock.advance(15 * MS)

    batches = drain(batcher)

    assert sorted((b.shape, b.size, b.lane) for b in batches) == [
        ((50, 50, 3), 2, "exact"), ((100, 100, 3), 2, "exact")]


def test_channels_are_never_mixed_even_for_equal_height_and_width():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(padding_waste_max=0.9, standard=(15, 0, 3)), clock)
    add_frames(batcher, clock, 2, shape=(64, 64, 3))
    add_frames(batcher, clock, 2, shape=(64, 64, 1))
    clock.advance(15 * MS)

    batches = drain(batcher)

    assert sorted(b.shape for b in batches) == [(64, 64, 1), (64, 64, 3)]
    assert all(len({f.channels for f in b.frames}) == 1 for b in batches)


def test_the_memory_cap_bounds_a_batch_by_its_padded_tensor_bytes():
    clock = FakeClock(T0)
    shape = (100, 100, 3)
    frame_bytes = 100 * 100 * 3 * 4
    batcher = MicroBatcher(make_settings(max_batch_size=32, max_batch_bytes=3 * frame_bytes + 1), clock)
    add_frames(batcher, clock, 7, shape=shape)

    batches = drain(batcher)

    assert [(b.size, b.reason) for b in batches] == [(3, "bytes"), (3, "bytes")]
    assert batcher.pending_frames == 1


def test_the_memory_cap_holds_for_padded_batches():
    clock = FakeClock(T0)
    big = 100 * 100 * 3 * 4
    batcher = MicroBatcher(make_settings(max_batch_size=32, max_batch_bytes=4 * big, padding_waste_max=0.2,
                                         standard=(15, 0, 3)), clock)
    add_frames(batcher, clock, 2, shape=(96, 100, 3))  # 4 fit by their own bytes, 4 once padded to 100x100
    add_frames(batcher, clock, 3, shape=(100, 100, 3))
    clock.advance(15 * MS)

    batches = drain(batcher)

    assert all(b.size * b.shape[0] * b.shape[1] * b.shape[2] * 4 <= 4 * big for b in batches)
    assert sum(b.size for b in batches) == 5


def test_a_frame_larger_than_max_batch_bytes_runs_alone_in_the_fallback_lane_at_once():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(max_batch_bytes=10_000, max_pending_bytes=10**9), clock)
    huge = add_frames(batcher, clock, 2, shape=(100, 100, 3))  # 120 kB each

    batches = drain(batcher)

    assert [(ids(b.frames), b.lane, b.reason) for b in batches] == [
        ([huge[0].frame_index], "fallback", "fallback"), ([huge[1].frame_index], "fallback", "fallback")]


def test_a_rare_shape_goes_to_the_fallback_lane_and_does_not_hold_common_shapes():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(rare_shape_min_count=2, standard=(15, 0, 3)), clock)
    odd = add_frames(batcher, clock, 1, shape=(33, 77, 3))
    common = add_frames(batcher, clock, 1, shape=(64, 64, 3)) + add_frames(batcher, clock, 1, shape=(64, 64, 3))

    now = drain(batcher)
    clock.advance(15 * MS)
    later = drain(batcher)

    # The first sighting of (64, 64, 3) is rare too; the second joins the normal lane and waits its turn.
    assert [(ids(b.frames), b.lane, b.reason) for b in now] == [
        ([odd[0].frame_index], "fallback", "fallback"), ([common[0].frame_index], "fallback", "fallback")]
    assert [b.lane for b in later] == ["exact"] and ids(later[0].frames) == [common[1].frame_index]


def test_a_shape_is_rare_again_once_its_sightings_leave_the_window():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(rare_shape_min_count=2, rare_shape_window_ms=1_000,
                                         standard=(0, 0, 3)), clock)
    lanes = []
    for gap in (0.0, 0.5, 0.5, 1.5):
        clock.advance(gap)
        add_frames(batcher, clock, 1)
        lanes += [b.lane for b in drain(batcher)]

    assert lanes == ["fallback", "exact", "exact", "fallback"]


def test_the_fallback_lane_batches_one_rare_shape_up_to_fallback_max_batch_size():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(rare_shape_min_count=10, fallback_max_batch_size=3), clock)
    add_frames(batcher, clock, 4, shape=(33, 77, 3))
    add_frames(batcher, clock, 1, shape=(31, 77, 3))

    batches = drain(batcher)

    assert sorted((b.shape, b.size) for b in batches) == [
        ((31, 77, 3), 1), ((33, 77, 3), 1), ((33, 77, 3), 3)]
    assert all(b.lane == "fallback" for b in batches)


# ------------------------------------------------------------------------------------------- expiry

def test_expired_frames_come_out_of_pop_expired_and_never_in_a_batch():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(realtime=(5, 100, 8)), clock)
    stale = add_frames(batcher, clock, 2, priority=REALTIME, captured_s_ago=0.098)
    fresh = add_frames(batcher, clock, 1, priority=REALTIME)

    clock.advance(5 * MS)
    batch = batcher.pop_batch()
    expired = batcher.pop_expired()

    assert batch is not None and ids(batch.frames) == ids(fresh)
    assert ids(expired) == ids(stale)
    assert batcher.pop_expired() == [] and batcher.pending_frames == 0


def test_a_frame_is_not_expired_until_its_deadline_has_passed():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(realtime=(5, 100, 8)), clock)
    add_frames(batcher, clock, 1, priority=REALTIME, captured_s_ago=0.090)

    clock.advance(9 * MS)
    assert batcher.pop_expired() == []
    clock.advance(2 * MS)
    assert len(batcher.pop_expired()) == 1


def test_max_age_zero_means_a_frame_never_expires():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(bulk=(100, 0, 1)), clock)
    add_frames(batcher, clock, 1, priority=BULK, captured_s_ago=86_400)

    clock.advance(1.0)

    assert batcher.pop_expired() == []
    assert [b.size for b in drain(batcher)] == [1]


def test_a_batched_frame_is_not_kept_until_its_max_age_passes():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(max_batch_size=4, standard=(5, 30_000, 3)), clock)
    [first] = add_frames(batcher, clock, 1)
    gone = weakref.ref(first)
    clock.advance(10 * MS)
    assert batcher.pop_batch().frames == (first,)
    del first
    for _ in range(50):  # 200 frames more, each batch run long before its 30 s max age
        add_frames(batcher, clock, 4)
        assert batcher.pop_batch().size == 4
        assert batcher.pop_expired() == []
    assert gone() is None  # nothing holds it (or its bytes) any more


def test_tenants_left_with_only_expired_frames_do_not_stall_a_release():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(max_batch_size=1, standard=(1, 1, 3)), clock)
    (fresh,) = add_frames(batcher, clock, 1, tenant="a")
    add_frames(batcher, clock, 1, tenant="b", captured_s_ago=0.002)
    add_frames(batcher, clock, 1, tenant="c", captured_s_ago=0.002)

    batch = batcher.pop_batch()

    assert batch is not None and ids(batch.frames) == [fresh.frame_index]
    assert len(batcher.pop_expired()) == 2


# ------------------------------------------------------------------------------------------- classes

def test_realtime_goes_first_when_every_class_has_a_due_batch():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(), clock)
    for prio in (BULK, STANDARD, REALTIME):
        add_frames(batcher, clock, 8, priority=prio)

    assert [b.priority for b in drain(batcher)][0] == REALTIME


def test_a_bulk_frame_that_arrived_later_never_goes_before_a_due_realtime_frame():
    clock = FakeClock(T0)
    # Bulk weighs far more than realtime here, so only the ordering rule keeps realtime first.
    batcher = MicroBatcher(make_settings(realtime=(5, 0, 1), bulk=(5, 0, 50)), clock)
    realtime = add_frames(batcher, clock, 3, priority=REALTIME)
    clock.advance(1 * MS)
    add_frames(batcher, clock, 8, priority=BULK)
    clock.advance(5 * MS)

    batches = drain(batcher)

    assert [b.priority for b in batches] == [REALTIME, BULK]
    assert ids(batches[0].frames) == ids(realtime)


def test_older_bulk_frames_may_go_ahead_of_newer_realtime_frames_by_weight():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(realtime=(5, 0, 1), bulk=(5, 0, 50)), clock)
    bulk = add_frames(batcher, clock, 8, priority=BULK)
    clock.advance(1 * MS)
    add_frames(batcher, clock, 8, priority=REALTIME)

    batches = drain(batcher)

    assert [b.priority for b in batches] == [BULK, REALTIME]
    assert ids(batches[0].frames) == ids(bulk)


def test_no_class_starves_under_a_realtime_backlog():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(realtime=(5, 0, 8), bulk=(100, 0, 1)), clock)
    add_frames(batcher, clock, 16, priority=BULK)  # older than every realtime frame below
    clock.advance(100 * MS)
    served = []
    for _ in range(40):  # a consumer with room for one batch per tick, realtime arriving faster than that
        add_frames(batcher, clock, 10, priority=REALTIME)
        batch = batcher.pop_batch()
        served.append(batch.priority)
        clock.advance(1 * MS)

    # Weights 8:1 give bulk one turn in nine while its frames are the older ones.
    assert served[:18].count(BULK) == 2
    assert BULK not in served[18:]


def test_within_a_class_the_group_with_the_oldest_frame_goes_first():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(padding_waste_max=0.0), clock)
    add_frames(batcher, clock, 8, shape=(50, 50, 3))
    clock.advance(1 * MS)
    add_frames(batcher, clock, 8, shape=(60, 60, 3))

    assert [b.shape for b in drain(batcher)] == [(50, 50, 3), (60, 60, 3)]


# ------------------------------------------------------------------------------------------- tenants

def test_a_flooding_tenant_does_not_delay_a_small_tenant():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(max_batch_size=32), clock)
    add_frames(batcher, clock, 500, tenant="flood")
    small = add_frames(batcher, clock, 10, tenant="small")
    add_frames(batcher, clock, 500, tenant="flood")

    first = batcher.pop_batch()

    assert first is not None and set(ids(small)) <= set(ids(first.frames))
    assert sum(f.tenant == "flood" for f in first.frames) == 22


def test_tenant_weights_set_each_tenant_share_of_a_batch():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(max_batch_size=8, tenant_weights={"gold": 3}), clock)
    add_frames(batcher, clock, 40, tenant="basic")
    add_frames(batcher, clock, 40, tenant="gold")

    tenants = [f.tenant for b in [batcher.pop_batch() for _ in range(4)] for f in b.frames]

    assert tenants.count("gold") == 24 and tenants.count("basic") == 8


def test_a_small_tenant_keeps_its_latency_under_a_flood_when_capacity_is_short():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(max_batch_size=8, standard=(15, 0, 3)), clock)
    sent: dict[int, float] = {}
    waited = []
    for tick in range(200):
        add_frames(batcher, clock, 10, tenant="flood")  # 10 a tick against room for 8
        if tick % 3 == 0:
            (f,) = add_frames(batcher, clock, 1, tenant="small")
            sent[f.frame_index] = clock.now
        batch = batcher.pop_batch()
        if batch is not None:
            waited += [clock.now - sent[f.frame_index] for f in batch.frames if f.tenant == "small"]
        clock.advance(1 * MS)

    assert len(waited) >= 60
    # Never held past its own wait (plus the polling tick) by the flood, whose backlog grows without end.
    assert max(waited) <= 16 * MS + 1e-9
    assert batcher.pending_frames > 300


# ------------------------------------------------------------------------------------------- next_due

def test_next_due_is_none_for_an_empty_batcher():
    assert MicroBatcher(make_settings(), FakeClock(T0)).next_due() is None


def test_next_due_is_the_oldest_frame_plus_its_wait():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(realtime=(5, 0, 8), bulk=(100, 0, 1)), clock)
    start = clock.now
    add_frames(batcher, clock, 1, priority=BULK)
    clock.advance(2 * MS)
    add_frames(batcher, clock, 1, priority=REALTIME)

    assert batcher.next_due() == pytest.approx(start + 7 * MS)
    clock.now = batcher.next_due()
    assert batcher.pop_batch().priority == REALTIME
    assert batcher.next_due() == pytest.approx(start + 100 * MS)


def test_next_due_is_now_or_earlier_when_a_batch_is_full():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(max_batch_size=4), clock)
    add_frames(batcher, clock, 4)

    assert batcher.next_due() <= clock.now


def test_next_due_is_the_arrival_of_a_fallback_frame():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(rare_shape_min_count=2), clock)
    add_frames(batcher, clock, 1)

    assert batcher.next_due() == clock.now


def test_next_due_includes_the_next_expiry():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(standard=(15, 100, 3)), clock)
    add_frames(batcher, clock, 1, captured_s_ago=0.095)

    due = batcher.next_due()

    assert due == pytest.approx(clock.now + 5 * MS)
    clock.now = due
    assert len(batcher.pop_expired()) == 1


# ------------------------------------------------------------------------------------------- flush, discard

def test_flush_returns_everything_pending_ignoring_waits_but_not_caps():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(max_batch_size=4, padding_waste_max=0.0), clock)
    frames = (add_frames(batcher, clock, 6, priority=BULK) + add_frames(batcher, clock, 1, shape=(10, 10, 1))
              + add_frames(batcher, clock, 2, priority=REALTIME))

    batches = batcher.flush()

    assert sorted(ids(f for b in batches for f in b.frames)) == sorted(ids(frames))
    assert all(b.reason == "flush" and b.size <= 4 for b in batches)
    assert batches[0].priority == REALTIME
    assert batcher.pending_frames == 0 and batcher.next_due() is None


def test_flush_sets_expired_frames_aside_for_pop_expired():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(realtime=(5, 100, 8)), clock)
    stale = add_frames(batcher, clock, 1, priority=REALTIME, captured_s_ago=1.0)

    assert batcher.flush() == []
    assert ids(batcher.pop_expired()) == ids(stale)


def test_discard_removes_matching_frames_which_never_come_out_again():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(max_batch_size=4), clock)
    revoked = add_frames(batcher, clock, 3, tenant="a")
    kept = add_frames(batcher, clock, 2, tenant="b")

    out = batcher.discard(lambda f: f.tenant == "a")
    clock.advance(1.0)
    batches = drain(batcher)

    assert sorted(ids(out)) == sorted(ids(revoked))
    assert [sorted(ids(b.frames)) for b in batches] == [sorted(ids(kept))]
    assert batcher.pending_frames == 0 and batcher.pending_bytes == 0


def test_discard_also_takes_expired_frames_not_yet_returned():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(realtime=(5, 100, 8)), clock)
    stale = add_frames(batcher, clock, 1, priority=REALTIME, captured_s_ago=1.0)
    assert batcher.pop_batch() is None  # sets the expired frame aside

    assert ids(batcher.discard(lambda f: True)) == ids(stale)
    assert batcher.pop_expired() == []


# ------------------------------------------------------------------------------------------- backpressure

def test_pending_counts_use_each_frame_tensor_bytes():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(tensor_dtype_bytes=2), clock)
    add_frames(batcher, clock, 2, shape=(10, 20, 3))
    add_frames(batcher, clock, 1, shape=(5, 5, 1))

    assert (batcher.pending_frames, batcher.pending_bytes) == (3, 2 * 10 * 20 * 3 * 2 + 5 * 5 * 2)


def test_every_class_pauses_at_the_frame_cap_and_resumes_below_75_percent():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(max_batch_size=4, max_pending_frames=8), clock)
    add_frames(batcher, clock, 7, priority=REALTIME)
    assert batcher.classes_to_pause() == set()
    add_frames(batcher, clock, 1, priority=REALTIME)
    assert batcher.classes_to_pause() == {REALTIME, STANDARD, BULK}

    batcher.pop_batch()  # 4 left: at 50%, below the 75% watermark
    assert batcher.classes_to_pause() == set()


def test_pause_has_hysteresis_between_the_watermarks():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(max_batch_size=1, max_pending_frames=8), clock)
    add_frames(batcher, clock, 8, priority=REALTIME)
    batcher.pop_batch()  # 7 pending: below the cap, above 6 (75%)
    assert batcher.classes_to_pause() == {REALTIME, STANDARD, BULK}
    batcher.pop_batch()
    batcher.pop_batch()  # 5 pending
    assert batcher.classes_to_pause() == set()


def test_every_class_pauses_at_the_byte_cap():
    clock = FakeClock(T0)
    frame_bytes = 64 * 64 * 3 * 4
    batcher = MicroBatcher(make_settings(max_pending_bytes=3 * frame_bytes), clock)
    add_frames(batcher, clock, 3, priority=REALTIME)

    assert batcher.classes_to_pause() == {REALTIME, STANDARD, BULK}


def test_less_urgent_classes_pause_at_their_own_share_and_never_fill_realtime_room():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(max_batch_size=4, max_pending_frames=100, **shares(1.0, 0.5, 0.25)), clock)
    add_frames(batcher, clock, 25, priority=BULK)
    assert batcher.classes_to_pause() == {BULK}  # bulk holds its 25%: it waits in Kafka (no deadline)
    add_frames(batcher, clock, 49, priority=STANDARD)
    assert batcher.classes_to_pause() == {BULK}  # bulk's frames do not take standard's room
    add_frames(batcher, clock, 1, priority=STANDARD)
    assert batcher.classes_to_pause() == {STANDARD, BULK}
    add_frames(batcher, clock, 24, priority=REALTIME)
    assert REALTIME not in batcher.classes_to_pause()  # the rest is realtime's
    add_frames(batcher, clock, 1, priority=REALTIME)
    assert batcher.classes_to_pause() == {REALTIME, STANDARD, BULK}  # the whole cap


def test_frames_of_less_urgent_classes_alone_never_keep_realtime_paused():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(max_batch_size=4, max_pending_frames=100, **shares(1.0, 0.5, 0.25)), clock)
    add_frames(batcher, clock, 60, priority=STANDARD)  # one poll overshot standard's share
    add_frames(batcher, clock, 40, priority=REALTIME)
    assert batcher.classes_to_pause() == {REALTIME, STANDARD, BULK}
    while batcher.pop_batch(max_priority=REALTIME) is not None:
        pass

    assert REALTIME not in batcher.classes_to_pause()  # 60 standard frames held, realtime reads again


def test_poll_room_keeps_each_reading_class_within_its_share():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(max_pending_frames=100, **shares(1.0, 0.5, 0.25)), clock)
    add_frames(batcher, clock, 20, priority=BULK)
    assert batcher.poll_room(set()) == 5
    assert batcher.poll_room({BULK}) == 50


def test_a_standard_backlog_pauses_nothing_and_bulk_runs_only_once_standard_is_out_of_risk():
    clock = FakeClock(T0)
    settings = make_settings(max_batch_size=4, standard=ClassSettings(5, 0, 3, latency_budget_ms=100))
    batcher = MicroBatcher(settings, clock, cost=cost_model((SHAPE, 4, 0.010)))
    add_frames(batcher, clock, 4, priority=BULK)
    add_frames(batcher, clock, 12, priority=STANDARD)
    clock.advance(100 * MS)
    assert batcher.classes_to_pause() == set()  # bulk reads on, within its share

    batches = drain(batcher)
    assert [b.priority for b in batches] == [STANDARD, STANDARD, STANDARD, BULK]  # backlogged standard first


def test_a_realtime_backlog_pauses_bulk_then_standard_too_until_realtime_is_drained():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(max_batch_size=4, realtime=(5, 0, 8)), clock)
    add_frames(batcher, clock, 4, priority=REALTIME)
    assert batcher.classes_to_pause() == set()  # a full batch waiting within its budget is not a backlog

    clock.advance(5 * MS)
    assert batcher.classes_to_pause() == {BULK}
    add_frames(batcher, clock, 5, priority=REALTIME)  # 9 realtime frames: more than two batches
    assert batcher.classes_to_pause() == {BULK, STANDARD}

    batcher.pop_batch()  # still realtime pending: stays paused (no flapping on each batch)
    assert batcher.classes_to_pause() == {BULK, STANDARD}
    drain(batcher)
    assert batcher.pending_frames == 1 and batcher.classes_to_pause() == {BULK, STANDARD}
    clock.advance(5 * MS)
    drain(batcher)
    assert batcher.pending_frames == 0 and batcher.classes_to_pause() == set()


def test_a_few_late_realtime_frames_pause_nothing():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(max_batch_size=4, realtime=(5, 0, 8)), clock)
    add_frames(batcher, clock, 3, priority=REALTIME)
    clock.advance(50 * MS)
    assert batcher.classes_to_pause() == set()


def test_add_past_twice_the_pending_cap_raises_batcher_full_error():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(max_batch_size=4, max_pending_frames=4), clock)
    add_frames(batcher, clock, 8, priority=BULK)

    with pytest.raises(BatcherFullError, match="classes_to_pause"):
        batcher.add(make_frame(clock, priority=BULK))
    assert batcher.pending_frames == 8


def test_frames_bound_for_a_fixed_model_input_count_that_input_s_bytes_not_their_own():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(max_batch_bytes=8 * 224 * 224 * 3 * 4), clock, input_hw=(224, 224))
    add_frames(batcher, clock, 8, shape=(1080, 1920, 3))

    assert batcher.pending_bytes == 8 * 224 * 224 * 3 * 4
    assert [(b.lane, b.size) for b in drain(batcher)] == [("exact", 8)]  # one batch: its tensor is 224x224 rows


def test_with_a_fixed_model_input_720p_and_1080p_frames_form_full_batches_together():
    """Both become the same 224x224 input: 5 + 3 frames are one full batch at once, not a 5 and a 3 at the wait."""
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(max_batch_size=8), clock, input_hw=(224, 224))
    for shape in [(720, 1280, 3), (1080, 1920, 3)] * 3 + [(720, 1280, 3)] * 2:
        add_frames(batcher, clock, 1, shape=shape)

    [batch] = drain(batcher)
    assert (batch.size, batch.shape, batch.lane, batch.reason, batch.padding_waste) == (8, (224, 224, 3), "exact",
                                                                                         "full", 0.0)
    assert {f.shape for f in batch.frames} == {(720, 1280, 3), (1080, 1920, 3)}


def test_without_a_fixed_model_input_720p_and_1080p_frames_stay_in_batches_of_their_own_shape():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(max_batch_size=8), clock)
    for shape in [(720, 1280, 3), (1080, 1920, 3)] * 3 + [(720, 1280, 3)] * 2:
        add_frames(batcher, clock, 1, shape=shape)

    assert drain(batcher) == []  # neither shape fills a batch: both wait
    clock.advance(1.0)
    assert sorted((b.shape, b.size) for b in drain(batcher)) == [((720, 1280, 3), 5), ((1080, 1920, 3), 3)]


def test_with_a_fixed_model_input_a_source_resolution_seen_once_is_not_a_rare_shape():
    """The rare-shape lane keeps odd shapes from holding a common shape's batch; for a fixed input nothing is odd."""
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(max_batch_size=4, rare_shape_min_count=2), clock, input_hw=(224, 224))
    add_frames(batcher, clock, 1, shape=(720, 1280, 3))  # the first frame of any batch shape is rare
    drain(batcher)
    add_frames(batcher, clock, 3, shape=(720, 1280, 3))
    add_frames(batcher, clock, 1, shape=(1080, 1920, 3))

    assert [(b.lane, b.size) for b in drain(batcher)] == [("exact", 4)]


def test_with_a_fixed_model_input_the_channels_still_split_groups():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(max_batch_size=4), clock, input_hw=(224, 224))
    add_frames(batcher, clock, 2, shape=(720, 1280, 3))
    add_frames(batcher, clock, 2, shape=(720, 1280, 1))
    clock.advance(1.0)

    assert sorted((b.shape, b.size) for b in drain(batcher)) == [((224, 224, 1), 2), ((224, 224, 3), 2)]


def test_poll_room_is_bounded_by_the_bytes_left_at_the_largest_frame_seen():
    clock = FakeClock(T0)
    frame_bytes = 720 * 1280 * 3 * 4
    batcher = MicroBatcher(make_settings(max_pending_frames=2048, max_pending_bytes=10 * frame_bytes), clock)
    add_frames(batcher, clock, 4, shape=(720, 1280, 3))

    assert batcher.poll_room(set()) == 6


def test_one_poll_of_frames_larger_than_any_before_passes_the_byte_cap_without_an_error():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(max_pending_frames=2048, max_pending_bytes=1 << 20), clock)
    add_frames(batcher, clock, 1, shape=(64, 64, 3))
    room = batcher.poll_room(set())
    add_frames(batcher, clock, room, shape=(1080, 1920, 3))  # sizes are known only once read

    assert batcher.pending_bytes > 2 * (1 << 20)
    assert STANDARD in batcher.classes_to_pause()  # the class holding the bytes reads no more
    assert batcher.poll_room({STANDARD}) == 1  # the others, one frame a poll until it drains


def test_an_empty_batcher_accepts_a_frame_bigger_than_its_byte_caps():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(max_batch_bytes=1024, max_pending_bytes=1024), clock)
    batcher.add(make_frame(clock, shape=(100, 100, 3)))

    assert [b.lane for b in drain(batcher)] == ["fallback"]


# ------------------------------------------------------------------------------------------- contract

def test_preferred_sizes_below_one_are_a_config_error():
    with pytest.raises(ConfigError, match="preferred_batch_sizes"):
        MicroBatcher(make_settings(), FakeClock(T0), preferred_batch_sizes=(0, 8))


def test_the_batcher_imports_neither_kafka_nor_torch_nor_numpy():
    code = ("import sys, worker.batching; "
            "print(sorted(m for m in ('confluent_kafka', 'torch', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout

    assert out.strip() == "[]"


# ------------------------------------------------------------------------------------------- urgency and cost

def cost_model(*points: tuple[tuple[int, int, int], int, float]) -> CostModel:
    """A cost model that measured these (shape, batch size, seconds) batches."""
    cost = CostModel()
    for shape, n, seconds in points:
        cost.observe(shape, n, seconds)
    return cost


SHAPE = (64, 64, 3)


def test_a_less_urgent_class_waits_when_running_first_would_put_realtime_past_its_budget():
    clock = FakeClock(T0)
    settings = make_settings(realtime=ClassSettings(5, 0, 1, latency_budget_ms=50), bulk=(5, 0, 50))
    cost = cost_model((SHAPE, 8, 0.030))
    batcher = MicroBatcher(settings, clock, cost=cost)
    add_frames(batcher, clock, 8, priority=BULK)
    clock.advance(1 * MS)
    add_frames(batcher, clock, 8, priority=REALTIME, captured_s_ago=0.010)

    # Bulk is older and weighs 50x more, but 30 ms of bulk + 30 ms of realtime would end 70 ms after capture.
    assert [b.priority for b in drain(batcher)] == [REALTIME, BULK]


def test_with_slack_the_weights_still_let_older_bulk_go_first():
    clock = FakeClock(T0)
    settings = make_settings(realtime=ClassSettings(5, 0, 1, latency_budget_ms=500), bulk=(5, 0, 50))
    batcher = MicroBatcher(settings, clock, cost=cost_model((SHAPE, 8, 0.030)))
    add_frames(batcher, clock, 8, priority=BULK)
    clock.advance(1 * MS)
    add_frames(batcher, clock, 8, priority=REALTIME)

    assert [b.priority for b in drain(batcher)] == [BULK, REALTIME]


def test_a_class_past_its_budget_goes_before_bulk_whatever_the_weights():
    clock = FakeClock(T0)
    settings = make_settings(standard=ClassSettings(5, 30_000, 1, latency_budget_ms=1_000), bulk=(5, 0, 50))
    batcher = MicroBatcher(settings, clock)  # no cost model: at risk means past the budget already
    add_frames(batcher, clock, 8, priority=BULK)
    clock.advance(1 * MS)
    add_frames(batcher, clock, 8, priority=STANDARD, captured_s_ago=2.0)

    assert [b.priority for b in drain(batcher)] == [STANDARD, BULK]


def test_under_overload_bulk_gets_no_turn_while_realtime_is_at_risk():
    clock = FakeClock(T0)
    settings = make_settings(realtime=ClassSettings(5, 2_000, 8, latency_budget_ms=100), bulk=(100, 0, 1))
    batcher = MicroBatcher(settings, clock, cost=cost_model((SHAPE, 8, 0.040)))
    add_frames(batcher, clock, 64, priority=BULK)  # older than every realtime frame below
    clock.advance(100 * MS)
    served = []
    for _ in range(20):  # one 40 ms batch per tick; realtime arrives faster than that
        add_frames(batcher, clock, 10, priority=REALTIME, captured_s_ago=0.020)
        served.append(batcher.pop_batch().priority)
        clock.advance(40 * MS)

    assert BULK not in served  # the old weighted round robin gave bulk 1 turn in 9 here


def test_pop_batch_can_be_limited_to_realtime():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(), clock)
    add_frames(batcher, clock, 8, priority=BULK)
    assert batcher.pop_batch(max_priority=REALTIME) is None
    add_frames(batcher, clock, 8, priority=REALTIME)
    assert batcher.pop_batch(max_priority=REALTIME).priority == REALTIME


def test_adaptive_sizing_releases_at_the_measured_most_efficient_size():
    clock = FakeClock(T0)
    # 8 frames in 10 ms (800/s) beat 32 in 80 ms (400/s): a CPU whose large batches fall out of cache.
    cost = cost_model((SHAPE, 8, 0.010), (SHAPE, 32, 0.080), (SHAPE, 16, 0.030))
    batcher = MicroBatcher(make_settings(max_batch_size=32), clock, cost=cost)
    add_frames(batcher, clock, 8)

    batch = batcher.pop_batch()
    assert batch is not None and (batch.size, batch.reason) == (8, "cost")
    assert batch.predicted_s == pytest.approx(0.010)


def test_a_group_made_again_after_the_cost_model_learned_something_is_sized_by_what_it_learned():
    clock = FakeClock(T0)
    # 8 measured live often enough that the cost model does not try it again as a neighbour of 16.
    cost = cost_model(*[(SHAPE, 8, 0.010)] * 3, (SHAPE, 16, 0.030))
    batcher = MicroBatcher(make_settings(max_batch_size=32), clock, cost=cost)
    add_frames(batcher, clock, 8)
    assert batcher.pop_batch().size == 8  # the group is empty now, and gone
    for _ in range(10):
        cost.observe(SHAPE, 16, 0.012)  # 16 frames are now the most per device second
    add_frames(batcher, clock, 16)

    batch = batcher.pop_batch()
    assert batch is not None and (batch.size, batch.reason) == (16, "cost")


def test_fixed_sizes_win_when_adaptive_sizing_is_off():
    clock = FakeClock(T0)
    cost = cost_model((SHAPE, 8, 0.010), (SHAPE, 32, 0.080))
    batcher = MicroBatcher(make_settings(max_batch_size=32, adaptive_batch_size=False), clock, cost=cost)
    add_frames(batcher, clock, 8)
    assert batcher.pop_batch() is None
    add_frames(batcher, clock, 24)
    assert batcher.pop_batch().size == 32


def test_a_batch_is_cut_so_its_oldest_frame_finishes_within_the_class_budget():
    clock = FakeClock(T0)
    settings = make_settings(max_batch_size=32, adaptive_batch_size=False,
                             standard=ClassSettings(15, 0, 3, latency_budget_ms=100))
    cost = cost_model((SHAPE, 1, 0.012), (SHAPE, 32, 0.320))  # ~ 2 ms + 10 ms per frame
    batcher = MicroBatcher(settings, clock, cost=cost)
    add_frames(batcher, clock, 32, captured_s_ago=0.030)  # 70 ms left: at most 6 frames

    assert drain(batcher)[0].size == 6


def test_a_budgeted_partial_batch_is_released_before_its_wait_when_the_budget_demands_it():
    clock = FakeClock(T0)
    settings = make_settings(max_batch_size=32, adaptive_batch_size=False,
                             standard=ClassSettings(500, 0, 3, latency_budget_ms=100))
    batcher = MicroBatcher(settings, clock, cost=cost_model((SHAPE, 4, 0.040)))
    add_frames(batcher, clock, 4, captured_s_ago=0.020)

    # Captured 20 ms ago, 100 ms budget, 40 ms to run: due in 40 ms, not after the 500 ms wait.
    assert batcher.next_due() == pytest.approx(clock.now + 0.040)
    clock.now = batcher.next_due()
    assert batcher.pop_batch().size == 4


def test_standard_and_bulk_batches_are_bounded_by_the_blocking_limit():
    clock = FakeClock(T0)
    settings = make_settings(max_batch_size=32, adaptive_batch_size=False, max_blocking_ms=20)
    cost = cost_model((SHAPE, 1, 0.005), (SHAPE, 32, 0.160))  # 5 ms per frame
    batcher = MicroBatcher(settings, clock, cost=cost)
    add_frames(batcher, clock, 32, priority=BULK)
    add_frames(batcher, clock, 32, priority=REALTIME)

    batches = drain(batcher)
    assert {b.size for b in batches if b.priority == BULK} == {4}  # 4 x 5 ms: one bounded wait for realtime
    assert [b.size for b in batches if b.priority == REALTIME] == [32]


def test_without_realtime_traffic_standard_and_bulk_fill_to_full_size_and_the_bound_returns_with_it():
    clock = FakeClock(T0)
    settings = make_settings(max_batch_size=32, adaptive_batch_size=False, max_blocking_ms=20,
                             realtime_quiet_ms=1_000)
    cost = cost_model((SHAPE, 1, 0.005), (SHAPE, 32, 0.160))  # 5 ms per frame
    batcher = MicroBatcher(settings, clock, cost=cost)
    add_frames(batcher, clock, 64, priority=BULK)
    assert [b.size for b in drain(batcher)] == [32, 32]  # no realtime ever seen: nothing to protect

    add_frames(batcher, clock, 1, priority=REALTIME)
    add_frames(batcher, clock, 32, priority=BULK)
    batches = drain(batcher)
    assert {b.size for b in batches if b.priority == BULK} == {4}  # realtime present: bounded again

    clock.advance(0.999)
    add_frames(batcher, clock, 32, priority=BULK)
    assert {b.size for b in drain(batcher) if b.priority == BULK} == {4}  # within the last realtime frame's window
    clock.advance(0.002)
    add_frames(batcher, clock, 32, priority=BULK)
    assert [b.size for b in drain(batcher)] == [32]


def test_a_zero_realtime_quiet_window_keeps_standard_and_bulk_always_bounded():
    clock = FakeClock(T0)
    settings = make_settings(max_batch_size=32, adaptive_batch_size=False, max_blocking_ms=20, realtime_quiet_ms=0)
    batcher = MicroBatcher(settings, clock, cost=cost_model((SHAPE, 1, 0.005), (SHAPE, 32, 0.160)))
    add_frames(batcher, clock, 32, priority=BULK)

    assert {b.size for b in drain(batcher)} == {4}


def test_the_device_memory_policy_caps_a_shape_batch_size():
    clock = FakeClock(T0)
    memory = MemoryPolicy(total_bytes=1000, memory_fraction=0.5)
    memory.record_peak(SHAPE, 1, 100)
    memory.record_peak(SHAPE, 4, 400)  # 100 bytes a frame: 5 frames fit under 500
    batcher = MicroBatcher(make_settings(max_batch_size=16), clock, memory=memory)
    add_frames(batcher, clock, 16)

    assert [b.size for b in drain(batcher)] == [5, 5, 5]


def test_a_padded_batch_stays_within_the_memory_cap_of_its_padded_shape():
    clock = FakeClock(T0)
    memory = MemoryPolicy(total_bytes=1000, memory_fraction=0.5)
    memory.record_peak((8, 8, 3), 1, 100)
    memory.record_peak((8, 8, 3), 4, 400)  # 5 frames of 8x8 fit; 8x6 was never measured
    batcher = MicroBatcher(make_settings(max_batch_size=16, padding_waste_max=0.35), clock, memory=memory)
    add_frames(batcher, clock, 3, shape=(8, 6, 3))
    add_frames(batcher, clock, 4, shape=(8, 8, 3))
    clock.advance(1.0)

    assert [(b.lane, b.shape, b.size) for b in drain(batcher)] == [("padded", (8, 8, 3), 5), ("exact", (8, 8, 3), 2)]


def test_with_a_fixed_model_input_the_memory_cap_is_the_model_inputs_whatever_the_frame_size():
    clock = FakeClock(T0)
    memory = MemoryPolicy(total_bytes=1000, memory_fraction=0.5)
    memory.record_peak((224, 224, 3), 1, 100)
    memory.record_peak((224, 224, 3), 4, 400)  # measured on what the device runs: 224x224 rows
    batcher = MicroBatcher(make_settings(max_batch_size=16), clock, memory=memory, input_hw=(224, 224))
    add_frames(batcher, clock, 15, shape=(1080, 1920, 3))

    assert [b.size for b in drain(batcher)] == [5, 5, 5]


def test_over_several_devices_a_batch_takes_what_the_devices_take_together():
    clock = FakeClock(T0)
    devices = []
    for total in (1000, 600):  # 100 bytes a frame: 5 frames on one device, 3 on the other (fraction 0.5)
        memory = MemoryPolicy(total_bytes=total, memory_fraction=0.5)
        memory.record_peak(SHAPE, 1, 100)
        memory.record_peak(SHAPE, 2, 200)
        devices.append(memory)
    batcher = MicroBatcher(make_settings(max_batch_size=16), clock, memory=DeviceMemories(devices))
    add_frames(batcher, clock, 16)

    assert [b.size for b in drain(batcher)] == [8, 8]  # the executor splits each across the two devices


# ------------------------------------------------------------------------------------------- batch size per class

def test_each_class_batches_up_to_its_own_max_batch_size():
    clock = FakeClock(T0)
    settings = make_settings(max_batch_size=8, realtime=(5, 0, 8, 0, 1.0, 2))
    batcher = MicroBatcher(settings, clock)
    add_frames(batcher, clock, 8, priority=REALTIME)
    add_frames(batcher, clock, 8, priority=BULK)

    batches = drain(batcher)
    assert [(b.priority, b.size, b.reason) for b in batches] == [(REALTIME, 2, "full")] * 4 + [(BULK, 8, "full")]


def test_a_class_max_batch_size_may_be_above_the_global_one():
    clock = FakeClock(T0)
    settings = make_settings(max_batch_size=4, bulk=(100, 0, 1, 0, 0.25, 16))
    batcher = MicroBatcher(settings, clock)
    add_frames(batcher, clock, 16, priority=BULK)
    add_frames(batcher, clock, 4, priority=STANDARD)

    assert sorted((b.priority, b.size, b.reason) for b in drain(batcher)) == [(STANDARD, 4, "full"),
                                                                              (BULK, 16, "full")]


def test_preferred_sizes_and_runner_buckets_above_a_class_cap_never_trigger_its_release():
    clock = FakeClock(T0)
    settings = make_settings(max_batch_size=16, realtime=(5, 0, 8, 0, 1.0, 6))
    batcher = MicroBatcher(settings, clock, preferred_batch_sizes=(4, 8, 16))
    add_frames(batcher, clock, 6, priority=REALTIME)
    add_frames(batcher, clock, 16, priority=STANDARD)

    got = [(b.priority, b.size, b.reason) for b in drain(batcher)]
    assert got == [(REALTIME, 4, "preferred"), (STANDARD, 16, "full")]  # realtime's largest preferred <= 6: 4


def test_the_cost_model_sizes_each_class_within_its_own_cap():
    clock = FakeClock(T0)
    # 32 frames a batch are the most per device second, but realtime takes at most 4.
    cost = cost_model((SHAPE, 4, 0.010), (SHAPE, 8, 0.016), (SHAPE, 32, 0.040))
    settings = make_settings(max_batch_size=32, realtime=(5, 0, 8, 0, 1.0, 4), realtime_quiet_ms=1)
    batcher = MicroBatcher(settings, clock, cost=cost)
    add_frames(batcher, clock, 8, priority=REALTIME)
    realtime = drain(batcher)
    clock.advance(1.0)  # realtime quiet: standard is no longer bounded by the blocking limit
    add_frames(batcher, clock, 32)

    assert [(b.size, b.reason) for b in realtime] == [(4, "cost"), (4, "cost")]  # the best size within 4
    assert [(b.size, b.reason) for b in drain(batcher)] == [(32, "cost")]


def test_a_realtime_backlog_is_counted_in_realtime_batches():
    clock = FakeClock(T0)
    batcher = MicroBatcher(make_settings(max_batch_size=8, realtime=(5, 0, 8, 0, 1.0, 2)), clock)
    add_frames(batcher, clock, 2, priority=REALTIME)
    clock.advance(5 * MS)
    assert batcher.classes_to_pause() == {BULK}  # a whole realtime batch waits past its wait
    add_frames(batcher, clock, 3, priority=REALTIME)
    assert batcher.classes_to_pause() == {BULK, STANDARD}  # more than two
