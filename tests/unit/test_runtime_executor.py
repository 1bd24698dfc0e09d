"""InferenceExecutor: what the pipeline sees. Batches in, verdicts and per-frame failures out, never a raise
for a bad frame; preprocessing of the next batch overlaps inference of the current one."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))

import model_factories
from model_factories import DeviceProbe, StandInRunner, jpeg_frame, raw_frame

from tests.unit.replay_tolerance import replay_tolerance
from worker.config import BatchingSettings, ConfigError, ModelSettings, RuntimeSettings
from worker.devices.memory import MemoryPolicy
from worker.frames import DECODE_ERROR, MODEL_ERROR, NON_FINITE_OUTPUT, Priority
from worker.runtime import InferenceExecutor, build_builtin_model
from worker.runtime.deviceplan import DeviceMemory
from worker.runtime.models import ModelContract
from worker.runtime.normalise import Normaliser
from worker.runtime.runners import EagerRunner
from worker.runtime.start import build_executor
from worker.testing import wait_for

CPU = RuntimeSettings(device="cpu", warmup_batches=1, graph_batch_sizes=(1, 4))
WAIT_S = 30

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


@pytest.fixture
def executor_for():
    made: list[InferenceExecutor] = []

    def make(model: ModelSettings = ModelSettings(), runtime: RuntimeSettings = CPU,
             batching: BatchingSettings | None = None) -> InferenceExecutor:
        ex = build_executor(model, runtime, batching)
        made.append(ex)
        return ex

    yield make
    for ex in made:
        ex.close()


def _scores(outcome) -> dict[int, np.ndarray]:
    return {f.frame_index: np.array(list(v.scores.values())) for f, v in outcome.verdicts}


def _run(ex: InferenceExecutor, frames, shape):
    return ex.submit(frames, shape).result(timeout=WAIT_S)


# --- start-up ---

def test_from_settings_on_cpu_has_no_graph_buckets_and_describes_itself(executor_for):
    ex = executor_for()
    assert ex.preferred_batch_sizes == ()
    assert (ex.model_name, ex.model_version, ex.labels) == ("streamfer-moderation-cnn", "1", ModelSettings().labels)
    assert "cpu" in ex.device_description and "eager" in ex.device_description


def test_ready_only_after_warm_up(executor_for):
    ex = executor_for()
    assert not ex.ready
    ex.warm_up([(24, 24, 3)])
    assert ex.ready and ex.capture_count == 0


def test_fp16_on_cpu_is_refused_with_a_clear_error():
    with pytest.raises(ConfigError, match="fp16 autocast needs a CUDA device"):
        build_executor(ModelSettings(), RuntimeSettings(device="cpu", precision="fp16"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_device_without_a_gpu_is_refused():
    with pytest.raises(ConfigError, match="asks for a GPU but torch sees none"):
        build_executor(ModelSettings(), RuntimeSettings(device="cuda"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU fallback of auto")
def test_auto_device_picks_cpu_without_a_gpu(executor_for):
    ex = executor_for(runtime=RuntimeSettings(device="auto", warmup_batches=1))
    assert ex.runners[0].device.type == "cpu"


def test_torch_threads_setting_sets_torch_intra_op_threads(executor_for):
    before = torch.get_num_threads()
    try:
        executor_for(runtime=RuntimeSettings(device="cpu", torch_threads=1))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


# --- results ---

def test_batched_scores_equal_one_by_one_scores_for_an_exact_shape_batch(executor_for):
    ex = executor_for()
    frames = [raw_frame(i, 40, 56) for i in range(6)] + [jpeg_frame(10, 40, 56)]
    batched = _scores(_run(ex, frames, (40, 56, 3)))
    for frame in frames:
        alone = _scores(_run(ex, [frame], (40, 56, 3)))[frame.frame_index]
        np.testing.assert_allclose(batched[frame.frame_index], alone, rtol=1e-5, atol=1e-6)


def test_mixed_shapes_in_one_padded_batch_run_with_finite_scores(executor_for):
    """Padding changes a CNN's output for the padded frames (the pool averages over the padding), so only
    frames of the batch shape are compared with their one-by-one scores; padded ones must run and be finite."""
    ex = executor_for()
    frames = [raw_frame(0, 48, 48), raw_frame(1, 44, 48), raw_frame(2, 48, 40), raw_frame(3, 40, 44)]
    outcome = _run(ex, frames, (48, 48, 3))
    assert not outcome.failures and outcome.batch_size == 4
    assert [f.frame_index for f, _ in outcome.verdicts] == [0, 1, 2, 3]
    scores = _scores(outcome)
    assert all(np.isfinite(s).all() for s in scores.values())
    np.testing.assert_allclose(scores[0], _scores(_run(ex, [frames[0]], (48, 48, 3)))[0], rtol=1e-5, atol=1e-6)


def test_with_a_fixed_input_size_batched_equals_one_by_one_for_any_mix_of_shapes(executor_for):
    ex = executor_for(ModelSettings(input_size=(32, 32)))
    frames = [raw_frame(0, 48, 48), raw_frame(1, 20, 36), jpeg_frame(2, 40, 24)]
    batched = _scores(_run(ex, frames, (48, 48, 3)))
    for frame in frames:
        alone = _scores(_run(ex, [frame], frame.shape))[frame.frame_index]
        np.testing.assert_allclose(batched[frame.frame_index], alone, rtol=1e-5, atol=1e-6)


def test_outcome_reports_sizes_and_timings(executor_for):
    ex = executor_for()
    outcome = _run(ex, [raw_frame(i, 16, 16) for i in range(3)], (16, 16, 3))
    assert (outcome.batch_size, outcome.bucket, outcome.used_graph) == (3, 3, False)
    assert outcome.preprocess_ms >= 0 and outcome.inference_ms > 0 and outcome.started_at > 0


def test_on_cpu_an_outcome_carries_the_thread_cpu_of_its_work(executor_for):
    """What the batcher ranks sizes by on a CPU device: the preparation's and the inference's thread CPU, which
    no thread can spend faster than the wall clock, each thread at most its own elapsed time."""
    ex = executor_for()
    assert ex.batch_cost_by_cpu
    outcome = _run(ex, [raw_frame(i, 64, 64) for i in range(8)], (64, 64, 3))
    assert outcome.cpu_ms is not None and outcome.cpu_ms > 0
    threads = ex._preprocessor._workers + 2  # the decode pool, the preparing thread, the runner's thread
    assert outcome.cpu_ms <= (outcome.preprocess_ms + outcome.inference_ms) * threads + 1.0


def test_verdicts_apply_per_label_thresholds(executor_for):
    labels = ModelSettings().labels
    ex = executor_for(ModelSettings(thresholds={labels[0]: 0.0}, default_threshold=1.0))
    outcome = _run(ex, [raw_frame(0, 16, 16)], (16, 16, 3))
    assert outcome.verdicts[0][1].flagged_labels == (labels[0],)


def test_empty_batch_gives_an_empty_outcome(executor_for):
    outcome = _run(executor_for(), [], (16, 16, 3))
    assert (outcome.verdicts, outcome.failures, outcome.batch_size) == ([], [], 0)


# --- bad frames never raise ---

def test_undecodable_frames_become_failures_and_the_others_get_verdicts(executor_for):
    ex = executor_for()
    frames = [raw_frame(0, 16, 16), raw_frame(1, 16, 16, data=b"\0" * 7), jpeg_frame(2, 16, 16, data=b"junk"),
              jpeg_frame(3, 16, 16)]
    outcome = _run(ex, frames, (16, 16, 3))
    assert [f.frame_index for f, _ in outcome.verdicts] == [0, 3]
    assert [(f.frame.frame_index, f.error_type) for f in outcome.failures] == [(1, DECODE_ERROR), (2, DECODE_ERROR)]
    assert "7 bytes" in outcome.failures[0].reason
    assert outcome.batch_size == 2


def test_a_frame_the_model_raises_on_is_isolated_and_the_others_run(executor_for):
    ex = executor_for(ModelSettings(source="model_factories:poison_model"))
    frames = [raw_frame(i, 16, 16, marker=(i == 2)) for i in range(5)]
    outcome = _run(ex, frames, (16, 16, 3))
    assert [f.frame_index for f, _ in outcome.verdicts] == [0, 1, 3, 4]
    [failure] = outcome.failures
    assert (failure.frame.frame_index, failure.error_type) == (2, MODEL_ERROR)
    assert "poisoned input" in failure.reason
    # The retried frames score as they would have in the batch.
    clean = _scores(_run(ex, [f for f in frames if f.frame_index != 2], (16, 16, 3)))
    for index, scores in _scores(outcome).items():
        np.testing.assert_allclose(scores, clean[index], rtol=1e-5, atol=1e-6)


def test_a_frame_with_non_finite_scores_is_a_failure(executor_for):
    ex = executor_for(ModelSettings(source="model_factories:nan_model"))
    outcome = _run(ex, [raw_frame(0, 16, 16), raw_frame(1, 16, 16, marker=True)], (16, 16, 3))
    assert [f.frame_index for f, _ in outcome.verdicts] == [0]
    assert [(f.frame.frame_index, f.error_type) for f in outcome.failures] == [(1, NON_FINITE_OUTPUT)]


def test_every_batch_gives_its_host_buffer_back_once_run_including_retried_and_all_bad_ones(executor_for,
                                                                                             monkeypatch):
    ex = executor_for(ModelSettings(source="model_factories:poison_model"))
    buffers = ex._preprocessor.buffers
    given_back = []
    give_back = buffers.give_back
    monkeypatch.setattr(buffers, "give_back", lambda buf: given_back.append(buf) or give_back(buf))
    _run(ex, [raw_frame(0, 16, 16), raw_frame(1, 16, 16)], (16, 16, 3))
    _run(ex, [raw_frame(2, 16, 16, marker=True), raw_frame(3, 16, 16)], (16, 16, 3))  # retried one by one
    _run(ex, [raw_frame(4, 16, 16, data=b"")], (16, 16, 3))  # no decodable frame
    assert len(given_back) == 3
    assert buffers.take(2, (16, 16, 3)) is given_back[-1]  # reused, not reallocated


@pytest.fixture(scope="module")
def poison_executor():
    ex = build_executor(ModelSettings(source="model_factories:poison_model"), CPU)
    yield ex
    ex.close()


_KINDS = {
    "raw": lambda i: raw_frame(i, 16, 16),
    "smaller_raw": lambda i: raw_frame(i, 12, 10),
    "jpeg": lambda i: jpeg_frame(i, 16, 16),
    "short_raw": lambda i: raw_frame(i, 16, 16, data=b"\0" * 5),
    "corrupt_jpeg": lambda i: jpeg_frame(i, 16, 16, data=b"\xff\xd8junk"),
    "too_big": lambda i: raw_frame(i, 17, 16),
    "poisoned": lambda i: raw_frame(i, 16, 16, marker=True),
}


@settings(max_examples=30, deadline=None)
@given(kinds=st.lists(st.sampled_from(sorted(_KINDS)), max_size=8))
def test_every_frame_comes_back_exactly_once_as_a_verdict_or_a_failure(poison_executor, kinds):
    frames = [_KINDS[kind](i) for i, kind in enumerate(kinds)]
    outcome = _run(poison_executor, frames, (16, 16, 3))
    ran = [f.frame_index for f, _ in outcome.verdicts]
    failed = [f.frame.frame_index for f in outcome.failures]
    assert sorted(ran + failed) == list(range(len(frames)))
    assert ran == sorted(ran)  # verdicts keep batch order
    good = {"raw", "smaller_raw", "jpeg"}
    assert {i for i, kind in enumerate(kinds) if kind in good} == set(ran)


# --- pipelining ---

def test_preprocessing_of_the_next_batch_overlaps_inference_of_the_current(executor_for, monkeypatch):
    gate = model_factories.GATE
    ex = executor_for(ModelSettings(source="model_factories:gated_model"))
    prepared_b = threading.Event()
    prepare = ex._preprocessor.prepare

    def observed_prepare(frames, shape):
        batch = prepare(frames, shape)
        if frames and frames[0].frame_index >= 100:
            prepared_b.set()
        return batch

    monkeypatch.setattr(ex._preprocessor, "prepare", observed_prepare)
    gate.arm()
    try:
        future_a = ex.submit([raw_frame(i, 16, 16) for i in range(4)], (16, 16, 3))
        assert gate.entered.wait(WAIT_S), "inference of batch A never started"
        future_b = ex.submit([raw_frame(100 + i, 16, 16) for i in range(4)], (16, 16, 3))
        # Batch A's inference is held open by the gate; batch B must get preprocessed meanwhile.
        assert prepared_b.wait(WAIT_S), "batch B was not preprocessed while batch A was in inference"
        assert not future_a.done()
    finally:
        gate.release()
    assert future_a.result(WAIT_S).batch_size == 4
    assert future_b.result(WAIT_S).batch_size == 4


def test_batches_go_to_the_least_loaded_runner():
    """With several devices each has a runner; two CPU runners stand in for two GPUs here."""
    contract = ModelContract.from_settings(ModelSettings(source="model_factories:gated_model"))
    runners = [EagerRunner(model_factories.gated_model(), contract, torch.device("cpu")) for _ in range(2)]
    gate = model_factories.GATE
    with InferenceExecutor(runners, contract) as ex:
        gate.arm()
        try:
            first = ex.submit([raw_frame(i, 16, 16) for i in range(8)], (16, 16, 3))
            assert gate.entered.wait(WAIT_S)
            loads = [s.load for s in ex._slots]
            assert sorted(loads) == [0, 8]
            second = ex.submit([raw_frame(10, 16, 16)], (16, 16, 3))
            assert sorted(s.load for s in ex._slots) == [1, 8]
            # The idle runner takes the second batch and finishes it while the first is still held.
            assert second.result(WAIT_S).batch_size == 1
            assert not first.done()
        finally:
            gate.release()
        assert first.result(WAIT_S).batch_size == 8
        assert [s.load for s in ex._slots] == [0, 0]


def test_a_realtime_batch_submitted_while_bulk_batches_wait_for_the_runner_runs_next(executor_for):
    gate = model_factories.GATE
    ex = executor_for(ModelSettings(source="model_factories:gated_model"))
    finished: list[str] = []
    lock = threading.Lock()

    def submit(tag: str, priority: Priority, first: int):
        future = ex.submit([raw_frame(first + i, 16, 16) for i in range(2)], (16, 16, 3), priority)
        future.add_done_callback(lambda _f: (lock.acquire(), finished.append(tag), lock.release()))
        return future

    gate.arm()
    try:
        running = submit("bulk-a", Priority.BULK, 0)
        assert gate.entered.wait(WAIT_S), "the first bulk batch never started"
        waiting = [submit("bulk-b", Priority.BULK, 10), submit("bulk-c", Priority.BULK, 20)]
        realtime = submit("realtime", Priority.REALTIME, 30)
    finally:
        gate.release()
    for f in (running, *waiting, realtime):
        f.result(WAIT_S)
    assert finished == ["bulk-a", "realtime", "bulk-b", "bulk-c"]


def test_several_instances_per_device_each_get_a_runner(executor_for):
    ex = executor_for(runtime=RuntimeSettings(device="cpu", warmup_batches=1, instances_per_device=2))
    assert len(ex.runners) == 2 == ex.runner_count and ex.runners[0].module is not ex.runners[1].module
    assert _run(ex, [raw_frame(0, 16, 16)], (16, 16, 3)).batch_size == 1


def test_calibrate_times_each_batch_size_up_to_the_limit(executor_for):
    ex = executor_for()
    measured = ex.calibrate([(16, 16, 3)], max_batch_size=4, rounds=1)
    assert [(shape, n) for shape, n, _ in measured] == [((16, 16, 3), 1), ((16, 16, 3), 2), ((16, 16, 3), 4)]
    assert all(seconds > 0 for _, _, seconds in measured)


def test_profile_records_the_next_batches_with_stage_ranges(executor_for, tmp_path):
    ex = executor_for()
    trace = ex.profile(2, str(tmp_path))
    for i in range(3):
        _run(ex, [raw_frame(i, 16, 16)], (16, 16, 3))
    path = trace.result(WAIT_S)
    text = Path(path).read_text()
    assert "streamfer.preprocess" in text and "streamfer.inference[n=1]" in text


# --- several runners and devices (CPU runners standing in for GPUs or instances) ---

TINY = ModelContract.from_settings(ModelSettings(source="model_factories:tiny_model"))
SHAPE = (16, 16, 3)


def devices(count: int, frames_each: int = 4) -> tuple[list[StandInRunner], list[DeviceMemory]]:
    """`count` runners, each standing in for a device whose measured memory takes `frames_each` frames of SHAPE."""
    runners, memory = [], []
    for _ in range(count):
        probe = DeviceProbe(total=1000, base=200, per_frame=800 // frames_each)
        policy = MemoryPolicy(probe.total_bytes(), memory_fraction=1.0)
        policy.measure(probe, SHAPE, 1, lambda probe=probe: probe.ran(1))
        runners.append(StandInRunner(TINY, probe))
        memory.append(DeviceMemory(policy, probe))
    return runners, memory


def frames(first: int, count: int) -> list:
    return [raw_frame(first + i, 16, 16) for i in range(count)]


def test_three_runners_each_run_a_batch_at_once():
    runners = [StandInRunner(TINY) for _ in range(3)]
    with InferenceExecutor(runners, TINY) as ex:
        for r in runners:
            r.gate.clear()
        try:
            futures = [ex.submit(frames(10 * i, 2), SHAPE) for i in range(3)]
            wait_for(lambda: all(r.entered.is_set() for r in runners), WAIT_S, "every runner inside a batch")
        finally:
            for r in runners:
                r.gate.set()
        assert [f.result(WAIT_S).batch_size for f in futures] == [2, 2, 2]
        assert [r.sizes for r in runners] == [[2], [2], [2]]


def test_a_batch_over_one_devices_cap_is_split_across_devices_and_answered_in_frame_order():
    runners, memory = devices(3, frames_each=4)
    reference = InferenceExecutor([EagerRunner(model_factories.tiny_model(), TINY, torch.device("cpu"))], TINY)
    with InferenceExecutor(runners, TINY, memory=memory) as ex, reference:
        batch = frames(0, 10)
        outcome = ex.submit(batch, SHAPE).result(WAIT_S)
        assert [r.sizes for r in runners] == [[4], [3], [3]]  # even shares, each within its device's 4
        assert [f.frame_index for f, _ in outcome.verdicts] == list(range(10)) and not outcome.failures
        assert (outcome.batch_size, outcome.bucket) == (10, 10)
        whole = _scores(reference.submit(batch, SHAPE).result(WAIT_S))
        for index, scores in _scores(outcome).items():
            np.testing.assert_allclose(scores, whole[index], rtol=1e-5, atol=1e-6)
        assert ex.submit(frames(20, 4), SHAPE).result(WAIT_S).batch_size == 4
        assert [r.sizes for r in runners] == [[4, 4], [3], [3]]  # one device takes 4: not split


def test_the_batcher_sees_what_the_devices_take_together():
    runners, memory = devices(3, frames_each=4)
    with InferenceExecutor(runners, TINY, memory=memory) as ex:
        assert ex.memory_policy is not None and ex.memory_policy.max_batch(SHAPE, 64) == 12


def test_a_split_batch_goes_to_the_idle_devices_first():
    runners, memory = devices(3, frames_each=4)
    with InferenceExecutor(runners, TINY, memory=memory) as ex:
        runners[0].gate.clear()
        try:
            busy = ex.submit(frames(0, 2), SHAPE)
            assert runners[0].entered.wait(WAIT_S)
            split = ex.submit(frames(10, 6), SHAPE).result(WAIT_S)  # done while device 0 still holds its batch
            assert [f.frame_index for f, _ in split.verdicts] == list(range(10, 16))
            assert [r.sizes for r in runners] == [[2], [3], [3]] and not busy.done()
        finally:
            runners[0].gate.set()
        assert busy.result(WAIT_S).batch_size == 2


def test_a_device_failing_its_part_fails_only_that_parts_frames():
    runners, memory = devices(3, frames_each=4)
    runners[1].broken = True
    with InferenceExecutor(runners, TINY, memory=memory) as ex:
        outcome = ex.submit(frames(0, 10), SHAPE).result(WAIT_S)
    assert [f.frame_index for f, _ in outcome.verdicts] == [0, 1, 2, 3, 7, 8, 9]
    assert [(f.frame.frame_index, f.error_type) for f in outcome.failures] == [(i, MODEL_ERROR) for i in (4, 5, 6)]
    assert all("device lost" in f.reason for f in outcome.failures)


def test_a_part_whose_preparation_fails_comes_back_as_failures_beside_the_scored_parts(monkeypatch):
    runners, memory = devices(3, frames_each=4)
    with InferenceExecutor(runners, TINY, memory=memory) as ex:
        prepare = ex._prepare

        def staging_fails_on_the_third_device(batch_frames, shape, slot):
            if slot.runners[0] is runners[2]:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return prepare(batch_frames, shape, slot)

        monkeypatch.setattr(ex, "_prepare", staging_fails_on_the_third_device)
        outcome = ex.submit(frames(0, 10), SHAPE).result(WAIT_S)
        assert [s.load for s in ex._slots] == [0, 0, 0]
    assert [f.frame_index for f, _ in outcome.verdicts] == list(range(7))
    assert [f.frame.frame_index for f in outcome.failures] == [7, 8, 9]
    assert all(f.error_type == MODEL_ERROR and "split batch" in f.reason and "illegal memory access" in f.reason
               for f in outcome.failures)
    assert outcome.batch_size == 7


def test_calibration_measures_each_devices_memory_with_its_own_probe():
    probes = [DeviceProbe(total=10**9, base=1000, per_frame=10), DeviceProbe(total=10**9, base=5000, per_frame=70)]
    runners = [StandInRunner(TINY, p) for p in probes]
    memory = [DeviceMemory(MemoryPolicy(p.total_bytes()), p) for p in probes]
    with InferenceExecutor(runners, TINY, memory=memory) as ex:
        ex.calibrate([SHAPE], max_batch_size=4, rounds=1)
    for probe, device in zip(probes, memory):
        assert [device.policy.predict_peak(SHAPE, n) for n in (0, 1, 4)] == [
            probe.base, probe.base + probe.per_frame, probe.base + 4 * probe.per_frame]


def test_runners_given_one_device_memory_each_or_none():
    with pytest.raises(ValueError, match="one DeviceMemory per runner"):
        InferenceExecutor([StandInRunner(TINY), StandInRunner(TINY)], TINY, memory=devices(1)[1])


# --- lifecycle ---

def test_close_finishes_submitted_batches_and_refuses_new_ones():
    ex = build_executor(ModelSettings(), CPU)
    futures = [ex.submit([raw_frame(i, 16, 16)], (16, 16, 3)) for i in range(3)]
    ex.close()
    assert all(f.result(timeout=0).batch_size == 1 for f in futures)
    with pytest.raises(RuntimeError, match="closed"):
        ex.submit([raw_frame(9, 16, 16)], (16, 16, 3))
    ex.close()  # idempotent


def test_builtin_executor_scores_match_the_builtin_model(executor_for):
    ex = executor_for()
    frame = raw_frame(0, 24, 24)
    outcome = _run(ex, [frame], (24, 24, 3))
    batch = ex._preprocessor.prepare([frame], (24, 24, 3))
    x = Normaliser(ex.contract)(batch.pixels, batch.regions)
    with torch.inference_mode():
        expected = torch.sigmoid(build_builtin_model(5)(x))[0].numpy()
    np.testing.assert_allclose(_scores(outcome)[0], expected, rtol=1e-5, atol=1e-6)


# --- CUDA (GPU only) ---

@pytest.mark.cuda
@cuda_only
def test_on_cuda_warmed_shapes_replay_their_bucket_without_new_captures(executor_for):
    buckets = (1, 2, 4, 8)
    ex = executor_for(runtime=RuntimeSettings(device="cuda:0", warmup_batches=2, graph_batch_sizes=buckets))
    assert ex.preferred_batch_sizes == buckets
    ex.warm_up([(32, 32, 3)])
    captures = ex.capture_count
    assert captures == len(buckets)
    for i in range(40):
        n = 1 + i % 8
        outcome = _run(ex, [raw_frame(j, 32, 32) for j in range(n)], (32, 32, 3))
        assert outcome.used_graph and outcome.bucket == min(b for b in buckets if b >= n)
    assert ex.capture_count == captures


@pytest.mark.cuda
@cuda_only
def test_cuda_graph_scores_match_cpu_eager_scores(executor_for):
    gpu = executor_for(runtime=RuntimeSettings(device="cuda:0", warmup_batches=2, graph_batch_sizes=(4,)))
    gpu.warm_up([(32, 32, 3)])
    cpu = executor_for()
    frames = [raw_frame(i, 32, 32) for i in range(3)] + [raw_frame(3, 30, 28)]
    on_gpu, on_cpu = _scores(_run(gpu, frames, (32, 32, 3))), _scores(_run(cpu, frames, (32, 32, 3)))
    for index, scores in on_cpu.items():
        np.testing.assert_allclose(on_gpu[index], scores, **replay_tolerance(torch.device("cuda", 0)))


@pytest.mark.cuda
@cuda_only
def test_on_cuda_only_buckets_the_batcher_can_send_are_captured_and_peaks_are_keyed_by_the_model_input(
        executor_for):
    batching = BatchingSettings(max_batch_size=2)
    ex = executor_for(model=ModelSettings(input_size=(32, 32)), batching=batching,
                      runtime=RuntimeSettings(device="cuda:0", warmup_batches=1, graph_batch_sizes=(1, 2, 4, 8)))
    ex.warm_up([(48, 64, 3)])
    assert ex.capture_count == 2  # buckets 1 and 2: no batch of more than 2 frames comes
    ex.calibrate([(48, 64, 3)], max_batch_size=2, rounds=1)
    assert ex.memory_policy is not None
    assert ex.memory_policy.max_batch((32, 32, 3), 2) == 2  # what the device runs, as the batcher looks it up
    assert ex.memory_policy.policies[0].predict_peak((48, 64, 3), 1) is None
    assert ex.graph_evictions == 0 and ex.capture_count == 2



@pytest.mark.cuda
@cuda_only
def test_on_cuda_each_gpu_has_its_own_memory_policy_shared_by_its_instances(executor_for):
    ex = executor_for(runtime=RuntimeSettings(device="cuda", warmup_batches=1, graph_batch_sizes=(1, 2),
                                              instances_per_device=2))
    assert ex.memory_policy is not None and len(ex.memory_policy.policies) == torch.cuda.device_count()
    for policy, index in zip(ex.memory_policy.policies, range(torch.cuda.device_count())):
        on_device = [r for r in ex.runners if r.device == torch.device("cuda", index)]
        assert len(on_device) == 2 and all(r.plan.memory is policy for r in on_device)
        total = torch.cuda.get_device_properties(index).total_memory
        assert policy.limit_bytes == int(total * RuntimeSettings().memory_fraction) and policy.runners == 2
