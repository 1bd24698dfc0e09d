"""The executor the loop holds while models can change (issue 69): it hands each batch to the serving model, and
between two batches takes a promoted model's place. Pure: no Kafka, no torch (it holds executors).

- A promote is applied by the loop's own thread at its next `submit`: the batches already dispatched finish on the
  old model, every later one runs on the new. No frame is dropped or run twice; the group never changes.
- Each outcome names the model that scored each frame (`BatchOutcome.scored_by`), so every result carries it.
- A replaced (or withdrawn) model is closed on a thread of its own once its last batch is done: its memory is freed
  after its last batch, never under it.
- A candidate in `canary` answers the streams in its share (worker.rollout.plan.in_share); in `shadow` it also
  scores its share's frames, at most one shadow batch at a time and only while the serving model keeps up (else the
  frames are skipped and counted): the shadow outcome goes to `on_shadow`, never to the loop."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from worker.control.records import ModelRef
from worker.frames import BatchOutcome, Frame, ModelId, Priority
from worker.rollout.plan import CANARY, SHADOW, in_share

log = logging.getLogger(__name__)

# Shadow batches run only while the serving model has at most this many batches of its own in flight per runner,
# and one at a time: shadow work is the lowest class of all, skipped (counted) when the worker is behind.
SHADOW_MAX_PRIMARY_INFLIGHT_PER_RUNNER = 1
PRIMARY = "primary"
ShadowHandler = Callable[[Sequence[Frame], BatchOutcome, BatchOutcome, ModelId], None]


class Held:
    """One executor the swap holds, with the batches it runs now; closed once retired and idle."""

    def __init__(self, executor: Any, ref: ModelRef) -> None:
        self.executor = executor
        self.ref = ref
        self.model: ModelId = (executor.model_name, executor.model_version)
        self.inflight = 0
        self.retired = False
        self.closed = False


class SwappableExecutor:
    """The loop's Executor (worker.loop.ports) over the serving model and, while one rolls out, a candidate."""

    def __init__(self, executor: Any, ref: ModelRef, on_swap: Callable[[Held], None] | None = None,
                 on_shadow: ShadowHandler | None = None, on_skipped: Callable[[int], None] | None = None,
                 on_scored: Callable[[ModelId, str, int, float], None] | None = None,
                 closer: Callable[[Callable[[], None]], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._primary = Held(executor, ref)
        self._next: Held | None = None  # promoted, taken at the next submit
        self._candidate: Held | None = None
        self.mode = ""
        self.share = 0.0
        self.on_swap = on_swap
        self.on_shadow = on_shadow
        self.on_skipped = on_skipped
        self.on_scored = on_scored  # (model, role, frames, seconds) of each batch: primary, canary or shadow
        self._closer = closer or _close_on_thread
        self.swaps = 0
        self._shadow_running = False
        # The Executor protocol's plain attributes, fixed at start: the batcher was built with them (a candidate
        # must take the same input size: worker.rollout.plan.contract_mismatch).
        self.preferred_batch_sizes: tuple[int, ...] = executor.preferred_batch_sizes
        self.model_input_hw: tuple[int, int] | None = executor.model_input_hw
        # The serving model's (updated by a promote).
        self.model_name: str = executor.model_name
        self.model_version: str = executor.model_version

    # -- what the loop and the app read: the serving model's ---------------------------------------------------------
    @property
    def serving(self) -> Held:
        return self._primary

    @property
    def candidate(self) -> Held | None:
        return self._candidate

    @property
    def memory_policy(self) -> Any:
        return self._primary.executor.memory_policy

    @property
    def runner_count(self) -> int:
        return int(self._primary.executor.runner_count)

    def __getattr__(self, name: str) -> Any:
        # Anything else (labels, device_description, profile, calibrate): the serving model's.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._primary.executor, name)

    # -- what the rollout sets (any thread) ----------------------------------------------------------------------
    def promote(self, executor: Any, ref: ModelRef) -> None:
        """`executor` serves from the loop's next batch on (the candidate's, when it is the same executor)."""
        with self._lock:
            held = self._candidate if self._candidate is not None and self._candidate.executor is executor else None
            if held is not None:
                self._candidate, self.mode, self.share = None, "", 0.0
            self._next = held or Held(executor, ref)

    @property
    def promoting(self) -> bool:
        return self._next is not None

    def set_candidate(self, executor: Any, ref: ModelRef, mode: str, share: float) -> None:
        """The candidate (replacing another, which is retired) and how it scores: shadow or canary, its share."""
        with self._lock:
            old = self._candidate
            if old is None or old.executor is not executor:
                self._candidate = Held(executor, ref)
                if old is not None:
                    self._retire(old)
            self.mode, self.share = mode, share

    def clear_candidate(self) -> None:
        """No candidate any more (an abort): it is closed after its last batch."""
        with self._lock:
            old, self._candidate, self.mode, self.share = self._candidate, None, "", 0.0
            if old is not None:
                self._retire(old)

    # -- the loop's thread ---------------------------------------------------------------------------------------
    def submit(self, frames: Sequence[Frame], shape: tuple[int, int, int],
               priority: Priority = Priority.BULK) -> Future[BatchOutcome]:
        with self._lock:
            swapped = self._take_next()
            primary, candidate, mode, share = self._primary, self._candidate, self.mode, self.share
        if swapped is not None and self.on_swap is not None:
            self.on_swap(swapped)
        frames = list(frames)
        if candidate is None or share <= 0.0:
            return self._run(primary, frames, shape, priority, PRIMARY)
        picked = [f for f in frames if in_share(f.stream_id, share)]
        if mode == CANARY and picked:
            if len(picked) == len(frames):
                return self._run(candidate, frames, shape, priority, CANARY)
            rest = [f for f in frames if not in_share(f.stream_id, share)]
            return _joined([self._run(primary, rest, shape, priority, PRIMARY),
                            self._run(candidate, picked, shape, priority, CANARY)])
        future = self._run(primary, frames, shape, priority, PRIMARY)
        if mode == SHADOW and picked:
            self._shadow(primary, candidate, picked, shape, future)
        return future

    def _take_next(self) -> Held | None:
        """Under the lock: a promoted model takes the serving one's place, which retires."""
        held, self._next = self._next, None
        if held is None:
            return None
        old, self._primary = self._primary, held
        self.model_name, self.model_version = held.model
        self.swaps += 1
        self._retire(old)
        log.info("model %s:%s serves from this batch on; %s:%s finishes its %d batches in flight, then is closed",
                 *held.model, *old.model, old.inflight)
        return held

    def _run(self, held: Held, frames: list[Frame], shape: tuple[int, int, int],
             priority: Priority, role: str) -> Future[BatchOutcome]:
        with self._lock:
            held.inflight += 1
        try:
            inner = held.executor.submit(frames, shape, priority)
        except BaseException:
            self._done(held)
            raise
        tagged: Future[BatchOutcome] = Future()

        def done(f: Future[BatchOutcome]) -> None:
            self._done(held)
            exc = f.exception()
            if exc is not None:
                tagged.set_exception(exc)
            else:
                outcome = f.result()
                if self.on_scored is not None:
                    self.on_scored(held.model, role, len(outcome.verdicts),
                                   (outcome.preprocess_ms + outcome.inference_ms) / 1000.0)
                tagged.set_result(dataclasses.replace(outcome, scored_by=(held.model,) * len(outcome.verdicts)))

        inner.add_done_callback(done)
        return tagged

    def _shadow(self, primary: Held, candidate: Held, picked: list[Frame], shape: tuple[int, int, int],
                primary_future: Future[BatchOutcome]) -> None:
        limit = SHADOW_MAX_PRIMARY_INFLIGHT_PER_RUNNER * max(1, self.runner_count)
        with self._lock:
            behind = self._shadow_running or primary.inflight > limit
            if not behind:
                self._shadow_running = True
        if behind:
            if self.on_skipped is not None:
                self.on_skipped(len(picked))
            return
        try:
            shadow_future = self._run(candidate, picked, shape, Priority.BULK, SHADOW)
        except RuntimeError:  # the candidate was closed meanwhile (an abort): nothing to compare
            with self._lock:
                self._shadow_running = False
            return

        def compared(_f: Future[BatchOutcome]) -> None:
            if not (primary_future.done() and shadow_future.done()):
                return
            with self._lock:
                if not self._shadow_running:
                    return  # the other callback compared them
                self._shadow_running = False
            if primary_future.exception() is None and shadow_future.exception() is None and \
                    self.on_shadow is not None:
                try:
                    self.on_shadow(picked, primary_future.result(), shadow_future.result(), candidate.model)
                except Exception:  # shadow figures must never reach the loop
                    log.exception("shadow comparison failed")

        primary_future.add_done_callback(compared)
        shadow_future.add_done_callback(compared)

    def _done(self, held: Held) -> None:
        with self._lock:
            held.inflight -= 1
            close = held.retired and held.inflight == 0 and not held.closed
            if close:
                held.closed = True
        if close:
            self._closer(held.executor.close)

    def _retire(self, held: Held) -> None:
        """Under the lock: closed now if idle, else by its last batch's callback."""
        held.retired = True
        if held.inflight == 0 and not held.closed:
            held.closed = True
            self._closer(held.executor.close)

    def close(self) -> None:
        """Every model held: the loop has drained (its batches are done)."""
        with self._lock:
            held = [h for h in (self._primary, self._next, self._candidate) if h is not None and not h.closed]
            for h in held:
                h.closed = True
        for h in held:
            h.executor.close()


def _close_on_thread(close: Callable[[], None]) -> None:
    """Close an executor off the thread that finished its last batch (closing joins that very thread)."""
    threading.Thread(target=close, name="model-close", daemon=True).start()


def _joined(futures: list[Future[BatchOutcome]]) -> Future[BatchOutcome]:
    """One outcome of a canary batch's two parts (serving model's frames, then the candidate's): verdicts and their
    scorers in part order, times of the slower part (they ran side by side)."""
    joined: Future[BatchOutcome] = Future()
    left = [len(futures)]
    lock = threading.Lock()

    def part_done(_f: Future[BatchOutcome]) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if not last:
            return
        for f in futures:
            exc = f.exception()
            if exc is not None:
                joined.set_exception(exc)
                return
        done = [f.result() for f in futures]
        joined.set_result(BatchOutcome(
            verdicts=[v for o in done for v in o.verdicts], failures=[x for o in done for x in o.failures],
            batch_size=sum(o.batch_size for o in done),
            preprocess_ms=max(o.preprocess_ms for o in done), inference_ms=max(o.inference_ms for o in done),
            started_at=min((o.started_at for o in done), default=time.time()), bucket=sum(o.bucket for o in done),
            used_graph=any(o.used_graph for o in done), scored_by=tuple(m for o in done for m in o.scored_by)))

    for f in futures:
        f.add_done_callback(part_done)
    return joined
