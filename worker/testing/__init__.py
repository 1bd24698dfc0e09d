"""A test kit for code around the worker, so a team tests its camera ingest or its consumer of results against the
real worker and a real Kafka broker in its own CI; the project's own tests and benchmarks (bench/) use the same
functions. docs/testing.md has an example.

- `plugin`: the pytest plugin (entry point `pytest11`): the fixtures `kafka_bootstrap`, `streamfer_topics`,
  `streamfer_worker`, `frame_producer`, `results_reader`, `schema_registry`, `registry_frame_producer`.
- `broker`: which broker a session gets (`kafka_broker`, `local_broker_pid`).
- `kafka`: the broker helpers: a test's topics (`TestTopics`, `make_topics`), `FrameProducer`, `ResultsReader`,
  offsets probes (`committed_offsets`, `end_offsets`, `wait_committed`, `uncommitted`), `synthetic_frames`.
- `workers`: `worker run` processes (`run_worker`, `start_worker`, `RunningWorker`, `settings_env`, `TEST_ENV`)
  and small waits (`wait_for`, `http_get`).
- `otlp`: `OtlpReceiver`, an OTLP/HTTP trace collector on the loopback address (`tracing.endpoint`), each export
  request's body handed to a callback.

The in-memory kit, loaded on first use: `InMemoryKafka`, `FakeConsumer`, `FakeProducer` and `FakeExecutor`
(worker.testing.fakes) run the real loop without a broker or a model; `FakeClock` (worker.testing.clock) for every
part that takes a clock; `FrameLedger` and `ledger` (worker.testing.frameledger) check what became of each frame.
Importing the kit loads neither pytest's fixtures, nor Kafka, nor Avro.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from worker.testing.broker import kafka_broker, local_broker_pid
from worker.testing.kafka import (
    FrameProducer,
    ResultsReader,
    TestTopics,
    committed_offsets,
    end_offsets,
    make_topics,
    synthetic_frames,
    uncommitted,
    wait_committed,
)
from worker.testing.workers import (
    TEST_ENV,
    RunningWorker,
    WorkerStartError,
    http_get,
    run_worker,
    settings_env,
    start_worker,
    wait_for,
)

__all__ = [
    "TEST_ENV", "FrameProducer", "ResultsReader", "RunningWorker", "TestTopics", "WorkerStartError",
    "committed_offsets", "end_offsets", "http_get", "kafka_broker", "local_broker_pid", "make_topics", "run_worker",
    "settings_env", "start_worker", "synthetic_frames", "uncommitted", "wait_committed", "wait_for",
]


# -- the in-memory kit, re-exported (imported on first use: the plugin stays free of Kafka and Avro) -------------
_KIT = {
    "worker.testing.clock": ("START", "FakeClock"),
    "worker.testing.fakes": ("CAPTURE_TS_MS", "FakeConsumer", "FakeExecutor", "FakeMessage", "FakeProducer",
                             "InMemoryKafka", "Produced", "abortable", "frame_value", "outcome"),
    "worker.testing.frameledger": ("DEAD_LETTER", "EITHER", "RESULT", "FrameLedger", "dead_letter_source", "ledger",
                              "result_source"),
}
_KIT_MODULE = {name: module for module, names in _KIT.items() for name in names}

if TYPE_CHECKING:  # the names mypy sees; __getattr__ loads them at run time
    from worker.testing.clock import START, FakeClock  # noqa: F401
    from worker.testing.fakes import (  # noqa: F401
        CAPTURE_TS_MS,
        FakeConsumer,
        FakeExecutor,
        FakeMessage,
        FakeProducer,
        InMemoryKafka,
        Produced,
        abortable,
        frame_value,
        outcome,
    )
    from worker.testing.frameledger import (  # noqa: F401
        DEAD_LETTER,
        EITHER,
        RESULT,
        FrameLedger,
        dead_letter_source,
        ledger,
        result_source,
    )


def __getattr__(name: str) -> Any:
    module = _KIT_MODULE.get(name)
    if module is None:
        raise AttributeError(f"module 'worker.testing' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
