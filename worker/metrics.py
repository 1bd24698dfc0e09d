"""Every Prometheus metric of the worker, defined once with its help text, and the HTTP endpoint that
serves them together with `/healthz` and `/readyz`.

docs/metrics.md lists the same names; tests/unit/test_deploy_manifests.py keeps the two in step.
"""

from __future__ import annotations

import bisect
import collections
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Generic, Protocol, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.samples import Exemplar

from worker.config import Settings
from worker.devices.graphplan import PROCESS_CAPTURES, CaptureStop
from worker.frames import DEAD_LETTER_ERROR_TYPES, TP, Frame, Priority
from worker.threadnames import name_os_thread

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                     2.0, 5.0, 10.0, 30.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256)
RATIO_BUCKETS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5)
PREDICTION_RATIO_BUCKETS = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)
# Candidate minus serving model score of a shadow-scored frame (issue 69).
SCORE_DIFFERENCE_BUCKETS = (-0.5, -0.2, -0.1, -0.05, -0.02, -0.005, 0.005, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
PIXEL_BUCKETS = (64 * 64, 128 * 128, 224 * 224, 320 * 240, 640 * 480, 1280 * 720, 1920 * 1080, 3840 * 2160)

MetricT = TypeVar("MetricT", bound=MetricWrapperBase)


class Children(Generic[MetricT]):
    """One labelled metric's children, each looked up once: `labels()` checks its values and takes a lock on every
    call, which the loop paid per frame. A label set still has no series until it is first used. Not for a
    metric whose children are removed (consumer_lag): a removed child would live on here."""

    def __init__(self, metric: MetricT) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], MetricT] = {}

    def labels(self, *values: str) -> MetricT:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child


def observe_many(histogram: Histogram, amounts: Iterable[float],
                 trace_ids: Sequence[str | None] | None = None) -> None:
    """`histogram.observe(a)` for each of `amounts` (none NaN), as one increment of the sum and one per bucket
    touched: a batch's frames land in a few buckets, and observe() costs about 2 us a call, which the loop paid
    three times per frame. It uses the child's bucket bounds and values (prometheus_client's private
    `_upper_bounds`, `_buckets`, `_sum`): tests/unit/test_metrics_observe_many.py checks that the exposition is
    the same as observe()'s, so a prometheus_client that changes them fails there, not in production.
    `trace_ids`: per amount, a sampled frame's trace id (worker.tracing) or None; each id becomes its bucket's
    OpenMetrics exemplar, as `observe(a, {"trace_id": id})` makes it."""
    amounts = list(amounts)
    if not amounts:
        return
    histogram._raise_if_not_observable()
    bounds = histogram._upper_bounds
    histogram._sum.inc(sum(amounts))
    for index, count in collections.Counter(bisect.bisect_left(bounds, a) for a in amounts).items():
        histogram._buckets[index].inc(count)
    if trace_ids is not None:
        now = time.time()
        for amount, trace_id in zip(amounts, trace_ids, strict=True):
            if trace_id is not None:
                histogram._buckets[bisect.bisect_left(bounds, amount)].set_exemplar(
                    Exemplar({"trace_id": trace_id}, amount, now))


def exemplar(trace_id: str | None) -> dict[str, str] | None:
    """The exemplar of an `observe()` for a sampled frame's trace id, None without one."""
    return None if trace_id is None else {"trace_id": trace_id}


# Why a trace span was not exported (worker/tracing/export.py).
TRACE_DROP_REASONS = ("queue_full", "export_failed", "shutdown")
# The label value of every tenant without a label of its own, and of every error_type not listed below.
OTHER = "other"
# streamfer_schema_lookups_total's outcomes (worker.kafka.schemalookups).
SCHEMA_LOOKUP_OUTCOMES = ("found", "transient", "permanent")
# The dead letters' error_type values (the worker's own classes); anything else is counted as "other".


class Metrics:
    """The worker's metrics on one registry (a fresh registry per worker keeps tests independent).

    No label takes producer input as it comes: a tenant goes through `tenant_label`, a dead letter's error
    type through `error_type_label`, so a scrape stays bounded whatever the producers send.
    """

    def __init__(self, registry: CollectorRegistry | None = None, settings: Settings | None = None,
                 captures_stop: CaptureStop = PROCESS_CAPTURES) -> None:
        settings = settings or Settings()
        self._listed_tenants = frozenset(settings.observability.metric_tenants)
        self._max_seen_tenants = settings.observability.max_metric_tenants
        self._max_tenant_bytes = settings.limits.max_identifier_bytes
        self._seen_tenants: set[str] = set()
        self._tenants_lock = threading.Lock()
        r = self.registry = registry or CollectorRegistry()
        self.frames_consumed = Counter("streamfer_frames_consumed_total", "Frame messages read from Kafka.",
                                       ["topic", "tenant"], registry=r)
        self.results_produced = Counter("streamfer_results_produced_total",
                                        "Moderation results acknowledged by the broker (status OK or EXPIRED).",
                                        ["topic", "tenant", "status"], registry=r)
        self.frames_expired = Counter("streamfer_frames_expired_total",
                                      "Frames not run because their deadline passed.", ["topic", "tenant"], registry=r)
        self.frames_dead_lettered = Counter("streamfer_frames_dead_lettered_total",
                                            "Messages sent to the dead-letter topic, by reason class.",
                                            ["topic", "error_type"], registry=r)
        self.frames_flagged = Counter("streamfer_frames_flagged_total", "Frames the model flagged, by label.",
                                      ["label"], registry=r)
        self.verdicts = Counter("streamfer_verdicts_total",
                                "Results by the policy's verdict (allow, review, flag) and tenant ([policy]).",
                                ["tenant", "verdict"], registry=r)
        self.policy_refused = Gauge("streamfer_policy_refused",
                                    "1 while the worker refuses the policy on the control topic (it keeps the last "
                                    "good one; /readyz's text says why).", registry=r)
        self.policy_applied = Counter("streamfer_policy_changes_total",
                                      "Policies from the control topic this worker applied or refused, by outcome.",
                                      ["outcome"], registry=r)
        # issue 69: model rollouts (worker.rollout).
        self.rollout_failed = Gauge("streamfer_rollout_failed",
                                    "1 while this worker's part of the group's model rollout failed (the serving model "
                                    "keeps serving; /readyz's text and `worker rollout status` say why).", registry=r)
        self.rollout_changes = Counter("streamfer_rollout_changes_total",
                                       "Model rollout steps on this worker, by outcome (ready, promoted, aborted, "
                                       "failed).", ["outcome"], registry=r)
        self.model_frames = Counter("streamfer_model_frames_total",
                                    "Frames scored by each model and version (the serving model, a canary's "
                                    "candidate, a shadow's), by role (primary, canary, shadow).",
                                    ["model", "version", "role"], registry=r)
        self.model_batch_seconds = Histogram("streamfer_model_batch_seconds",
                                             "Preprocessing + inference time of a batch, by model and version.",
                                             ["model", "version"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.shadow_frames = Counter("streamfer_shadow_frames_total",
                                     "Frames of the shadow share, by outcome: scored by the candidate, or skipped "
                                     "while the worker was behind (shadow work is the lowest class).",
                                     ["outcome"], registry=r)
        self.shadow_agreement = Counter("streamfer_shadow_verdicts_total",
                                        "Shadow-scored frames by label and whether the candidate's flag agreed with "
                                        "the serving model's (agree, disagree).", ["label", "agreement"], registry=r)
        self.shadow_score_difference = Histogram("streamfer_shadow_score_difference",
                                                 "Candidate score minus serving model score per shadow-scored frame, "
                                                 "by label.", ["label"], buckets=SCORE_DIFFERENCE_BUCKETS,
                                                 registry=r)
        # Every outcome's series from the start, as dashboards and alerts expect (worker.control.records,
        # worker.rollout.manager and the shadow's scoring name these outcomes).
        for outcome in ("applied", "refused"):
            self.policy_applied.labels(outcome)
        for outcome in ("ready", "promoted", "aborted", "failed"):
            self.rollout_changes.labels(outcome)
        for outcome in ("scored", "skipped"):
            self.shadow_frames.labels(outcome)
        self.frames_scored = Counter("streamfer_frames_scored_total", "Frames the model ran on, by class.",
                                     ["priority"], registry=r)
        self.frames_reused = Counter("streamfer_frames_reused_total",
                                     "Frames answered with an earlier frame's verdict of their stream, the picture "
                                     "unchanged (batching.<class>.reuse_max_age_ms), by class.", ["priority"],
                                     registry=r)
        for priority in Priority:  # every class's series from the start, reuse on or off, as dashboards expect
            self.frames_scored.labels(priority.label)
            self.frames_reused.labels(priority.label)
        self.reuse_streams = Gauge("streamfer_reuse_streams",
                                   "Streams whose reference frame verdict reuse keeps (bounded, least recently seen "
                                   "dropped first).", registry=r)
        self.batch_size = Histogram("streamfer_batch_size", "Frames per executed batch.", ["priority", "lane"],
                                    buckets=BATCH_SIZE_BUCKETS, registry=r)
        self.queue_wait = Histogram("streamfer_queue_wait_seconds",
                                    "From a frame being read to its batch starting to run.", ["priority"],
                                    buckets=LATENCY_BUCKETS_S, registry=r)
        self.preprocess_latency = Histogram("streamfer_preprocess_seconds",
                                            "Decode, resize and pad per batch (normalising runs with the model).",
                                            buckets=LATENCY_BUCKETS_S, registry=r)
        self.inference_latency = Histogram("streamfer_inference_seconds", "Normalising and the model call, per batch.",
                                           buckets=LATENCY_BUCKETS_S, registry=r)
        self.end_to_end_latency = Histogram("streamfer_end_to_end_seconds",
                                            "From the frame's capture timestamp to its result being built for the "
                                            "producer.",
                                            ["priority"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.padding_waste = Histogram("streamfer_padding_waste_ratio",
                                       "Share of padded pixels in each executed batch.", buckets=RATIO_BUCKETS,
                                       registry=r)
        self.inflight_frames = Gauge("streamfer_inflight_frames",
                                     "Frames read but not yet done (batching, running or awaiting acks).",
                                     registry=r)
        self.inflight_bytes = Gauge("streamfer_inflight_bytes", "Padded tensor bytes held by the batcher.",
                                    registry=r)
        self.uncommitted_frames = Gauge("streamfer_uncommitted_frames",
                                        "Offsets read since the last confirmed commit (what a lost session redoes).",
                                        registry=r)
        self.done_offsets_held = Gauge("streamfer_done_offsets_held",
                                       "Offsets answered beyond their partition's commit point, held there by an "
                                       "earlier one not yet answered.", registry=r)
        self.unacknowledged_outputs = Gauge("streamfer_unacknowledged_outputs",
                                            "Frames whose output was produced and awaits the broker's "
                                            "acknowledgement (at-least-once).", registry=r)
        self.commit_metadata_overflows = Counter("streamfer_commit_metadata_overflows_total",
                                                 "Commits of a partition whose done-offsets list did not fit the "
                                                 "commit metadata (its done offsets are redone after a hand-over).",
                                                 registry=r)
        self.frames_already_done = Counter("streamfer_frames_already_done_total",
                                           "Frames read and skipped: a previous owner answered them beyond its "
                                           "commit point and said so in the commit's metadata.", registry=r)
        self.output_partition_unacknowledged = Gauge(
            "streamfer_output_partition_unacknowledged_seconds",
            "Seconds a results or dead-letter partition with outputs waiting has acknowledged none (0: none wait).",
            ["topic", "partition"], registry=r)
        self.paused_partitions = Gauge("streamfer_paused_partitions",
                                       "Input partitions paused for priority or backpressure.", registry=r)
        self.priority_paused = Gauge("streamfer_priority_paused",
                                     "1 while the class's partitions are paused so that a more urgent class's "
                                     "backlog in Kafka is read first (reading by priority).", ["priority"],
                                     registry=r)
        self.priority_pauses = Counter("streamfer_priority_pauses_total",
                                       "Times the class's partitions were paused for a more urgent class's "
                                       "backlog (each stop after a turn of its floor share counts too).",
                                       ["priority"], registry=r)
        self.backlog_unservable = Gauge("streamfer_backlog_unservable",
                                        "1 while the class's backlog in Kafka cannot be read within its max_age_ms "
                                        "(every frame of it read lately had expired): it holds no class back.",
                                        ["priority"], registry=r)
        self.consumer_lag = Gauge("streamfer_consumer_lag", "High watermark minus position, per assigned partition.",
                                  ["topic", "partition"], registry=r)
        self.commits = Counter("streamfer_commits_total", "Offset commits, by outcome.", ["outcome"], registry=r)
        self.redelivered = Counter("streamfer_redelivered_messages_total",
                                   "Messages the consumer delivered again at an offset this assignment had already "
                                   "delivered (a client-side rewind); dropped, since the first copy is in the "
                                   "pipeline.", registry=r)
        self.committed_offset_waits = Counter(
            "streamfer_committed_offset_waits_total",
            "Partitions kept paused after an assignment or rewind because their committed offset could not be "
            "read yet (typically held by a dead member's open transaction until the broker aborts it).", registry=r)
        self.commit_latency = Histogram("streamfer_commit_seconds",
                                        "Offset commit: from the request to the broker's answer being seen "
                                        "(exactly-once: the transaction commit).",
                                        buckets=LATENCY_BUCKETS_S, registry=r)
        self.rebalances = Counter("streamfer_rebalances_total", "Partition assignment changes, by kind.",
                                  ["kind"], registry=r)
        self.model_info = Info("streamfer_model", "The loaded model and device.", registry=r)
        self.gpu_memory = Gauge("streamfer_gpu_memory_bytes", "GPU memory allocated by torch, per device.",
                                ["device"], registry=r)
        self.cuda_graph_evictions = Counter("streamfer_cuda_graph_evictions_total",
                                            "CUDA graphs released to keep captured graphs under their device "
                                            "memory budget.", registry=r)
        self.cuda_graph_captures_stopped = Gauge(
            "streamfer_cuda_graph_captures_stopped",
            "1 once a CUDA graph capture failed in this process: none is captured again, batches without a "
            "captured graph run eager.", registry=r)
        self.cuda_graph_captures_stopped.set_function(
            lambda: 0.0 if captures_stop.reason is None else 1.0)
        # The Schema Registry as the frames' writer-schema lookups see it (worker.kafka.schemalookups).
        self.schema_lookups = Counter("streamfer_schema_lookups_total",
                                      "Writer-schema lookups at the Schema Registry, by outcome: found, transient "
                                      "(unreachable, timeout, HTTP 5xx/429: frames held, asked again), permanent "
                                      "(unknown id, unreadable schema: frames dead-lettered).", ["outcome"],
                                      registry=r)
        for outcome in SCHEMA_LOOKUP_OUTCOMES:  # every outcome's series from the start, as dashboards expect
            self.schema_lookups.labels(outcome)
        self.frames_held_for_schema = Gauge("streamfer_frames_held_for_schema",
                                            "Framed frames held on their partition until the registry gives their "
                                            "writer schema (with the framed frames read after them there).",
                                            registry=r)
        self.schema_registry_unanswered = Gauge("streamfer_schema_registry_unanswered_seconds",
                                                "Seconds the Schema Registry has not answered, from the first lookup "
                                                "it left unanswered, while lookups fail for a transient reason; 0 "
                                                "once it answers.", registry=r)
        self.ready = Gauge("streamfer_ready", "1 when assigned, consuming and warmed up.", registry=r)
        # /healthz as Prometheus sees it: a number to alert on before the liveness probe gives up.
        self.loop_stalled = Gauge("streamfer_loop_stalled_seconds",
                                  "Seconds since the worker loop last turned, read at each scrape.", registry=r)
        # The scheduler: why each batch was released (its size), and how well the learned cost model predicts.
        self.batch_releases = Counter("streamfer_batch_releases_total",
                                      "Batches released, by class and reason (full, cost, blocking, preferred, "
                                      "bytes, deadline, fallback, flush).", ["priority", "reason"], registry=r)
        self.batch_time_ratio = Histogram("streamfer_batch_time_ratio",
                                          "Measured / predicted run time (preprocess + inference) per batch.",
                                          buckets=PREDICTION_RATIO_BUCKETS, registry=r)
        self.trace_spans_dropped = Counter("streamfer_trace_spans_dropped_total",
                                           "Trace spans not exported, by reason: queue_full (the collector is slower "
                                           "than the worker, or gone), export_failed, shutdown.", ["reason"],
                                           registry=r)
        for reason in TRACE_DROP_REASONS:  # at 0 from the start: a rate over them needs no first drop
            self.trace_spans_dropped.labels(reason)
        self.input_pixels = Histogram("streamfer_input_pixels",
                                      "Pixels (height x width) of each frame run, by the batch's padded shape.",
                                      ["shape"], buckets=PIXEL_BUCKETS, registry=r)

    def model_labels(self, labels: Sequence[str]) -> None:
        """The serving model's labels: their shadow series exist from the start (0 until a shadow scores)."""
        for label in labels:
            for agreement in ("agree", "disagree"):
                self.shadow_agreement.labels(label, agreement)
            self.shadow_score_difference.labels(label)

    def count_by_tenant(self, counter: Children[Counter], frames: Sequence[Frame]) -> None:
        """One increment per (topic, tenant label) of `frames` on a (topic, tenant) counter; tenants are labelled
        in the order first seen, as frame by frame."""
        for (topic, tenant), n in collections.Counter((f.source.topic, f.tenant) for f in frames).items():
            counter.labels(topic, self.tenant_label(tenant)).inc(n)

    def tenant_label(self, tenant: str) -> str:
        """The `tenant` label value to count this tenant under: the tenant itself if it is listed in
        observability.metric_tenants (when that list is set) or among the first max_metric_tenants seen
        (when it is not); otherwise "other". Once given a label of its own, a tenant keeps it."""
        if self._listed_tenants:
            return tenant if tenant in self._listed_tenants else OTHER
        if tenant in self._seen_tenants:
            return tenant
        if len(tenant) > self._max_tenant_bytes or len(tenant.encode()) > self._max_tenant_bytes:
            return OTHER  # (a str has at least as many UTF-8 bytes as characters: no copy for a huge one)
        with self._tenants_lock:
            if tenant in self._seen_tenants:
                return tenant
            if len(self._seen_tenants) < self._max_seen_tenants:
                self._seen_tenants.add(tenant)
                return tenant
        return OTHER

    @staticmethod
    def error_type_label(error_type: str) -> str:
        """The `error_type` label value of a dead letter: one of DEAD_LETTER_ERROR_TYPES, else "other"."""
        return error_type if error_type in DEAD_LETTER_ERROR_TYPES else OTHER

    def exposition_for(self, accept: str) -> tuple[bytes, str]:
        """The exposition in the format the scraper's Accept header asks for, and its content type: OpenMetrics
        (which carries the latency histograms' exemplars) when it asks for it, else Prometheus' text format."""
        encode, content_type = choose_encoder(accept)
        return encode(self.registry), content_type


class WatchedOutputs(Protocol):
    """What Health reads of delivery's outputs (worker.loop.delivery, over its sink's worker.kafka.outputstalls), at
    each probe and scrape."""

    def output_problem(self) -> str | None:
        """The results or dead-letter partitions not acknowledging for a while, named, or None."""

    def unacknowledged_outputs(self) -> dict[tuple[str, int], float]:
        """Per output partition with outputs waiting, the seconds since its last acknowledgement."""


class Watched(Protocol):
    """What Health reads of the frame source (worker.kafka.consumer.FrameSource), at each probe."""

    @property
    def assignment(self) -> frozenset[TP]:
        """The partitions owned now (none once the source closed)."""

    def cluster_problem(self) -> str | None:
        """Why the worker cannot use the cluster now (refused, or unreachable too long), or None."""

    def registry_problem(self) -> str | None:
        """The Schema Registry's trouble while running, or None."""


@dataclass
class Health:
    """What /healthz and /readyz report; start-up flips its flags, the loop beats once per turn, and the frame source
    (`source`, given by build_pipeline) is read at each probe for its assignment and its troubles.

    A loop that has not turned for `stall_limit_s` (kafka.max_poll_interval_ms, the bound Kafka itself puts
    on a consumer) is reported dead, so a supervisor restarts a worker stuck in a call that never returns."""

    alive: bool = True
    warmed_up: bool = False
    reasons: list[str] = field(default_factory=list)
    stall_limit_s: float = 300.0
    clock: Callable[[], float] = time.monotonic
    last_beat: float | None = None
    # What start-up waits for (the Schema Registry), or None: /readyz says it, and the source's registry trouble
    # while running (without turning not ready: the worker still serves everything else).
    waiting_for: str | None = None
    # A policy from the control topic this worker refuses (it keeps the last good one), or None: /readyz says so
    # without turning not ready.
    policy_problem: Callable[[], str | None] | None = None
    source: Watched | None = None
    outputs: WatchedOutputs | None = None

    def beat(self) -> None:
        self.last_beat = self.clock()

    @property
    def stalled_for(self) -> float:
        """Seconds since the loop last turned (0 before it started)."""
        return 0.0 if self.last_beat is None else max(0.0, self.clock() - self.last_beat)

    @property
    def assigned(self) -> bool:
        """Whether the worker owns a partition (a cooperative rebalance can hand out an empty increment)."""
        return self.source is not None and bool(self.source.assignment)

    @property
    def cluster_problem(self) -> str | None:
        return self.source.cluster_problem() if self.source is not None else None

    @property
    def live(self) -> bool:
        return self.alive and self.stalled_for <= self.stall_limit_s and self.cluster_problem is None

    @property
    def ready(self) -> bool:
        return self.live and self.warmed_up and self.assigned

    @property
    def degraded(self) -> str:
        """/readyz's note on a dependency start-up waits for or the loop works around ("" when none)."""
        notes = [f"waiting for {self.waiting_for}"] if self.waiting_for else []
        problem = self.source.registry_problem() if self.source is not None else None
        if problem:
            notes.append(problem)
        refused = self.policy_problem() if self.policy_problem is not None else None
        if refused:
            notes.append(refused)
        stalled = self.outputs.output_problem() if self.outputs is not None else None
        if stalled:
            notes.append(stalled)
        return "".join(f"; {note}" for note in notes)


class MetricsServer:
    """Serves /metrics, /healthz and /readyz on one port, in a daemon thread."""

    def __init__(self, metrics: Metrics, health: Health, host: str, port: int,
                 before_scrape: Callable[[], None] | None = None,
                 profile: Callable[[int], str] | None = None) -> None:
        metrics_ref, health_ref, hook, profile_hook = metrics, health, before_scrape, profile

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    metrics_ref.loop_stalled.set(health_ref.stalled_for)
                    if hook is not None:
                        hook()
                    self._reply(200, *metrics_ref.exposition_for(self.headers.get("Accept", "")))
                elif path == "/healthz":
                    if health_ref.live:
                        self._reply(200, b"ok\n")
                    elif not health_ref.alive:
                        self._reply(503, b"dead\n")
                    elif (problem := health_ref.cluster_problem) is not None:
                        self._reply(503, f"kafka: {problem}\n".encode())
                    else:
                        self._reply(503, f"stalled: the worker loop has not turned for "
                                         f"{health_ref.stalled_for:.0f}s\n".encode())
                elif path == "/readyz":
                    ok = health_ref.ready
                    text = "ready" if ok else (
                        f"not ready: warmed_up={health_ref.warmed_up} assigned={health_ref.assigned}")
                    self._reply(200 if ok else 503, f"{text}{health_ref.degraded}\n".encode())
                elif path == "/debug/profile" and profile_hook is not None:
                    self._profile(self.path)
                else:
                    self._reply(404, b"not found\n")

            def _profile(self, raw: str) -> None:
                """Record the next N batches (?batches=N, default 20) with the torch profiler; answer the trace's
                path once written."""
                query = urllib.parse.parse_qs(urllib.parse.urlsplit(raw).query)
                try:
                    batches = int(query.get("batches", ["20"])[0])
                    if not 1 <= batches <= 10_000:
                        raise ValueError
                except ValueError:
                    self._reply(400, b"batches must be an integer 1..10000\n")
                    return
                try:
                    trace = profile_hook(batches)  # type: ignore[misc]
                except Exception as exc:  # noqa: BLE001 (the requester gets the reason)
                    self._reply(503, f"profile failed: {type(exc).__name__}: {exc}\n".encode())
                    return
                self._reply(200, f"{trace}\n".encode())

            def _reply(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # quiet: one line per scrape is noise
                return

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._serve, name="metrics-http", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def _serve(self) -> None:
        name_os_thread()
        self._server.serve_forever()

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
