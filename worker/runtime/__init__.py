"""Model loading, preprocessing and the eager / CUDA-graph runners behind one `InferenceExecutor`.

The pipeline imports from here only. Nothing in this package imports Kafka or the pipeline stages.
"""

from worker.runtime.decode import FrameDecodeError
from worker.runtime.executor import InferenceExecutor
from worker.runtime.models import ModelContract, ModelContractError, build_builtin_model, load_model
from worker.runtime.start import StartedRuntime, start_runtime

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
