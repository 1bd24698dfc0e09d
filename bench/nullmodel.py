"""A near-zero model for the benchmarks: the mean colour of the frame through one linear layer.

Its cost is a few microseconds per frame, so a worker running it spends its time in the pipeline itself
(consume, decode, resize, batch, produce, commit): what the "pipeline cost" figures measure.
Named as `model.source = "bench.nullmodel:null_model"` (the project root on the path, as the benchmarks run).
"""

from __future__ import annotations

import torch
from torch import nn

NUM_LABELS = 5  # the default model.labels


class MeanColour(nn.Module):
    def __init__(self, channels: int = 3) -> None:
        super().__init__()
        self.head = nn.Linear(channels, NUM_LABELS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x.mean(dim=(2, 3)))


def null_model() -> nn.Module:
    torch.manual_seed(0)
    return MeanColour().eval()
