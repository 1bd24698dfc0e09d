"""Invariants of the micro-batcher over random workloads (hypothesis), with a caller that polls every tick."""

from __future__ import annotations

import math
from collections import Counter

from hypothesis import HealthCheck, given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st

from tests.unit.test_batching import BULK, REALTIME, STANDARD, T0, make_frame, make_settings
from worker.batching import Batch, MicroBatcher
from worker.frames import Frame, Priority
from worker.testing import FakeClock

TICK = 0.001
SHAPES = [(8, 8, 3), (8, 7, 3), (7, 8, 3), (6, 8, 3), (8, 8, 1), (16, 16, 3), (4, 4, 3), (40, 40, 3)]
TENANTS = ["t0", "t1", "t2"]
PROPERTY = hyp_settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def class_settings(draw, max_wait: int) -> tuple[int, int, int, float, float, int]:
    """(max_wait_ms, max_age_ms, weight, no budget, pending share 1, max_batch_size: its own or the global one)."""
    wait = draw(st.integers(0, max_wait))
    age = draw(st.sampled_from([0, wait, wait + 5, wait + 30]))
    return (wait, age, draw(st.integers(1, 8)), 0.0, 1.0, draw(st.sampled_from([0, 1, 2, 3, 5, 8, 12])))


@st.composite
def scenarios(draw):
    max_batch_size = draw(st.integers(1, 8))
    settings = make_settings(
        max_batch_size=max_batch_size,
        preferred_batch_sizes=tuple(draw(st.sets(st.integers(1, max_batch_size), max_size=3))),
        padding_waste_max=draw(st.sampled_from([0.0, 0.1, 0.2, 0.35])),
        max_batch_bytes=draw(st.integers(2_000, 40_000)),  # (40, 40, 3) float32 is 19,200 bytes
        rare_shape_min_count=draw(st.integers(1, 3)),
        rare_shape_window_ms=draw(st.sampled_from([5.0, 50.0, 10_000.0])),
        fallback_max_batch_size=draw(st.integers(1, max_batch_size)),
        realtime=draw(class_settings(5)), standard=draw(class_settings(15)), bulk=draw(class_settings(30)),
        tenant_weights={"t1": draw(st.integers(1, 3))},
    )
    runner_buckets = tuple(draw(st.sets(st.integers(1, 16), max_size=3)))
    input_hw = draw(st.sampled_from([None, None, (8, 8)]))  # a model with a fixed input, now and then
    arrival = st.tuples(st.sampled_from(list(Priority)), st.sampled_from(TENANTS),
                        st.integers(0, len(SHAPES) - 1), st.integers(0, 40))
    ticks = draw(st.lists(st.lists(arrival, max_size=6), min_size=1, max_size=60))
    discard = draw(st.none() | st.tuples(st.integers(0, len(ticks) - 1), st.sampled_from(TENANTS)))
    return settings, runner_buckets, ticks, discard, input_hw


class Ledger:
    """What went in and what came out, checked as it happens."""

    def __init__(self, batcher: MicroBatcher, settings, input_hw: tuple[int, int] | None = None):
        self.batcher = batcher
        self.settings = settings
        self.input_hw = input_hw
        self.added: dict[str, tuple[Frame, int]] = {}  # frame_id -> (frame, arrival order)
        self.pending: dict[str, Frame] = {}
        self.out: Counter[str] = Counter()

    def add(self, frame: Frame) -> None:
        self.batcher.add(frame)
        self.added[frame.frame_id] = (frame, len(self.added))
        self.pending[frame.frame_id] = frame

    def wait_s(self, frame: Frame) -> float:
        return self.settings.for_class(frame.priority).max_wait_ms / 1000.0

    def expire_at(self, frame: Frame) -> float:
        age = self.settings.for_class(frame.priority).max_age_ms / 1000.0
        return frame.capture_ts_ms / 1000.0 + age if age > 0 else math.inf

    def released(self, frames) -> None:
        for f in frames:
            self.out[f.frame_id] += 1
            self.pending.pop(f.frame_id, None)

    def check_batch(self, batch: Batch, now: float) -> None:
        s = self.settings
        frames = batch.frames
        assert batch.size == len(frames) >= 1
        assert all(f.priority == batch.priority for f in frames)
        assert len({f.channels for f in frames}) == 1 and frames[0].channels == batch.shape[2]
        height, width, channels = batch.shape
        if self.input_hw is not None:
            # Every frame becomes the model's input: batched by it, whatever its own size, and never padded.
            assert (height, width) == self.input_hw and batch.padding_waste == 0.0 and batch.lane != "padded"
        else:
            assert all(f.height <= height and f.width <= width for f in frames)
            real = sum(f.height * f.width for f in frames)
            waste = (batch.size * height * width - real) / (batch.size * height * width)
            assert batch.padding_waste == waste or math.isclose(batch.padding_waste, waste, abs_tol=1e-12)
            assert batch.padding_waste <= s.padding_waste_max + 1e-12
            assert (batch.lane == "padded") == (len({f.shape for f in frames}) > 1)
        assert batch.size <= s.max_batch_size_for(batch.priority)
        tensor = batch.size * height * width * channels * s.tensor_dtype_bytes
        lone_oversized = batch.size == 1 and tensor > s.max_batch_bytes
        assert tensor <= s.max_batch_bytes or lone_oversized
        if lone_oversized:
            assert batch.lane == "fallback"
        if batch.lane == "fallback":
            assert batch.size <= s.fallback_max_batch_size
        if batch.reason != "flush":
            for f in frames:
                # Polled every tick: out within its wait plus one tick, and never once expired.
                assert now <= f.received_at + self.wait_s(f) + TICK + 1e-9, f"{f.frame_id} held too long"
                assert not self.expire_at(f) < now, f"{f.frame_id} batched after its deadline"
        self.released(frames)
        self.check_no_urgent_frame_behind(batch, now)

    def check_no_urgent_frame_behind(self, batch: Batch, now: float) -> None:
        """No frame of a more urgent class, due now and still pending, arrived before a frame of this batch."""
        newest = max(self.added[f.frame_id][1] for f in batch.frames)
        for r in self.pending.values():
            if (r.priority < batch.priority and r.received_at + self.wait_s(r) <= now
                    and not self.expire_at(r) < now):
                assert self.added[r.frame_id][1] > newest, (
                    f"{batch.priority.name} batch released ahead of due {r.priority.name} frame {r.frame_id}")

    def check_expired(self, frames: list[Frame], now: float) -> None:
        for f in frames:
            # Out at the first poll after its deadline (or after its arrival, if it came in already expired).
            assert self.expire_at(f) < now <= max(self.expire_at(f), f.received_at) + TICK + 1e-9
        self.released(frames)


def run_scenario(scenario) -> Ledger:
    settings, runner_buckets, ticks, discard, input_hw = scenario
    clock = FakeClock(T0)
    base = clock.now
    batcher = MicroBatcher(settings, clock, runner_buckets, input_hw=input_hw)
    ledger = Ledger(batcher, settings, input_hw)
    for i, arrivals in enumerate(ticks):
        clock.now = base + i * TICK
        for priority, tenant, shape, lag_ms in arrivals:
            ledger.add(make_frame(clock, tenant=tenant, priority=priority, shape=SHAPES[shape],
                                  captured_s_ago=lag_ms / 1000.0))
        due = batcher.next_due()
        expired = batcher.pop_expired()
        ledger.check_expired(expired, clock.now)
        released = 0
        while (batch := batcher.pop_batch()) is not None:
            ledger.check_batch(batch, clock.now)
            released += 1
        if due is None or due > clock.now:
            assert not expired and not released, "next_due() was later than something due"
        if discard is not None and discard[0] == i:
            ledger.released(batcher.discard(lambda f: f.tenant == discard[1]))
    clock.advance(TICK)
    for batch in batcher.flush():
        assert batch.reason == "flush"
        ledger.check_batch(batch, clock.now)
    ledger.check_expired(batcher.pop_expired(), clock.now)
    return ledger


@PROPERTY
@given(scenarios())
def test_every_frame_comes_out_exactly_once(scenario):
    ledger = run_scenario(scenario)

    assert ledger.out == Counter(list(ledger.added))
    assert ledger.batcher.pending_frames == 0 and ledger.batcher.pending_bytes == 0
    assert ledger.batcher.next_due() is None


@PROPERTY
@given(scenarios())
def test_batches_respect_caps_padding_waits_deadlines_and_class_order(scenario):
    # The checks run inside the ledger as each batch and expiry comes out.
    run_scenario(scenario)


@hyp_settings(max_examples=200, deadline=None)
@given(
    flood=st.integers(50, 400), small=st.integers(1, 40), batch_size=st.integers(2, 32),
    flood_weight=st.integers(1, 3), small_weight=st.integers(1, 3), order_seed=st.randoms(use_true_random=False),
)
def test_a_flooding_tenant_delays_a_small_one_by_at_most_its_drr_share(
        flood, small, batch_size, flood_weight, small_weight, order_seed):
    clock = FakeClock(T0)
    settings = make_settings(max_batch_size=batch_size, tenant_weights={"flood": flood_weight, "small": small_weight})
    batcher = MicroBatcher(settings, clock)
    tenants = ["flood"] * flood + ["small"] * small
    order_seed.shuffle(tenants)
    for tenant in tenants:
        batcher.add(make_frame(clock, tenant=tenant))
    clock.advance(1.0)
    batches = []
    while (batch := batcher.pop_batch()) is not None:
        batches.append(batch)

    last = max(i for i, b in enumerate(batches) if any(f.tenant == "small" for f in b.frames))
    total_weight = flood_weight + small_weight
    bound = (math.ceil(small / small_weight) + 1) * total_weight  # frames taken, from the module docstring
    assert (last + 1) <= math.ceil(bound / batch_size)
    assert sum(b.size for b in batches) == flood + small


@hyp_settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([REALTIME, STANDARD, BULK]), st.integers(0, 3)), min_size=1,
                max_size=80))
def test_realtime_is_never_behind_later_bulk_for_a_capacity_limited_consumer(arrivals):
    """One batch per tick, so due batches queue up and the class order is what decides."""
    settings = make_settings(max_batch_size=4, realtime=(2, 0, 1), standard=(4, 0, 4), bulk=(6, 0, 16))
    clock = FakeClock(T0)
    base = clock.now
    batcher = MicroBatcher(settings, clock)
    ledger = Ledger(batcher, settings)
    i = 0
    for i, (priority, count) in enumerate(arrivals):
        clock.now = base + i * TICK
        for _ in range(count):
            ledger.add(make_frame(clock, priority=priority))
        batch = batcher.pop_batch()
        if batch is not None:
            ledger.released(batch.frames)
            ledger.check_no_urgent_frame_behind(batch, clock.now)
    while batcher.pending_frames:
        i += 1
        clock.now = base + i * TICK
        batch = batcher.pop_batch()
        if batch is not None:
            ledger.released(batch.frames)
            ledger.check_no_urgent_frame_behind(batch, clock.now)
    assert ledger.out == Counter(list(ledger.added))
