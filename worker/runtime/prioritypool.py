"""The executor's thread pools: the most urgent job first, so a realtime batch overtakes bulk batches still waiting
for preprocessing or for their runner (it waits for at most the batch already running)."""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import threading
from collections.abc import Callable
from typing import Any

from worker.threadnames import name_os_thread


class PriorityPool:
    """Threads that run the most urgent job first (lowest priority value), FIFO within a priority.

    close() lets the jobs already queued finish (like ThreadPoolExecutor.shutdown(wait=True))."""

    def __init__(self, threads: int, name: str) -> None:
        self._heap: list[tuple[int, int, concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...]]] = []
        self._cv = threading.Condition()
        self._seq = itertools.count()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, priority: int, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("cannot submit to a closed pool")
            heapq.heappush(self._heap, (int(priority), next(self._seq), future, fn, args))
            self._cv.notify()
        return future

    def _work(self) -> None:
        name_os_thread()
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self._cv.wait()
                if not self._heap:
                    return
                _, _, future, fn, args = heapq.heappop(self._heap)
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 (handed to the caller through the future)
                future.set_exception(exc)

    def shutdown(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join()
