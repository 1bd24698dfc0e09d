"""The graph plan (pure policy), the eager runner on CPU, and the CUDA-graph runner where a GPU exists."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from worker.config import ModelSettings
from worker.runtime import build_builtin_model
from worker.runtime.models import ModelContract, apply_activation
from worker.runtime.preprocess import Normaliser
from worker.runtime.runners import CudaGraphRunner, EagerRunner, GraphPlan

CONTRACT = ModelContract.from_settings(ModelSettings())
SHAPE = (32, 48, 3)  # a runner's input: uint8 pixels, H x W x C

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def _batch(n: int, shape=SHAPE, device="cpu") -> torch.Tensor:
    return torch.randint(0, 256, (n, *shape), dtype=torch.uint8, generator=torch.Generator().manual_seed(n)).to(device)


def _reference(pixels: torch.Tensor, regions: torch.Tensor | None = None) -> torch.Tensor:
    with torch.inference_mode():
        x = Normaliser(CONTRACT, pixels.device)(pixels, regions)
        return apply_activation(build_builtin_model(5).to(pixels.device)(x), "sigmoid").cpu()


# --- GraphPlan ---

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
    plan.mark_captured(8, SHAPE)
    step = plan.decide(5, SHAPE)
    assert (step.action, step.bucket) == ("replay", 8)


def test_unseen_shape_runs_eager_first_and_is_captured_when_it_recurs():
    plan = GraphPlan((4,), capture_after=2)
    assert plan.decide(3, SHAPE).action == "eager"
    assert plan.decide(4, SHAPE).action == "capture"
    plan.mark_captured(4, SHAPE)
    assert plan.decide(2, SHAPE).action == "replay"


def test_shape_whose_capture_failed_stays_eager():
    plan = GraphPlan((4,), capture_after=1)
    assert plan.decide(3, SHAPE).action == "capture"
    plan.mark_failed(4, SHAPE)
    assert all(plan.decide(3, SHAPE).action == "eager" for _ in range(3))


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


# --- CudaGraphRunner (GPU only) ---

def _graph_runner(buckets=(1, 2, 4, 8), precision="fp32") -> CudaGraphRunner:
    device = torch.device("cuda", 0)
    return CudaGraphRunner(build_builtin_model(5).to(device), CONTRACT, device, precision, buckets, warmup_batches=2)


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
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.cuda
@cuda_only
def test_graph_replay_normalises_inside_the_graph_with_padding_regions_like_cpu_eager():
    runner = _graph_runner(buckets=(4,))
    runner.warm_up(SHAPE, batches=1)
    x, regions = _batch(3), torch.tensor([[0, 0, 32, 48], [0, 0, 10, 20], [4, 6, 24, 36]], dtype=torch.int32)
    replayed = runner.run(x.to(runner.device), regions=regions.to(runner.device))
    assert replayed.used_graph and replayed.bucket == 4
    torch.testing.assert_close(torch.from_numpy(replayed.scores), _reference(x, regions), rtol=1e-4, atol=1e-5)


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
    runner = _graph_runner(buckets=(4,), precision="fp16")
    runner.warm_up(SHAPE, batches=1)
    x = _batch(4, device=runner.device)
    torch.testing.assert_close(torch.from_numpy(runner.run(x).scores), _reference(x), atol=0.02, rtol=0.02)
