"""The batches the loop has handed to the runtime and not yet collected, and the rules at both ends: at most
`delivery.max_inflight_batches` of them plus one slot that is realtime's alone, and collection in submission
order within a class (a stream's results keep their order) but as soon as done across classes (a realtime
batch never waits behind a running bulk batch)."""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future

from worker.batching import Batch, MicroBatcher
from worker.frames import BatchOutcome, Priority
from worker.metrics import Children, Metrics
from worker.ports import Executor


class InFlight:
    """Dispatches due batches to the runtime (counting their sizes, release reasons and padding) and collects
    them when done."""

    def __init__(self, batcher: MicroBatcher, runtime: Executor, limit: int, release_when_idle: bool,
                 metrics: Metrics) -> None:
        self._batcher = batcher
        self._runtime = runtime
        self._limit = limit
        self._release_when_idle = release_when_idle
        self._padding_waste = metrics.padding_waste
        self._batch_size = Children(metrics.batch_size)
        self._releases = Children(metrics.batch_releases)
        self._running: deque[tuple[Batch, Future[BatchOutcome]]] = deque()

    def __len__(self) -> int:
        return len(self._running)

    def next_finish(self) -> float | None:
        """When the first running batch is predicted to finish (released_at + the cost model's run time; a batch
        queued behind another on its runner finishes later, so the earliest is a lower bound); -inf when a running
        batch has no prediction (it may be done any time); None when none runs."""
        if not self._running:
            return None
        if any(batch.predicted_s is None for batch, _ in self._running):
            return float("-inf")
        return min(batch.released_at + (batch.predicted_s or 0.0) for batch, _ in self._running)

    def dispatch_due(self, input_drained: bool) -> None:
        """Every due batch the limit has room for; with nothing running and no input waiting (`input_drained`),
        the most urgent pending group now; and a due realtime batch in realtime's own slot."""
        while len(self._running) < self._limit:
            batch = self._batcher.pop_batch()
            if batch is None:
                break
            self.dispatch(batch)
        # Nothing runs and no input is waiting: holding frames for a fuller batch would leave the runtime idle.
        if not self._running and input_drained and self._release_when_idle:
            batch = self._batcher.pop_batch(idle=True)
            if batch is not None:
                self.dispatch(batch)
        # One slot beyond the limit is realtime's alone: a due realtime batch never waits for a lower class's
        # batch to free a slot (the executor then runs it before their queued batches).
        if len(self._running) >= self._limit and not any(b.priority == Priority.REALTIME for b, _ in self._running):
            batch = self._batcher.pop_batch(max_priority=Priority.REALTIME)
            if batch is not None:
                self.dispatch(batch)

    def dispatch(self, batch: Batch) -> None:
        self._batch_size.labels(batch.priority.label, batch.lane).observe(batch.size)
        self._releases.labels(batch.priority.label, batch.reason).inc()
        self._padding_waste.observe(batch.padding_waste)
        self._running.append((batch, self._runtime.submit(batch.frames, batch.shape, batch.priority)))

    def finished(self, wait: bool = False) -> list[tuple[Batch, BatchOutcome]]:
        """The batches done now, in the order they may be answered; `wait`: all of them, waiting for each."""
        if wait:
            done = [(batch, future.result()) for batch, future in self._running]
            self._running.clear()
            return done
        if not any(future.done() for _, future in self._running):
            return []
        done, blocked = [], set()
        kept: deque[tuple[Batch, Future[BatchOutcome]]] = deque()
        for batch, future in self._running:
            if batch.priority not in blocked and future.done():
                # The executor isolates bad frames; an exception here is a bug: crash.
                done.append((batch, future.result()))
            else:
                blocked.add(batch.priority)
                kept.append((batch, future))
        self._running = kept
        return done
