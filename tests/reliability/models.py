"""Model factories for the fault suite, named as a user's `model.source` names them:
`WORKER_MODEL_SOURCE=tests.reliability.models:<function>` (the worker needs the project root on PYTHONPATH).

The models are tiny (the suite tests delivery, not inference) and take their knobs from environment
variables, because the worker builds them in its own process:

- STREAMFER_REL_BATCH_SLEEP_MS  every forward sleeps this long: sets the worker's pace, so a fault lands
                                mid-stream and a kill lands mid-batch with a useful probability.
- STREAMFER_REL_STALL_S         `stall_model`: a batch holding a marked frame sleeps this long.
- STREAMFER_REL_PROBE_DIR       every forward touches `<dir>/forward.<pid>` while it runs (and a stall
                                `<dir>/stall.<pid>`), then appends its batch size to `<dir>/forwards.<pid>`,
                                so the harness can strike while a batch is inside the model, or right after
                                a given batch ran.

A marked frame has its top-left pixel pure red (255, 0, 0): channel 0 at (0, 0) normalises to
(1 - 0.485) / 0.229 = 2.25, which the suite's other frames (pixel values <= 200) never reach. Frames are
padded bottom/right, so the marker stays at (0, 0) whatever the batch shape.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

NUM_LABELS = 5
MARKER_THRESHOLD = 2.0


def marked_pixels(height: int, width: int, seed: int = 0) -> np.ndarray:
    """(height, width, 3) uint8 pixels in 0..200 with the marker at the top-left."""
    img = unmarked_pixels(height, width, seed)
    img[0, 0] = (255, 0, 0)
    return img


def unmarked_pixels(height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 201, (height, width, 3), dtype=np.uint8)


def _has_marker(x: torch.Tensor) -> torch.Tensor:
    return x[:, 0, 0, 0] > MARKER_THRESHOLD


class _Probe:
    """Marks "a forward is running in this process" with a file (for kills aimed mid-batch)."""

    def __init__(self) -> None:
        probe_dir = os.environ.get("STREAMFER_REL_PROBE_DIR")
        self.path = Path(probe_dir) / f"forward.{os.getpid()}" if probe_dir else None

    def enter(self) -> None:
        if self.path is not None:
            self.path.touch()

    def leave(self, batch_size: int) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            with open(self.path.with_name(f"forwards.{os.getpid()}"), "a") as fh:
                fh.write(f"{batch_size}\n")

    def stalling(self, on: bool) -> None:
        """`<dir>/stall.<pid>` exists while a stall (StallNet) is in progress."""
        if self.path is None:
            return
        path = self.path.with_name(f"stall.{os.getpid()}")
        if on:
            path.touch()
        else:
            path.unlink(missing_ok=True)


class SteadyNet(nn.Module):
    """A one-conv net whose every forward takes at least STREAMFER_REL_BATCH_SLEEP_MS."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, kernel_size=3, stride=2, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(4, NUM_LABELS)
        self.sleep_s = float(os.environ.get("STREAMFER_REL_BATCH_SLEEP_MS", "0")) / 1000.0
        self.probe = _Probe()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.probe.enter()
        try:
            if self.sleep_s:
                time.sleep(self.sleep_s)
            self.check(x)
            return self.head(self.pool(torch.relu(self.conv(x))).flatten(1))
        finally:
            self.probe.leave(x.shape[0])

    def check(self, x: torch.Tensor) -> None:
        """Hook for the fault models: runs inside forward, before the maths."""


class PoisonNet(SteadyNet):
    """Raises on any batch holding a marked frame, like a model with a data-dependent bug."""

    def check(self, x: torch.Tensor) -> None:
        if bool(_has_marker(x).any()):
            raise ValueError("poisoned input (marked frame)")


class StallNet(SteadyNet):
    """A batch holding a marked frame takes STREAMFER_REL_STALL_S, e.g. longer than max.poll.interval.ms."""

    def __init__(self) -> None:
        super().__init__()
        self.stall_s = float(os.environ.get("STREAMFER_REL_STALL_S", "0"))

    def check(self, x: torch.Tensor) -> None:
        if self.stall_s and bool(_has_marker(x).any()):
            self.probe.stalling(True)
            try:
                time.sleep(self.stall_s)
            finally:
                self.probe.stalling(False)


def _seeded(cls: type[SteadyNet]) -> SteadyNet:
    torch.manual_seed(0)
    return cls()


def steady_model() -> nn.Module:
    return _seeded(SteadyNet)


def poison_model() -> nn.Module:
    return _seeded(PoisonNet)


def stall_model() -> nn.Module:
    return _seeded(StallNet)
