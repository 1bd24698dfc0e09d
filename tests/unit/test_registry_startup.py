"""Start-up against a Schema Registry that cannot be reached or refuses (worker.kafka.registry.connect_registry):
an unreachable one (or HTTP 5xx/429) is waited for with backoff while /readyz says why; a refusal still ends
start-up with an operator's error (exit 2)."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka.schema_registry.error import SchemaRegistryError

import worker.kafka.registry as registry_module
from tests.unit.test_health import OWNING, SourceStub
from worker.config import SchemaRegistrySettings, Settings
from worker.errors import OperatorError
from worker.kafka.registry import RegistryUnreachable, connect_registry
from worker.metrics import Health
from worker.testing import FakeClock

URL = "http://registry.invalid/apis/ccompat/v7"


class Registry:
    """register_schema failing with each of `failures` in turn, then answering id 7."""

    def __init__(self, *failures: Exception) -> None:
        self.failures = list(failures)
        self.calls = 0

    def register_schema(self, subject: str, schema: Any) -> int:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return 7


def connect(monkeypatch: pytest.MonkeyPatch, registry: Registry, **kwargs: Any) -> Any:
    monkeypatch.setattr(registry_module, "new_registry_client", lambda r, max_retries=1: registry)
    return connect_registry(Settings(schema_registry=SchemaRegistrySettings(url=URL)), **kwargs)


def test_an_unreachable_registry_is_waited_for_with_backoff_while_readiness_says_why(
        monkeypatch: pytest.MonkeyPatch) -> None:
    registry = Registry(ConnectionRefusedError("refused"), SchemaRegistryError(503, 50301, "unavailable"),
                        SchemaRegistryError(429, 42901, "slow down"))
    health, said, clock = Health(), [], FakeClock()
    started = clock.now

    def waiting(why: str | None) -> None:
        health.waiting_for = why
        said.append(why)

    link = connect(monkeypatch, registry, waiting=waiting, sleep=clock.advance, clock=clock)

    assert link is not None and link.result_framing == b"\x00\x00\x00\x00\x07"
    assert registry.calls == 4
    assert [s for s in said if s] == [f"the Schema Registry at {URL}, which does not answer (try {n}; next in {w}s)"
                                      for n, w in ((1, 1), (2, 2), (3, 4))]
    assert said[-1] is None and health.waiting_for is None  # answered: nothing to wait for
    assert clock.now - started == pytest.approx(7.0)  # 1 + 2 + 4 s, in short slices that watch for a stop


def test_a_refusal_ends_start_up_at_once_with_an_operators_error(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = Registry(SchemaRegistryError(401, 40101, "unauthorized"))
    with pytest.raises(OperatorError, match="HTTP 401") as refused:
        connect(monkeypatch, registry, sleep=lambda s: None)
    assert not isinstance(refused.value, RegistryUnreachable)
    assert registry.calls == 1


def test_a_stop_while_waiting_ends_start_up_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = Registry(*[ConnectionRefusedError("refused")] * 10)
    with pytest.raises(RegistryUnreachable, match="cannot reach the Schema Registry"):
        connect(monkeypatch, registry, should_stop=lambda: True, sleep=lambda s: None)
    assert registry.calls == 1


def test_readiness_names_what_start_up_waits_for_and_a_running_worker_s_registry_trouble() -> None:
    source = SourceStub(OWNING)
    health = Health(warmed_up=True, source=source)
    assert health.degraded == ""
    source.registry_problem = lambda: "schema registry not answering for 12s (ReadTimeout): 30 frames held"
    assert health.ready  # still serving everything that needs no lookup
    assert health.degraded == "; schema registry not answering for 12s (ReadTimeout): 30 frames held"
    health.waiting_for = "the Schema Registry at x"
    assert health.degraded.startswith("; waiting for the Schema Registry at x; schema registry not answering")
