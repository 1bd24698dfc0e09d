"""Device budgets: pure policy, no torch.

- `memory`: the largest batch per shape under a device-memory fraction; the byte budget for captured graphs.
- `graphplan`: which CUDA graphs a runner captures, replays, skips and releases.
"""
