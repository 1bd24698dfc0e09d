"""CUDA graph captures take turns process-wide, and no graph is destroyed while one is in progress.

Destroying a `torch.cuda.CUDAGraph` while any capture runs in the process fails that capture ("operation not
permitted when stream is capturing"): a graph released for the memory budget, an old runner's graphs freed by
reference counting in another thread, or by the cyclic garbage collector inside the capturing thread itself.
`CaptureGate` serialises captures (PyTorch allows one at a time per process), holds what is released during
one until it ends, destroys it before the next begins, and keeps the garbage collector from running inside a
capture. It also ends captures for good after one fails (`worker.devices.graphplan.CaptureStop`: torch 2.11 cannot
capture, nor empty its cache, after a failed capture). Pure Python (no torch), so its ordering is tested on any
machine with stand-in graphs.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from worker.devices.graphplan import CaptureStop
from worker.errors import StreamferError

log = logging.getLogger(__name__)


class CapturesStopped(StreamferError):
    """A capture was asked for after one failed in this process; the caller runs eager instead."""


class CaptureGate:
    """One turn at a time: a capture, or the destruction of released objects (which never overlaps a capture)."""

    def __init__(self, stop: CaptureStop | None = None) -> None:
        self._cond = threading.Condition()
        self._busy = False
        self._held: list[tuple[list[Any], Callable[[], None] | None]] = []
        self.stop = stop if stop is not None else CaptureStop()

    @property
    def stopped(self) -> str | None:
        """Why captures stopped for good (a capture failed), None while they may go on."""
        return self.stop.reason

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Wait for the turn, capture with the garbage collector off (its previous state restored after), then
        destroy what was released meanwhile, before the next capture may begin. CapturesStopped, before any
        work, once a capture has failed."""
        with self._cond:
            while self._busy:
                self._cond.wait()
            if self.stop.reason is not None:
                self._cond.notify_all()
                raise CapturesStopped(f"CUDA graph captures stopped after a failed one: {self.stop.reason}")
            self._busy = True
        collecting = gc.isenabled()
        gc.disable()
        try:
            yield
        finally:
            if collecting:
                gc.enable()
            self._destroy_then_end_turn([])

    @contextlib.contextmanager
    def graph(self, what: str) -> Iterator[None]:
        """Around the capture itself (`torch.cuda.graph`), inside `capturing()`: an error escaping it stops every
        later capture, with one log line naming `what` (device, bucket, shape) and the error; the error goes on."""
        try:
            yield
        except BaseException as exc:
            if self.stop.record_failure(f"{type(exc).__name__}: {exc}"):
                log.error("cuda graph capture failed; no CUDA graph is captured again in this process (torch cannot "
                          "capture after a failed capture, pytorch issues 180395 and 190348): graphs captured "
                          "before are replayed, every other batch runs eager %s error=%s: %s", what,
                          type(exc).__name__, exc)
            raise

    def release(self, objects: list[Any], then: Callable[[], None] | None = None) -> None:
        """Take every object out of `objects` and destroy it: now, or, while a capture is in progress, right after
        it. The caller must hold no other reference (a local variable counts); `then` runs after the destruction
        (e.g. giving freed device memory back)."""
        taken = objects[:]
        objects.clear()
        with self._cond:
            if self._busy:
                self._held.append((taken, then))
                return
            self._busy = True
        self._destroy_then_end_turn([(taken, then)])

    def adopt(self, owner: object, objects: dict[Any, Any], then: Callable[[], None] | None = None) -> None:
        """When `owner` is freed (by reference counting in any thread, or by the garbage collector), release the
        values of `objects` through this gate. `objects` must not refer back to `owner`."""
        weakref.finalize(owner, _release_values, self, objects, then)

    def _destroy_then_end_turn(self, batch: list[tuple[list[Any], Callable[[], None] | None]]) -> None:
        """Still holding the turn: destroy `batch` and whatever was released meanwhile, then let the next in."""
        try:
            while True:
                for taken, then in batch:
                    taken.clear()  # the last references: the objects are destroyed here
                    if then is not None:
                        then()
                with self._cond:
                    batch, self._held = self._held, []
                    if not batch:
                        self._busy = False
                        self._cond.notify_all()
                        return
        except BaseException:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
            raise


def _release_values(gate: CaptureGate, objects: dict[Any, Any], then: Callable[[], None] | None) -> None:
    values = list(objects.values())
    objects.clear()
    gate.release(values, then)
