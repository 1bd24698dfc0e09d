"""Model loading, preprocessing and the eager / CUDA-graph runners behind one `InferenceExecutor`.

The pipeline imports from here only. Nothing in this package imports Kafka or the pipeline stages.
"""

from worker.runtime.executor import (
    DECODE_ERROR,
    MODEL_ERROR,
    NON_FINITE_OUTPUT,
    BatchOutcome,
    FrameFailure,
    InferenceExecutor,
)
from worker.runtime.models import ModelContract, ModelContractError, build_builtin_model, load_model
from worker.runtime.preprocess import FrameDecodeError

__all__ = [
    "DECODE_ERROR",
    "MODEL_ERROR",
    "NON_FINITE_OUTPUT",
    "BatchOutcome",
    "FrameDecodeError",
    "FrameFailure",
    "InferenceExecutor",
    "ModelContract",
    "ModelContractError",
    "build_builtin_model",
    "load_model",
]
