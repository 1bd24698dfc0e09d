"""The batches the loop has handed to the runtime and not yet collected, and the rules at both ends: at most
`delivery.max_inflight_batches` of them plus one slot that is realtime's alone, and collection in submission
order within a class (a stream's results keep their order) but as soon as done across classes (a realtime
batch never waits behind a running bulk batch)."""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future

from worker.batching import Batch, MicroBatcher
from worker.frames import BatchOutcome, Priority
from worker.loop.ports import Executor
from worker.metrics import Children, Metrics

# While batches run the loop's poll cannot be woken by one finishing (librdkafka's poll has no wake-up): it looks
# every FINISH_CHECK_SHARE of the first one's predicted run time, at least every FINISH_CHECK_MIN_S (wait_for_finish).
# A finished batch's results wait at most that long: 5% of a 400 ms NudeNet batch, 2 ms of a 2 ms one.
FINISH_CHECK_MIN_S = 0.002
FINISH_CHECK_SHARE = 0.05


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

    def wait_for_finish(self, now: float) -> float | None:
        """How long the loop may block before looking for a finished batch (None: none runs). The first running
        batch is predicted to finish at its release plus the cost model's run time (one queued behind another on its
        runner finishes later: the earliest is a lower bound): half the time left until then, and from then on
        every FINISH_CHECK_SHARE of its predicted time (a batch runs longer than predicted while other runners and
        the decode threads share the cores), never under FINISH_CHECK_MIN_S; FINISH_CHECK_MIN_S when a running
        batch has no prediction."""
        if not self._running:
            return None
        if any(batch.predicted_s is None for batch, _ in self._running):
            return FINISH_CHECK_MIN_S
        finish, predicted = min((batch.released_at + (batch.predicted_s or 0.0), batch.predicted_s or 0.0)
                                for batch, _ in self._running)
        return max(FINISH_CHECK_MIN_S, (finish - now) * 0.5, predicted * FINISH_CHECK_SHARE)

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
