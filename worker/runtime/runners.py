"""Execute a batch on one device: eagerly, or by replaying a CUDA graph captured for its (bucket, shape).

A runner takes the batch as uint8 NHWC pixels on its device and normalises them itself (`Normaliser`), inside
the captured graph where it has one, so the host never touches float32 and the copy to the device is small.

`worker.devices.graphplan.GraphPlan` decides (which bucket, replay / capture now / run eager, which buckets are worth
capturing, which graphs to release for the memory budget) and is pure; the runners execute.
A runner is used from one thread at a time (the executor gives each its own inference thread). On CUDA each
takes its streams from `worker.runtime.streams.STREAMS` (each its own), and waits for its scores on an event
that sleeps rather than spins (`ScoresToHost`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from worker.devices.graphplan import LAZY_CAPTURE_AFTER, PROCESS_CAPTURES, BatchCaps, GraphKey, GraphPlan, GraphStep
from worker.devices.memory import MemoryPolicy
from worker.runtime.capturegate import CaptureGate, CapturesStopped
from worker.runtime.contract import ModelContract, ModelContractError
from worker.runtime.hostsync import SERVING
from worker.runtime.models import apply_activation
from worker.runtime.normalise import Normaliser
from worker.runtime.streams import STREAMS, StreamRegistry, check_distinct

log = logging.getLogger(__name__)

PRECISION_DTYPES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}
# PyTorch allows one CUDA graph capture at a time per process, so runners of several GPUs take turns; no graph
# is destroyed while one captures (worker.runtime.capturegate), and none is tried after one failed.
CAPTURES = CaptureGate(PROCESS_CAPTURES)

# On a CPU, first-call costs (allocations, oneDNN primitives) are paid per input shape whatever the batch size,
# so warm-up batches larger than this only cost start-up time (32 frames of a ResNet-50: seconds each).
CPU_WARMUP_BATCH_MAX = 2

# On a CPU, a batch of at most SMALL_BATCH frames runs on one intra-op thread when warm-up found the configured threads
# make it less than SMALL_BATCH_MIN_SPEEDUP times as fast (issue 61): between sparse batches the other threads sleep,
# and waking them cost more than they saved (the builtin CNN at batch 1 on 2 loaded cores: 1.5-1.7 CPU-ms and a mean
# of 3.7-4.1 ms against 1.3-1.5 CPU-ms and 1.5-1.9 ms on one thread).
SMALL_BATCH = 2
SMALL_BATCH_MIN_SPEEDUP = 1.5
SMALL_BATCH_PROBES = 5

Shape = tuple[int, int, int]  # one sample of the runner's input: uint8 pixels (H, W, C), whatever the model layout


def blocking_event() -> torch.cuda.Event:
    """An event whose synchronize() sleeps until the device reaches it: with CUDA's default scheduling a host
    thread waiting on the device otherwise spins a core for the whole wait."""
    return torch.cuda.Event(blocking=True)


class ScoresToHost:
    """A batch's scores from the device to the host: copied asynchronously into pinned memory on the runner's
    stream, then waited for on a blocking event (so the inference thread sleeps, not spins, through the batch).
    On a CPU (no stream) the scores are already on the host: copied off them."""

    def __init__(self, stream: torch.cuda.Stream | None, make_event: Callable[[], torch.cuda.Event] = blocking_event,
                 pin_memory: bool = True) -> None:
        self.stream = stream
        self._make_event = make_event
        self._pin_memory = pin_memory
        self._done: torch.cuda.Event | None = None  # one per runner, recorded again for every batch

    def __call__(self, scores: torch.Tensor) -> np.ndarray:
        if self.stream is None:  # a copy: the scores may be a view of the runner's reused input (Normaliser._output)
            return scores.to("cpu").numpy().copy()
        host = torch.empty(scores.shape, dtype=scores.dtype, pin_memory=self._pin_memory)
        host.copy_(scores, non_blocking=True)
        if self._done is None:
            self._done = self._make_event()
        self._done.record(self.stream)
        self._done.synchronize()
        # A copy: the pinned block goes back to torch's host cache now, not when the last score is read.
        return host.numpy().copy()


@dataclass(frozen=True)
class RunResult:
    """Scores of the n real rows of a batch (float32, on the host) and how they were computed."""

    scores: np.ndarray
    bucket: int
    used_graph: bool


class ModelRunner(Protocol):
    """What the executor drives: one model on one device, used from one thread at a time. `make_engine_runner`
    (worker.runtime.engine) is where a kind is chosen (OnnxRuntimeRunner, or `make_torch_runner`'s EagerRunner or
    CudaGraphRunner); another engine is another class with these members."""

    @property
    def device(self) -> torch.device: ...

    @property
    def copy_stream(self) -> torch.cuda.Stream | None:
        """Where the batch's host->device copies go (None: copied synchronously, e.g. on a CPU)."""

    @property
    def uses_graphs(self) -> bool: ...

    @property
    def capture_count(self) -> int: ...

    @property
    def graph_evictions(self) -> int: ...

    def warm_up(self, shape: Shape, batches: int, batch_size: int) -> None:
        """Pay first-call costs (and capture graphs) for inputs of `shape` = (H, W, C) uint8 pixels."""

    def run(self, pixels: torch.Tensor, ready: torch.cuda.Event | None = None,
            regions: torch.Tensor | None = None) -> RunResult:
        """The model's output for every row of `pixels` ([n, H, W, C] uint8 on `device`), after `ready`."""
        ...


class EagerRunner:
    """Runs the model as is, under inference_mode and the configured autocast; on CUDA, on its own stream."""

    uses_graphs = False
    tunes_threads = True  # whether torch's intra-op threads run the model (an onnxruntime session has its own)
    contiguous_input = False  # whether the model takes contiguous NCHW memory only (an onnxruntime session)

    def __init__(self, module: Callable[[torch.Tensor], torch.Tensor], contract: ModelContract,
                 device: torch.device, precision: str = "fp32", streams: StreamRegistry = STREAMS):
        if precision not in PRECISION_DTYPES:
            raise ValueError(f"runtime.precision: {precision!r} is not one of {sorted(PRECISION_DTYPES)}")
        self.module = module
        self.contract = contract
        self.device = torch.device(device)
        self.precision = precision
        on_cuda = self.device.type == "cuda"
        self.stream = streams.take(self.device, "a runner's compute", self) if on_cuda else None
        # Host->device copies of upcoming batches go on this stream, overlapping the current batch's compute.
        self.copy_stream = streams.take(self.device, "a runner's copies", self) if on_cuda else None
        self.capture_count = 0
        self.normaliser = Normaliser(contract, self.device, contiguous=self.contiguous_input)
        self._to_host = ScoresToHost(self.stream)
        self.small_batch_threads: int | None = None  # set by warm_up on a CPU (SMALL_BATCH)

    @property
    def graph_evictions(self) -> int:
        """CUDA graphs released for their memory budget (a CudaGraphRunner's; none here)."""
        return 0

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
            if self.device.type == "cpu" and self.tunes_threads and batches and torch.get_num_threads() > 1:
                self.small_batch_threads = self._small_batch_threads(x[:1])

    def _small_batch_threads(self, x: torch.Tensor) -> int | None:
        """1 when one intra-op thread runs a batch of one nearly as fast as all of them (SMALL_BATCH), else None."""
        threads = torch.get_num_threads()

        def best(n: int) -> float:
            torch.set_num_threads(n)
            try:
                times = []
                for _ in range(SMALL_BATCH_PROBES):
                    t0 = time.perf_counter()
                    self.infer(x)
                    times.append(time.perf_counter() - t0)
                return min(times)
            finally:
                torch.set_num_threads(threads)

        one, all_threads = best(1), best(threads)
        chosen = 1 if one < SMALL_BATCH_MIN_SPEEDUP * all_threads else None
        log.info("cpu intra-op threads for batches of <= %d frames: %d (a batch of one took %.3f ms on one thread, "
                 "%.3f ms on %d)", SMALL_BATCH, chosen or threads, one * 1000, all_threads * 1000, threads)
        return chosen

    @contextlib.contextmanager
    def _threads_for(self, n: int):
        """One intra-op thread for a small batch where warm-up chose it (SMALL_BATCH), the configured ones after."""
        if self.small_batch_threads is None or n > SMALL_BATCH:
            yield
            return
        threads = torch.get_num_threads()
        torch.set_num_threads(self.small_batch_threads)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    def run(self, pixels: torch.Tensor, ready: torch.cuda.Event | None = None,
            regions: torch.Tensor | None = None) -> RunResult:
        """Scores for every row of `pixels` ([n, H, W, C] uint8, already on this runner's device); `regions`
        ([n, 4] int32 top, left, height, width) marks padding, None when every row is all pixels."""
        SERVING.begin()
        with self._on_device(), self._threads_for(pixels.shape[0]):
            self._wait_for_input(ready, pixels, regions)
            scores = self.infer(pixels, regions)
            return RunResult(scores=self._to_host(scores), bucket=pixels.shape[0], used_graph=False)

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


class CudaMemoryProbe:
    """worker.devices.memory.MemoryProbe over torch.cuda's allocator statistics for one device, and the memory it
    holds from the device (a captured graph's pool grows it)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def total_bytes(self) -> int:
        return int(torch.cuda.get_device_properties(self.device).total_memory)

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_bytes(self) -> int:
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device))

    def reserved_bytes(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    static_in: torch.Tensor  # [bucket, H, W, C] uint8
    static_regions: torch.Tensor  # [bucket, 4] int32; padding rows get an empty region, so they normalise to 0
    full: torch.Tensor  # [bucket, 4] int32: every row all pixels
    static_out: torch.Tensor
    nbytes: int  # device memory it holds: its pool (static_out included) and the static inputs


class CudaGraphRunner(EagerRunner):
    """One CUDA graph per (bucket, input shape) on static buffers; a batch is padded to its bucket.

    Captured at warm-up for the configured shapes, and lazily for a shape that recurs, for the buckets a batch
    can reach (`GraphPlan.worth_capturing`); each capture's peak memory feeds `memory` and its bytes the graph
    budget, least recently replayed graphs released past it. Batches larger than the largest bucket, buckets
    not worth capturing, and shapes not (yet) captured run eagerly. `capture_count` counts every capture.
    """

    uses_graphs = True

    def __init__(self, module: Callable[[torch.Tensor], torch.Tensor], contract: ModelContract,
                 device: torch.device, precision: str = "fp32", buckets: Sequence[int] = (1, 2, 4, 8, 16, 32),
                 warmup_batches: int = 8, capture_after: int = LAZY_CAPTURE_AFTER, caps: BatchCaps = BatchCaps(),
                 memory: MemoryPolicy | None = None, graph_budget_bytes: int | None = None,
                 captures: CaptureGate = CAPTURES, streams: StreamRegistry = STREAMS):
        if torch.device(device).type != "cuda":
            raise ValueError("CudaGraphRunner needs a CUDA device; use EagerRunner on cpu")
        super().__init__(module, contract, device, precision, streams)
        self.plan = GraphPlan(buckets, capture_after, caps, memory, graph_budget_bytes)
        self.warmup_batches = warmup_batches
        self.probe = CudaMemoryProbe(self.device)
        self._captures = captures
        self._graphs: dict[GraphKey, _Graph] = {}
        # Its graphs outlive it until no capture is in progress (a runner replaced, or collected, mid-capture).
        self._return_memory = functools.partial(_return_memory, self.device, captures)
        captures.adopt(self, self._graphs, then=self._return_memory)
        self._side_stream = streams.take(self.device, "a runner's warm-up side stream", self)
        # torch.cuda.graph's default capture stream belongs to whichever GPU was current when first used. Its own:
        # another thread's work on it (a decode, a copy) would be captured, and fail the capture.
        self._capture_stream = streams.take(self.device, "a runner's captures", self)
        check_distinct({"compute": self.stream, "copies": self.copy_stream, "warm-up": self._side_stream,
                        "captures": self._capture_stream})

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.plan.buckets

    @property
    def graph_evictions(self) -> int:
        return self.plan.evictions

    def warm_up(self, shape: Shape, batches: int, batch_size: int = 0) -> None:
        """Capture a graph for every bucket worth it for this shape, smallest first (`GraphPlan.next_warm_up`);
        none once a capture has failed in this process (this shape then runs eager)."""
        SERVING.begin()
        while self._captures.stopped is None and (bucket := self.plan.next_warm_up(shape)) is not None:
            try:
                graph = self._capture(bucket, shape)
            except CapturesStopped:
                break  # another runner's capture failed meanwhile: this shape runs eager
            except Exception as exc:
                raise ModelContractError(
                    f"the model cannot be captured in a CUDA graph for batch {bucket} x {list(shape)} "
                    f"({type(exc).__name__}: {exc}); remove data-dependent host syncs (.item(), .cpu(), "
                    "Python branches on tensor values) from forward, or set runtime.cuda_graphs = false"
                ) from exc
            nbytes = graph.nbytes
            self._graphs[(bucket, shape)] = graph
            del graph  # the dict's reference is the only one, so releasing it below destroys the graph
            if not self.plan.admit_warm_up(bucket, shape, nbytes):
                self._captures.release([self._graphs.pop((bucket, shape))], then=self._return_memory)
                log.info("cuda graph budget full at warm-up; larger buckets are captured when batches need them "
                         "device=%s bucket=%d shape=%s graph_bytes=%d budget_bytes=%s", self.device, bucket,
                         list(shape), self.plan.budget.used_bytes, self.plan.budget.budget_bytes)
        captured = [b for b in self.plan.buckets if self.plan.is_captured(b, shape)]
        log.info("cuda graphs warmed up device=%s shape=%s captured=%s largest_batch=%s graph_bytes=%d",
                 self.device, list(shape), captured, self.plan.largest_batch(shape), self.plan.budget.used_bytes)

    def run(self, pixels: torch.Tensor, ready: torch.cuda.Event | None = None,
            regions: torch.Tensor | None = None) -> RunResult:
        n = pixels.shape[0]
        h, w, c = pixels.shape[1:]
        shape = (int(h), int(w), int(c))
        step = self.plan.decide(n, shape)
        if step.skipped:
            log.info("cuda graph bucket not captured: it is above the largest batch for this shape; such batches "
                     "run eager device=%s bucket=%d shape=%s largest_batch=%s", self.device,
                     self.plan.bucket_for(n), list(shape), self.plan.largest_batch(shape))
        if step.action == "capture" and not self._capture_lazily(step.bucket, shape):
            step = GraphStep("eager", n)
        if step.action == "eager":
            return super().run(pixels, ready, regions)
        graph = self._graphs[(step.bucket, shape)]
        SERVING.begin()
        with self._on_device():
            self._wait_for_input(ready, pixels, regions)
            graph.static_in[:n].copy_(pixels)
            graph.static_regions[:n].copy_(graph.full[:n] if regions is None else regions)
            if n < step.bucket:
                # Padding rows: an empty region normalises them to zeros (deterministic; rows never mix in eval).
                graph.static_regions[n:].zero_()
            graph.graph.replay()
            scores = self._to_host(graph.static_out[:n])
        return RunResult(scores=scores, bucket=step.bucket, used_graph=True)

    def _capture_lazily(self, bucket: int, shape: Shape) -> bool:
        """Capture (bucket, shape) now; False (run eager) when it fails, or when captures stopped after a failed one
        (in any runner of the process: worker.devices.graphplan.CaptureStop)."""
        if self._captures.stopped is not None:
            self.plan.mark_failed(bucket, shape)
            return False
        failed: list[BaseException] = []
        try:
            graph = self._capture(bucket, shape)
        except Exception as exc:  # noqa: BLE001 (reported to the caller)
            self.plan.mark_failed(bucket, shape)
            if self._captures.stopped is None:  # failed before capturing (e.g. out of memory in the warm-up runs)
                log.warning("cuda graph capture failed; running eager for this shape device=%s bucket=%d shape=%s "
                            "error=%s", self.device, bucket, list(shape), exc)
            failed.append(exc)
        if failed:
            # The error's traceback holds the failed graph: released once the except block no longer holds the
            # error, through the gate, so that it is not destroyed while another runner captures.
            self._captures.release(failed)
            return False
        evicted = self.plan.admit(bucket, shape, graph.nbytes)
        self._graphs[(bucket, shape)] = graph
        self._release(evicted)
        log.info("cuda graph captured lazily device=%s bucket=%d shape=%s bytes=%d captures=%d graph_bytes=%d "
                 "evicted=%s", self.device, bucket, list(shape), graph.nbytes, self.capture_count,
                 self.plan.budget.used_bytes, [(b, list(s)) for b, s in evicted])
        return True

    def _release(self, evicted: list[GraphKey]) -> None:
        """Drop the graphs released for the budget (after any capture in progress) and give their memory back."""
        if not evicted:
            return
        self._captures.release([self._graphs.pop(key) for key in evicted], then=self._return_memory)

    def _capture(self, bucket: int, shape: Shape) -> _Graph:
        """Capture (bucket, shape) on new static buffers; its eager warm-up runs record the batch's peak memory."""
        with self._captures.capturing(), torch.cuda.device(self.device), torch.inference_mode():
            static_in = torch.zeros((bucket, *shape), dtype=torch.uint8, device=self.device)
            full = torch.tensor([[0, 0, shape[0], shape[1]]] * bucket, dtype=torch.int32, device=self.device)
            static_regions = full.clone()

            def warm() -> None:
                with torch.cuda.stream(self._side_stream):
                    for _ in range(max(1, self.warmup_batches)):
                        self.infer(static_in, static_regions)

            # Warm-up on a side stream before capture, as the PyTorch CUDA-graph docs prescribe: lazy
            # initialisation (cuBLAS/cuDNN handles, autotuning) must not happen inside the capture.
            self._side_stream.wait_stream(torch.cuda.current_stream(self.device))
            if self.plan.memory is not None:
                self.plan.memory.measure(self.probe, shape, bucket, warm)
            else:
                warm()
            torch.cuda.current_stream(self.device).wait_stream(self._side_stream)
            graph = torch.cuda.CUDAGraph()
            # Each graph has its own memory pool (no pool= shared with the others), so a released graph's memory
            # really returns to the device. thread_local: preprocessing threads keep copying to the device while
            # this thread captures.
            what = f"device={self.device} bucket={bucket} shape={list(shape)}"
            with self._captures.graph(what), \
                    torch.cuda.graph(graph, stream=self._capture_stream, capture_error_mode="thread_local"):
                # Read inside: entering torch.cuda.graph empties the allocator's cache, which is not this graph's.
                before = self.probe.reserved_bytes()
                static_out = self.infer(static_in, static_regions)
            pool = max(0, self.probe.reserved_bytes() - before)
            self.capture_count += 1
            nbytes = pool + static_in.nbytes + static_regions.nbytes + full.nbytes
            return _Graph(graph, static_in, static_regions, full, static_out, nbytes)


def _return_memory(device: torch.device, captures: CaptureGate) -> None:
    """A graph's private pool goes back to the device only once the graph and its tensors are gone, and then
    only through empty_cache; never after a failed capture, when torch 2.11's empty_cache fails an internal
    assertion (worker.devices.graphplan.CaptureStop): the memory stays in torch's cache, for eager batches to reuse."""
    if captures.stopped is not None:
        return
    with torch.cuda.device(device):
        torch.cuda.empty_cache()


def make_torch_runner(module: Callable[[torch.Tensor], torch.Tensor], contract: ModelContract, device: torch.device,
                precision: str, cuda_graphs: bool, buckets: Sequence[int], warmup_batches: int,
                caps: BatchCaps = BatchCaps(), memory: MemoryPolicy | None = None,
                graph_budget_bytes: int | None = None) -> ModelRunner:
    """A torch model's runner: CudaGraphRunner on CUDA with graphs enabled, else EagerRunner (the CPU path). The
    executor makes every runner through worker.runtime.engine.make_engine_runner, which calls this for torch."""
    if device.type == "cuda" and cuda_graphs:
        return CudaGraphRunner(module, contract, device, precision, buckets, warmup_batches, caps=caps,
                               memory=memory, graph_budget_bytes=graph_budget_bytes)
    return EagerRunner(module, contract, device, precision)
