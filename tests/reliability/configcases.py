"""The bad-configuration cases: each invalid setting must stop `python -m worker run` at start-up with exit
code 2 and an error naming the setting, never a traceback, a crash later, or a worker that runs without
working. Shared by tests/reliability/test_bad_config.py and tests/reliability/run.py; every case starts at once
(most never import torch; the ones that load a model take a few seconds each)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field

from tests.integration.helpers import make_topics

from .harness import PROJECT_ROOT

CONFIG_ERROR_EXIT = 2
TIMEOUT_S = 60.0

FACTORY_CASE = "tests.reliability.models:steady_model"


@dataclass(frozen=True)
class Case:
    env: dict[str, str]
    field: str  # the setting the error must name
    argv: tuple[str, ...] = ()
    needs_broker: bool = False
    timeout_s: float = TIMEOUT_S  # a start-up error comes well within this


@dataclass
class Outcome:
    returncode: int | None
    stderr: str
    seconds: float
    notes: list[str] = field(default_factory=list)


CASES: dict[str, Case] = {
    "session timeout not a number": Case({"WORKER_KAFKA_SESSION_TIMEOUT_MS": "abc"}, "kafka.session_timeout_ms"),
    "session timeout below 1 s": Case({"WORKER_KAFKA_SESSION_TIMEOUT_MS": "500"}, "kafka.session_timeout_ms"),
    "poll interval below session timeout": Case({"WORKER_KAFKA_SESSION_TIMEOUT_MS": "10000",
                                                 "WORKER_KAFKA_MAX_POLL_INTERVAL_MS": "6000"},
                                                "kafka.max_poll_interval_ms"),
    "empty bootstrap servers": Case({"WORKER_KAFKA_BOOTSTRAP_SERVERS": " "}, "kafka.bootstrap_servers"),
    "empty group id": Case({"WORKER_KAFKA_GROUP_ID": ""}, "kafka.group_id"),
    "results topic is an input topic": Case({"WORKER_TOPICS_RESULTS": "frames.realtime"}, "topics"),
    "batch size 0": Case({"WORKER_BATCHING_MAX_BATCH_SIZE": "0"}, "batching.max_batch_size"),
    "padding waste 1.5": Case({"WORKER_BATCHING_PADDING_WASTE_MAX": "1.5"}, "batching.padding_waste_max"),
    "tensor dtype 3 bytes": Case({"WORKER_BATCHING_TENSOR_DTYPE_BYTES": "3"}, "batching.tensor_dtype_bytes"),
    "pending frames below batch size": Case({"WORKER_BATCHING_MAX_PENDING_FRAMES": "1"},
                                            "batching.max_pending_frames"),
    "realtime wait 5 s": Case({"WORKER_BATCHING_REALTIME_MAX_WAIT_MS": "5000"}, "batching.realtime.max_wait_ms"),
    "bulk weight 0": Case({"WORKER_BATCHING_BULK_WEIGHT": "0"}, "batching.bulk.weight"),
    "unknown batching setting": Case({"WORKER_BATCHING_MAX_BATCH": "8"}, "batching.max_batch"),
    "delivery mode at_most_once": Case({"WORKER_DELIVERY_MODE": "at_most_once"}, "delivery.mode"),
    "in-flight batches -1": Case({"WORKER_DELIVERY_MAX_INFLIGHT_BATCHES": "-1"}, "delivery.max_inflight_batches"),
    "negative commit interval": Case({"WORKER_DELIVERY_COMMIT_INTERVAL_MS": "-1"}, "delivery.commit_interval_ms"),
    "activation relu": Case({"WORKER_MODEL_ACTIVATION": "relu"}, "model.activation"),
    "threshold for an unknown label": Case({"WORKER_MODEL_THRESHOLDS": "gore=0.5"}, "model.thresholds"),
    "threshold 2": Case({"WORKER_MODEL_DEFAULT_THRESHOLD": "2"}, "model.default_threshold"),
    "input size 0x0": Case({"WORKER_MODEL_INPUT_SIZE": "0,0"}, "model.input_size"),
    "device tpu": Case({"WORKER_RUNTIME_DEVICE": "tpu"}, "runtime.device"),
    "precision fp8": Case({"WORKER_RUNTIME_PRECISION": "fp8"}, "runtime.precision"),
    "decode on a gpu": Case({"WORKER_RUNTIME_DECODE": "gpu"}, "runtime.decode"),
    "negative preprocess threads": Case({"WORKER_RUNTIME_PREPROCESS_THREADS": "-1"}, "runtime.preprocess_threads"),
    "metrics port 70000": Case({"WORKER_OBSERVABILITY_METRICS_PORT": "70000"}, "observability.metrics_port"),
    "metrics enabled maybe": Case({"WORKER_OBSERVABILITY_METRICS_ENABLED": "maybe"}, "observability.metrics_enabled"),
    "log level verbose": Case({"WORKER_OBSERVABILITY_LOG_LEVEL": "verbose"}, "observability.log_level"),
    "config file missing": Case({}, "config file", argv=("--config", "/nonexistent/streamfer.toml")),
    # Found only once torch is up (the model or the device is checked against this machine).
    "fp16 on a CPU": Case({"WORKER_RUNTIME_DEVICE": "cpu", "WORKER_RUNTIME_PRECISION": "fp16"}, "runtime.precision"),
    "model factory that does not import": Case({"WORKER_MODEL_SOURCE": "no_such_package.models:build"},
                                               "model.source"),
    "model file that does not exist": Case({"WORKER_MODEL_SOURCE": "/nonexistent/model.pt"}, "model.source"),
    "state dict that does not exist": Case({"WORKER_MODEL_SOURCE": FACTORY_CASE,
                                            "WORKER_MODEL_STATE_DICT": "/nonexistent/weights.pt"},
                                           "model.state_dict"),
    # Found by librdkafka when the clients are built.
    "unknown consumer property": Case({"WORKER_MODEL_SOURCE": FACTORY_CASE,
                                       "WORKER_KAFKA_CONSUMER_OVERRIDES": "no.such.property=1"},
                                      "kafka.consumer_overrides"),
    "bad producer property value": Case({"WORKER_MODEL_SOURCE": FACTORY_CASE,
                                         "WORKER_KAFKA_PRODUCER_OVERRIDES": "linger.ms=banana"},
                                        "kafka.producer_overrides"),
    # Found by the validator: properties the delivery guarantees depend on.
    "auto commit switched on": Case({"WORKER_KAFKA_CONSUMER_OVERRIDES": "enable.auto.commit=true"},
                                    "kafka.consumer_overrides"),
    "producer acks weakened": Case({"WORKER_KAFKA_PRODUCER_OVERRIDES": "acks=1"}, "kafka.producer_overrides"),
    # Found only by the broker.
    "session timeout below the broker's minimum": Case({"WORKER_MODEL_SOURCE": FACTORY_CASE,
                                                        "WORKER_KAFKA_SESSION_TIMEOUT_MS": "3000",
                                                        "WORKER_KAFKA_MAX_POLL_INTERVAL_MS": "6000"},
                                                       "kafka.session_timeout_ms", needs_broker=True,
                                                       timeout_s=12.0),
}


def env_for(case: Case, bootstrap: str) -> dict[str, str]:
    """The worker's environment for a case: no WORKER_* of the caller's, fresh group, no metrics port."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    unique = uuid.uuid4().hex[:8]
    env.update({
        "PYTHONPATH": str(PROJECT_ROOT),
        "WORKER_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        # Fresh names: a worker that wrongly starts consumes nothing of anyone else's.
        "WORKER_KAFKA_GROUP_ID": f"badcfg-{unique}",
        "WORKER_OBSERVABILITY_METRICS_PORT": "0",
        "WORKER_RUNTIME_TORCH_THREADS": "1",
        "WORKER_RUNTIME_WARMUP_BATCHES": "0",
    })
    env.update(case.env)
    return env


def run_cases(bootstrap: str) -> dict[str, Outcome]:
    """Start every case at once, then collect each exit code and stderr (a case still running after the
    timeout is stopped and reported as still running)."""
    topics = make_topics(bootstrap, f"cfg{uuid.uuid4().hex[:6]}")
    procs = {}
    for i, (name, case) in enumerate(CASES.items()):
        env = env_for(case, bootstrap if case.needs_broker else "127.0.0.1:9")
        if case.needs_broker:
            env.update(topics.env())
            env["WORKER_KAFKA_GROUP_ID"] = f"{topics.group}-{i}"
        procs[name] = (time.monotonic(), subprocess.Popen(
            [sys.executable, "-m", "worker", "run", *case.argv], env=env, cwd=PROJECT_ROOT,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    out = {}
    for name, (started, proc) in procs.items():
        try:
            _, stderr = proc.communicate(timeout=max(1.0, started + CASES[name].timeout_s - time.monotonic()))
            out[name] = Outcome(proc.returncode, stderr, time.monotonic() - started)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, stderr = proc.communicate()
            out[name] = Outcome(None, stderr, time.monotonic() - started, ["still running at the timeout"])
    return out


def problems(case: Case, got: Outcome) -> list[str]:
    """Why an outcome is not the start-up error the case must give (empty when it is)."""
    out = []
    if got.returncode != CONFIG_ERROR_EXIT:
        out.append(f"exit code {got.returncode}{' ' + ', '.join(got.notes) if got.notes else ''}, not 2")
    if case.field not in got.stderr:
        out.append(f"stderr does not name {case.field}")
    if "Traceback" in got.stderr:
        out.append("a traceback")
    return out
