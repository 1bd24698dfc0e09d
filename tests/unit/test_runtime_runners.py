"""The eager runner on CPU, and the CUDA-graph runner where a GPU exists (its plan: tests/unit/test_graphplan.py)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from torch import nn

from tests.unit.replay_tolerance import HEADROOM, TF32_UNIT_ROUNDOFF, replay_tolerance
from worker.config import ModelSettings
from worker.devices.graphplan import BatchCaps, GraphPlan
from worker.devices.memory import MemoryPolicy
from worker.runtime import build_builtin_model
from worker.runtime.capturegate import CaptureGate
from worker.runtime.hostsync import ServingState
from worker.runtime.models import ModelContract, apply_activation
from worker.runtime.normalise import Normaliser
from worker.runtime.runners import CudaGraphRunner, EagerRunner, ScoresToHost, _return_memory, blocking_event

CONTRACT = ModelContract.from_settings(ModelSettings())
SHAPE = (32, 48, 3)  # a runner's input: uint8 pixels, H x W x C

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def _batch(n: int, shape=SHAPE, device="cpu") -> torch.Tensor:
    return torch.randint(0, 256, (n, *shape), dtype=torch.uint8, generator=torch.Generator().manual_seed(n)).to(device)


def _reference(pixels: torch.Tensor, regions: torch.Tensor | None = None) -> torch.Tensor:
    with torch.inference_mode():
        x = Normaliser(CONTRACT, pixels.device)(pixels, regions)
        return apply_activation(build_builtin_model(5).to(pixels.device)(x), "sigmoid").cpu()


# --- EagerRunner (the CPU path) ---

def test_eager_runner_scores_equal_the_model_with_its_activation():
    runner = EagerRunner(build_builtin_model(5), CONTRACT, torch.device("cpu"))
    x = _batch(4)
    result = runner.run(x)
    assert (result.bucket, result.used_graph) == (4, False)
    torch.testing.assert_close(torch.from_numpy(result.scores), _reference(x))


def test_eager_runner_normalises_uint8_pixels_itself_with_padding_zeroed():
    runner = EagerRunner(build_builtin_model(5), CONTRACT, torch.device("cpu"))
    x, regions = _batch(3), torch.tensor([[0, 0, 32, 48], [0, 0, 10, 20], [4, 6, 24, 36]], dtype=torch.int32)
    scores = torch.from_numpy(runner.run(x, regions=regions).scores)
    torch.testing.assert_close(scores, _reference(x, regions))
    # The padding's old pixels do not reach the model: only the region's do.
    x[1, 10:] = 255
    torch.testing.assert_close(torch.from_numpy(runner.run(x, regions=regions).scores), scores)


def test_eager_runner_runs_under_inference_mode():
    seen = []

    def model(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.is_inference_mode_enabled())
        return x.flatten(1)[:, :5]

    EagerRunner(model, CONTRACT, torch.device("cpu")).run(_batch(2))
    assert seen == [True]


def test_bf16_autocast_on_cpu_runs_close_to_fp32():
    runner = EagerRunner(build_builtin_model(5), CONTRACT, torch.device("cpu"), precision="bf16")
    x = _batch(3)
    scores = torch.from_numpy(runner.run(x).scores)
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores, _reference(x), atol=0.05, rtol=0.05)


def test_graph_runner_refuses_a_cpu_device():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        CudaGraphRunner(build_builtin_model(5), CONTRACT, torch.device("cpu"))


def _tf32(t: torch.Tensor) -> torch.Tensor:
    """fp32 cut to TF32's 10 mantissa bits, truncating (the larger error of the two ways a GPU may round)."""
    return (t.contiguous().view(torch.int32) & ~((1 << 13) - 1)).view(torch.float32).view_as(t)


def test_the_replay_tolerance_covers_tf32_and_not_a_region_one_row_off():
    """tests/unit/replay_tolerance.py's reasoning, on this CPU: the builtin model with every convolution's and linear
    layer's input and weight cut to TF32 stays within the tolerance a TF32 GPU gets; a region one row off does not."""
    atol = HEADROOM * TF32_UNIT_ROUNDOFF
    exact, emulated = build_builtin_model(5), build_builtin_model(5)
    for layer in emulated.modules():
        if isinstance(layer, (nn.Conv2d, nn.Linear)):
            layer.weight.data = _tf32(layer.weight.data)
            layer.register_forward_pre_hook(lambda _, args: (_tf32(args[0]),))
    regions = torch.tensor([[0, 0, 32, 48], [0, 0, 10, 20], [4, 6, 24, 36], *[[0, 0, 32, 48]] * 5], dtype=torch.int32)
    one_row_off = regions.clone()
    one_row_off[1:3, 2] += 1
    tf32_error, region_error = 0.0, 1.0
    with torch.inference_mode():
        for seed in range(1, 9):
            x = _batch(8, SHAPE) if seed == 8 else torch.randint(
                0, 256, (8, *SHAPE), dtype=torch.uint8, generator=torch.Generator().manual_seed(100 + seed))
            want = torch.sigmoid(exact(Normaliser(CONTRACT)(x, regions)))
            tf32_error = max(tf32_error, (torch.sigmoid(emulated(Normaliser(CONTRACT)(x, regions))) - want).abs().max())
            off = torch.sigmoid(exact(Normaliser(CONTRACT)(x, one_row_off)))
            region_error = min(region_error, (off - want)[1:3].abs().amax(dim=1).min())
    assert 0 < tf32_error <= atol / 1.5, tf32_error
    assert region_error > atol, region_error


# --- CudaGraphRunner (GPU only) ---

def _graph_runner(buckets=(1, 2, 4, 8), precision="fp32", **kw) -> CudaGraphRunner:
    device = torch.device("cuda", 0)
    return CudaGraphRunner(build_builtin_model(5).to(device), CONTRACT, device, precision, buckets, warmup_batches=2,
                           **kw)


@pytest.mark.cuda
@cuda_only
def test_graph_replay_equals_eager_for_every_bucket_and_padded_size():
    runner = _graph_runner()
    eager = EagerRunner(runner.module, CONTRACT, runner.device)
    runner.warm_up(SHAPE, batches=2)
    for n in range(1, 9):  # exact bucket sizes and sizes padded up to the next bucket
        x = _batch(n, device=runner.device)
        replayed, reference = runner.run(x), eager.run(x)
        assert replayed.used_graph and replayed.bucket == runner.plan.bucket_for(n)
        torch.testing.assert_close(torch.from_numpy(replayed.scores), torch.from_numpy(reference.scores),
                                   **replay_tolerance(runner.device))


@pytest.mark.cuda
@cuda_only
def test_graph_replay_normalises_inside_the_graph_with_padding_regions_like_cpu_eager():
    runner = _graph_runner(buckets=(4,))
    runner.warm_up(SHAPE, batches=1)
    x, regions = _batch(3), torch.tensor([[0, 0, 32, 48], [0, 0, 10, 20], [4, 6, 24, 36]], dtype=torch.int32)
    replayed = runner.run(x.to(runner.device), regions=regions.to(runner.device))
    assert replayed.used_graph and replayed.bucket == 4
    torch.testing.assert_close(torch.from_numpy(replayed.scores), _reference(x, regions),
                               **replay_tolerance(runner.device))


@pytest.mark.cuda
@cuda_only
def test_no_capture_on_the_hot_path_after_warm_up():
    runner = _graph_runner()
    runner.warm_up(SHAPE, batches=2)
    captures = runner.capture_count
    assert captures == len(runner.buckets)
    for i in range(200):
        runner.run(_batch(1 + i % 8, device=runner.device))
    assert runner.capture_count == captures


@pytest.mark.cuda
@cuda_only
def test_new_shape_runs_eager_once_then_is_captured_lazily():
    runner = _graph_runner(buckets=(4,))
    other = (40, 40, 3)
    first = runner.run(_batch(3, other, runner.device))
    second = runner.run(_batch(3, other, runner.device))
    third = runner.run(_batch(3, other, runner.device))
    assert (first.used_graph, second.used_graph, third.used_graph) == (False, True, True)
    assert runner.capture_count == 1


@pytest.mark.cuda
@cuda_only
def test_batch_larger_than_the_largest_bucket_runs_eager_on_the_gpu():
    runner = _graph_runner(buckets=(1, 2))
    runner.warm_up(SHAPE, batches=1)
    result = runner.run(_batch(5, device=runner.device))
    assert (result.used_graph, result.bucket, result.scores.shape) == (False, 5, (5, 5))


@pytest.mark.cuda
@cuda_only
def test_fp16_graph_replay_is_close_to_fp32_eager():
    """fp16 against fp32 on purpose: a precision bound, not replay_tolerance's rounding of one precision."""
    runner = _graph_runner(buckets=(4,), precision="fp16")
    runner.warm_up(SHAPE, batches=1)
    x = _batch(4, device=runner.device)
    torch.testing.assert_close(torch.from_numpy(runner.run(x).scores), _reference(x), atol=0.02, rtol=0.02)


@pytest.mark.cuda
@cuda_only
def test_buckets_above_the_largest_batch_are_not_captured_and_such_a_batch_runs_eager(caplog):
    runner = _graph_runner(caps=BatchCaps(max_batch_size=2))
    runner.warm_up(SHAPE, batches=1)
    assert [b for b in runner.buckets if runner.plan.is_captured(b, SHAPE)] == [1, 2]
    with caplog.at_level("INFO", logger="worker.runtime.runners"):
        results = [runner.run(_batch(3, device=runner.device)) for _ in range(3)]
    assert [(r.used_graph, r.bucket) for r in results] == [(False, 3)] * 3
    assert runner.capture_count == 2
    assert sum("bucket not captured" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.cuda
@cuda_only
def test_each_capture_records_its_buckets_peak_memory_and_its_graphs_bytes():
    device = torch.device("cuda", 0)
    memory = MemoryPolicy(torch.cuda.get_device_properties(device).total_memory)
    runner = _graph_runner(memory=memory)
    runner.warm_up(SHAPE, batches=1)
    assert all((memory.predict_peak(SHAPE, b) or 0) > 0 for b in (0, *runner.buckets))
    assert memory.predict_peak(SHAPE, 8) >= memory.predict_peak(SHAPE, 1)
    # Each graph's bytes: its static inputs (uint8 rows, int32 regions twice) and the pool its capture grew.
    static = {b: b * (SHAPE[0] * SHAPE[1] * SHAPE[2] + 2 * 4 * 4) for b in runner.buckets}
    graphs = {b: n for (b, _), n in runner.plan.budget.graphs.items()}
    assert sorted(graphs) == list(runner.buckets) and all(graphs[b] > static[b] for b in graphs)
    assert runner.plan.budget.used_bytes == sum(graphs.values())


@pytest.mark.cuda
@cuda_only
def test_graphs_past_the_budget_are_released_least_recently_used_and_their_memory_goes_back():
    runner = _graph_runner(capture_after=1, graph_budget_bytes=1)
    eager = EagerRunner(runner.module, CONTRACT, runner.device)
    runner.warm_up(SHAPE, batches=1)  # no graph fits a 1-byte budget beside another: none kept at warm-up
    assert runner.capture_count == 1 and not runner.plan.budget.graphs
    reserved = []
    for i in range(12):  # buckets 1 and 4 alternately: each capture releases the other
        x = _batch(1 if i % 2 == 0 else 4, device=runner.device)
        result = runner.run(x)
        assert result.used_graph
        torch.testing.assert_close(torch.from_numpy(result.scores), torch.from_numpy(eager.run(x).scores),
                                   **replay_tolerance(runner.device))
        reserved.append(torch.cuda.memory_reserved(runner.device))
    assert runner.graph_evictions == 11 and len(runner.plan.budget.graphs) == 1
    # Released graphs give their pools back: twelve captures hold no more than the first two did.
    assert max(reserved[2:]) <= reserved[1] + (2 << 20)



# --- scores to the host: pinned memory and a blocking event (issue 45, item 4) ---

class FakeEvent:
    def __init__(self, calls: list[str], **kwargs: object) -> None:
        self.calls, self.kwargs = calls, kwargs
        calls.append(f"event made {kwargs}")

    def record(self, stream: object) -> None:
        self.calls.append(f"recorded on {stream}")

    def synchronize(self) -> None:
        self.calls.append("host waits")


def test_the_runners_event_sleeps_rather_than_spins(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: FakeEvent(calls, **kw))
    blocking_event()
    assert calls == ["event made {'blocking': True}"]


def test_scores_are_copied_without_blocking_then_waited_for_on_one_reused_blocking_event(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: FakeEvent(calls, **kw))
    copies: list[bool] = []
    real_copy = torch.Tensor.copy_

    def copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        copies.append(non_blocking)
        calls.append("copy queued")
        return real_copy(self, src, non_blocking=non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    to_host = ScoresToHost("stream", pin_memory=False)  # pinned memory needs CUDA; the rest is the same
    scores = torch.rand(4, 5)
    first, second = to_host(scores), to_host(scores * 2)
    assert calls == ["copy queued", "event made {'blocking': True}", "recorded on stream", "host waits",
                     "copy queued", "recorded on stream", "host waits"]
    assert copies == [True, True]
    torch.testing.assert_close(torch.from_numpy(first), scores)
    torch.testing.assert_close(torch.from_numpy(second), scores * 2)
    assert first.base is None  # its own memory: the pinned block goes back at once


def test_on_a_cpu_scores_are_copied_off_the_device_tensor():
    scores = torch.rand(3, 2)
    out = ScoresToHost(None)(scores)
    assert out.dtype == np.float32 and not np.shares_memory(out, scores.numpy())
    np.testing.assert_array_equal(out, scores.numpy())


class _InputView(nn.Module):
    """A model whose scores are a view of its input: of the Normaliser's buffer, reused by the next batch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, 0, 0, :5]


def test_a_batchs_scores_survive_the_next_batch_that_reuses_the_cpu_runners_input_buffer():
    contract = ModelContract.from_settings(ModelSettings(activation="none"))
    runner = EagerRunner(_InputView(), contract, torch.device("cpu"))
    first_pixels, second_pixels = _batch(4), torch.full((4, *SHAPE), 255, dtype=torch.uint8)
    first = runner.run(first_pixels).scores
    kept = first.copy()
    second = runner.run(second_pixels).scores
    np.testing.assert_array_equal(first, kept)
    assert not np.array_equal(first, second)
    with torch.inference_mode():
        expected = Normaliser(contract)(first_pixels)[:, 0, 0, :5].numpy()
    np.testing.assert_array_equal(first, expected)


# --- after a failed capture, eager for good (issue 45, item 3); CudaGraphRunner's logic without a GPU ---

def _graph_runner_without_a_gpu(gate: CaptureGate, capture) -> CudaGraphRunner:
    """The runner's lazy-capture logic on its own: its plan, its gate and a capture that uses a stand-in graph."""
    runner = object.__new__(CudaGraphRunner)
    runner.device = torch.device("cuda", 0)
    runner.plan = GraphPlan((1, 2, 4, 8), capture_after=1)
    runner._captures = gate
    runner._graphs = {}
    runner._capture = capture
    return runner


def test_after_a_failed_capture_no_runner_captures_again_and_memory_is_not_emptied(monkeypatch, caplog):
    from tests.unit.test_runtime_capturegate import FailingGraph

    gate, tried = CaptureGate(), []

    def capture(bucket: int, shape: tuple[int, int, int]):
        tried.append((bucket, shape))
        with gate.capturing(), gate.graph(f"bucket={bucket} shape={list(shape)}"):
            FailingGraph().capture()

    first, second = _graph_runner_without_a_gpu(gate, capture), _graph_runner_without_a_gpu(gate, capture)
    assert first._capture_lazily(8, SHAPE) is False
    assert second._capture_lazily(4, (64, 64, 3)) is False
    assert first._capture_lazily(2, SHAPE) is False
    assert tried == [(8, SHAPE)]  # one capture tried in the process, then none
    assert second.plan.decide(4, (64, 64, 3)).action == "eager"
    assert [r.levelname for r in caplog.records if "capture" in r.getMessage()] == ["ERROR"]
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    _return_memory(torch.device("cuda", 0), gate)
    assert emptied == []


def test_a_released_graphs_memory_is_emptied_while_captures_go_on(monkeypatch):
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    _return_memory(torch.device("cuda", 0), CaptureGate())
    assert emptied == [True]


# --- the host-sync check's process-wide mode, before any runner serves (issue 45, item 7) ---

def test_a_runner_says_it_serves_from_its_first_batch(monkeypatch):
    state = ServingState()
    monkeypatch.setattr("worker.runtime.runners.SERVING", state)
    runner = EagerRunner(build_builtin_model(5), CONTRACT, torch.device("cpu"))
    assert not state.began
    runner.run(_batch(1))
    assert state.began
