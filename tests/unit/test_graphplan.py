"""Which CUDA graphs a runner captures, replays, skips and releases (pure policy), driven by a fake memory probe
and a hand-made order of use; the CudaGraphRunner that executes it needs a GPU (tests/unit/test_runtime_runners.py)."""

from __future__ import annotations

import subprocess
import sys

from hypothesis import HealthCheck, given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st

from tests.unit.test_batching import FakeClock, make_frame, make_settings
from tests.unit.test_memorypolicy import FakeProbe
from worker.batching import MicroBatcher
from worker.devices.graphplan import BatchCaps, GraphPlan
from worker.devices.memory import MemoryPolicy

SHAPE = (32, 48, 3)  # a runner's input: uint8 pixels, H x W x C
HD = (1080, 1920, 3)
BUCKETS = (1, 2, 4, 8, 16, 32)
GIB = 1 << 30


def warm_up(plan: GraphPlan, probe: FakeProbe, shape=SHAPE, graph_bytes=lambda bucket: 10) -> list[int]:
    """What CudaGraphRunner.warm_up does, with the fake device: capture (measuring the peak) while the plan says,
    keep what the budget admits. The buckets kept, in capture order."""
    kept = []
    while (bucket := plan.next_warm_up(shape)) is not None:
        if plan.memory is not None:
            plan.memory.measure(probe, shape, bucket, lambda b=bucket: probe.run(b))
        if plan.admit_warm_up(bucket, shape, graph_bytes(bucket)):
            kept.append(bucket)
    return kept


def serve(plan: GraphPlan, n: int, shape=SHAPE, nbytes: int = 10):
    """What CudaGraphRunner.run does with a step: a capture is admitted (and may release others)."""
    step = plan.decide(n, shape)
    evicted = plan.admit(step.bucket, shape, nbytes) if step.action == "capture" else []
    return step, evicted


# --- buckets ---

@given(buckets=st.lists(st.integers(1, 64), min_size=1, max_size=6), n=st.integers(1, 100))
def test_bucket_is_the_smallest_that_holds_the_batch_or_none(buckets, n):
    bucket = GraphPlan(buckets).bucket_for(n)
    fitting = [b for b in buckets if b >= n]
    assert bucket == (min(fitting) if fitting else None)


def test_batch_larger_than_every_bucket_runs_eager():
    step = GraphPlan((1, 2, 4)).decide(5, SHAPE)
    assert (step.action, step.bucket) == ("eager", 5)


def test_captured_shape_replays_in_its_bucket():
    plan = GraphPlan((1, 2, 4, 8))
    plan.admit(8, SHAPE, 10)
    step = plan.decide(5, SHAPE)
    assert (step.action, step.bucket) == ("replay", 8)


def test_unseen_shape_runs_eager_first_and_is_captured_when_it_recurs():
    plan = GraphPlan((4,), capture_after=2)
    assert plan.decide(3, SHAPE).action == "eager"
    assert plan.decide(4, SHAPE).action == "capture"
    plan.admit(4, SHAPE, 10)
    assert plan.decide(2, SHAPE).action == "replay"


def test_shape_whose_capture_failed_stays_eager():
    plan = GraphPlan((4,), capture_after=1)
    assert plan.decide(3, SHAPE).action == "capture"
    plan.mark_failed(4, SHAPE)
    assert all(plan.decide(3, SHAPE).action == "eager" for _ in range(3))


# --- buckets the batcher can never send ---

def test_buckets_the_byte_cap_makes_unreachable_are_not_captured():
    # 256 MiB over a 1080p float32 row (24.9 MB): the batcher sends at most 10 frames, padded up to 16 at most.
    plan = GraphPlan(BUCKETS, caps=BatchCaps(max_batch_size=32, max_batch_bytes=256 << 20))
    assert plan.largest_batch(HD) == 10
    assert [b for b in BUCKETS if plan.worth_capturing(b, HD)] == [1, 2, 4, 8, 16]
    assert [b for b in BUCKETS if plan.worth_capturing(b, SHAPE)] == list(BUCKETS)  # small frames reach all


def test_buckets_above_max_batch_size_are_not_captured_but_the_one_it_pads_to_is():
    plan = GraphPlan(BUCKETS, caps=BatchCaps(max_batch_size=12))
    assert [b for b in BUCKETS if plan.worth_capturing(b, SHAPE)] == [1, 2, 4, 8, 16]
    plan = GraphPlan(BUCKETS, caps=BatchCaps(max_batch_size=8))
    assert [b for b in BUCKETS if plan.worth_capturing(b, SHAPE)] == [1, 2, 4, 8]


def test_buckets_over_the_memory_fraction_are_not_captured_not_even_to_pad():
    # 10 GiB device, 80%: 2 GiB of model + 0.25 GiB a frame fits 24 frames; a batch of 17..24 padded to 32 would
    # not fit, so it runs eager instead.
    probe = FakeProbe(total=10 * GIB, base=2 * GIB, per_frame=GIB // 4)
    memory = MemoryPolicy(probe.total_bytes(), memory_fraction=0.8)
    memory.measure(probe, SHAPE, 8, lambda: probe.run(8))
    plan = GraphPlan(BUCKETS, caps=BatchCaps(max_batch_size=64), memory=memory)

    assert plan.largest_batch(SHAPE) == 24
    assert [b for b in BUCKETS if plan.worth_capturing(b, SHAPE)] == [1, 2, 4, 8, 16]


def test_the_bucket_the_byte_cap_pads_to_is_captured_when_it_fits_memory():
    probe = FakeProbe(total=100 * GIB, base=2 * GIB, per_frame=GIB // 4)
    memory = MemoryPolicy(probe.total_bytes(), memory_fraction=0.8)
    memory.measure(probe, HD, 4, lambda: probe.run(4))
    plan = GraphPlan(BUCKETS, caps=BatchCaps(max_batch_size=32, max_batch_bytes=256 << 20), memory=memory)

    assert [b for b in BUCKETS if plan.worth_capturing(b, HD)] == [1, 2, 4, 8, 16]


def test_a_shape_never_measured_and_no_caps_captures_every_bucket():
    plan = GraphPlan(BUCKETS, memory=MemoryPolicy(10 * GIB))
    assert plan.largest_batch(SHAPE) is None
    assert all(plan.worth_capturing(b, SHAPE) for b in BUCKETS)


def test_a_batch_reaching_a_bucket_not_worth_capturing_runs_eager_and_says_so_once():
    plan = GraphPlan(BUCKETS, capture_after=1, caps=BatchCaps(max_batch_size=8))
    steps = [plan.decide(20, SHAPE) for _ in range(3)]
    assert [(s.action, s.bucket, s.skipped) for s in steps] == [("eager", 20, True), ("eager", 20, False),
                                                                ("eager", 20, False)]
    assert plan.decide(8, SHAPE).action == "capture"


# Close shapes (8x8 beside 8x6 and 8x7, padded together), one measured larger, one far, one grey.
ARRIVING = st.sampled_from([(8, 8, 3), (8, 6, 3), (8, 7, 3), (16, 16, 3), (30, 30, 3), (8, 8, 1)])


@hyp_settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(max_batch_size=st.integers(1, 40), max_batch_bytes=st.integers(1_000, 60_000),
       per_frame=st.integers(1, 1_000), resident=st.integers(0, 2_000), tick_s=st.sampled_from([0.001, 0.004, 0.02]),
       arrivals=st.lists(st.lists(ARRIVING, min_size=1, max_size=12), min_size=3, max_size=30))
def test_no_batch_the_batcher_releases_is_larger_than_the_plans_largest_or_pads_to_a_skipped_bucket_that_fits(
        max_batch_size, max_batch_bytes, per_frame, resident, tick_s, arrivals):
    """Cross-check against the real MicroBatcher (exact, padded and fallback lanes, deadlines, flush): the plan's
    bound is the batcher's, and a bucket is skipped only where padding to it would exceed memory_fraction."""
    settings = make_settings(max_batch_size=max_batch_size, max_batch_bytes=max_batch_bytes, padding_waste_max=0.35,
                             rare_shape_min_count=2)
    memory = MemoryPolicy(total_bytes=10_000, memory_fraction=0.5)
    for shape in ((8, 8, 3), (16, 16, 3)):
        memory.record_peak(shape, 1, resident + per_frame)
        memory.record_peak(shape, 4, resident + 4 * per_frame)
    plan = GraphPlan(BUCKETS, caps=BatchCaps.from_settings(settings), memory=memory)
    clock = FakeClock()
    batcher = MicroBatcher(settings, clock, BUCKETS, memory=memory)
    batches = []
    for shapes in arrivals:
        for shape in shapes:
            batcher.add(make_frame(clock, shape=shape))
        clock.advance(tick_s)
        while (batch := batcher.pop_batch()) is not None:
            batches.append(batch)
    batches += batcher.flush()

    for batch in batches:
        limit = plan.largest_batch(batch.shape)
        assert limit is not None and batch.size <= limit
        bucket = plan.bucket_for(batch.size)
        if bucket is not None and not plan.worth_capturing(bucket, batch.shape):
            assert memory.predict_peak(batch.shape, bucket) > memory.limit_bytes


def test_the_plans_largest_batch_is_the_batchers_cap():
    settings = make_settings(max_batch_size=32, max_batch_bytes=10 * 30 * 30 * 3 * 4)
    plan = GraphPlan(BUCKETS, caps=BatchCaps.from_settings(settings))
    clock = FakeClock()
    batcher = MicroBatcher(settings, clock)  # no preferred sizes: a group is released full at its cap
    for _ in range(25):
        batcher.add(make_frame(clock, shape=(30, 30, 3)))

    assert [b.size for b in batcher.flush()] == [10, 10, 5] and plan.largest_batch((30, 30, 3)) == 10
    assert plan.worth_capturing(16, (30, 30, 3)) and not plan.worth_capturing(32, (30, 30, 3))


def test_the_plans_caps_are_the_largest_batch_any_class_sends():
    settings = make_settings(max_batch_size=8, realtime=(5, 0, 8, 0, 1.0, 4), bulk=(100, 0, 1, 0, 0.25, 32))
    plan = GraphPlan(BUCKETS, caps=BatchCaps.from_settings(settings))

    assert plan.largest_batch((30, 30, 3)) == 32  # a runner runs every class's batches: bulk's 32 reach it
    assert plan.worth_capturing(32, (30, 30, 3))


# --- warm-up: smallest first, measured as it goes ---

def test_warm_up_captures_smallest_first_and_stops_where_the_measured_peaks_say_memory_ends():
    # 2 GiB model + 1 GiB a frame on a 10 GiB device at 80%: 6 frames fit, so 8 (to pad 5..6) does not.
    probe = FakeProbe(total=10 * GIB, base=2 * GIB, per_frame=GIB)
    memory = MemoryPolicy(probe.total_bytes(), memory_fraction=0.8)
    plan = GraphPlan(BUCKETS, memory=memory)

    assert warm_up(plan, probe) == [1, 2, 4]
    assert memory.max_batch(SHAPE, 32) == 6
    assert memory.predict_peak(SHAPE, 4) == 6 * GIB  # measured while capturing bucket 4


def test_a_model_taking_half_the_device_still_warms_up_more_than_one_bucket():
    # One measured size predicts the next from the model's own size (the 0-frame point), not through zero.
    probe = FakeProbe(total=10 * GIB, base=5 * GIB, per_frame=GIB // 16)
    plan = GraphPlan(BUCKETS, memory=MemoryPolicy(probe.total_bytes(), memory_fraction=0.8))

    assert warm_up(plan, probe) == [1, 2, 4, 8, 16, 32]


def test_warm_up_stops_at_the_graph_budget_and_releases_nothing():
    probe = FakeProbe(total=10 * GIB, base=0, per_frame=1)
    plan = GraphPlan(BUCKETS, memory=MemoryPolicy(probe.total_bytes()), budget_bytes=35)

    assert warm_up(plan, probe, graph_bytes=lambda bucket: 10) == [1, 2, 4]
    assert plan.evictions == 0 and plan.budget.used_bytes == 30
    assert plan.next_warm_up(SHAPE) is None
    # The buckets past the budget are captured lazily if batches need them; that one releases the oldest.
    assert serve(plan, 16)[0].action == "eager"
    step, evicted = serve(plan, 16)
    assert (step.action, evicted) == ("capture", [(1, SHAPE)])


# --- the graph budget: least recently used out ---

def test_captured_graphs_stay_under_the_budget_least_recently_replayed_out_first():
    plan = GraphPlan(BUCKETS, capture_after=1, budget_bytes=30)
    for n in (1, 2, 4):
        assert serve(plan, n)[1] == []
    serve(plan, 1)  # replayed: bucket 2 is now the least recently used
    step, evicted = serve(plan, 8)

    assert step.action == "capture" and evicted == [(2, SHAPE)]
    assert list(plan.budget.graphs) == [(4, SHAPE), (1, SHAPE), (8, SHAPE)] and plan.budget.used_bytes == 30
    assert plan.evictions == 1


def test_a_released_graph_is_forgotten_and_captured_again_when_it_recurs():
    plan = GraphPlan(BUCKETS, capture_after=2, budget_bytes=10)
    for _ in range(2):
        serve(plan, 1)
    serve(plan, 2)
    assert serve(plan, 2)[1] == [(1, SHAPE)]

    assert not plan.is_captured(1, SHAPE)
    assert [serve(plan, 1)[0].action for _ in range(2)] == ["eager", "capture"]  # the lazy rule again
    assert plan.is_captured(1, SHAPE) and not plan.is_captured(2, SHAPE) and plan.evictions == 2


def test_no_budget_releases_nothing():
    plan = GraphPlan(BUCKETS, capture_after=1)
    assert all(serve(plan, b, nbytes=1 << 40)[1] == [] for b in BUCKETS)
    assert plan.evictions == 0


def test_the_graph_plan_imports_neither_kafka_nor_torch():
    code = "import sys, worker.devices.graphplan; print(any(m in sys.modules for m in ('confluent_kafka', 'torch')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
