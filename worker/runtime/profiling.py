"""On-demand profiling (/debug/profile): the torch profiler around the next few batches, written as a Chrome
trace; the executor's runner threads share one request."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time

import torch

log = logging.getLogger("worker.runtime.executor")  # its lines read as the executor's, as before the split


class ProfileRequest:
    """One on-demand profiler capture: started by the first batch after the request, stopped after `batches`.
    The runner threads share it; only the thread that started the profiler stops it."""

    def __init__(self, batches: int, directory: str) -> None:
        self.left = batches
        self.directory = directory
        self.done: concurrent.futures.Future[str] = concurrent.futures.Future()
        self._lock = threading.Lock()
        self._prof: torch.profiler.profile | None = None
        self._thread: int | None = None

    def start(self) -> bool:
        """True when this thread records the batch it is about to run (the first runner thread to ask)."""
        with self._lock:
            if self.done.done():
                return False
            if self._thread is None:
                self._thread = threading.get_ident()
                self._prof = torch.profiler.profile(activities=profiler_activities(), record_shapes=True)
                self._prof.__enter__()
            return self._thread == threading.get_ident()

    def batch_done(self) -> None:
        with self._lock:
            if self.done.done():
                return
            self.left -= 1
            if self.left > 0 or self._prof is None:
                return
            prof, self._prof = self._prof, None
        try:
            prof.__exit__(None, None, None)
            path = f"{self.directory}/streamfer-profile-{time.strftime('%Y%m%d-%H%M%S')}-{id(self):x}.json"
            prof.export_chrome_trace(path)
            log.info("profiler trace written: %s", path)
            self.done.set_result(path)
        except Exception as exc:  # noqa: BLE001 (reported to the requester, never crashes a runner)
            self.done.set_exception(exc)


def profiler_activities() -> list[torch.profiler.ProfilerActivity]:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts
