"""What the loop answers for each frame it read: a scored result, an EXPIRED result, or a dead letter, with the
per-frame metrics that go with each (waits, latencies, flags, tenants). No Kafka, no torch: the loop hands the
outputs to delivery."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

from worker.batching import Batch
from worker.codec.schemas import ResultContext, reencode_frame, result_writer
from worker.config import Settings, model_label_thresholds
from worker.frames import BatchOutcome, DeadLetter, Frame, ModelId, Output, Status, Verdict
from worker.metrics import Children, Metrics, exemplar, observe_many
from worker.policy.judge import Judge
from worker.reuse.policy import Reused
from worker.tracing import TRACING_OFF, FrameTraces, Tracing

# One DEBUG line per finished batch (class, shape, size, waits, padding, predicted and measured time): enable
# with observability.log_level = "DEBUG", or this logger alone, when chasing a p99.
batch_log = logging.getLogger("worker.batches")
# Tenants whose metric label (Metrics.tenant_label) is remembered; past it the memory starts afresh.
MAX_TENANT_LABELS = 16384


class Answers:
    """Builds the outputs of finished batches, expired frames and refused ones, and counts them in the metrics
    (each labelled metric's children looked up once: the loop touches them per frame)."""

    def __init__(self, metrics: Metrics, context: ResultContext, tracing: Tracing = TRACING_OFF,
                 judge: Judge | None = None) -> None:
        self.metrics = metrics
        self.tracing = tracing
        # The policy each result's verdict is decided by (worker.policy): None writes the model's flags alone.
        self.judge = judge
        self._verdicts = Children(metrics.verdicts)
        self._tenant_labels: dict[str, str] = {}
        self._writer = result_writer(context)
        # issue 69: a writer per model that scored a batch (a rollout swaps or canaries models while serving).
        self._context = context
        self._writers = {(context.model_name, context.model_version): self._writer}
        self._expired = Children(metrics.frames_expired)
        self._flagged = Children(metrics.frames_flagged)
        self._queue_wait = Children(metrics.queue_wait)
        self._end_to_end = Children(metrics.end_to_end_latency)
        self._input_pixels = Children(metrics.input_pixels)
        self._reused = Children(metrics.frames_reused)
        self._scored = Children(metrics.frames_scored)

    def of_batch(self, batch: Batch, outcome: BatchOutcome, now: float) -> list[Output]:
        """A finished batch's results (OK) and dead letters (frames the runtime refused)."""
        run_ms = outcome.preprocess_ms + outcome.inference_ms
        if batch_log.isEnabledFor(logging.DEBUG):
            oldest = min((f.received_at for f in batch.frames), default=now)
            batch_log.debug("batch class=%s shape=%dx%dx%d size=%d lane=%s reason=%s oldest_wait_ms=%.1f "
                            "queued_ms=%.1f padding=%.3f predicted_ms=%s measured_ms=%.1f", batch.priority.label,
                            *batch.shape, batch.size, batch.lane, batch.reason,
                            (batch.released_at - oldest) * 1000.0, (outcome.started_at - batch.released_at) * 1000.0,
                            batch.padding_waste,
                            "-" if batch.predicted_s is None else f"{batch.predicted_s * 1000.0:.1f}", run_ms)
        observe_many(self._input_pixels.labels(f"{batch.shape[0]}x{batch.shape[1]}"),
                     [frame.height * frame.width for frame in batch.frames])
        self._scored.labels(batch.priority.label).inc(len(outcome.verdicts))
        traces = self.tracing.answer_batch(batch, outcome, now) if self.tracing.enabled else None
        trace_ids, first = (traces.trace_ids, exemplar(traces.first_trace_id)) if traces else (None, None)
        self.metrics.preprocess_latency.observe(outcome.preprocess_ms / 1000.0, first)
        self.metrics.inference_latency.observe(outcome.inference_ms / 1000.0, first)
        # A batch's frames are of its class.
        queued = [max(0.0, outcome.started_at - frame.received_at) for frame, _ in outcome.verdicts]
        observe_many(self._queue_wait.labels(batch.priority.label), queued, trace_ids)
        observe_many(self._end_to_end.labels(batch.priority.label),
                     [max(0.0, now - frame.capture_ts_ms / 1000.0) for frame, _ in outcome.verdicts], trace_ids)
        flagged = Counter(itertools.chain.from_iterable(verdict.flagged_labels for _, verdict in outcome.verdicts))
        for label, n in flagged.items():
            self._flagged.labels(label).inc(n)
        results = [(frame, verdict, queued_s * 1000.0) for (frame, verdict), queued_s in zip(outcome.verdicts, queued,
                                                                                              strict=True)]
        if outcome.scored_by and any(m != outcome.scored_by[0] for m in outcome.scored_by):
            # A canary batch: each model's frames written by that model's writer (without trace headers).
            outputs = []
            for model, group in itertools.groupby(zip(results, outcome.scored_by, strict=True), key=lambda r: r[1]):
                outputs += self._results([r for r, _ in group], Status.OK, outcome.batch_size, run_ms, now,
                                         writer=self.writer_for(model))
        else:
            outputs = self._results(results, Status.OK, outcome.batch_size, run_ms, now, traces,
                                    writer=self.writer_for(outcome.scored_by[0]) if outcome.scored_by else None)
        outputs.extend(self.dead_letter(f.frame, f.error_type, f.reason) for f in outcome.failures)
        return outputs

    def expired(self, frames: Sequence[Frame], now: float) -> list[Output]:
        """EXPIRED results for frames past their class's max_age_ms (in the batcher, or already when read)."""
        self.metrics.count_by_tenant(self._expired, frames)
        traces = self.tracing.answer_expired(frames, now) if self.tracing.enabled else None
        return self._results([(frame, None, (now - frame.received_at) * 1000.0) for frame in frames], Status.EXPIRED,
                             0, 0.0, now, traces)

    def reused(self, reused: Sequence[Reused], now: float) -> list[Output]:
        """OK results for frames answered with their stream's reference verdict (worker.reuse.policy): batch size and
        inference time 0, `reused_from_frame` the reference's frame_index, named by the model that scored it."""
        outputs: list[Output] = []
        for (reference, _, model), group in itertools.groupby(reused, key=lambda r: (r.reference, r.frame.priority,
                                                                                       r.model)):
            frames = list(group)
            self._reused.labels(frames[0].frame.priority.label).inc(len(frames))
            observe_many(self._end_to_end.labels(frames[0].frame.priority.label),
                         [max(0.0, now - r.frame.capture_ts_ms / 1000.0) for r in frames])
            outputs += self._results([(r.frame, r.verdict, (now - r.frame.received_at) * 1000.0) for r in frames],
                                     Status.OK, 0, 0.0, now, reused_from=reference,
                                     writer=self.writer_for(model) if model else None)
        return outputs

    @staticmethod
    def dead_letter(frame: Frame, error_type: str, reason: str) -> Output:
        dl = DeadLetter(source=frame.source, reason=reason, error_type=error_type, payload=reencode_frame(frame),
                        key=frame.stream_id.encode(), headers=frame.headers)
        return Output.of_dead_letter(dl, frame.tenant)

    def writer_for(self, model: ModelId) -> Any:
        """The result writer naming `model` (name, version)."""
        writer = self._writers.get(model)
        if writer is None:
            writer = self._writers[model] = result_writer(dataclasses.replace(self._context, model_name=model[0],
                                                                              model_version=model[1]))
        return writer

    def use_model(self, model: ModelId) -> None:
        """Expired frames' results name `model` from now on (a promote, on the loop's thread)."""
        self._writer = self.writer_for(model)

    def _results(self, results: Sequence[tuple[Frame, Verdict | None, float]], status: Status, batch_size: int,
                 run_ms: float, now: float, traces: FrameTraces | None = None,
                 reused_from: int | None = None, writer: Any = None) -> list[Output]:
        writer = writer or self._writer
        if self.judge is not None:
            return self._judged(results, status, batch_size, run_ms, now, traces, reused_from, self.judge, writer)
        values = writer.write_frames(results, status.value, batch_size, run_ms, now * 1000.0, reused_from)
        # Keyed by stream so a stream's results stay ordered within one output partition.
        if traces is None:
            return [Output(frame.source, frame.stream_id.encode(), value, frame.tenant, status, headers=frame.headers)
                    for (frame, _, _), value in zip(results, values, strict=True)]
        return [Output(frame.source, frame.stream_id.encode(), value, frame.tenant, status, headers=frame.headers,
                       result_headers=sent)
                for (frame, _, _), value, sent in zip(results, values, traces.headers, strict=True)]

    def _judged(self, results: Sequence[tuple[Frame, Verdict | None, float]], status: Status, batch_size: int,
                run_ms: float, now: float, traces: FrameTraces | None, reused_from: int | None,
                judge: Judge, writer: Any = None) -> list[Output]:
        """The results under the policy: each frame's verdict for its tenant, written into the result, counted, and
        the route topics its copy goes to. One policy for the whole call (a batch boundary)."""
        policy = judge.policy()
        decide, expired = policy.decide, policy.expired
        decisions = [expired if verdict is None else decide(frame.tenant, verdict) for frame, verdict, _ in results]
        values = (writer or self._writer).write_frames(results, status.value, batch_size, run_ms, now * 1000.0,
                                                       reused_from, decisions, policy.version)
        counts = Counter((frame.tenant, d.verdict) for (frame, _, _), d in zip(results, decisions, strict=True))
        for (tenant, verdict), n in counts.items():
            if verdict:
                self._verdict_child(tenant, verdict).inc(n)
        headers = traces.headers if traces is not None else [()] * len(results)
        routes = judge.routes
        return [Output(frame.source, frame.stream_id.encode(), value, frame.tenant, status, headers=frame.headers,
                       result_headers=sent, routes=routes(d.verdict))
                for (frame, _, _), value, sent, d in zip(results, values, headers, decisions, strict=True)]

    def _verdict_child(self, tenant: str, verdict: str) -> Any:
        """The streamfer_verdicts_total child of (tenant, verdict): the tenant's label bounded as every per-tenant
        metric's is (observability.metric_tenants / max_metric_tenants, the rest `other`), worked out once per
        tenant (remembered for MAX_TENANT_LABELS tenants; past it the memory starts afresh)."""
        label = self._tenant_labels.get(tenant)
        if label is None:
            if len(self._tenant_labels) >= MAX_TENANT_LABELS:
                self._tenant_labels.clear()
            label = self._tenant_labels[tenant] = self.metrics.tenant_label(tenant)
        return self._verdicts.labels(label, verdict)

def judge_of(settings: Settings) -> Judge:
    """The settings file's policy, its routes, and the model's labels a policy from the control topic is checked
    against."""
    return Judge.of_settings(settings.policy, settings.topics,
                             model_label_thresholds(settings.models or (settings.model,)))
