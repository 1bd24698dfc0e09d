"""Model factories for integration tests, loaded by the worker as `tests.integration.models:<name>`."""

from __future__ import annotations

import time

import torch
from torch import nn

# Frames of this height make the slow model stall; warm-up (224x224) and other frames run at full speed.
SLOW_HEIGHT = 40
SLOW_SECONDS = 9.0


class _SlowOnHeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, kernel_size=3, stride=2, padding=1)
        self.head = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[2] == SLOW_HEIGHT:
            time.sleep(SLOW_SECONDS)  # a stalled GPU, a huge frame: longer than max.poll.interval.ms
        return self.head(torch.relu(self.conv(x)).mean(dim=(2, 3)))


def slow_on_40px_frames() -> nn.Module:
    torch.manual_seed(0)
    return _SlowOnHeight().eval()


class _Paced(nn.Module):
    """A model whose batch time is set by construction (sleep, GIL released), so an overload test offers a
    known multiple of capacity whatever else the machine runs."""

    def __init__(self, fixed_s: float, per_frame_s: float) -> None:
        super().__init__()
        self.fixed_s, self.per_frame_s = fixed_s, per_frame_s
        self.head = nn.Linear(3, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.fixed_s + self.per_frame_s * x.shape[0])
        return self.head(x.mean(dim=(2, 3)))


PACED_FIXED_S = 0.020
PACED_PER_FRAME_S = 0.004


def paced_model() -> nn.Module:
    torch.manual_seed(0)
    return _Paced(PACED_FIXED_S, PACED_PER_FRAME_S).eval()
