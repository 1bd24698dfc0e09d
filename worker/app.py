"""Assembling a worker process: logging, the runtime, the metrics endpoint, signals, the pipeline, and its rollout:
which model it starts with (the group's desired primary when the control topic names one, so a worker that joins
after a promote serves the same revision), the swap the loop holds, and the loader every later model goes through:
the one runtime start path (worker.runtime.start.start_runtime)."""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from worker.config import ConfigError, Settings
from worker.control.records import ControlRecord, ModelRef
from worker.errors import StreamferError
from worker.frames import ModelId
from worker.identity import worker_identity
from worker.kafka.access import probe_access
from worker.kafka.control import ControlUnavailable
from worker.kafka.registry import connect_registry
from worker.kafka.rollout import ShadowPublisher, read_desired, skipped_counter, start_control_with_rollout
from worker.kafka.wiring import check_client_configs
from worker.loop.pipeline import RunSummary, build_pipeline
from worker.metrics import Health, Metrics, MetricsServer
from worker.rollout.manager import Rollout
from worker.rollout.plan import contract_mismatch, file_ref, memory_refusal, rollout_settings, source_refusal
from worker.rollout.swap import SwappableExecutor
from worker.tracing import setup_tracing

if TYPE_CHECKING:
    from worker.runtime import InferenceExecutor

log = logging.getLogger("worker")
# /debug/profile waits at most this long for its batches to run.
PROFILE_TIMEOUT_S = 120.0


class JsonFormatter(logging.Formatter):
    def __init__(self, worker_id: str) -> None:
        super().__init__()
        self.worker_id = worker_id

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "worker_id": self.worker_id,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(settings: Settings) -> None:
    """Log lines name the worker id: resolve it first (worker.identity.worker_identity). Only the parent of
    `worker run --processes N`, which holds no slot, logs with the worker id unset: it names itself by the host."""
    o = settings.observability
    name = o.worker_id or socket.gethostname()
    handler = logging.StreamHandler(sys.stderr)
    if o.log_format == "json":
        handler.setFormatter(JsonFormatter(name))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(o.log_level.upper())


class StopFlag:
    """First SIGTERM/SIGINT: stop intake and drain. Second: exit at once (offsets stay where they were)."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def install(self) -> StopFlag:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, _frame: Any) -> None:
        if self._event.is_set():
            log.warning("second signal %d: exiting without draining", signum)
            os._exit(128 + signum)
        log.info("signal %d: draining then exiting", signum)
        self._event.set()

    def set(self) -> None:
        self._event.set()

    def __call__(self) -> bool:
        return self._event.is_set()


def run_worker(settings: Settings, exit_when_idle_s: float | None = None, stop: StopFlag | None = None,
               health: Health | None = None) -> RunSummary:
    """Load and warm the model, serve metrics, then run the pipeline until stopped or idle.

    Pass `health` to watch readiness from another thread (the demo and tests do). Without
    `observability.worker_id` the worker takes this host's lowest free slot (`<hostname>-<slot>`) until it returns."""
    with worker_identity(settings) as settings:
        return _run_worker(settings, exit_when_idle_s, stop, health)


def _run_worker(settings: Settings, exit_when_idle_s: float | None, stop: StopFlag | None,
                health: Health | None) -> RunSummary:
    metrics = Metrics(settings=settings)
    health = health if health is not None else Health()
    health.stall_limit_s = settings.kafka.max_poll_interval_ms / 1000.0
    started = time.monotonic()
    # Before any broker call: librdkafka refusing a property is a configuration error, reported at once.
    check_client_configs(settings)
    # Before the model loads: a wrong password or a missing ACL stops start-up in seconds, with exit code 2.
    cluster_answered = probe_access(settings)
    tracing = setup_tracing(settings, metrics)
    # Imported here: torch loads with the runtime, not with the CLI.
    from worker.runtime.start import start_runtime

    # The runtime once its model loaded, handed to /profile (which answers "still loading" until then).
    loaded: Future[Serving] = Future()
    # What runs beside the loop (tracing's exporter, the metrics server, the executor) is stopped when it ends, in
    # reverse order.
    with contextlib.ExitStack() as running:
        running.callback(tracing.shutdown)
        try:
            if settings.observability.metrics_enabled:
                # Served from here on: /readyz says what start-up waits for (the Schema Registry, the warm-up).
                server = MetricsServer(metrics, health, settings.observability.metrics_host,
                                       settings.observability.metrics_port,
                                       before_scrape=functools.partial(_refresh_scrape_gauges, health, metrics,
                                                                       GraphEvictions(loaded, metrics)),
                                       profile=functools.partial(_profile, loaded)
                                       if settings.observability.profile_endpoint else None)
                running.callback(server.start().stop)
                log.info("metrics on http://%s:%d/metrics", settings.observability.metrics_host, server.port)

            wait_started = time.monotonic()

            def waiting(why: str | None) -> None:
                """Start-up waits for the Schema Registry: /readyz and the registry gauge say so."""
                health.waiting_for = why
                metrics.schema_registry_unanswered.set(0.0 if why is None else time.monotonic() - wait_started)

            # Likewise the Schema Registry: the results schema registered (or found) under its subject, or exit 2
            # when it refuses; while it cannot be reached, start-up waits with backoff (kafka.registry).
            registry = connect_registry(settings, waiting=waiting, should_stop=stop or (lambda: False))

            def serve_while_warming(executor: InferenceExecutor) -> None:
                """Once the model loaded: its description on /metrics, and /profile can reach it."""
                metrics.model_labels(executor.labels)
                metrics.model_info.info({"name": executor.model_name, "version": executor.model_version,
                                         "device": executor.device_description,
                                         "labels": ",".join(executor.labels)})
                loaded.set_result(Serving(executor))

            # The model loads (ModelContractError, or an OperatorError naming its setting: exit 2), warms up and is
            # calibrated as in every other start of the runtime (worker.runtime.start).
            # issue 69: the group's desired model (control topic) when one is named, so a worker that joins during
            # a rollout serves the same revision; the loop holds a swap over it (worker.rollout).
            choice = choose_start(settings, read_control=cluster_answered)
            runtime = start_runtime(choice.settings, before_warm_up=serve_while_warming)
            swap, rollout, shadow = build_rollout(settings, choice, runtime.executor, metrics)
            loaded.result().executor = swap  # /profile profiles the serving model, whichever it is
            running.callback(shadow.close)
            executor = runtime.executor
            running.callback(swap.close)
            health.warmed_up = True
            log.info("model %s:%s warmed up on %s in %.1fs", executor.model_name, executor.model_version,
                     executor.device_description, time.monotonic() - started)
            # Built once the runtime is warm: its consumer joins the group when the loop runs.
            pipeline = build_pipeline(settings, swap, metrics, health, registry=registry, tracing=tracing)
            rollout.on_promoted = pipeline.model_promoted
            # The control topic read to its end before the loop serves: the group's policy (issue 66) applies from
            # the first batch, then changes between batches as the follower thread reads them.
            running.callback(start_control_with_rollout(settings, pipeline.answers.judge, metrics, health,
                                                        rollout).stop)
            pipeline.seed_costs(runtime.calibration)
            del runtime, executor  # the swap alone holds the model: a promote frees it after its last batch
            frozen = freeze_startup_heap()
            log.info("start-up heap frozen: %d objects that garbage collections no longer walk", frozen)
            return pipeline.run(stop or StopFlag().install(), exit_when_idle_s)
        finally:
            health.alive = False


class Serving:
    """What /profile profiles: the serving model (issue 69: a promote replaces it)."""

    def __init__(self, executor: Any) -> None:
        self.executor = executor


def _profile(loaded: Future[Serving], batches: int) -> str:
    """/profile: a profile of the next `batches` batches, once the model loaded."""
    if not loaded.done():
        raise StreamferError("the model is still loading: profile once it is warm")
    return loaded.result().executor.profile(batches, tempfile.gettempdir()).result(PROFILE_TIMEOUT_S)


def freeze_startup_heap() -> int:
    """Collect, then move every object still alive (torch, the model, imported modules: about 230,000 once warm)
    out of the garbage collector's reach; they live as long as the process. A full collection walks every
    tracked object with every thread stopped (it holds the GIL): 85-95 ms over these in a warm worker, a few ms
    over what the loop itself keeps. Full collections are rare (none in 40 s at half load), so this bounds a
    rare pause, not the usual p99. Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GraphEvictions:
    """streamfer_cuda_graph_evictions_total, read from the serving runtime's runners when /metrics is scraped (they
    count the graphs they released for their budget); a promoted model's runners count from zero again."""

    def __init__(self, loaded: Future[Serving], metrics: Metrics) -> None:
        self._loaded = loaded
        self._counter = metrics.cuda_graph_evictions
        self._counted: tuple[int, int] = (0, 0)  # (id of the runtime read, its evictions counted)
        self._lock = threading.Lock()  # scrapes are served on threads of their own

    def read(self) -> None:
        if not self._loaded.done():
            return
        with self._lock:
            runtime = self._loaded.result().executor
            serving = getattr(runtime, "serving", None)  # a SwappableExecutor's serving model, else the runtime
            key = id(serving.executor if serving is not None else runtime)
            total = runtime.graph_evictions
            counted = self._counted[1] if self._counted[0] == key else 0
            if total > counted:
                self._counter.inc(total - counted)
            self._counted = (key, max(total, counted))


def _refresh_scrape_gauges(health: Health, metrics: Metrics, evictions: GraphEvictions) -> None:
    metrics.ready.set(1 if health.ready else 0)
    evictions.read()
    if health.outputs is not None:
        for (topic, partition), seconds in health.outputs.unacknowledged_outputs().items():
            metrics.output_partition_unacknowledged.labels(topic, str(partition)).set(seconds)
    try:
        import torch

        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                metrics.gpu_memory.labels(f"cuda:{i}").set(torch.cuda.memory_allocated(i))
    except Exception:  # noqa: BLE001 (a scrape must never fail because of a gauge)
        pass


# -- the rollout, assembled (issue 69) ------------------------------------------------------------------------------
@dataclass
class StartChoice:
    """The settings the worker starts its model with, the record's model they name, and why the group's desired
    primary could not be used (then the settings file's model serves)."""

    settings: Settings
    ref: ModelRef
    desired: ControlRecord | None = None
    refused: str = ""


def choose_start(settings: Settings, read_control: bool = True) -> StartChoice:
    """The group's desired primary when the control topic names one this worker may load, else the file's model.
    Without `read_control` (the start-up probe reached no broker) the file's model starts at once, as before
    rollouts: a bad one stops start-up in seconds, and the control topic's follower brings the worker to the
    group's primary once the cluster answers."""
    if not read_control:
        log.warning("control topic not read before start-up (no broker answered the probe): the settings file's "
                    "model loads; the group's model set applies once the control topic is read")
        return StartChoice(settings, file_ref(settings))
    try:
        desired = read_desired(settings)
    except ControlUnavailable as exc:
        log.warning("control topic not read before start-up, the settings file's model serves: %s", exc)
        return StartChoice(settings, file_ref(settings))
    primary = desired.models.primary if desired is not None and desired.models is not None else None
    if primary is None or primary == file_ref(settings):
        return StartChoice(settings, file_ref(settings), desired)
    refusal = source_refusal(primary.source, settings.model.allowed_sources)
    if refusal is not None:
        return StartChoice(settings, file_ref(settings), desired, refusal)
    try:
        chosen = rollout_settings(primary, settings)
    except ConfigError as exc:
        return StartChoice(settings, file_ref(settings), desired, "; ".join(exc.problems))
    log.info("the group's model set (control topic revision %d) names %s: it serves", desired.revision if desired
             else 0, primary.label)
    return StartChoice(chosen, primary, desired)


def policy_labels(settings: Settings) -> frozenset[str]:
    """The labels the settings file's policy judges: a candidate must score them."""
    p = settings.policy
    labels = set(p.flag) | set(p.review)
    for overrides in p.tenants.values():
        for table in overrides.values():
            labels |= set(table)
    return frozenset(labels)


def build_rollout(settings: Settings, start: StartChoice, executor: Any, metrics: Any,
                  on_promoted: Callable[[ModelId], None] | None = None) -> tuple[SwappableExecutor, Rollout, Any]:
    """The swap over the started executor, the rollout that drives it, and the shadow publisher (close it last)."""
    from worker.runtime.start import start_runtime  # torch loads with the runtime

    shadow = ShadowPublisher(settings, metrics)
    swap = SwappableExecutor(executor, start.ref, on_shadow=shadow, on_skipped=skipped_counter(metrics),
                             on_scored=lambda model, role, n, seconds: _scored(metrics, model, role, n, seconds))
    labels = policy_labels(settings)

    def load(ref: ModelRef, warming: Callable[[], None]) -> Any:
        try:
            chosen = rollout_settings(ref, settings)
        except ConfigError as exc:
            raise StreamferError("; ".join(exc.problems)) from None
        refusal = memory_refusal(*_device_memory(settings, chosen.model.source))
        if refusal is not None:
            raise StreamferError(refusal)

        def check(candidate: Any) -> None:
            mismatch = contract_mismatch(swap.model_input_hw, candidate.model_input_hw, tuple(executor.labels),
                                         tuple(candidate.labels), labels)
            if mismatch is not None:
                raise StreamferError(mismatch)
            warming()

        return start_runtime(chosen, before_warm_up=check, calibrate=False).executor

    rollout = Rollout(swap, file_ref(settings), settings.model.allowed_sources, load, lambda _r: None, metrics,
                      on_promoted=on_promoted)
    if start.refused and start.desired is not None and start.desired.models is not None \
            and start.desired.models.primary is not None:
        rollout.failed_at_start(start.desired.models.primary, start.desired.revision, start.refused)
    return swap, rollout, shadow


def _scored(metrics: Any, model: ModelId, role: str, n: int, seconds: float) -> None:
    metrics.model_frames.labels(model[0], model[1], role).inc(n)
    metrics.model_batch_seconds.labels(model[0], model[1]).observe(seconds)


def _device_memory(settings: Settings, source: str) -> tuple[int | None, int, int | None]:
    """(free bytes, bytes the candidate needs, the cap) on a CUDA device; (None, 0, None) on a CPU, which has no cap.
    The need is estimated by the model file's size (weights dominate a classifier's resident memory), twice over
    for the activations and graphs of its warm-up."""
    try:
        import torch
    except ImportError:
        return None, 0, None
    device = settings.runtime.device
    if device == "cpu" or not torch.cuda.is_available():
        return None, 0, None
    index = int(device.split(":", 1)[1]) if device.startswith("cuda:") else 0
    free, total = torch.cuda.mem_get_info(index)
    cap = int(total * settings.runtime.memory_fraction) - torch.cuda.memory_allocated(index)
    size = os.path.getsize(source) if os.path.isfile(source) else 0
    return free, 2 * size, max(0, cap)
