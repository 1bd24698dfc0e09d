"""The writer-schema hold's part in a poll, in the order a poll plays it (pure: no Kafka import). With a Schema
Registry, registry-framed frames wait on their partition for their writer schema (worker.kafka.schemalookups,
worker.kafka.schemahold); without one, every step is nothing, and the poll pays one `is None` per message.

1. before the poll's messages: what the registry's answers released, decoded (tracked when they were held);
2. per message: held (`held.admit`), or decoded now;
3. after them: the lookups the new holds need are asked, the pinned count reported, and the partitions the hold
   pauses handed to the pause union;
4. a partition given up or rewound: its held messages dropped (read again by its next reading).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Generic, Protocol, TypeVar

from worker.codec import schemas
from worker.config import LimitsSettings
from worker.frames import TP, DeadLetter, Frame, Polled, Priority, SourceRef


class WriterSchemas(schemas.WriterSchemas, Protocol):
    """What the gate needs of worker.kafka.schemalookups.HeldFrames (and decode_frame of it)."""

    def admit(self, tp: TP, message: Any, value: bytes | None) -> bool: ...

    def decode_released(self, now: float, priorities: Mapping[str, Priority], limits: LimitsSettings,
                        is_current: Callable[[SourceRef], bool]) -> tuple[list[Frame], list[DeadLetter],
                                                                          set[SourceRef]]: ...

    def ask_due(self) -> None: ...

    def drop(self, tps: list[TP]) -> int: ...

    @property
    def paused(self) -> frozenset[TP]: ...

    @property
    def pinned_frames(self) -> int: ...

    def close(self) -> None: ...


H = TypeVar("H", bound=WriterSchemas)


class SchemaGate(Generic[H]):
    """The hold's steps in a poll; `held` is the registry's HeldFrames, or None without a registry."""

    def __init__(self, held: H | None) -> None:
        self.held = held

    def released_into(self, polled: Polled, now: float, priorities: Mapping[str, Priority], limits: LimitsSettings,
                      is_current: Callable[[SourceRef], bool]) -> None:
        """Step 1: what the registry's answers released, ahead of this poll's messages."""
        if self.held is not None:
            polled.frames, polled.dead_letters, polled.released = self.held.decode_released(
                now, priorities, limits, is_current)

    def after_messages(self, polled: Polled) -> None:
        """Step 3: ask the lookups the poll's new holds need; report the offsets no commit passes yet."""
        if self.held is not None:
            if polled.held:
                self.held.ask_due()
            polled.pinned_frames = self.held.pinned_frames

    @property
    def paused(self) -> frozenset[TP]:
        """The partitions the hold pauses (one holding its byte bound)."""
        return self.held.paused if self.held is not None else frozenset()

    def drop_partitions(self, tps: Iterable[TP]) -> None:
        """Step 4: uncommitted, the held messages are read again by the partition's next reading."""
        if self.held is not None:
            self.held.drop(list(tps))

    def close(self) -> None:
        if self.held is not None:
            self.held.close()
