"""Model loading, preprocessing and the eager / CUDA-graph runners behind one `InferenceExecutor`.

The pipeline imports from here only. Nothing in this package imports Kafka or the pipeline stages.
"""

from worker.runtime.executor import InferenceExecutor
from worker.runtime.models import ModelContract, ModelContractError, build_builtin_model, load_model
from worker.runtime.preprocess import FrameDecodeError

__all__ = [
    "FrameDecodeError",
    "InferenceExecutor",
    "ModelContract",
    "ModelContractError",
    "build_builtin_model",
    "load_model",
]
