"""Model loading, preprocessing and the eager / CUDA-graph runners behind one `InferenceExecutor`.

The pipeline imports from here only. Nothing in this package imports Kafka or the pipeline stages. The names below
load on first use, so a torch-free module of this package (`decode`: frame bytes to pixels) is imported without
torch: verdict reuse's thumbnails (worker.reuse.thumbnail) decode with it on the loop's side.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.runtime.executor import InferenceExecutor
    from worker.runtime.models import ModelContract, ModelContractError, build_builtin_model, load_model
    from worker.runtime.preprocess import FrameDecodeError
    from worker.runtime.start import StartedRuntime, start_runtime

_WHERE = {
    "FrameDecodeError": "worker.runtime.preprocess",
    "InferenceExecutor": "worker.runtime.executor",
    "ModelContract": "worker.runtime.models",
    "ModelContractError": "worker.runtime.models",
    "StartedRuntime": "worker.runtime.start",
    "build_builtin_model": "worker.runtime.models",
    "load_model": "worker.runtime.models",
    "start_runtime": "worker.runtime.start",
}

__all__ = [
    "FrameDecodeError",
    "InferenceExecutor",
    "ModelContract",
    "ModelContractError",
    "StartedRuntime",
    "build_builtin_model",
    "load_model",
    "start_runtime",
]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'worker.runtime' has no attribute {name!r}")
