"""The one thread's turn: the loop and its parts.

- `pipeline`: the orchestrator (`Pipeline.step`, `build_pipeline`).
- `admission`: what a poll read, into the loop (tracked, repeats, expired, reuse, the batcher).
- `inflight`: the batches handed to the runtime.
- `answers`: each frame's answer (results, `EXPIRED`, dead letters) and its metrics.
- `delivery`: the commit protocol, at-least-once or exactly-once behind one interface.
- `flow`: which partitions to pause and how much a poll takes.
- `ports`: what the loop needs of its two edges (`Source`, `Executor`), as Protocols.
"""
