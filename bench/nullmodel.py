"""A near-zero model for the benchmarks: its forward is a slice of its input (five values as five labels).

It costs next to nothing, so a worker or executor running it spends its time in the pipeline itself (consume,
decode, resize, normalise, batch, produce, commit): what the "pipeline cost" figures measure.
Named as `model.source = "bench.nullmodel:null_model"` from the project root (the worker processes the
benchmarks start), or `nullmodel:null_model` with bench/ on the path (bench/preprocess_cost.py's rounds).
"""

from __future__ import annotations

import torch
from torch import nn


class NearZero(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Five values (the default model.labels are five) as a view: flatten() would copy the whole batch when the
        # input is channels_last (what the Normaliser hands an NCHW model), and that copy is not the pipeline's.
        return x[:, 0, 0, :5]


def null_model() -> nn.Module:
    return NearZero()
