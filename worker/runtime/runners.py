"""Execute a batch on one device: eagerly, or by replaying a CUDA graph captured for its (bucket, shape).

A runner takes the batch as uint8 NHWC pixels on its device and normalises them itself (`Normaliser`), inside
the captured graph where it has one, so the host never touches float32 and the copy to the device is small.

`GraphPlan` decides (which bucket, replay / capture now / run eager) and is pure; the runners execute.
A runner is used from one thread at a time (the executor gives each its own inference thread).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from worker.runtime.models import ModelContract, ModelContractError, apply_activation
from worker.runtime.preprocess import Normaliser

log = logging.getLogger(__name__)

PRECISION_DTYPES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}
# A shape without a graph is captured lazily the n-th time it is seen, so one-off shapes never pay a capture.
LAZY_CAPTURE_AFTER = 2
# PyTorch allows one CUDA graph capture at a time per process, so runners of several GPUs take turns.
_CAPTURE_LOCK = threading.Lock()

# On a CPU, first-call costs (allocations, oneDNN primitives) are paid per input shape whatever the batch size,
# so warm-up batches larger than this only cost start-up time (32 frames of a ResNet-50: seconds each).
CPU_WARMUP_BATCH_MAX = 2

Shape = tuple[int, int, int]  # one sample of the runner's input: uint8 pixels (H, W, C), whatever the model layout


@dataclass(frozen=True)
class RunResult:
    """Scores of the n real rows of a batch (float32, on the host) and how they were computed."""

    scores: np.ndarray
    bucket: int
    used_graph: bool


@dataclass(frozen=True)
class GraphStep:
    action: str  # "replay", "capture" (then replay) or "eager"
    bucket: int  # padded batch size executed; == n for eager


class GraphPlan:
    """Which CUDA graph serves a batch of n frames of a shape; counts shapes to capture recurring ones lazily."""

    def __init__(self, buckets: Sequence[int], capture_after: int = LAZY_CAPTURE_AFTER):
        if not buckets or min(buckets) < 1:
            raise ValueError("CUDA graph buckets must be a non-empty list of sizes >= 1")
        self.buckets = tuple(sorted(set(buckets)))
        self.capture_after = capture_after
        self._captured: set[tuple[int, Shape]] = set()
        self._failed: set[tuple[int, Shape]] = set()
        self._seen: Counter[tuple[int, Shape]] = Counter()

    def bucket_for(self, n: int) -> int | None:
        """The smallest bucket holding n frames; None when n exceeds the largest."""
        return next((b for b in self.buckets if b >= n), None)

    def decide(self, n: int, shape: Shape) -> GraphStep:
        bucket = self.bucket_for(n)
        if bucket is None:
            return GraphStep("eager", n)
        key = (bucket, shape)
        if key in self._captured:
            return GraphStep("replay", bucket)
        if key in self._failed:
            return GraphStep("eager", n)
        self._seen[key] += 1
        if self._seen[key] >= self.capture_after:
            return GraphStep("capture", bucket)
        return GraphStep("eager", n)

    def mark_captured(self, bucket: int, shape: Shape) -> None:
        self._captured.add((bucket, shape))

    def mark_failed(self, bucket: int, shape: Shape) -> None:
        self._failed.add((bucket, shape))

    def is_captured(self, bucket: int, shape: Shape) -> bool:
        return (bucket, shape) in self._captured


class EagerRunner:
    """Runs the model as is, under inference_mode and the configured autocast; on CUDA, on its own stream."""

    uses_graphs = False

    def __init__(self, module: Callable[[torch.Tensor], torch.Tensor], contract: ModelContract,
                 device: torch.device, precision: str = "fp32"):
        if precision not in PRECISION_DTYPES:
            raise ValueError(f"runtime.precision: {precision!r} is not one of {sorted(PRECISION_DTYPES)}")
        self.module = module
        self.contract = contract
        self.device = torch.device(device)
        self.precision = precision
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # Host->device copies of upcoming batches go on this stream, overlapping the current batch's compute.
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.capture_count = 0
        self.normaliser = Normaliser(contract, self.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Model + activation -> float32 scores on the device. The caller holds inference_mode."""
        dtype = PRECISION_DTYPES[self.precision]
        # cache_enabled=False: autocast's weight-cast cache must not outlive a CUDA graph capture.
        autocast = (torch.autocast(self.device.type, dtype=dtype, cache_enabled=False)
                    if dtype is not None else contextlib.nullcontext())
        with autocast:
            logits = self.module(x)
        return apply_activation(logits, self.contract.activation)

    def infer(self, pixels: torch.Tensor, regions: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 NHWC pixels (and padding regions) -> float32 scores on the device. The caller holds inference_mode."""
        return self.forward(self.normaliser(pixels, regions))

    def warm_up(self, shape: Shape, batches: int, batch_size: int) -> None:
        """Run `batches` passes so first-call costs (allocations, kernel selection) leave the hot path."""
        if self.device.type == "cpu":
            batch_size = max(1, min(batch_size, CPU_WARMUP_BATCH_MAX))
        with self._on_device():
            x = torch.zeros((batch_size, *shape), dtype=torch.uint8, device=self.device)
            for _ in range(batches):
                self.infer(x)
            self._sync()

    def run(self, pixels: torch.Tensor, ready: torch.cuda.Event | None = None,
            regions: torch.Tensor | None = None) -> RunResult:
        """Scores for every row of `pixels` ([n, H, W, C] uint8, already on this runner's device); `regions`
        ([n, 4] int32 top, left, height, width) marks padding, None when every row is all pixels."""
        with self._on_device():
            self._wait_for_input(ready, pixels, regions)
            scores = self.infer(pixels, regions)
            return RunResult(scores=scores.to("cpu").numpy(), bucket=pixels.shape[0], used_graph=False)

    @contextlib.contextmanager
    def _on_device(self):
        if self.stream is None:
            with torch.inference_mode():
                yield
        else:
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream), torch.inference_mode():
                yield

    def _wait_for_input(self, ready: torch.cuda.Event | None, *inputs: torch.Tensor | None) -> None:
        if self.stream is not None and ready is not None:
            self.stream.wait_event(ready)
            # The inputs were allocated on the copy stream; keep their memory alive until this stream is done.
            for x in inputs:
                if x is not None:
                    x.record_stream(self.stream)

    def _sync(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    static_in: torch.Tensor  # [bucket, H, W, C] uint8
    static_regions: torch.Tensor  # [bucket, 4] int32; padding rows get an empty region, so they normalise to 0
    full: torch.Tensor  # [bucket, 4] int32: every row all pixels
    static_out: torch.Tensor


class CudaGraphRunner(EagerRunner):
    """One CUDA graph per (bucket, input shape) on static buffers; a batch is padded to its bucket.

    Captured at warm-up for the configured shapes, and lazily for a shape that recurs; batches larger than
    the largest bucket, and shapes not (yet) captured, run eagerly. `capture_count` counts every capture.
    """

    uses_graphs = True

    def __init__(self, module: Callable[[torch.Tensor], torch.Tensor], contract: ModelContract,
                 device: torch.device, precision: str = "fp32", buckets: Sequence[int] = (1, 2, 4, 8, 16, 32),
                 warmup_batches: int = 8, capture_after: int = LAZY_CAPTURE_AFTER):
        if torch.device(device).type != "cuda":
            raise ValueError("CudaGraphRunner needs a CUDA device; use EagerRunner on cpu")
        super().__init__(module, contract, device, precision)
        self.plan = GraphPlan(buckets, capture_after)
        self.warmup_batches = warmup_batches
        self._graphs: dict[tuple[int, Shape], _Graph] = {}
        # Graphs share one memory pool: they are replayed one at a time on one stream, and each replay's
        # output is copied out before the next replay, so their intermediates may reuse the same memory.
        self._pool = torch.cuda.graph_pool_handle()
        self._side_stream = torch.cuda.Stream(self.device)
        # torch.cuda.graph's default capture stream belongs to whichever GPU was current when first used.
        self._capture_stream = torch.cuda.Stream(self.device)

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.plan.buckets

    def warm_up(self, shape: Shape, batches: int, batch_size: int = 0) -> None:
        """Capture a graph for every bucket of this shape (largest first, so smaller ones reuse its memory)."""
        for bucket in reversed(self.plan.buckets):
            if self.plan.is_captured(bucket, shape):
                continue
            try:
                self._capture(bucket, shape)
            except Exception as exc:
                raise ModelContractError(
                    f"the model cannot be captured in a CUDA graph for batch {bucket} x {list(shape)} "
                    f"({type(exc).__name__}: {exc}); remove data-dependent host syncs (.item(), .cpu(), "
                    "Python branches on tensor values) from forward, or set runtime.cuda_graphs = false"
                ) from exc

    def run(self, pixels: torch.Tensor, ready: torch.cuda.Event | None = None,
            regions: torch.Tensor | None = None) -> RunResult:
        n = pixels.shape[0]
        h, w, c = pixels.shape[1:]
        shape = (int(h), int(w), int(c))
        step = self.plan.decide(n, shape)
        if step.action == "capture" and not self._capture_lazily(step.bucket, shape):
            step = GraphStep("eager", n)
        if step.action == "eager":
            return super().run(pixels, ready, regions)
        graph = self._graphs[(step.bucket, shape)]
        with self._on_device():
            self._wait_for_input(ready, pixels, regions)
            graph.static_in[:n].copy_(pixels)
            graph.static_regions[:n].copy_(graph.full[:n] if regions is None else regions)
            if n < step.bucket:
                # Padding rows: an empty region normalises them to zeros (deterministic; rows never mix in eval).
                graph.static_regions[n:].zero_()
            graph.graph.replay()
            scores = graph.static_out[:n].to("cpu").numpy()
        return RunResult(scores=scores, bucket=step.bucket, used_graph=True)

    def _capture_lazily(self, bucket: int, shape: Shape) -> bool:
        try:
            self._capture(bucket, shape)
            log.info("cuda graph captured lazily device=%s bucket=%d shape=%s captures=%d",
                     self.device, bucket, list(shape), self.capture_count)
            return True
        except Exception as exc:  # noqa: BLE001 (reported to the caller)
            self.plan.mark_failed(bucket, shape)
            log.warning("cuda graph capture failed; running eager for this shape device=%s bucket=%d shape=%s "
                        "error=%s", self.device, bucket, list(shape), exc)
            return False

    def _capture(self, bucket: int, shape: Shape) -> None:
        with _CAPTURE_LOCK, torch.cuda.device(self.device), torch.inference_mode():
            static_in = torch.zeros((bucket, *shape), dtype=torch.uint8, device=self.device)
            full = torch.tensor([[0, 0, shape[0], shape[1]]] * bucket, dtype=torch.int32, device=self.device)
            static_regions = full.clone()
            # Warm-up on a side stream before capture, as the PyTorch CUDA-graph docs prescribe: lazy
            # initialisation (cuBLAS/cuDNN handles, autotuning) must not happen inside the capture.
            self._side_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._side_stream):
                for _ in range(max(1, self.warmup_batches)):
                    self.infer(static_in, static_regions)
            torch.cuda.current_stream(self.device).wait_stream(self._side_stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: preprocessing threads keep copying to the device while this thread captures.
            with torch.cuda.graph(graph, pool=self._pool, stream=self._capture_stream,
                                  capture_error_mode="thread_local"):
                static_out = self.infer(static_in, static_regions)
            self._graphs[(bucket, shape)] = _Graph(graph, static_in, static_regions, full, static_out)
            self.plan.mark_captured(bucket, shape)
            self.capture_count += 1


def make_runner(module: Callable[[torch.Tensor], torch.Tensor], contract: ModelContract, device: torch.device,
                precision: str, cuda_graphs: bool, buckets: Sequence[int], warmup_batches: int) -> EagerRunner:
    """CudaGraphRunner on CUDA with graphs enabled, else EagerRunner (the CPU path)."""
    if device.type == "cuda" and cuda_graphs:
        return CudaGraphRunner(module, contract, device, precision, buckets, warmup_batches)
    return EagerRunner(module, contract, device, precision)
