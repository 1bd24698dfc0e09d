"""A partition's state has one lifetime (worker.partitions.lifetime): once a partition is revoked or lost, nothing
the loop or its source keeps still names it. The walk below reaches every object of the pipeline, so a new holder of
per-partition state that the one drop does not reach fails these tests, whatever it is called."""

from __future__ import annotations

import dataclasses
import types
from collections import deque
from collections.abc import Collection
from dataclasses import fields, is_dataclass
from typing import Any

import pytest

from tests.unit.test_pipeline import P0, P1, World
from worker.codec.resultwriter import ResultWriter
from worker.config import BatchingSettings, Settings
from worker.frames import TP, Frame, SourceRef
from worker.loop.pipeline import Pipeline
from worker.partitions.assignment import Assignments
from worker.partitions.lifetime import PartitionStates
from worker.testing import FakeConsumer, FakeExecutor, FakeProducer

# Kept on purpose after a partition is given up: the last epoch of each partition, so a re-assignment gets a newer
# one and the stale work of the old one is told apart (worker.partitions.assignment).
# And the result encoder's cache of each partition's encoded bytes: a value of the name alone, bounded, the same
# under any owner.
KEPT = {(Assignments, "._last_epoch"), (ResultWriter, "._partitions")}
# The test doubles stand for the broker and the runtime, whose records name every partition: not the loop's state.
DOUBLES = (FakeConsumer, FakeProducer, FakeExecutor, Settings)
CONTAINERS = (dict, list, tuple, set, frozenset, deque)
WALKED = (*CONTAINERS, types.FunctionType, types.MethodType)


def names(value: Any, tp: TP) -> bool:
    if isinstance(value, tuple) and value == tp:
        return True
    if isinstance(value, SourceRef):
        return value.topic_partition == tp
    return isinstance(value, Frame) and value.source.topic_partition == tp


def children(obj: Any) -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        return [(f"[{k!r}]", v) for k, v in obj.items()] + [(f".key({k!r})", k) for k in obj]
    if isinstance(obj, list | tuple | set | frozenset | deque):
        return [(f"[{i}]", v) for i, v in enumerate(obj)]
    if isinstance(obj, types.MethodType):
        return [(".__self__", obj.__self__)]
    if isinstance(obj, types.FunctionType):
        return [(f".<closure {i}>", c.cell_contents) for i, c in enumerate(obj.__closure__ or ())
                if c.cell_contents is not None]
    out: list[tuple[str, Any]] = []
    if hasattr(obj, "__dict__"):
        out += [(f".{k}", v) for k, v in vars(obj).items()]
    for cls in type(obj).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            if hasattr(obj, slot):
                out.append((f".{slot}", getattr(obj, slot)))
    if is_dataclass(obj) and not out:
        out = [(f".{f.name}", getattr(obj, f.name)) for f in fields(obj)]
    return out


def holders_of(root: Pipeline, tp: TP) -> list[str]:
    """The paths (from the pipeline) of everything the loop's own objects hold that still names `tp`."""
    found: list[str] = []
    seen: set[int] = set()
    queue: deque[tuple[str, Any]] = deque([("pipeline", root)])
    while queue:
        path, obj = queue.popleft()
        if id(obj) in seen or isinstance(obj, (*DOUBLES, str, bytes, int, float, type)):
            continue
        seen.add(id(obj))
        module = type(obj).__module__ or ""
        if not (module.startswith(("worker.", "tests.")) or isinstance(obj, WALKED)):
            continue  # prometheus, threads, locks: not where the loop keeps a partition's state
        for name, value in children(obj):
            if (type(obj), name) in KEPT:
                continue
            if names(value, tp):
                found.append(f"{path}{name}")
            else:
                queue.append((f"{path}{name}", value))
    return found


def busy_world(mode: str, reuse: bool) -> World:
    """Two partitions read, their frames scored, committed, and some still in flight or held: every kind of
    per-partition state exists for both."""
    batching = BatchingSettings(rare_shape_min_count=1, max_batch_size=4)
    if reuse:
        batching = dataclasses.replace(batching, bulk=dataclasses.replace(batching.bulk, reuse_max_age_ms=10_000))
    w = World(mode, hold=True, batching=batching)
    w.assign([P0, P1])
    for tp in (P0, P1):
        w.frames(tp, 6)
    w.step(3)
    w.executor.release()
    w.step(3)
    for tp in (P0, P1):
        w.frames(tp, 3, start=6)
    w.step(2)
    w.pipeline.update_lag()
    return w


@pytest.mark.parametrize("mode", ["at_least_once", "exactly_once"])
@pytest.mark.parametrize("reuse", [False, True])
@pytest.mark.parametrize("how", ["revoke", "lost"])
def test_nothing_of_a_partition_given_up_is_kept(mode: str, reuse: bool, how: str) -> None:
    w = busy_world(mode, reuse)
    assert holders_of(w.pipeline, P1), "the walk must see the partition's state while it is owned"
    if how == "revoke":
        w.executor.hold = False  # a revoke waits for the partition's batches running, to deliver them
        w.executor.release()
    w.kafka.rebalance(how, [P1])
    w.step()  # the rebalance is served inside its poll; nothing after it in this turn
    w.executor.release()  # a lost partition's stale batches finish: their outputs are dropped, nothing kept
    w.pipeline._collect_finished(wait=True)
    w.pipeline._emit()  # delivery drops outputs of an ended epoch
    assert holders_of(w.pipeline, P1) == []
    assert holders_of(w.pipeline, P0), "the partition still owned keeps its state"


class Keeper:
    """A per-partition holder that the one drop does not list."""

    def __init__(self) -> None:
        self.seen: dict[TP, int] = {}

    def drop_partitions(self, tps: Collection[TP]) -> None:
        for tp in tps:
            self.seen.pop(tp, None)


def test_a_holder_left_out_of_the_one_drop_is_found() -> None:
    w = busy_world("at_least_once", reuse=False)
    keeper = Keeper()
    keeper.seen[P1] = 1
    w.pipeline.flow.keeper = keeper  # type: ignore[attr-defined]  # a new part of the loop, forgotten in the list
    w.executor.hold = False
    w.executor.release()
    w.kafka.rebalance("revoke", [P1])
    w.step()
    assert holders_of(w.pipeline, P1) == ["pipeline.flow.keeper.seen.key(('frames.bulk', 1))"]
    listed = w.pipeline.partition_state
    w.pipeline.partition_state = PartitionStates(read=listed.read + (keeper,), owned=listed.owned)
    keeper.seen[P1] = 1
    w.kafka.rebalance("assign", [P1])
    w.step()
    w.kafka.rebalance("revoke", [P1])
    w.step()
    assert holders_of(w.pipeline, P1) == []


def test_a_rewind_drops_what_was_read_and_keeps_what_belongs_to_owning_the_partition() -> None:
    dropped: list[tuple[str, list[TP]]] = []

    class Recorder:
        def __init__(self, name: str) -> None:
            self.name = name

        def drop_partitions(self, tps: Collection[TP]) -> None:
            dropped.append((self.name, sorted(tps)))

    states = PartitionStates(read=(Recorder("tracker"), Recorder("reuse")), owned=(Recorder("dedup"),))
    states.drop_partitions([P0], rewind=True)
    assert dropped == [("tracker", [P0]), ("reuse", [P0])]
    dropped.clear()
    states.drop_partitions([P1])
    assert dropped == [("tracker", [P1]), ("reuse", [P1]), ("dedup", [P1])]
