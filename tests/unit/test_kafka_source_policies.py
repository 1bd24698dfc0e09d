"""The consumer's pure policies alone, each over fakes, no Kafka client: the pause union (worker.kafka.pauses),
the guard against offsets delivered twice (worker.kafka.redelivery) and the writer-schema hold's steps in a poll
(worker.kafka.schemagate). FrameSource applies them (tests/unit/test_source.py)."""

from __future__ import annotations

import ast
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import worker.kafka.pauses as pauses_module
import worker.kafka.redelivery as redelivery_module
import worker.kafka.schemagate as schemagate_module
from worker.config import LimitsSettings
from worker.frames import TP, DeadLetter, Frame, Polled, Priority, SourceRef
from worker.kafka.pauses import PauseUnion
from worker.kafka.redelivery import RedeliveryGuard
from worker.kafka.schemagate import SchemaGate

BULK, RT = "frames.bulk", "frames.realtime"
TOPICS = {BULK: Priority.BULK, RT: Priority.REALTIME}
B0, B1, R0 = (BULK, 0), (BULK, 1), (RT, 0)
ALL = [B0, B1, R0]


@pytest.mark.parametrize("module", [pauses_module, redelivery_module, schemagate_module])
def test_the_policies_import_no_kafka_client_and_no_torch(module: ModuleType) -> None:
    tree = ast.parse(Path(module.__file__ or "").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported.isdisjoint({"confluent_kafka", "torch"})


# -- the pause union ---------------------------------------------------------------------------------------------
def test_each_of_the_four_reasons_pauses_and_their_end_resumes() -> None:
    union = PauseUnion(TOPICS)
    assert union.plan(ALL, set(), frozenset()) == ([], [])
    assert union.request({Priority.BULK}, frozenset())
    assert union.plan(ALL, set(), frozenset()) == ([B0, B1], [])  # a paused class
    assert union.request(set(), frozenset({R0}))
    assert union.plan(ALL, set(), frozenset()) == ([R0], [B0, B1])  # one waiting for its siblings
    assert union.request(set(), frozenset())
    assert union.plan(ALL, {B1}, frozenset()) == ([B1], [R0])  # waiting for its committed offset
    assert union.plan(ALL, set(), frozenset({B0})) == ([B0], [B1])  # holding frames for their writer schema
    assert union.plan(ALL, set(), frozenset()) == ([], [B0]) and len(union) == 0


def test_a_partition_paused_for_two_reasons_stays_paused_until_both_end() -> None:
    union = PauseUnion(TOPICS)
    union.request({Priority.BULK}, frozenset())
    assert union.plan(ALL, {B0}, frozenset()) == ([B0, B1], [])
    union.request(set(), frozenset())
    assert union.plan(ALL, {B0}, frozenset()) == ([], [B1]) and len(union) == 1
    assert union.plan(ALL, set(), frozenset()) == ([], [B0])


def test_partitions_resume_highest_class_first() -> None:
    union = PauseUnion(TOPICS)
    union.request({Priority.BULK, Priority.REALTIME}, frozenset())
    union.plan(ALL, set(), frozenset())
    union.request(set(), frozenset())
    assert union.plan(ALL, set(), frozenset()) == ([], [R0, B0, B1])


def test_only_assigned_partitions_are_paused() -> None:
    union = PauseUnion(TOPICS)
    union.request({Priority.BULK}, frozenset({R0}))
    assert union.plan([B1], {B0}, frozenset({R0})) == ([B1], [])


def test_an_unchanged_request_asks_for_nothing_and_a_changed_schema_hold_is_seen() -> None:
    union = PauseUnion(TOPICS)
    assert not union.request(set(), frozenset())
    assert union.request({Priority.BULK}, frozenset()) and not union.request({Priority.BULK}, frozenset())
    assert not union.schemas_changed(frozenset())
    assert union.schemas_changed(frozenset({B0}))
    union.plan(ALL, set(), frozenset({B0}))
    assert not union.schemas_changed(frozenset({B0}))


def test_a_dropped_partition_is_no_longer_counted_paused_and_is_paused_again_when_it_returns() -> None:
    union = PauseUnion(TOPICS)
    union.request({Priority.BULK}, frozenset())
    union.plan(ALL, set(), frozenset())
    union.drop_partitions([B0])
    assert len(union) == 1
    assert union.plan(ALL, set(), frozenset()) == ([B0], [])


# -- the redelivery guard ----------------------------------------------------------------------------------------
def test_offsets_below_the_next_one_are_repeats_and_logged_once_per_poll(caplog: pytest.LogCaptureFixture) -> None:
    guard = RedeliveryGuard()
    guard.poll_started()
    assert [guard.fresh(B0, o) for o in (5, 6, 7)] == [True, True, True]
    with caplog.at_level(logging.WARNING, logger=redelivery_module.__name__):
        assert [guard.fresh(B0, o) for o in (6, 7)] == [False, False]
        assert guard.fresh(B0, 8) and guard.fresh(B1, 0)
        guard.poll_started()
        assert not guard.fresh(B0, 3)
    assert [r.getMessage() for r in caplog.records] == [
        "the consumer delivered ('frames.bulk', 0) again from offset 6 (already read up to 7): dropping the offsets "
        "already read",
        "the consumer delivered ('frames.bulk', 0) again from offset 3 (already read up to 8): dropping the offsets "
        "already read"]


def test_a_dropped_partition_starts_a_new_reading_anywhere() -> None:
    guard = RedeliveryGuard()
    assert guard.fresh(B0, 10) and guard.fresh(B1, 10)
    guard.drop_partitions([B0])
    assert guard.fresh(B0, 2)
    assert not guard.fresh(B1, 2)


def test_delivered_past_tells_whether_the_reading_reached_an_offset() -> None:
    guard = RedeliveryGuard()
    assert not guard.delivered_past(B0, 4)
    guard.fresh(B0, 3)
    assert not guard.delivered_past(B0, 4)
    guard.fresh(B0, 4)
    assert guard.delivered_past(B0, 4)


# -- the writer-schema gate --------------------------------------------------------------------------------------
class FakeHeldFrames:
    """Records the gate's calls; holds what `admit` is told to, releases what a test queues."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.paused: frozenset[TP] = frozenset()
        self.pinned_frames = 0
        self.to_release: tuple[list[Frame], list[DeadLetter], set[SourceRef]] = ([], [], set())
        self.dropped: list[list[TP]] = []

    def writer_schema(self, schema_id: int) -> Any:
        return None

    def admit(self, tp: TP, message: Any, value: bytes | None) -> bool:
        return True

    def decode_released(self, now: float, priorities: Mapping[str, Priority], limits: LimitsSettings,
                        is_current: Callable[[SourceRef], bool]) -> tuple[list[Frame], list[DeadLetter],
                                                                          set[SourceRef]]:
        self.calls.append("decode_released")
        return self.to_release

    def ask_due(self) -> None:
        self.calls.append("ask_due")

    def drop(self, tps: list[TP]) -> int:
        self.dropped.append(tps)
        return 0

    def close(self) -> None:
        self.calls.append("close")


def empty_poll() -> Polled:
    return Polled(frames=[], dead_letters=[])


def test_without_a_registry_every_step_is_nothing() -> None:
    gate: SchemaGate[FakeHeldFrames] = SchemaGate(None)
    polled = empty_poll()
    gate.released_into(polled, 0.0, TOPICS, LimitsSettings(), lambda ref: True)
    gate.after_messages(polled)
    gate.drop_partitions([B0])
    gate.close()
    assert polled == empty_poll() and gate.paused == frozenset() and gate.held is None


def test_released_messages_come_ahead_of_the_poll_and_are_marked_as_tracked_already() -> None:
    held = FakeHeldFrames()
    ref = SourceRef(BULK, 0, 4, 1)
    dead = DeadLetter(source=ref, reason="no schema", error_type="MessageDecodeError")
    held.to_release = ([], [dead], {ref})
    polled = empty_poll()
    SchemaGate(held).released_into(polled, 0.0, TOPICS, LimitsSettings(), lambda r: True)
    assert polled.dead_letters == [dead] and polled.released == {ref}


def test_lookups_are_asked_only_after_a_poll_that_held_and_the_pinned_count_is_reported() -> None:
    held = FakeHeldFrames()
    held.pinned_frames = 3
    gate = SchemaGate(held)
    polled = empty_poll()
    gate.after_messages(polled)
    assert held.calls == [] and polled.pinned_frames == 3
    polled.held.append(SourceRef(BULK, 0, 9, 1))
    gate.after_messages(polled)
    assert held.calls == ["ask_due"]


def test_the_gate_passes_on_the_holds_pauses_drops_and_close() -> None:
    held = FakeHeldFrames()
    held.paused = frozenset({B1})
    gate = SchemaGate(held)
    gate.drop_partitions(tp for tp in [B0, R0])
    gate.close()
    assert gate.paused == {B1} and held.dropped == [[B0, R0]] and held.calls == ["close"]
