"""What the loop and its parts need of the two objects at its edges, described once: the frame source
(worker.kafka.consumer.FrameSource) and the runtime (worker.runtime.InferenceExecutor). The pipeline, flow control,
the in-flight batches and delivery all take these two, so each class is described in one place."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Protocol

from worker.devices.memory import BatchSizeLimit
from worker.frames import TP, BatchOutcome, Frame, Polled, Priority, RebalanceHandler, RevokeHandler
from worker.partitions.assignment import Assignments


class Source(Protocol):
    """What the loop needs from the consumer side (worker.kafka.consumer.FrameSource)."""

    # Owned by the source (assigned and released in its rebalance callbacks); read by the loop and delivery.
    @property
    def assignments(self) -> Assignments: ...

    @property
    def paused_partitions(self) -> int: ...

    def subscribe(self, on_assign: RebalanceHandler, on_revoke: RevokeHandler,
                  on_lost: RebalanceHandler) -> None: ...

    def poll(self, max_messages: int, timeout_s: float) -> Polled: ...

    def pause_classes(self, classes: set[Priority], held: frozenset[TP] = frozenset()) -> None: ...

    @property
    def awaiting_committed_offset(self) -> frozenset[TP]: ...

    def seek_to_committed(self, tps: list[TP]) -> None: ...

    def caught_up(self) -> bool: ...

    def lag(self) -> dict[TP, int]: ...

    def commit(self, points: dict[TP, int], asynchronous: bool = False,
               metadata: dict[TP, str] | None = None) -> None: ...

    def group_metadata(self) -> object: ...

    def close(self) -> None: ...


class Executor(Protocol):
    """What the loop needs from the runtime (worker.runtime.InferenceExecutor)."""

    preferred_batch_sizes: tuple[int, ...]
    # The model's fixed input (height, width), or None when it takes each batch's own size.
    model_input_hw: tuple[int, int] | None
    model_name: str
    model_version: str

    @property
    def memory_policy(self) -> BatchSizeLimit | None:
        """Device memory peaks per shape measured at warm-up (CUDA), or None: a cap on each shape's batch size."""

    @property
    def runner_count(self) -> int:
        """Runners that execute batches at once: the loop keeps each of them fed."""

    def submit(self, frames: Sequence[Frame], shape: tuple[int, int, int],
               priority: Priority = Priority.BULK) -> Future[BatchOutcome]: ...
