"""How far a CUDA graph replay's scores may be from an eager run's (on the GPU or the CPU): rounding only, set by
what the hardware does. Every fp32 replay test compares with `replay_tolerance(device)`.

Replay and eager run the same operations on the same weights, so they differ by floating-point rounding, never by
logic:
- On a GPU of compute capability 8.0 or later, cuDNN convolutions take TF32 by default
  (`torch.backends.cudnn.allow_tf32`; cuBLAS matmuls too when `torch.backends.cuda.matmul.allow_tf32`): each input
  and weight is cut to 10 mantissa bits, a unit roundoff u = 2**-11 (4.9e-4) instead of fp32's 2**-24. The CPU
  runs fp32.
- cuDNN picks kernels per batch size and memory format, so a batch padded to its bucket and the same batch run
  eagerly sum in other orders, and one may use TF32 where the other does not.
A score is therefore off by a fraction of u. Emulated on the CPU for the builtin model on the replay tests'
batches (every convolution's and linear layer's input and weight cut to 10 bits:
`test_the_replay_tolerance_covers_tf32_and_not_a_region_one_row_off` in test_runtime_runners.py), scores move by
at most 1.3e-3 when truncating (1.8e-4 when rounding to nearest); open_nsfw's by at most 7e-5 (its softmax
saturates). The tolerance is 4u = 2**-9 = 1.95e-3, absolute, on scores in [0, 1]: 1.5x the truncating worst
case, and still below the smallest logic error these tests guard against (a padding region one row too tall
moves a score by 2.8e-3 or more; padding left as pixels, by 5.5e-2).
On the H200 a graph and CPU eager differed by 3.2e-5, against the 1e-5 allowed before.
Without TF32 (an older GPU, or TF32 switched off) both sides are fp32 and only the order of each output's sum
changes: up to K u for K terms, so 4 u K with K = 512 (the builtin model sums at most 288) = 2**-13 = 1.2e-4.
Lower precisions (fp16, bf16 autocast) are compared with fp32 on purpose by their own tests, not with this.
"""

from __future__ import annotations

import torch

TF32_UNIT_ROUNDOFF = 2.0 ** -11
FP32_UNIT_ROUNDOFF = 2.0 ** -24
TERMS_PER_SUM = 512
HEADROOM = 4


def tf32_in_use(device: torch.device) -> bool:
    """Whether convolutions or matmuls on `device` may round their fp32 inputs to TF32."""
    if device.type != "cuda":
        return False
    allowed = torch.backends.cudnn.allow_tf32 or torch.backends.cuda.matmul.allow_tf32
    return allowed and torch.cuda.get_device_capability(device)[0] >= 8


def replay_tolerance(device: torch.device) -> dict[str, float]:
    """`assert_close` / `assert_allclose` keywords for scores of a graph replay on `device` against eager."""
    unit = TF32_UNIT_ROUNDOFF if tf32_in_use(device) else FP32_UNIT_ROUNDOFF * TERMS_PER_SUM
    return {"rtol": 0.0, "atol": HEADROOM * unit}
