"""Which CUDA graphs a runner captures, replays, skips and releases: pure policy (no torch), executed by
worker.runtime.runners.CudaGraphRunner. A shape here is the runner's input: the model's (H, W, C) uint8 rows.

- Bucket: a batch of n frames replays the graph of the smallest bucket >= n, padded; a batch larger than every
  bucket runs eager.
- Reachable: a runner gets at most `largest_batch(shape)` frames of a shape in one batch: max_batch_size (the
  largest of any class's), max_batch_bytes over one row's bytes (`BatchCaps`, as worker.batching counts them),
  and its device's memory policy's largest batch under runtime.memory_fraction (a larger batch is split across
  devices by the executor). A bucket is worth capturing when it is at most that, or when it
  is the bucket that many frames pad to and its own batch is predicted to fit device memory. No other bucket
  is captured: a batch that reaches one anyway runs eager (`GraphStep.skipped` the first time, for a log line).
- Warm-up captures the buckets worth it smallest first, so the peaks measured on the way predict the larger
  buckets' before they run, and stops at the first graph that does not fit the graph budget: it evicts no
  graph that was never used.
- Lazy capture: a (bucket, shape) without a graph is captured the `capture_after`-th time a batch needs it.
- Budget: the graphs' measured bytes stay under the budget, the least recently replayed released first; a
  released graph is forgotten, so it is captured again by the lazy rule if batches need it again.
- After a failed capture, none is tried again in the process (`CaptureStop`): everything without a graph runs eager.
Not thread-safe: one runner thread owns a plan (`CaptureStop` is, being process-wide).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from worker.config import BatchingSettings
from worker.devices.memory import GraphBudget, MemoryPolicy

Shape = tuple[int, int, int]
GraphKey = tuple[int, Shape]  # (bucket, shape)

# A shape without a graph is captured lazily the n-th time it is seen, so one-off shapes never pay a capture.
LAZY_CAPTURE_AFTER = 2


@dataclass(frozen=True)
class BatchCaps:
    """The batcher's bounds on one batch (worker.batching: max_batch_size, the largest of any class's, since a runner
    takes every class's batches, and max_batch_bytes over a row of h x w x c x tensor_dtype_bytes); None where the
    runner is not told them (then only memory bounds a batch)."""

    max_batch_size: int | None = None
    max_batch_bytes: int | None = None
    tensor_dtype_bytes: int = 4

    @classmethod
    def from_settings(cls, settings: BatchingSettings) -> BatchCaps:
        return cls(settings.largest_batch_size, settings.max_batch_bytes, settings.tensor_dtype_bytes)

    def limit(self, shape: Shape) -> int | None:
        """The most frames of `shape` in one batch, before device memory; at least 1 (a frame too large for
        max_batch_bytes runs alone)."""
        caps = [c for c in (self.max_batch_size, self._by_bytes(shape)) if c is not None]
        return max(1, min(caps)) if caps else None

    def _by_bytes(self, shape: Shape) -> int | None:
        if self.max_batch_bytes is None:
            return None
        h, w, c = shape
        return self.max_batch_bytes // (h * w * c * self.tensor_dtype_bytes)


class CaptureStop:
    """Process-wide: once any CUDA graph capture has failed, no capture is tried again.

    On torch 2.11 a failed capture can leave the caching allocator counting a capture as under way, so the next
    `torch.cuda.empty_cache()` (which `torch.cuda.graph` calls on entry, and which giving a released graph's memory
    back calls) fails an internal assertion, and the failed graph's pool is not returned (pytorch issues 180395,
    190348): one failure would become "every later capture and eviction fails". Graphs captured before stay.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reason: str | None = None
        self._failures = 0

    @property
    def reason(self) -> str | None:
        """Why captures stopped (the first failure), None while they may go on."""
        return self._reason

    @property
    def failures(self) -> int:
        return self._failures

    def record_failure(self, reason: str) -> bool:
        """A capture failed: stop captures. True the first time (the caller logs it once)."""
        with self._lock:
            self._failures += 1
            first = self._reason is None
            if first:
                self._reason = reason
            return first


# The worker's own: runners share it through worker.runtime.runners.CAPTURES; the metric
# streamfer_cuda_graph_captures_stopped reads it.
PROCESS_CAPTURES = CaptureStop()


@dataclass(frozen=True)
class GraphStep:
    action: str  # "replay", "capture" (then replay) or "eager"
    bucket: int  # padded batch size executed; == n for eager
    # Eager because this bucket is not captured for the shape (above the largest batch); True only the first
    # time per (bucket, shape), so the runner logs it once.
    skipped: bool = False


class GraphPlan:
    """Which CUDA graph serves a batch of n frames of a shape, which buckets are worth capturing, and which
    graphs to release to stay under the budget; see the module docstring."""

    def __init__(self, buckets: Sequence[int], capture_after: int = LAZY_CAPTURE_AFTER, caps: BatchCaps = BatchCaps(),
                 memory: MemoryPolicy | None = None, budget_bytes: int | None = None):
        if not buckets or min(buckets) < 1:
            raise ValueError("CUDA graph buckets must be a non-empty list of sizes >= 1")
        self.buckets = tuple(sorted(set(buckets)))
        self.capture_after = capture_after
        self.caps = caps
        self.memory = memory
        self.budget: GraphBudget[GraphKey] = GraphBudget(budget_bytes)
        self._captured: set[GraphKey] = set()
        self._failed: set[GraphKey] = set()
        self._skipped: set[GraphKey] = set()
        self._warmed: set[Shape] = set()  # shapes whose warm-up stopped at the budget
        self._seen: Counter[GraphKey] = Counter()

    def bucket_for(self, n: int) -> int | None:
        """The smallest bucket holding n frames; None when n exceeds the largest."""
        return next((b for b in self.buckets if b >= n), None)

    # -- which buckets ---------------------------------------------------------------------------------------
    def largest_batch(self, shape: Shape) -> int | None:
        """The most frames of `shape` the batcher sends in one batch; None when nothing bounds it."""
        limit = self.caps.limit(shape)
        if self.memory is not None:
            fits = self.memory.max_batch(shape, limit if limit is not None else self.buckets[-1])
            if fits is not None:
                limit = fits if limit is None else min(limit, fits)
        return limit

    def worth_capturing(self, bucket: int, shape: Shape) -> bool:
        """A batch the batcher can send is padded to this bucket, and the padded batch fits device memory."""
        limit = self.largest_batch(shape)
        if limit is None or bucket <= limit:
            return True
        if bucket != self.bucket_for(limit):
            return False
        # The bucket the largest batch pads to: only if a batch of the whole bucket fits memory too (when memory
        # is what bounds the batch, padding past it would exceed memory_fraction: such batches run eager).
        fits = self.memory.max_batch(shape, bucket) if self.memory is not None else None
        return fits is None or fits >= bucket

    def next_warm_up(self, shape: Shape) -> int | None:
        """The next bucket to capture at warm-up, smallest first; None when warm-up is done for `shape`."""
        if shape in self._warmed:
            return None
        for bucket in self.buckets:
            key = (bucket, shape)
            if key in self._captured or key in self._failed:
                continue
            # Buckets grow, so the first one not worth capturing ends warm-up: no larger one is either.
            return bucket if self.worth_capturing(bucket, shape) else None
        return None

    # -- per batch -------------------------------------------------------------------------------------------
    def decide(self, n: int, shape: Shape) -> GraphStep:
        bucket = self.bucket_for(n)
        if bucket is None:
            return GraphStep("eager", n)
        key = (bucket, shape)
        if key in self._captured:
            self.budget.touch(key)
            return GraphStep("replay", bucket)
        if key in self._failed:
            return GraphStep("eager", n)
        if not self.worth_capturing(bucket, shape):
            first = key not in self._skipped
            self._skipped.add(key)
            return GraphStep("eager", n, skipped=first)
        self._seen[key] += 1
        if self._seen[key] >= self.capture_after:
            return GraphStep("capture", bucket)
        return GraphStep("eager", n)

    # -- after a capture -------------------------------------------------------------------------------------
    def admit_warm_up(self, bucket: int, shape: Shape, nbytes: int) -> bool:
        """A graph captured at warm-up: kept if it fits beside the graphs held, releasing none; otherwise the
        caller releases it and warm-up stops for this shape (its larger buckets are captured lazily)."""
        if not self.budget.fits(nbytes):
            self._warmed.add(shape)
            return False
        self.admit(bucket, shape, nbytes)
        return True

    def admit(self, bucket: int, shape: Shape, nbytes: int) -> list[GraphKey]:
        """A captured graph of nbytes is kept; the graphs to release (least recently replayed first) so the
        total stays within the budget. Those are forgotten: captured again lazily if batches need them."""
        key = (bucket, shape)
        self._captured.add(key)
        self._seen.pop(key, None)
        evicted = self.budget.admit(key, nbytes)
        for old in evicted:
            self._captured.discard(old)
            self._seen.pop(old, None)
        return evicted

    def mark_failed(self, bucket: int, shape: Shape) -> None:
        self._failed.add((bucket, shape))

    def is_captured(self, bucket: int, shape: Shape) -> bool:
        return (bucket, shape) in self._captured

    @property
    def evictions(self) -> int:
        """Graphs released for the budget so far."""
        return self.budget.evictions
