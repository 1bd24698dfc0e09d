"""The worker's CUDA streams: each one its own, never another runner's nor a library's.

`torch.cuda.Stream()` does not create a stream: it hands out the next of a pool of 32 per device and priority,
round-robin, so two objects can be one CUDA stream. A runner takes four (compute, copy, warm-up side, capture)
and the device data path one for decoding; torchvision's nvJPEG decoder takes one from the default priority's
pool. Were a capture stream also the decoder's, a lazy capture would record decode work and fail (then no
capture is tried again: worker.devices.graphplan.CaptureStop). So every stream here comes from `StreamRegistry`: from a
pool of a priority of its own (above the default, which libraries draw from), never one that a live stream of
this process already is; with more streams than a pool holds, the next priority's pool.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

# torch's stream pools: 32 streams per device and priority; priorities below 0 are the higher ones (torch 2.11 has
# pools for -1, -2 and -3 on GPUs that have that many levels). The worker's streams take -1 first: equal among
# themselves, as before, and never the default priority's (0), which torchvision's nvJPEG stream comes from.
POOL_SIZE = 32
PRIORITIES = (-1, -2, -3)


def _torch_stream(device: torch.device, priority: int) -> Any:
    return torch.cuda.Stream(device, priority=priority)


class StreamRegistry:
    """Streams that are distinct from every other live one it handed out (per device); thread-safe.

    `make(device, priority)` is `torch.cuda.Stream`'s round-robin draw; a stream is identified by its
    `cuda_stream` handle, and is free again once its owner (a runner) is collected (streams take no weakrefs)."""

    def __init__(self, make: Callable[[torch.device, int], Any] = _torch_stream, pool_size: int = POOL_SIZE,
                 priorities: Sequence[int] = PRIORITIES) -> None:
        self._make = make
        self._pool_size = pool_size
        self._priorities = tuple(priorities)
        self._lock = threading.Lock()
        self._live: dict[tuple[str, int], str] = {}  # (device, handle) -> the role that holds it

    def take(self, device: torch.device | str, role: str, owner: object) -> Any:
        """A stream on `device` that no live stream of this registry is, held while `owner` lives; RuntimeError
        when every pool is taken."""
        device = torch.device(device)
        with self._lock:
            for priority in self._priorities:
                for _ in range(self._pool_size):
                    stream = self._make(device, priority)
                    key = (str(device), int(stream.cuda_stream))
                    if key not in self._live:
                        self._live[key] = role
                        weakref.finalize(owner, self._forget, key)
                        return stream
            raise RuntimeError(
                f"no free CUDA stream on {device} for {role}: the {len(self._live)} streams of torch's pools of "
                f"priorities {list(self._priorities)} are all in use; lower runtime.instances_per_device")

    def held(self, device: torch.device | str) -> dict[int, str]:
        """The live streams on `device`: handle -> role."""
        name = str(torch.device(device))
        with self._lock:
            return {handle: role for (d, handle), role in self._live.items() if d == name}

    def _forget(self, key: tuple[str, int]) -> None:
        with self._lock:
            self._live.pop(key, None)


def check_distinct(streams: dict[str, Any]) -> None:
    """Raise RuntimeError naming any two roles given one CUDA stream (None, no stream, is skipped)."""
    seen: dict[int, str] = {}
    for role, stream in streams.items():
        if stream is None:
            continue
        handle = int(stream.cuda_stream)
        if handle in seen:
            raise RuntimeError(f"CUDA streams for {seen[handle]} and {role} are one stream ({handle:#x}); each "
                               "must be its own (worker.runtime.streams)")
        seen[handle] = role


# The process's: runners and the device data path take their streams here.
STREAMS = StreamRegistry()
