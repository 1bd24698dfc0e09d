"""The worker's Python thread names given to the operating system too, so that `top -H`, `ps -L`, perf, py-spy
and /proc/<pid>/task/*/comm tell its threads apart (inference, decode, preprocessing, metrics). Python 3.11 names
only its own Thread objects; the kernel keeps at most 15 bytes of a thread's name."""

from __future__ import annotations

import ctypes
import sys
import threading

OS_NAME_MAX_BYTES = 15
_PR_SET_NAME = 15  # prctl(2)

_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def os_thread_name(name: str) -> bytes:
    """What the kernel keeps of `name`: its first 15 bytes of UTF-8, cut at a character boundary."""
    return name.encode()[:OS_NAME_MAX_BYTES].decode(errors="ignore").encode()


def name_os_thread() -> None:
    """Give the calling thread's Python name to the OS thread (Linux; elsewhere nothing). Call it first thing in
    the thread. A refusal is ignored: a thread name is only for people looking at the process."""
    if _prctl is not None:
        _prctl(_PR_SET_NAME, ctypes.c_char_p(os_thread_name(threading.current_thread().name)), 0, 0, 0)
