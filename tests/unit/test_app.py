"""Process-level start-up of the worker (worker/app.py) that needs no broker."""

from __future__ import annotations

import dataclasses
import gc
import sys
import types
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from worker.app import GraphEvictions, Serving, StopFlag, freeze_startup_heap
from worker.config import load_settings
from worker.metrics import Health, Metrics
from worker.testing.fakes import FakeConsumer, InMemoryKafka


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


def test_the_worker_joins_its_group_only_once_the_model_is_warm(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replacement takes partitions only when it can serve them: the pipeline and its consumer are built once the
    runtime has started (warmed up), and the consumer subscribes (joins the group) when the loop runs."""
    sys.path.insert(0, str(Path(__file__).parent))  # model_factories, as model.source imports it
    import worker.app as app
    from worker.loop.pipeline import build_pipeline

    kafka = InMemoryKafka()
    health = Health()
    stop = StopFlag()
    warm_at_subscribe: list[bool] = []
    made_while_warm: list[bool] = []

    def consumer(conf: dict[str, Any], logger: Any = None) -> FakeConsumer:
        made_while_warm.append(health.warmed_up)
        fake: FakeConsumer = kafka.clients.consumer(conf, logger)
        subscribe = fake.subscribe

        def subscribed(*args: Any, **kwargs: Any) -> None:
            warm_at_subscribe.append(health.warmed_up)
            stop.set()  # one turn is enough
            subscribe(*args, **kwargs)

        fake.subscribe = subscribed  # type: ignore[method-assign]
        return fake

    clients = dataclasses.replace(kafka.clients, consumer=consumer)
    monkeypatch.setattr(app, "check_client_configs", lambda settings: None)
    monkeypatch.setattr(app, "probe_access", lambda settings: None)
    monkeypatch.setattr(app, "connect_registry", lambda settings, **kwargs: None)
    # No control topic here (worker.kafka.control reads it from the broker): the settings file's policy decides.
    # (issue 69: the follower of the control topic applies rollouts too; no model set is read before the start.)
    monkeypatch.setattr(app, "start_control_with_rollout",
                        lambda *args, **kwargs: types.SimpleNamespace(stop=lambda: None))
    monkeypatch.setattr("worker.app.read_desired", lambda settings: None)
    monkeypatch.setattr(app, "build_pipeline",
                        lambda *args, **kwargs: build_pipeline(*args, **{**kwargs, "clients": clients}))
    settings = load_settings(env={}, overrides={
        "model": {"source": "model_factories:tiny_model"},
        "runtime": {"device": "cpu", "warmup_batches": 1, "warmup_shapes": ["16x16"]},
        "observability": {"worker_id": "w-warm", "metrics_enabled": False}})

    app.run_worker(settings, stop=stop, health=health)

    assert made_while_warm == [True]
    assert warm_at_subscribe == [True]


class CountingRuntime:
    graph_evictions = 0


def test_graph_evictions_are_read_from_the_runtime_when_scraped() -> None:
    metrics, loaded, runtime = Metrics(), Future(), CountingRuntime()  # type: ignore[var-annotated]
    evictions = GraphEvictions(loaded, metrics)

    def counted() -> float:
        return metrics.registry.get_sample_value("streamfer_cuda_graph_evictions_total") or 0.0

    evictions.read()  # the model still loading: nothing to read
    serving = Serving(runtime)
    loaded.set_result(serving)
    runtime.graph_evictions = 3
    evictions.read()
    evictions.read()
    assert counted() == 3
    runtime.graph_evictions = 5
    evictions.read()
    assert counted() == 5
    # A promoted model's runners count from zero: its evictions add to the total, none lost, none counted twice.
    promoted = CountingRuntime()
    serving.executor = promoted
    promoted.graph_evictions = 2
    evictions.read()
    assert counted() == 7
