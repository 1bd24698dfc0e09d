"""Process-level start-up of the worker (worker/app.py) that needs no broker."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from worker.app import freeze_startup_heap


class Node:
    """A cycle: only the garbage collector, never reference counting, can free one."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()  # the test process's heap goes back where collections walk it


def test_objects_alive_at_start_up_are_frozen_and_no_longer_walked_by_collections(unfrozen: None) -> None:
    survivor = Node()
    assert any(o is survivor for o in gc.get_objects())

    frozen = freeze_startup_heap()

    assert frozen == gc.get_freeze_count() > 0
    assert not any(o is survivor for o in gc.get_objects())  # a full collection no longer visits it
    made_later = Node()
    assert any(o is made_later for o in gc.get_objects())  # what the loop makes afterwards still is


def test_garbage_is_collected_before_the_heap_is_frozen(unfrozen: None) -> None:
    collected: list[int] = []

    def on_collect(phase: str, info: dict[str, int]) -> None:
        if phase == "stop":
            collected.append(info["collected"])

    Node()  # a cycle nothing refers to: garbage until a collection
    gc.callbacks.append(on_collect)
    try:
        freeze_startup_heap()
    finally:
        gc.callbacks.remove(on_collect)
    assert sum(collected) >= 1  # freed, not frozen forever
